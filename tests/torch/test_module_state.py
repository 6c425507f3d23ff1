"""State a checkpointed module keeps outside the autograd graph: its replay sees what the
forward saw and the forward's updates happen once (``recomp._module_state``).

Every test trains the same model with and without recomp and compares gradients and
state bit for bit; each fails where the replay reads the module's state as it is at
backward time (as ``torch.utils.checkpoint`` does): fast weights swapped in by
``functional_call``, buffers updated in place or rebound, a parametrization's own
buffers. The first update the library could not see coming is a warning, asserted.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import recomp  # noqa: E402
import recomp.torch as rt  # noqa: E402

EARLY_STOP = pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "full"])


def batch(step: int, rows: int = 5, width: int = 6) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(step))


def train(model, steps, *, wrapped=(), backwards=1, before_step=None, lr=0.1, **options):
    """SGD steps on fixed batches, with ``wrapped`` submodule paths checkpoint-wrapped
    (``""``: the model itself); each step's gradients, and the buffers at the end."""
    model = copy.deepcopy(model)
    run = model
    for path in wrapped:
        if path:
            parent, _, name = path.rpartition(".")
            owner = model.get_submodule(parent)
            setattr(owner, name, rt.checkpoint_wrapper(owner.get_submodule(name), **options))
        else:
            run = rt.checkpoint_wrapper(model, **options)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads = []
    for step in range(steps):
        if before_step is not None:
            before_step(model, step)
        opt.zero_grad(set_to_none=True)
        loss = run(batch(step)).pow(2).sum()
        for i in range(backwards):
            loss.backward(retain_graph=i + 1 < backwards)
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
        opt.step()
    train.last_model = model  # type: ignore[attr-defined]
    return grads, {n: b.clone() for n, b in model.named_buffers()}


def assert_same_training(model, steps=3, backwards=1, **kwargs):
    want_grads, want_buffers = train(model, steps, backwards=backwards)
    got_grads, got_buffers = train(model, steps, backwards=backwards, **kwargs)
    for step, (want, got) in enumerate(zip(want_grads, got_grads)):
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"step {step}, gradient {i}: {(a - b).abs().max()}"
    assert want_buffers.keys() == got_buffers.keys()
    for name, value in want_buffers.items():
        assert torch.equal(value, got_buffers[name]), f"{name}: {value} vs {got_buffers[name]}"


class RunningMean(nn.Module):
    """Keeps a running mean of its input in a buffer, updated in place, and reads the
    updated value in the same forward (as HF I-BERT's QuantAct does with its ranges)."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("mean", torch.zeros(width))

        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.lin(x)
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * y.mean(0))
        return torch.tanh(y - self.mean) * y


class Counted(nn.Module):
    """Rebinds a counter buffer each forward (``self.seen = self.seen + 1``) and scales
    by it, as a quantiser or a warm-up schedule kept in a buffer does."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.seen = self.seen + 1
        return torch.sin(y / self.seen) * y


@EARLY_STOP
def test_a_buffer_updated_in_place_and_read_is_replayed_as_the_forward_read_it(early_stop):
    torch.manual_seed(0)
    assert_same_training(RunningMean(), wrapped=[""], early_stop=early_stop)


def test_the_update_happens_once_with_backwards_that_retain_the_graph():
    torch.manual_seed(0)
    assert_same_training(RunningMean(), wrapped=[""], backwards=2)


def test_buffers_rebound_by_the_forward_are_replayed_as_the_forward_saw_them():
    torch.manual_seed(0)
    assert_same_training(Counted(), wrapped=[""])


def test_a_nested_checkpoint_restores_the_state_of_its_own_modules():
    torch.manual_seed(0)
    model = nn.Sequential(RunningMean(), nn.Sequential(nn.Linear(6, 6), RunningMean()))
    assert_same_training(model, wrapped=["1.1", ""])


@EARLY_STOP
def test_spectral_norm_updates_its_vectors_once_and_replays_with_the_forwards(early_stop):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.utils.parametrizations.spectral_norm(nn.Linear(6, 6)), nn.Tanh(), nn.Linear(6, 6)
    )
    assert_same_training(model, wrapped=[""], early_stop=early_stop)


