"""The planner's rules against the engine's.

The profiler predicts, from one recorded forward, what every option of every layer keeps
and replays: which tensors an excluded region keeps, which of its inputs it defers to the
replay, which cached outputs it drops because the replay stops before them, and where
the replay stops. The engine decides the same things while it runs. Here every option of
every layer of several models is applied with ``apply_plan`` and run, and what the
engine reports (``region_saved_bytes`` of each excluded region, the replayed FLOPs) must
be what the profile predicted, exactly. A change of either side's rules that the other
does not follow fails here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from recomp import _testing  # noqa: E402
from recomp.bench.measure import SplitFlopCounter  # noqa: E402
from recomp.bench.models import llama, norm_matmul_silu  # noqa: E402
from recomp.plan import OptionSlot, apply_plan, make_plan, profile  # noqa: E402
from recomp.plan.planfile import FULL_CHECKPOINT, NO_CHECKPOINT  # noqa: E402
from recomp.torch import ExcludeWrapper  # noqa: E402
from torch_models import Block, stack  # noqa: E402


class Mixed(nn.Module):
    """A layer whose candidates meet every rule: ``first`` feeds ``second`` (an excluded
    output is no deferred input of the next region), ``side`` reads the layer's own input
    (held by the checkpoint, so kept, not deferred), ``last``'s output goes only into an
    add that saves nothing (dropped when nothing the checkpoint saves comes after it)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.pre = nn.Linear(d, d)
        self.first = nn.Linear(d, d)
        self.second = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.side = nn.Linear(d, d)
        self.last = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sin(self.pre(x))
        b = self.second(self.first(h))
        return self.last(b * self.side(x)) + x


class MixedStack(nn.Module):
    def __init__(self, layers: int, d: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Mixed(d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _llama() -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    return llama(layers=2, hidden=32, heads=2), torch.randn(2, 16, 32), None


def _scenario() -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    return norm_matmul_silu(layers=2, hidden=16), torch.randn(2, 8, 16), None


def _blocks() -> tuple[nn.Module, Any, Any]:
    return stack(3, d=16), torch.randn(4, 16), lambda m: isinstance(m, Block)


def _mixed() -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    return MixedStack(2, 8), torch.randn(3, 8, requires_grad=True), None


MODELS: dict[str, Callable[[], tuple[nn.Module, Any, Any]]] = {
    "llama": _llama,
    "norm_matmul_silu": _scenario,
    "blocks": _blocks,
    "mixed": _mixed,
}


def _loss(out: Any) -> torch.Tensor:
    return out.float().pow(2).mean()


def _run(model: nn.Module, x: Any) -> tuple[dict[str, int], dict[str, int], int]:
    """One forward and backward: the bytes each excluded region reports it keeps, the
    saved tensors the engine deferred per region, and the FLOPs replayed."""
    deferred: dict[str, int] = {}

    def on_deferred(is_view: bool) -> None:
        name = _testing.active_region_name()
        assert name is not None
        deferred[name] = deferred.get(name, 0) + 1

    counter = SplitFlopCounter()
    inputs = x.detach().clone().requires_grad_(x.requires_grad)
    with _testing.observe(deferred=on_deferred), counter:
        with counter.in_phase("forward"):
            loss = _loss(model(inputs))
        with counter.in_phase("backward"):
            loss.backward()
    saved = {
        m.region.name: int(m.region_saved_bytes)
        for m in model.modules()
        if isinstance(m, ExcludeWrapper)
    }
    return saved, deferred, counter.split["replay"]


@pytest.fixture(scope="module", params=sorted(MODELS))
def profiled(request):
    model, x, layers = MODELS[request.param]()
    return request.param, model, x, profile(model, x, _loss, layers=layers, steps=1)


def test_option_order_is_named(profiled):
    _, _, _, prof = profiled
    for layer in prof.layers:
        assert layer.options[OptionSlot.NONE].name == NO_CHECKPOINT
        assert layer.options[OptionSlot.FULL].name == FULL_CHECKPOINT
        assert all(o.name.startswith("exclude:") for o in layer.options[OptionSlot.EXCLUSIONS :])


def test_every_option_keeps_and_replays_what_the_engine_does(profiled):
    """Per option slot, the same option on every layer: each excluded region's bytes
    (kept saved tensors, deferred inputs left out, cached outputs unless dropped) and the
    replayed FLOPs (early stop, the boundary of deferred inputs) as predicted."""
    name, model, x, prof = profiled
    counts = {len(layer.options) for layer in prof.layers}
    assert len(counts) == 1, "the models here have alike layers"
    any_deferred = False
    for slot in range(counts.pop()):
        plan = make_plan(prof, "100%")
        for layer_plan, layer in zip(plan.layers, prof.layers):
            layer_plan.option = layer.options[slot].name
        options = [layer.options[slot] for layer in prof.layers]
        saved, deferred, replay = _run(apply_plan(copy.deepcopy(model), plan), x)
        expected = {
            f"{layer.path}.{region}": nbytes
            for layer, option in zip(prof.layers, options)
            for region, nbytes in option.region_saved_bytes.items()
        }
        assert saved == expected, (name, options[0].name)
        assert replay == sum(o.replay_flops for o in options), (name, options[0].name)
        any_deferred |= bool(deferred)
    if name != "blocks":
        # The comparison covers deferral: some region deferred a saved input.
        assert any_deferred, name
    if name == "mixed":
        # ... and dropping: excluded alone, ``last`` keeps nothing: its input is made in
        # the layer (deferred), and nothing the checkpoint saves comes after its output.
        assert prof.layers[0].option("exclude:last").region_saved_bytes == {"last": 0}
        # ``side`` reads the layer's input, which the checkpoint holds: kept, not deferred.
        assert prof.layers[0].option("exclude:side").region_saved_bytes["side"] >= 3 * 8 * 4
