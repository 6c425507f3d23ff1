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

import random_programs as rp  # noqa: E402
from recomp import _testing  # noqa: E402
from recomp.cli.torch.measure import SplitFlopCounter  # noqa: E402
from recomp.cli.torch.models import llama, norm_matmul_silu  # noqa: E402
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
        names = [o.name for o in layer.options[OptionSlot.EXCLUSIONS :]]
        first = names.index("selective")
        assert all(n.startswith("exclude:") for n in names[:first])
        assert names[first + 1 :] == [f"selective+{n}" for n in names[:first]]


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


# --------------------------------------------------------------------------- random programs


class _Region(nn.Module):
    """A region of a random program as a module (a candidate of the layers that call it);
    the parameters its body uses stay with the program, as shared weights would."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class _Layer(nn.Module):
    """A top-level checkpoint block of a random program as a layer. The values the block
    reads without receiving them come from ``outer``, set by the program before the call
    (captured, as a closure captures them)."""

    def __init__(self, stmt: Any, run: Callable[..., Any]) -> None:
        super().__init__()
        self.stmt = stmt
        self.run = run
        self.outer: dict[int, Any] = {}

    def forward(self, *args: Any) -> Any:
        return self.run(self.stmt, self.outer, args)


class ProgramModel(nn.Module):
    """A random program (``random_programs``) as a model for the planner: its top-level
    checkpoint blocks are the layers (inner checkpoints run inline: the planner plans one
    level), its regions the candidates; the forward returns the loss."""

    def __init__(self, program: Any) -> None:
        super().__init__()
        from torch_programs import OPS

        self.ops, self.program = OPS, program
        _, params = rp.initial_values(program)
        self.weights = nn.ParameterDict(
            {n: nn.Parameter(torch.tensor(v)) for n, v in params.items()}
        )
        self.regions = [_Region(self._region_fn(r)) for r in program.regions]
        blocks = [s for s in program.body if isinstance(s, rp.Checkpoint)]
        self.layers = nn.ModuleList(_Layer(s, self._run_layer) for s in blocks)
        for layer in self.layers:
            for index in sorted(self._calls(layer.stmt.body)):
                layer.add_module(program.regions[index].name, self.regions[index])

    def _dtype(self, value: int) -> str:
        return str(self.program.types[value][1])

    def _calls(self, body: Any) -> set[int]:
        found: set[int] = set()
        for s in body:
            if isinstance(s, rp.Call):
                found.add(s.region)
            elif isinstance(s, rp.Checkpoint):
                found |= self._calls(s.body)
        return found

    def _block(self, body: Any, env: dict[int, Any]) -> None:
        for s in body:
            if isinstance(s, rp.Op):
                env[s.out] = self.ops[s.kind](
                    [env[a] for a in s.args], [self.weights[n] for n in s.params], s.attrs
                )
            elif isinstance(s, rp.Call):
                r = self.program.regions[s.region]
                values = [env[a] for a in s.args]
                out = self.regions[s.region](
                    *rp.fill(r.in_tmpl[0], values), **rp.fill(r.in_tmpl[1], values)
                )
                env.update(zip(s.outs, rp.bind(r.out_tmpl, out, len(s.outs))))
            else:  # an inner checkpoint: inline
                out = self._run_layer(s, env, tuple(rp.fill(s.args_tmpl, [env[a] for a in s.args])))
                env.update(zip(s.outs, rp.bind(s.out_tmpl, out, len(s.outs))))

    def _run_layer(self, stmt: Any, outer: dict[int, Any], args: tuple[Any, ...]) -> Any:
        env = dict(outer)
        env.update(zip(stmt.args, rp.bind(stmt.args_tmpl, args, len(stmt.args))))
        self._block(stmt.body, env)
        return rp.fill(stmt.out_tmpl, [env[o] for o in stmt.outs])

    def _region_fn(self, r: Any) -> Callable[..., Any]:

        def fn(*args: Any, **kwargs: Any) -> Any:
            env = dict(zip(r.in_ids, rp.bind(r.in_tmpl, (args, kwargs), len(r.in_ids))))
            self._block(r.body, env)
            return rp.fill(r.out_tmpl, [env[o] for o in r.out_ids])

        return fn

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        env: dict[int, Any] = {i: x for (i, _), x in zip(self.program.inputs, inputs)}
        layers = iter(self.layers)
        for s in self.program.body:
            if isinstance(s, rp.Checkpoint):
                layer = next(layers)
                layer.outer = dict(env)
                out = layer(*rp.fill(s.args_tmpl, [env[a] for a in s.args]))
                env.update(zip(s.outs, rp.bind(s.out_tmpl, out, len(s.outs))))
            else:
                self._block((s,), env)
        # The loss also reads every float output of every layer: the planner plans layers
        # whose backward runs (one whose outputs do not reach the loss never replays).
        reach = dict.fromkeys(self.program.loss)
        for layer in self.layers:
            reach.update(dict.fromkeys(o for o in layer.stmt.outs if self._dtype(o) == rp.FLOAT))
        terms = [self.ops["square_sum"]([env[i]], [], ()) for i in reach]
        return sum(terms[1:], terms[0])


def _random_program_check(program: Any) -> int:
    """Profile ``program`` as a model; per layer, run each option whose excluded regions
    are called once in the whole program (the planner sums a region's calls, the engine
    reports its last one), with the other layers not checkpointed. Returns the number of
    options compared."""
    from recomp.plan.planfile import LayerPlan, Plan

    model = ProgramModel(program)
    xs, _ = rp.initial_values(program)
    inputs = tuple(torch.tensor(x, requires_grad=True) for x in xs)
    prof = profile(
        model,
        inputs,
        lambda loss: loss,
        layers=list(_layer_paths(model)),
        exclude=_is_region,
        steps=1,
    )
    calls = program.calls_per_region()
    once = {r.name for r, n in zip(program.regions, calls) if n == 1}
    compared = 0
    for i, layer in enumerate(prof.layers):
        for option in layer.options[OptionSlot.FULL :]:
            if not set(option.region_saved_bytes) <= once:
                continue
            if option.name.startswith("selective+"):
                continue  # the mixes: test_every_option_keeps_and_replays_what_the_engine_does

            chosen = [
                LayerPlan(lp.path, option.name if j == i else NO_CHECKPOINT)
                for j, lp in enumerate(prof.layers)
            ]
            planned = apply_plan(copy.deepcopy(model), Plan(0, chosen))
            saved, _, replay = _run_loss(planned, inputs)
            expected = {f"{layer.path}.{r}": n for r, n in option.region_saved_bytes.items()}
            assert saved == expected, (option.name, program)
            assert replay == option.replay_flops, (option.name, program)
            compared += 1
    return compared


def _layer_paths(model: ProgramModel) -> list[str]:
    return [f"layers.{i}" for i in range(len(model.layers))]


def _is_region(m: nn.Module) -> bool:
    return isinstance(m, _Region)


def _run_loss(
    model: nn.Module, inputs: tuple[torch.Tensor, ...]
) -> tuple[dict[str, int], None, int]:
    counter = SplitFlopCounter()
    fresh = [x.detach().clone().requires_grad_(True) for x in inputs]
    with counter:
        with counter.in_phase("forward"):
            loss = model(*fresh)
        with counter.in_phase("backward"):
            loss.backward()
    saved = {
        m.region.name: int(m.region_saved_bytes)
        for m in model.modules()
        if isinstance(m, ExcludeWrapper)
    }
    return saved, None, counter.split["replay"]


def test_random_programs_keep_and_replay_what_the_engine_does():
    """The same comparison on random programs: captured values, pytree inputs and
    outputs with constants, chained regions, regions outside the layers."""
    hypothesis = pytest.importorskip("hypothesis")

    compared: list[int] = []

    @hypothesis.settings(
        max_examples=40,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        # A shrink of these programs takes minutes; the failing program is printed whole.
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
    )
    @hypothesis.given(program=rp.programs())
    def check(program: Any) -> None:
        blocks = [s for s in program.body if isinstance(s, rp.Checkpoint)]
        hypothesis.assume(
            blocks and all(any(program.types[o][1] == rp.FLOAT for o in b.outs) for b in blocks)
        )
        compared.append(_random_program_check(program))

    check()
    assert sum(compared) >= 20, compared