def test_an_excluded_module_with_state_runs_once_and_the_rest_is_restored():
    torch.manual_seed(0)
    model = nn.Sequential(RunningMean(), nn.Tanh(), RunningMean())
    want_grads, want_buffers = train(model, 3)
    excluded = copy.deepcopy(model)
    excluded[0] = rt.checkpoint_exclude_wrapper(excluded[0])
    got_grads, got_buffers = train(excluded, 3, wrapped=[""])
    ran = train.last_model  # type: ignore[attr-defined]
    assert (ran[0].calls, ran[2].calls) == (3, 6)  # the excluded one is not replayed
    for want, got in zip(want_grads, got_grads):
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    for name, value in want_buffers.items():
        assert torch.equal(value, got_buffers[name]), name


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def fast_weights_gradients(model: nn.Module, inner_steps: int = 2) -> list[torch.Tensor]:
    """MAML: adapt the weights by ``inner_steps`` gradient steps through
    ``functional_call`` (keeping the graph), then the meta-gradient of the adapted loss."""
    params = dict(model.named_parameters())
    x, y = batch(0), batch(1)
    fast = params
    for _ in range(inner_steps):
        loss = (torch.func.functional_call(model, fast, (x,)) - y).pow(2).sum()
        grads = torch.autograd.grad(loss, list(fast.values()), create_graph=True)
        fast = {k: w - 0.1 * g for (k, w), g in zip(fast.items(), grads)}
    outer = (torch.func.functional_call(model, fast, (x,)) - y).pow(2).sum()
    return list(torch.autograd.grad(outer, list(params.values())))


@EARLY_STOP
def test_fast_weights_from_functional_call_are_the_weights_the_replay_uses(early_stop):
    torch.manual_seed(0)
    model = TwoLayers()
    want = fast_weights_gradients(model)
    wrapped = copy.deepcopy(model)
    wrapped.a = rt.checkpoint_wrapper(wrapped.a, early_stop=early_stop)
    wrapped.b = rt.checkpoint_wrapper(wrapped.b, early_stop=early_stop)
    got = fast_weights_gradients(wrapped)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"gradient {i}: {(a - b).abs().max()}"
    # the module holds its own parameters again after every replay
    assert all(isinstance(p, nn.Parameter) for p in wrapped.parameters())
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in model.named_parameters()]


class LateUpdate(nn.Module):
    """Updates its buffer only once ``updating`` is set (from the second step on)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("scale", torch.ones(6))
        self.updating = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.updating:
            with torch.no_grad():
                self.scale.add_(y.mean(0))
        return torch.sin(y * self.scale)


@pytest.mark.replay_differs  # the warned step's replay reads the updated value
# From step 3 on: the calls before read the modules from a layout (NOTE [ Calls after the
# first: layouts ]), and the first update is seen there.
@pytest.mark.parametrize("first", [1, 3])
def test_a_first_update_after_earlier_forwards_did_none_warns_once_naming_it(first: int):
    torch.manual_seed(0)
    model = LateUpdate()

    def from_first(model: nn.Module, step: int) -> None:
        model.updating = step >= first

    steps = first + 3
    # lr=0: the weights stay as they are, so that one step's gradient does not carry over
    want_grads, want_buffers = train(model, steps, before_step=from_first, lr=0.0)
    with pytest.warns(recomp.ReplayStateWarning, match=r"LateUpdate updated scale in place"):
        got_grads, got_buffers = train(
            model, steps, wrapped=[""], before_step=from_first, lr=0.0
        )
    # the first updating step is the one the warning is about; the others are exact
    for step in range(steps):
        same = all(torch.equal(a, b) for a, b in zip(want_grads[step], got_grads[step]))
        assert same is (step != first), step
    assert torch.equal(want_buffers["scale"], got_buffers["scale"])  # updated once per step


class FrozenBase(nn.Module):
    """A frozen layer with a trainable adapter, as PEFT's LoRA builds them."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.adapter = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.adapter(x))


class _CountCopies(TorchDispatchMode):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.clone.default and args[0].numel() == self.numel:
            self.copies += 1
        return out


