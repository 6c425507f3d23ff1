"""Parameters and buffers changed in place between a checkpoint's forward and its backward.

Without checkpointing autograd refuses such a step ("modified by an inplace operation");
a plain replay would silently recompute with the new values. recomp refuses it with
:class:`recomp.errors.ParameterChangedError`, naming the tensor, in a checkpoint's
replay, in an excluded region's backward and when a later backward pass reads what a
replay kept (NOTE [ State changed before backward ] in ``recomp._module_state``). The
second half trains through every ordinary pattern that changes parameters or module
state around backward and asserts gradients equal to the unwrapped model's and no
warning at all.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import recomp.errors  # noqa: E402
import recomp.torch as rt  # noqa: E402
from recomp.errors import ParameterChangedError  # noqa: E402


def discriminator() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def checkpointed(model: nn.Module, exclude_first: bool) -> nn.Module:
    if exclude_first:
        model[0] = rt.checkpoint_exclude_wrapper(model[0], name="D.0")
    return rt.checkpoint_wrapper(model)


def gan_step(d: nn.Module) -> None:
    """The classic GAN step: D's optimizer steps between the two backwards of one forward."""
    torch.manual_seed(1)
    g = nn.Linear(8, 8)
    opt_d = torch.optim.SGD(d.parameters(), lr=0.5)
    out = d(g(torch.randn(4, 8)))
    out.mean().backward(retain_graph=True)
    opt_d.step()
    (-out.mean()).backward()


def test_without_checkpointing_autograd_refuses_the_gan_step() -> None:
    # The reference behaviour recomp matches.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        gan_step(discriminator())


@pytest.mark.parametrize("exclude_first", [False, True], ids=["checkpoint", "excluded-region"])
def test_gan_step_through_a_checkpointed_discriminator_is_refused(exclude_first: bool) -> None:
    d = checkpointed(discriminator(), exclude_first)
    with pytest.raises(ParameterChangedError) as caught:
        gan_step(d)
    err = caught.value
    assert isinstance(err, RuntimeError) and isinstance(err, recomp.errors.RecompError)
    message = str(err)
    assert "'2.weight'" in message and "'2.bias'" in message
    assert "checkpointed Sequential" in message
    assert "between this checkpoint's forward and its backward" in message
    assert "optimizer step" in message and "step after backward" in message


def test_clipping_a_recomputed_weight_before_backward_is_refused() -> None:
    d = rt.checkpoint_wrapper(discriminator())
    out = d(torch.randn(4, 8, requires_grad=True)).sum()
    with torch.no_grad():
        d[2].weight.clamp_(-0.01, 0.01)
    with pytest.raises(ParameterChangedError, match=r"^Parameter '2\.weight' of the checkpointed"):
        out.backward()


def test_clipping_an_excluded_regions_weight_before_backward_is_refused() -> None:
    # The excluded region is not replayed: its own backward reads the weight it saved.
    # Before, this raised CachedValueMutatedError, whose advice (make an op out of place)
    # does not apply to a weight.
    d = checkpointed(discriminator(), exclude_first=True)
    out = d(torch.randn(4, 8, requires_grad=True)).sum()
    with torch.no_grad():
        d[0].weight.clamp_(-0.01, 0.01)
    with pytest.raises(
        ParameterChangedError, match=r"^Parameter 'weight' of excluded region 'D\.0' changed"
    ):
        out.backward()


def test_a_buffer_the_replay_reads_is_named() -> None:
    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("shift", torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.lin(x) + self.shift).tanh()

    model = rt.checkpoint_wrapper(nn.Sequential(Shifted()))
    out = model(torch.randn(4, 8, requires_grad=True)).sum()
    model[0].shift.add_(1)
    with pytest.raises(ParameterChangedError, match=r"^Buffer '0\.shift' of the checkpointed"):
        out.backward()


def test_a_replay_kept_for_a_later_pass_is_refused_after_a_step() -> None:
    # A replay run ahead of backward (HyperParallel's recompute sessions) keeps what it
    # recomputed, the weight among it; a step before the backward reads it is refused.
    d = rt.checkpoint_wrapper(discriminator())
    with rt.recompute_handle_collector_ctx() as handles:
        out = d(torch.randn(4, 8, requires_grad=True)).sum()
    with rt.recompute_session_ctx("mb0", retain_on_unpack=True):
        for handle in handles:
            rt.recompute_handle(handle, "mb0")
        with torch.no_grad():
            d[2].weight.mul_(0.5)
        with pytest.raises(ParameterChangedError, match="kept for a later backward pass"):
            out.backward()
    rt.clear_recompute_session("mb0")


