"""What a recomp checkpoint call leaves to the garbage collector, and what it keeps until
its backward (NOTE [ What a call keeps ] in ``recomp._engine``).

A call's objects go with its autograd graph by reference counting: a training step with
the collector off leaves exactly the cyclic garbage that PyTorch's own checkpoint leaves
(its closures), whatever recomp adds to the call (excluded regions, the debug log, two
backward passes over a retained graph). A call keeps few objects of its own through the
forward (each one counts towards the collector's next run), and keeps its parts as long as
its graph (some are found through weak references while it lives).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import recomp.torch as rt

LAYERS = 4


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class PyTorchCheckpointed(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)


def _pytorch() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[PyTorchCheckpointed(Layer()) for _ in range(LAYERS)])


def _recomp(**options: object) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[rt.checkpoint_wrapper(Layer(), **options) for _ in range(LAYERS)])


def _with_region() -> nn.Module:
    model = _recomp()
    for layer in model:
        rt.checkpoint_exclude_wrapper(layer.fc1)
    return model


def _step(model: nn.Module, passes: int = 1) -> None:
    x = torch.randn(4, 16, requires_grad=True)
    loss = model(x).sum()
    params = list(model.parameters())
    for i in range(passes):
        # Two passes: one for the input's gradient over the retained graph, then the
        # parameters' (a zero-bubble schedule's split): the replay is kept between them.
        inputs = [x] if i < passes - 1 else params
        torch.autograd.grad(loss, inputs, retain_graph=i < passes - 1)


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _garbage_of(model: nn.Module, passes: int = 1, steps: int = 3) -> int:
    _step(model, passes)  # first steps learn layouts, make caches
    _step(model, passes)
    gc.collect()
    for _ in range(steps):
        _step(model, passes)
    return gc.collect()


@pytest.mark.parametrize(
    "make",
    [_recomp, _with_region, lambda: _recomp(debug=True), lambda: _recomp(preserve_rng_state=False)],
    ids=["plain", "excluded region", "debug", "no rng state"],
)
@pytest.mark.parametrize("passes", [1, 2])
def test_a_step_leaves_what_pytorchs_checkpoint_leaves(
    collector_off: None, make: Callable[[], nn.Module], passes: int
) -> None:
    pytorch = _garbage_of(_pytorch(), passes)
    assert _garbage_of(make(), passes) == pytorch


def _kept_through_forward(model: nn.Module) -> int:
    """Objects tracked by the collector that one forward leaves alive, per layer."""
    x = torch.randn(4, 16, requires_grad=True)
    for _ in range(3):
        model(x).sum().backward()
    gc.collect()
    before = len(gc.get_objects())
    out = model(x)
    kept = len(gc.get_objects()) - before
    del out
    return kept


def test_a_call_keeps_few_objects_of_its_own_through_the_forward(collector_off: None) -> None:
    # The tiny layer, PyTorch's checkpoint against recomp's: 60 and 89 per layer before
    # the objects a call keeps were cut (NOTE [ What a call keeps ]), 60 and 71 after,
    # then 60 and 69 once a phase's context was also its recompute state and held its one
    # part's context itself: 9 more per layer, also on this small model, on PyTorch 2.9
    # and 2.14 (five instances of recomp's classes: the call, its invocation, the module
    # state, the kept-replay handle, the replay's context; three lists: the parts, the
    # module state's tensors and their versions; two bound methods; one of PyTorch's
    # nullcontexts fewer).
    pytorch = _kept_through_forward(_pytorch())
    recomp = _kept_through_forward(_recomp())
    assert pytorch > 0
    assert (recomp - pytorch) / LAYERS <= 9


class AllReduced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        h = torch.tanh(self.fc(x))
        dist.all_reduce(h)  # a sum over one rank: h itself
        return h.exp()


@pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered:UserWarning")
def test_a_calls_parts_live_as_long_as_its_graph(tmp_path: Any) -> None:
    # A part is found through weak references while its checkpoint's graph lives (the
    # collective record by kept_collective_bytes): the call holds its parts until the graph
    # goes, not only until their contexts are made.
    import torch.distributed as dist

    from recomp.torch.collectives import kept_collective_bytes

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = rt.checkpoint_wrapper(AllReduced())
        x = torch.randn(4, 16, requires_grad=True)
        out = model(x)
        gc.collect()
        assert kept_collective_bytes() == 4 * 16 * 4  # the all-reduced tensor, kept
        out.sum().backward()
        del out
        assert kept_collective_bytes() == 0  # gone with the graph
    finally:
        dist.destroy_process_group()