def test_frozen_weights_are_not_copied():
    block = rt.checkpoint_wrapper(FrozenBase())
    x = torch.randn(3, 64, requires_grad=True)
    for _ in range(2):
        with _CountCopies(64 * 64) as counter:
            loss = block(x).sum()
        loss.backward()
        assert counter.copies == 0


@pytest.mark.replay_differs  # the warned step's replay reads the updated value
def test_a_frozen_parameter_written_in_place_warns():
    class Writes(FrozenBase):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.base.bias.add_(1.0)
            return super().forward(x)

    block = rt.checkpoint_wrapper(Writes(8))
    with pytest.warns(recomp.ReplayStateWarning, match=r"base\.bias"):
        block(torch.randn(2, 8, requires_grad=True)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.ReplayStateWarning)  # once per module
        block(torch.randn(2, 8, requires_grad=True)).sum().backward()


# -- layouts with state a forward may update (NOTE [ Calls after the first: layouts ]) ----


def _walks(run: object) -> int:
    from call_counts import calls_of

    calls = calls_of(run)
    return sum(n for (_, qual), n in calls.items() if qual == "_replayed_modules")


def _walks_per_call(make, calls: int = 4) -> list[int]:
    """How many walks each of ``calls`` steps of a checkpoint-wrapped ``make()`` made."""
    torch.manual_seed(0)
    model = rt.checkpoint_wrapper(make())
    x = torch.randn(4, 6, requires_grad=True)

    def step() -> None:
        model(x).sum().backward()

    return [_walks(step) for _ in range(calls)]


class Masked(nn.Module):
    """A constant buffer the forward reads and never writes (an attention mask, a
    relative-position index)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("mask", (torch.arange(6) % 2).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.lin(x) * self.mask)


class NormBlock(nn.Module):
    """A Linear and a BatchNorm. In training mode: running statistics the kernel updates
    without a trace in the version counter, and a counter it updates in place; kept in
    eval mode inside a model that trains (``_eval_norm``): frozen statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.lin(x)))


def _eval_norm() -> NormBlock:
    model = NormBlock()
    model.norm.eval()
    return model


@pytest.mark.parametrize(
    "make", [lambda: FrozenBase(6), Masked, _eval_norm], ids=["frozen", "buffer", "eval-norm"]
)
def test_state_no_forward_updates_is_read_from_a_layout_and_stays_exact(make):
    """Once a forward of a module in its mode was seen to update none of its frozen
    parameters and buffers, later calls read them without a walk, and training stays
    exact (gradients and buffers)."""
    assert _walks_per_call(make) == [1, 1, 0, 0]
    torch.manual_seed(0)
    assert_same_training(make(), steps=4, wrapped=[""])


@pytest.mark.parametrize("where", ["frozen", "buffer"])
def test_state_read_from_a_layout_and_changed_before_backward_is_refused(where):
    torch.manual_seed(0)
    model = rt.checkpoint_wrapper(FrozenBase(6) if where == "frozen" else Masked())
    x = torch.randn(4, 6, requires_grad=True)
    for _ in range(3):
        model(x).sum().backward()
    out = model(x).sum()
    with torch.no_grad():
        (model.base.weight if where == "frozen" else model.mask).mul_(2)
    name = r"Parameter 'base\.weight'" if where == "frozen" else r"Buffer 'mask'"
    with pytest.raises(recomp.errors.ParameterChangedError, match=rf"^{name} of the checkpointed"):
        out.backward()


def test_a_norm_put_back_in_training_mode_updates_its_statistics_once():
    """The training flag is part of what a layout checks: a BatchNorm read from a layout
    in eval mode and put in training mode between steps is walked again, and its
    statistics are restored for the replay (updated once per step, as without recomp)."""

    def switch(model: nn.Module, step: int) -> None:
        model.norm.train(step >= 3)

    torch.manual_seed(0)
    want_grads, want_buffers = train(_eval_norm(), 5, before_step=switch)
    torch.manual_seed(0)
    got_grads, got_buffers = train(_eval_norm(), 5, wrapped=[""], before_step=switch)
    for want, got in zip(want_grads, got_grads):
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert int(got_buffers["norm.num_batches_tracked"]) == 2
    for name, value in want_buffers.items():
        assert torch.equal(value, got_buffers[name]), name


