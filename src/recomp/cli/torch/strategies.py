"""Checkpointing strategies for PyTorch models, all applied per layer (``model.layers``, or
the decoder layers of a Hugging Face model: ``layers_of``). Their names and what each
is: ``recomp.cli.strategies``; how each is made here:

==============================  ========================================================
``none``                        no checkpointing
``full``                        ``torch.utils.checkpoint`` (non-reentrant) around every
                                layer
``exclude:R``                   recomp: ``apply_activation_checkpointing`` with every
                                layer checkpointed and its children ``R`` excluded
``selective``,                  the plan option of that name for every layer, applied
``selective+exclude:R``,        with ``recomp.plan.apply_plan``
``swap``, ``offload``
``full+swap-inputs``            recomp's checkpoint with ``swap_inputs=True``
``full+swap-matmuls``           recomp's checkpoint, the outputs of its matmuls
                                ``MUST_SWAP`` (kept on the host instead of recomputed)
``sac:R``                       PyTorch selective checkpointing: every layer
                                checkpointed, the outputs of the non-view ops inside
                                region ``R`` saved: the tensors an exclusion of ``R``
                                keeps. Compiled, the policy finds the region's ops
                                through the module stack Dynamo records on each node
                                (module hooks do not run while AOTAutograd traces)
``torch-remat:R``               torch-remat 0.2.2: ``remat.checkpoint`` per layer,
                                ``remat.region(R, recompute=False)``, and
                                ``remat.recompute_needs_tensor`` on its output
``exclude-offload:R``           ``exclude:R``, with ``R`` offloading what it keeps to
                                host memory (CUDA; a no-op on CPU unless
                                ``RECOMP_OFFLOAD_HOST_COPY=1``)
``keep:R``                      reference design without deferred inputs: like
                                ``exclude:R``, but the region keeps every tensor it
                                saves, its inputs included (written here, 40 lines, for
                                the deferred-input scenario)
``every@K``                     layer-frequency policy (torchtitan's):
                                ``torch.utils.checkpoint`` around every K-th layer
                                (layers K-1, 2K-1, ...), none elsewhere
``plan@B``                      ``recomp.plan``: the fastest plan whose predicted
                                activation memory fits budget ``B`` (``50%``,
                                ``6GiB``), applied with ``recomp.plan.apply_plan``;
                                compiled, the partitioner's memory budget that lands on
                                ``B`` (``recomp.plan.compiled``)
``budget@F``                    compiled only: no checkpoint, PyTorch's partitioner with
                                ``torch._functorch.config.activation_memory_budget = F``
==============================  ========================================================
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.utils.checkpoint as tuc
from torch import nn

from ..args import did_you_mean
from ..strategies import REGION_ALIASES, Strategy, StrategyError, parse
from .measure import RegionTracker

#: The plan options that are strategies made with ``recomp.plan.apply_plan`` here.
PLANNED_KINDS = ("selective", "selective+exclude", "swap", "offload")


@dataclass
class Prepared:
    """A model with a strategy applied, and what the measurements need to know about it."""

    strategy: str
    model: nn.Module
    # Checkpoint units and kept regions, by name, as the original (unwrapped) modules.
    units: dict[str, nn.Module] = field(default_factory=dict)
    regions: dict[str, nn.Module] = field(default_factory=dict)
    # recomp ExcludeWrapper objects, by region name (their region_runs / region_skips).
    exclude_wrappers: dict[str, Any] = field(default_factory=dict)
    # Shared region tracker that a strategy's policy reads (SAC), if any.
    tracker: RegionTracker | None = None
    # recomp Offloader of the offloading regions (exclude-offload:R), if any.
    offloader: Any = None


def layers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The checkpoint units, by path: the layers the planner finds
    (``recomp.plan.profiler.find_layers``): ``model.layers``, or the Hugging Face model's
    decoder layers (``model.layers.N`` of a causal LM)."""
    from recomp.plan.profiler import find_layers

    stack = getattr(model, "layers", None)
    if isinstance(stack, (list, tuple)):  # a plain list of modules, not registered
        return [(f"layers.{i}", layer) for i, layer in enumerate(stack)]
    return find_layers(model)


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    *head, name = path.split(".")
    parent: Any = model
    for part in head:
        parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
    if name.isdigit():
        parent[int(name)] = module
    else:
        setattr(parent, name, module)