def test_a_refused_step_leaves_nothing_behind() -> None:
    """After the error the same model trains on, with the unwrapped model's gradients."""
    reference = discriminator()
    d = checkpointed(discriminator(), exclude_first=True)
    with pytest.raises(ParameterChangedError):
        gan_step(d)
    reference.load_state_dict(rt.unwrap(copy.deepcopy(d)).state_dict())
    for model in (reference, d):
        model.zero_grad(set_to_none=True)
    x = torch.randn(4, 8, requires_grad=True)
    reference(x).pow(2).sum().backward()
    d(x).pow(2).sum().backward()
    for p, q in zip(reference.parameters(), d.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert d[0]._recomp_region.runs >= 2  # the region ran again, as a region


# --------------------------------------------------------------------------- legitimate paths


class Attention(nn.Linear):
    """The excluded region's stand-in."""


class Block(nn.Module):
    """A residual block with an excluded attention stand-in and a BatchNorm, whose running
    statistics each forward updates in place."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(x)
        return h + self.mlp(self.norm(h))


def model_pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = nn.Sequential(Block(), Block(), nn.Linear(8, 1))
    wrapped = copy.deepcopy(plain)
    rt.apply_activation_checkpointing(wrapped, checkpoint_fn=Block, exclude_fn=Attention)
    return plain, wrapped


def data(step: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(step))


def run_pattern(model: nn.Module, pattern: str) -> list[list[torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    grads = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        if pattern == "loop":
            model(data(step)).pow(2).mean().backward()
        elif pattern == "accumulation":
            for micro in range(3):
                (model(data(10 * step + micro)).pow(2).mean() / 3).backward()
        elif pattern == "all-forwards-first":  # GPipe: every micro-batch's forward, then backwards
            losses = [model(data(10 * step + micro)).pow(2).mean() for micro in range(3)]
            for loss in losses:
                loss.backward()
        elif pattern == "retain-graph":
            loss = model(data(step)).pow(2).mean()
            loss.backward(retain_graph=True)
            loss.backward()
        elif pattern == "clip-after-backward":
            model(data(step)).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        if pattern == "clip-after-backward":
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.5, 0.5)  # weight clipping after the step: the next forward reads it
    return grads


@pytest.mark.parametrize(
    "pattern",
    ["loop", "accumulation", "all-forwards-first", "retain-graph", "clip-after-backward"],
)
def test_ordinary_training_patterns_stay_exact_and_silent(pattern: str) -> None:
    plain, wrapped = model_pair()
    expected = run_pattern(plain, pattern)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run_pattern(wrapped, pattern)
    for step, (e, g) in enumerate(zip(expected, got)):
        for a, b in zip(e, g):
            assert torch.equal(a, b), (pattern, step)
    for (name, a), b in zip(plain.named_buffers(), wrapped.buffers()):
        assert torch.equal(a, b), name
    regions = [m._recomp_region for m in wrapped.modules() if "_recomp_region" in vars(m)]
    assert regions and all(r.runs > 0 and r.skips > 0 for r in regions)


def test_fast_weights_from_functional_call_stay_exact() -> None:
    """MAML-style: the replay runs with the adapted weights the forward used, which the
    module no longer holds; nothing changed in place, so nothing is refused."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    wrapped = rt.checkpoint_wrapper(copy.deepcopy(plain))

    def meta_grad(model: nn.Module) -> list[torch.Tensor]:
        x, y = data(0)[:, :6], data(1)[:, :1]
        params = dict(model.named_parameters())
        inner = (torch.func.functional_call(model, params, (x,)) - y).pow(2).sum()
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {n: p - 0.1 * g for (n, p), g in zip(params.items(), grads)}
        outer = (torch.func.functional_call(model, fast, (x,)) - y).pow(2).sum()
        return list(torch.autograd.grad(outer, list(params.values())))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = meta_grad(wrapped)
    for a, b in zip(meta_grad(plain), got):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


# --------------------------------------------------------------------------- the tree between calls
# Each change below comes after a first step: a checkpoint call must see the module tree
# as it is now, not as an earlier call found it.


def _clip_then_backward(d: nn.Module, clipped: nn.Module) -> None:
    out = d(torch.randn(4, 8, requires_grad=True)).sum()
    with torch.no_grad():
        clipped.weight.clamp_(-0.01, 0.01)
    out.backward()


def test_a_layer_put_in_place_after_a_step_is_watched() -> None:
    d = rt.checkpoint_wrapper(discriminator())
    d(torch.randn(4, 8, requires_grad=True)).sum().backward()
    d[2] = nn.Linear(16, 1)  # a new module where the old one was (an adapter, a swap)
    with pytest.raises(ParameterChangedError, match=r"'2\.weight'"):
        _clip_then_backward(d, d[2])


def test_a_region_unwrapped_after_a_step_is_watched_again() -> None:
    d = checkpointed(discriminator(), exclude_first=True)
    d(torch.randn(4, 8, requires_grad=True)).sum().backward()
    rt.unwrap(d[0])  # in place: the same object, its class back to Linear
    assert type(d[0]) is nn.Linear
    with pytest.raises(ParameterChangedError, match=r"^Parameter '0\.weight' of the checkpointed"):
        _clip_then_backward(d, d[0])


def test_a_parameter_registered_after_a_step_is_watched() -> None:
    d = rt.checkpoint_wrapper(discriminator())
    d(torch.randn(4, 8, requires_grad=True)).sum().backward()
    d[1].register_parameter("weight", nn.Parameter(torch.ones(16)))
    d[1].forward = lambda x: torch.tanh(x) * d[1].weight  # type: ignore[method-assign]
    out = d(torch.randn(4, 8, requires_grad=True)).sum()
    with torch.no_grad():
        d[1].weight.mul_(2)
    with pytest.raises(ParameterChangedError, match=r"'1\.weight'"):
        out.backward()


def test_running_statistics_turned_on_after_a_step_are_restored() -> None:
    """A BatchNorm that tracked no statistics at the first call and does at the next: its
    statistics are updated once per step, not once more by the replay."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, track_running_stats=False))
    wrapped = rt.checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(4, 8, requires_grad=True)
    for model in (plain, wrapped):
        model(x).sum().backward()
        bn = model[1]
        bn.track_running_stats = True
        bn.register_buffer("running_mean", torch.zeros(8))
        bn.register_buffer("running_var", torch.ones(8))
        bn.register_buffer("num_batches_tracked", torch.tensor(0))
        model(x).sum().backward()
    assert torch.equal(plain[1].running_mean, wrapped[1].running_mean)
    assert int(wrapped[1].num_batches_tracked) == 1


def test_a_parameter_frozen_after_a_step_is_watched() -> None:
    d = rt.checkpoint_wrapper(discriminator())
    d(torch.randn(4, 8, requires_grad=True)).sum().backward()
    d[2].weight.requires_grad_(False)  # frozen: state a forward may update
    with pytest.raises(ParameterChangedError, match=r"'2\.weight'"):
        _clip_then_backward(d, d[2])


def test_a_parameter_object_replaced_after_a_step_is_watched() -> None:
    d = rt.checkpoint_wrapper(discriminator())
    d(torch.randn(4, 8, requires_grad=True)).sum().backward()
    d[2].weight = nn.Parameter(torch.randn(1, 16))  # the same name, another tensor
    with pytest.raises(ParameterChangedError, match=r"'2\.weight'"):
        _clip_then_backward(d, d[2])


def test_a_buffer_registered_after_a_step_is_restored_for_the_replay() -> None:
    """A module that starts keeping a running count in a buffer after the first step: the
    replay reads the count the forward read, and the count goes up once per step."""

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            count = vars(self)["_buffers"].get("count")
            if count is None:
                return self.fc(x)
            out = self.fc(x) * (1 + count)
            count.add_(1)
            return out

    torch.manual_seed(0)
    plain = Counting()
    wrapped = rt.checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(4, 8, requires_grad=True)
    for model in (plain, wrapped):
        model(x).sum().backward()
        model.register_buffer("count", torch.zeros(()))
        model.zero_grad()
        model(x).sum().backward()
    assert float(wrapped.count) == float(plain.count) == 1.0
    torch.testing.assert_close(wrapped.fc.weight.grad, plain.fc.weight.grad, rtol=0, atol=0)


def test_a_region_excluded_after_a_step_is_not_replayed() -> None:
    d = rt.checkpoint_wrapper(discriminator())
    d(torch.randn(4, 8, requires_grad=True)).sum().backward()
    d[0] = rt.checkpoint_exclude_wrapper(d[0], name="D.0")
    d(torch.randn(4, 8, requires_grad=True)).sum().backward()
    region = d[0]._recomp_region
    assert (region.runs, region.skips) == (1, 1)


def test_calls_after_the_first_read_the_modules_without_walking_them() -> None:
    """The modules a checkpoint's replay runs are walked at a module's first call; later
    calls read their tensors from what that walk found, and build nothing per tensor
    while nothing differs (the host cost of a plain checkpoint)."""
    from call_counts import calls_of

    d = rt.checkpoint_wrapper(discriminator())
    x = torch.randn(4, 8, requires_grad=True)

    def step() -> None:
        d(x).sum().backward()

    first = calls_of(step)
    later = calls_of(step)

    def count(calls: object, name: str) -> int:
        return sum(n for (path, qual), n in calls.items() if qual == name)  # type: ignore[attr-defined]

    assert count(first, "_replayed_modules") == 1 and count(first, "_Slot.__init__") == 4
    assert count(later, "_replayed_modules") == 0 and count(later, "_Slot.__init__") == 0
    # A change of the tree is seen again by a walk.
    d[2] = nn.Linear(16, 1)
    assert count(calls_of(step), "_replayed_modules") == 1


def _walks(step: object) -> int:
    from call_counts import calls_of

    calls = calls_of(step)
    return sum(n for (path, qual), n in calls.items() if qual == "_replayed_modules")


def test_layers_without_bias_are_read_without_a_walk() -> None:
    """A parameter registered as None (``Linear(bias=False)``, every projection of HF's
    Llama-like layers) holds no state: later calls read such modules from the layout
    too, and a clipped weight is still refused."""
    torch.manual_seed(0)
    d = rt.checkpoint_wrapper(
        nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 1, bias=False))
    )
    x = torch.randn(4, 8, requires_grad=True)

    def step() -> None:
        d(x).sum().backward()

    assert _walks(step) == 1
    assert _walks(step) == 0
    with pytest.raises(ParameterChangedError, match=r"^Parameter '2\.weight' of the checkpointed"):
        _clip_then_backward(d, d[2])


def test_a_bias_put_in_place_or_removed_after_a_step_is_seen() -> None:
    """A parameter that was None and holds a tensor now (or the reverse) is a change of
    the tree: the call walks again, watches the new tensor and stays exact."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1, bias=False))
    d = rt.checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(4, 8, requires_grad=True)

    def step() -> None:
        d(x).sum().backward()

    step()
    d[2].bias = nn.Parameter(torch.ones(1))
    assert _walks(step) == 1
    with pytest.raises(ParameterChangedError, match=r"'2\.bias'"):
        out = d(x).sum()
        with torch.no_grad():
            d[2].bias.mul_(2)
        out.backward()
    plain[2].bias = nn.Parameter(d[2].bias.detach().clone())
    d[0].bias = None
    plain[0].bias = None
    assert _walks(step) == 1
    for model in (plain, d):
        model.zero_grad()
        model(x).sum().backward()
    for mine, theirs in zip(d.parameters(), plain.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=0)


def test_a_module_that_refers_back_to_its_checkpointed_parent_is_freed() -> None:
    """What a call keeps of its modules between calls holds none of them: a child that
    refers back to the checkpointed module (a hook's closure here) does not keep the
    model alive once the user drops it."""
    import gc
    import weakref

    layer = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    layer[2].register_forward_hook(lambda m, i, o, owner=layer: None)  # child -> parent
    wrapped = rt.checkpoint_wrapper(layer)
    x = torch.randn(2, 4, requires_grad=True)
    for _ in range(2):
        wrapped(x).sum().backward()
    gone = weakref.ref(wrapped)
    del wrapped, layer
    gc.collect()
    assert gone() is None


def test_a_model_freed_while_the_interpreter_exits_leaves_no_error() -> None:
    """A checkpointed model that dies after the modules' globals are gone (the record of
    its layout still referenced at exit) frees its entry without an error."""
    import subprocess
    import sys

    script = (
        "import torch, recomp.torch as rt\n"
        "from torch import nn\n"
        "from recomp import _module_state\n"
        "m = rt.checkpoint_wrapper(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)))\n"
        "x = torch.randn(2, 4, requires_grad=True)\n"
        "for _ in range(3):\n"
        "    m(x).sum().backward()\n"
        "held = list(_module_state._LAYOUTS.values())  # outlives the module's globals\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "Exception ignored" not in run.stderr, run.stderr
