"""RNG trackers (random states kept outside torch's generators) inside recomp checkpoints.

The tracker here keeps named generator states in a dict and swaps one into torch's default
generator around a draw (``fork()``), as Megatron-Core's ``CudaRNGStatesTracker`` and
DeepSpeed's tracker do. torch's checkpoint restores only the default generators, so its
replay would draw another dropout mask from the state the forward left in the tracker.
With the tracker known to recomp (registered, or found as Megatron-Core's or DeepSpeed's),
the gradients are those of the model without checkpointing, bit for bit, and the tracker
ends the step where it ends without checkpointing: every draw happens once.
"""

from __future__ import annotations

import contextlib
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import recomp  # noqa: E402
import recomp.torch as rt  # noqa: E402

NAME = "model-parallel-rng"


class DictTracker:
    """Named CPU generator states in a dict; ``fork`` makes one the default generator's."""

    def __init__(self, seed: int = 1234) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[NAME] = torch.get_rng_state()
        torch.set_rng_state(outer)

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = states  # adopts the dict, as Megatron's does

    @contextlib.contextmanager
    def fork(self, name: str = NAME):
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class GeneratorTracker:
    """Named ``torch.Generator`` objects that draws advance in place (as a tracker built
    for CUDA graphs keeps them); ``fork`` yields one."""

    def __init__(self, seed: int = 99) -> None:
        self.states_ = {NAME: torch.Generator().manual_seed(seed)}

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = states

    @contextlib.contextmanager
    def fork(self, name: str = NAME):
        yield self.states_[name]


def tracked_dropout(tracker, x, p):
    if isinstance(tracker, GeneratorTracker):
        with tracker.fork() as generator:
            keep = torch.rand(x.shape, generator=generator) >= p
        return x * keep / (1 - p)
    with tracker.fork():
        return F.dropout(x, p)


class Attention(nn.Module):
    def __init__(self, tracker) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.tracker = tracker

    def forward(self, x):
        return tracked_dropout(self.tracker, self.proj(x), 0.5)


class Block(nn.Module):
    def __init__(self, tracker) -> None:
        super().__init__()
        self.attn = Attention(tracker)
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.tracker = tracker

    def forward(self, x):
        h = torch.tanh(self.fc1(self.attn(x)))
        h = tracked_dropout(self.tracker, h, 0.3)
        h = F.dropout(h, 0.2)  # torch's default generator, outside the tracker
        return self.fc2(h) + x


def make_model(tracker, *, checkpointed: bool, exclude: bool):
    torch.manual_seed(0)
    model = nn.Sequential(Block(tracker), Block(tracker))
    if checkpointed:
        for block in model:
            if exclude:
                rt.checkpoint_exclude_wrapper(block.attn)
            rt.checkpoint_wrapper(block)
    return model


def run_step(model, *, backwards: int = 1):
    """One forward and backward from a fixed default-generator state; the gradients and
    the default generator's state after it."""
    torch.manual_seed(7)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    loss = model(x).square().sum()
    for i in range(backwards):
        loss.backward(retain_graph=i + 1 < backwards)
    grads = [x.grad, *(p.grad for p in model.parameters())]
    return [g.clone() for g in grads], torch.get_rng_state()


def tracker_state(tracker):
    state = tracker.states_[NAME]
    return state.get_state() if isinstance(state, torch.Generator) else state


def assert_exact(reference, checkpointed, ref_tracker, tracker):
    (want, want_rng), (got, got_rng) = reference, checkpointed
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"gradient {i} differs: max {float((a - b).abs().max())}"
    assert torch.equal(want_rng, got_rng), "torch's default generator ends elsewhere"
    assert torch.equal(tracker_state(ref_tracker), tracker_state(tracker)), (
        "the tracker ends elsewhere than without checkpointing (a draw was repeated)"
    )


@pytest.mark.parametrize("exclude", [False, True], ids=["full", "attention-excluded"])
@pytest.mark.parametrize("tracker_class", [DictTracker, GeneratorTracker])
@pytest.mark.parametrize("backwards", [1, 2])
def test_registered_tracker_replays_the_forward_draws(exclude, tracker_class, backwards):
    ref_tracker = tracker_class()
    reference = run_step(make_model(ref_tracker, checkpointed=False, exclude=False))
    # A second backward over the same graph replays again: the tracker advances once.
    ref_tracker_once = tracker_class()
    run_step(make_model(ref_tracker_once, checkpointed=False, exclude=False))

    tracker = tracker_class()
    with recomp.register_rng_tracker(tracker):
        model = make_model(tracker, checkpointed=True, exclude=exclude)
        checkpointed = run_step(model, backwards=backwards)
    if backwards == 1:
        assert_exact(reference, checkpointed, ref_tracker, tracker)
    else:
        # Gradients accumulate over the backwards: compare against twice the reference.
        want = ([2 * g for g in reference[0]], reference[1])
        assert_exact(want, checkpointed, ref_tracker_once, tracker)
    assert recomp.register_rng_tracker(tracker).tracker() is tracker  # a new registration
    recomp.unregister_rng_tracker(tracker)


@pytest.mark.parametrize(
    "module_name",
    [
        "megatron.core.tensor_parallel.random",
        "deepspeed.runtime.activation_checkpointing.checkpointing",
    ],
)
def test_megatron_and_deepspeed_trackers_are_found_without_registration(monkeypatch, module_name):
    ref_tracker = DictTracker()
    reference = run_step(make_model(ref_tracker, checkpointed=False, exclude=False))

    tracker = DictTracker()
    stand_in = types.ModuleType(module_name)
    stand_in._CUDA_RNG_STATE_TRACKER = tracker  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module_name, stand_in)
    checkpointed = run_step(make_model(tracker, checkpointed=True, exclude=True))
    assert_exact(reference, checkpointed, ref_tracker, tracker)


@pytest.mark.replay_differs
def test_preserve_rng_state_false_leaves_trackers_alone():
    """As for torch's generators: the user asked for no restore, the replay draws anew."""
    tracker = DictTracker()
    with recomp.register_rng_tracker(tracker):
        model = make_model(tracker, checkpointed=False, exclude=False)
        for block in model:
            rt.checkpoint_wrapper(block, preserve_rng_state=False)
        torch.manual_seed(7)
        x = torch.randn(4, 8, requires_grad=True)
        out = model(x)
        after_forward = tracker_state(tracker).clone()
        out.sum().backward()
    assert not torch.equal(after_forward, tracker_state(tracker)), "the replay drew again"


GLOBAL_TRACKER = DictTracker(seed=5)  # as Megatron's: a global, not copied with the model


class GlobalTrackerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return tracked_dropout(GLOBAL_TRACKER, self.lin(x), 0.5)


def test_profiling_leaves_trackers_as_it_found_them():
    from recomp.plan import profile

    model = nn.Sequential(GlobalTrackerBlock(), GlobalTrackerBlock())
    before = tracker_state(GLOBAL_TRACKER).clone()
    with recomp.register_rng_tracker(GLOBAL_TRACKER):
        profile(model, torch.randn(4, 8), layers=lambda m: isinstance(m, GlobalTrackerBlock))
    assert torch.equal(tracker_state(GLOBAL_TRACKER), before)