def child_of(layer: nn.Module, region: str) -> tuple[str, nn.Module]:
    for name in REGION_ALIASES.get(region, (region,)):
        child = getattr(layer, name, None)
        if isinstance(child, nn.Module):
            return name, child
    names = [n for n, _ in layer.named_children()]
    hint = did_you_mean(region, list(dict.fromkeys(names + list(REGION_ALIASES))))
    raise ValueError(
        f"layer {type(layer).__name__} has no child module {region!r}{hint}; a region is "
        f"a child of every layer, by name (children: {', '.join(names)})"
    )


def prepare(
    strategy: str, model: nn.Module, plan: Any = None, compiled: bool = False
) -> Prepared:
    """Apply ``strategy`` to ``model`` in place; ``plan`` (a ``recomp.plan.Plan``) for
    ``plan@B``. ``compiled``: the model will be run under ``torch.compile`` (SAC then
    identifies the region without module hooks)."""
    parsed = parse(strategy)
    kind = parsed.kind
    layers = layers_of(model)
    prepared = Prepared(parsed.name, model, units=dict(layers))
    if kind == "every":
        _apply_every(model, int(parsed.value))
        return prepared
    if kind == "budget":
        if not compiled:
            raise ValueError(
                f"strategy {strategy!r} is PyTorch's compiled memory budget: run it with --compile"
            )
        return prepared
    if kind == "plan":
        if plan is None:
            raise ValueError(f"strategy {strategy!r} needs a plan (recomp.plan.make_plan)")
        _apply_plan(model, plan, prepared)
        return prepared
    if kind in PLANNED_KINDS:
        _apply_plan(model, uniform_plan(parsed, layers), prepared)
        if kind in ("swap", "offload"):
            from recomp.torch import default_offloader

            prepared.offloader = default_offloader()
        return prepared
    for lname, layer in layers:
        for region in parsed.regions:
            cname, child = child_of(layer, region)
            prepared.regions[f"{lname}.{cname}"] = child
    if kind == "none":
        return prepared
    if kind == "full":
        _wrap_units(model, lambda name, layer: TorchCheckpoint(layer))
    elif kind == "sac" and compiled:
        region_types = tuple({type(m) for m in prepared.regions.values()})
        policy = partial(_compiled_sac_policy, region_types)
        context_fn = partial(tuc.create_selective_checkpoint_contexts, policy)
        _wrap_units(model, lambda name, layer: TorchCheckpoint(layer, context_fn=context_fn))
    elif kind == "sac":
        tracker = RegionTracker()
        tracker.track(prepared.regions)
        prepared.tracker = tracker
        policy = partial(_sac_policy, tracker)
        context_fn = partial(tuc.create_selective_checkpoint_contexts, policy)
        _wrap_units(model, lambda name, layer: TorchCheckpoint(layer, context_fn=context_fn))
    elif kind in ("full+swap-inputs", "full+swap-matmuls"):
        _apply_swap(model, prepared, kind)
    elif kind == "torch-remat":
        _apply_torch_remat(model, layers, parsed.regions)
    elif kind in ("exclude", "exclude-offload"):
        _apply_recomp(model, prepared, offload=kind == "exclude-offload")
    elif kind == "keep":
        for _lname, layer in layers:
            for region in parsed.regions:
                cname, child = child_of(layer, region)
                setattr(layer, cname, NaiveKeep(child))
        _wrap_units(model, lambda name, layer: TorchCheckpoint(layer, context_fn=_naive_contexts))
    else:
        raise ValueError(f"strategy {parsed} does not run on a PyTorch model here")
    return prepared