# -- layouts with state a forward updates: copied at each call ------------------------


class ConvBlock(nn.Module):
    """A residual block of two convolutions, each followed by a BatchNorm in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 2, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(2)
        self.c2 = nn.Conv2d(2, 2, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 2, 3, 1).expand(-1, 2, 3, 3)
        y = self.bn2(self.c2(torch.relu(self.bn1(self.c1(x)))))
        return (x + y).mean((2, 3)).repeat(1, 3)


UPDATING = pytest.mark.parametrize(
    "make", [RunningMean, NormBlock, ConvBlock], ids=["running-mean", "batchnorm", "conv-bn"]
)


@UPDATING
def test_state_a_forward_updates_is_read_from_a_layout_with_copies_and_stays_exact(make):
    """Once a forward of a module in its mode was seen (what it updates is then known),
    later calls read its tensors from a layout and copy only what forwards update, which
    each replay reads: no walk after the second call, training exact (gradients, running
    statistics, counters), with two backward passes over one graph too."""
    assert _walks_per_call(make) == [1, 1, 0, 0]
    for backwards in (1, 2):
        torch.manual_seed(0)
        assert_same_training(make(), steps=5, backwards=backwards, wrapped=[""])


def train_micro_batches(model, steps, micro=3, wrapped=False):
    """Steps of ``micro`` forwards (different batches) before one backward of their summed
    loss: each replay runs after the later forwards have updated the module's state."""
    model = copy.deepcopy(model)
    run = rt.checkpoint_wrapper(model) if wrapped else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = sum(run(batch(step * micro + i)).pow(2).sum() for i in range(micro))
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads, {n: b.clone() for n, b in model.named_buffers()}


@UPDATING
def test_micro_batches_read_from_a_layout_replay_with_the_state_each_forward_saw(make):
    torch.manual_seed(0)
    model = make()
    want_grads, want_buffers = train_micro_batches(model, 4)
    got_grads, got_buffers = train_micro_batches(model, 4, wrapped=True)
    for step, (want, got) in enumerate(zip(want_grads, got_grads)):
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"step {step}, gradient {i}: {(a - b).abs().max()}"
    for name, value in want_buffers.items():
        assert torch.equal(value, got_buffers[name]), name


@pytest.mark.parametrize("make", [RunningMean, NormBlock], ids=["running-mean", "batchnorm"])
def test_a_parameter_changed_before_backward_is_refused_where_a_layout_copies(make):
    torch.manual_seed(0)
    model = rt.checkpoint_wrapper(make())
    x = torch.randn(4, 6, requires_grad=True)
    for _ in range(3):
        model(x).sum().backward()
    out = model(x).sum()
    with torch.no_grad():
        model.lin.weight.mul_(2)
    with pytest.raises(recomp.errors.ParameterChangedError, match=r"^Parameter 'lin\.weight'"):
        out.backward()


class MeanThenLate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean = RunningMean()
        self.late = LateUpdate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(self.mean(x))


@pytest.mark.replay_differs  # the warned step's replay reads the updated value
def test_a_first_update_seen_from_a_layout_that_copies_warns_and_is_learnt():
    """A layout copies what forwards were seen to update (the running mean); a forward
    that first updates another buffer (from step 3) is reported, the running mean's copy
    still serves that step's replay, and later calls copy both."""
    torch.manual_seed(0)
    model = MeanThenLate()

    def from_third(model: nn.Module, step: int) -> None:
        model.late.updating = step >= 3

    want_grads, want_buffers = train(model, 6, before_step=from_third, lr=0.0)
    with pytest.warns(recomp.ReplayStateWarning, match=r"MeanThenLate updated late\.scale"):
        got_grads, got_buffers = train(model, 6, wrapped=[""], before_step=from_third, lr=0.0)
    for step in range(6):
        same = all(torch.equal(a, b) for a, b in zip(want_grads[step], got_grads[step]))
        assert same is (step != 3), step
    for name, value in want_buffers.items():
        assert torch.equal(value, got_buffers[name]), name