def prepare_plan(model: nn.Module, plan: Any, name: str) -> Prepared:
    """Apply ``plan`` (a ``recomp.plan.Plan``, say read from a plan file) to ``model`` in
    place; ``name`` names it in reports."""
    prepared = Prepared(name, model, units=dict(layers_of(model)))
    _apply_plan(model, plan, prepared)
    return prepared


def uniform_plan(strategy: Strategy, layers: list[tuple[str, nn.Module]]) -> Any:
    """The plan that gives every layer the option ``strategy`` names (its regions found
    under their aliases in each layer)."""
    from recomp.plan import LayerPlan, Plan
    from recomp.plan.planfile import exclude_option

    plans = []
    for path, layer in layers:
        option = strategy.kind
        if strategy.regions:
            found = [child_of(layer, r)[0] for r in strategy.regions]
            option = exclude_option(found, selective=strategy.kind == "selective+exclude")
        plans.append(LayerPlan(path, option))
    return Plan(budget_bytes=0, layers=plans, budget=strategy.name)


def torch_memory_budget(strategy: str) -> float:
    """``budget@F`` -> ``F`` (checked to lie in [0, 1] when the name was parsed)."""
    parsed = parse(strategy)
    if parsed.kind != "budget":
        raise StrategyError(f"{strategy!r} is not a budget@F strategy")
    return float(parsed.value)


def _wrap_units(model: nn.Module, wrap: Callable[[str, nn.Module], nn.Module]) -> None:
    for path, layer in layers_of(model):
        _set_submodule(model, path, wrap(path, layer))


class TorchCheckpoint(nn.Module):
    """``torch.utils.checkpoint.checkpoint(layer, ..., use_reentrant=False)``."""

    def __init__(self, inner: nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.context_fn = context_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Hugging Face calls its layers with keyword arguments: passed on to the layer.
        options: dict[str, Any] = {"use_reentrant": False}
        if self.context_fn is not None:
            options["context_fn"] = self.context_fn
        return tuc.checkpoint(self.inner, *args, **options, **kwargs)


def _sac_policy(tracker: RegionTracker, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    # Inside the kept region, save every op output that is not a view (views of saved
    # tensors cost nothing to recompute and no memory to keep); elsewhere recompute.
    if tracker.depth > 0 and not getattr(op, "is_view", False):
        return tuc.CheckpointPolicy.MUST_SAVE
    return tuc.CheckpointPolicy.PREFER_RECOMPUTE


def _compiled_sac_policy(
    region_types: tuple[type, ...], ctx: Any, op: Any, *args: Any, **kwargs: Any
) -> Any:
    # The same choice as _sac_policy, made while AOTAutograd traces a compiled model: the
    # op is inside the region if a module of the region's type is on the module stack
    # that Dynamo recorded for the node being traced.
    import torch.fx.traceback as fx_traceback

    stack = fx_traceback.current_meta.get("nn_module_stack") or {}
    inside = any(issubclass(cls, region_types) for _path, cls in stack.values())
    if inside and not getattr(op, "is_view", False):
        return tuc.CheckpointPolicy.MUST_SAVE
    return tuc.CheckpointPolicy.PREFER_RECOMPUTE


# --------------------------------------------------------------------------- torch-remat


class RematCheckpoint(nn.Module):
    def __init__(self, inner: nn.Module, name: str) -> None:
        super().__init__()
        self.inner = inner
        self.region_name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        import torch_remat as remat

        return remat.checkpoint(region_name=self.region_name)(self.inner)(*args, **kwargs)


class RematRegion(nn.Module):
    """``remat.region(child, name, recompute=False)``, then ``recompute_needs_tensor`` on the
    output: the residual add after it is a bare op that reads it in the replay."""

    def __init__(self, inner: nn.Module, name: str) -> None:
        super().__init__()
        import torch_remat as remat

        self.inner = inner
        call = self.inner.__call__
        # A region is a function, not a module: keep it out of nn.Module attributes.
        object.__setattr__(
            self, "_region", remat.region(lambda *a, **k: call(*a, **k), name, recompute=False)
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        import torch_remat as remat

        out = self._region(*args, **kwargs)  # type: ignore[operator]
        # A Hugging Face attention returns (output, weights): each tensor of a tuple.
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                remat.recompute_needs_tensor(t)
        return out


def _apply_torch_remat(
    model: nn.Module, layers: list[tuple[str, nn.Module]], regions: tuple[str, ...]
) -> None:
    for _lname, layer in layers:
        for region in regions:
            cname, child = child_of(layer, region)
            setattr(layer, cname, RematRegion(child, cname))
    _wrap_units(model, lambda name, layer: RematCheckpoint(layer, name))


# --------------------------------------------------------------------------- recomp


def _apply_recomp(model: nn.Module, prepared: Prepared, offload: bool = False) -> None:
    from recomp.torch import ExcludeWrapper, Offloader, apply_activation_checkpointing

    units = set(prepared.units.values())
    kept = set(prepared.regions.values())
    if offload:
        prepared.offloader = Offloader()
    apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: m in units,
        exclude_fn=lambda m: m in kept,
        offload_fn=(lambda m: prepared.offloader) if offload else None,
    )
    by_module = {id(m): name for name, m in prepared.regions.items()}
    for module in model.modules():
        if isinstance(module, ExcludeWrapper):
            prepared.exclude_wrappers[by_module[id(module)]] = module


def _swap_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from recomp.torch import CheckpointPolicy

    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SWAP
    return CheckpointPolicy.PREFER_RECOMPUTE


def _apply_swap(model: nn.Module, prepared: Prepared, kind: str) -> None:
    from recomp.torch import apply_activation_checkpointing, default_offloader

    units = set(prepared.units.values())
    options: dict[str, Any] = (
        {"swap_inputs": True} if kind == "full+swap-inputs" else {"policy_fn": _swap_matmuls}
    )
    apply_activation_checkpointing(model, checkpoint_fn=lambda m: m in units, **options)
    prepared.offloader = default_offloader()


def _apply_plan(model: nn.Module, plan: Any, prepared: Prepared) -> None:
    from recomp.plan import apply_plan
    from recomp.torch import ExcludeWrapper

    for layer in plan.layers:
        for path in layer.excluded:
            name = f"{layer.path}.{path}"
            prepared.regions[name] = model.get_submodule(name)
    apply_plan(model, plan)
    for module in model.modules():
        if isinstance(module, ExcludeWrapper) and module.region.name in prepared.regions:
            prepared.exclude_wrappers[module.region.name] = module


# --------------------------------------------------------------------------- every@K


def _apply_every(model: nn.Module, k: int) -> None:
    for i, (path, layer) in enumerate(layers_of(model)):
        if (i + 1) % k == 0:
            _set_submodule(model, path, TorchCheckpoint(layer))


# --------------------------------------------------------------------------- keep:R


class _NaiveInvocation:
    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []
        self.cursor = 0
        self.replaying = False


_naive: contextvars.ContextVar[_NaiveInvocation | None] = contextvars.ContextVar(
    "bench_naive_keep", default=None
)


@contextlib.contextmanager
def _naive_phase(inv: _NaiveInvocation, replaying: bool) -> Iterator[None]:
    inv.replaying, inv.cursor = replaying, 0
    token = _naive.set(inv)
    try:
        yield
    finally:
        _naive.reset(token)


def _naive_contexts() -> tuple[Any, Any]:
    inv = _NaiveInvocation()
    return _naive_phase(inv, False), _naive_phase(inv, True)


class NaiveKeep(nn.Module):
    """An excluded region without deferred inputs: in the forward it keeps everything its
    autograd nodes save (its input included) under an identity saved-tensors hook; in the
    replay it returns its cached output without running."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inv = _naive.get()
        if inv is None:
            return self.inner(x)
        if inv.replaying:
            cached = inv.outputs[inv.cursor]
            inv.cursor += 1
            return cached.detach().requires_grad_(cached.requires_grad)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = self.inner(x)
        inv.outputs.append(out.detach().requires_grad_(out.requires_grad))
        return out
