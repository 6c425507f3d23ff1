"""The record of one profiled forward: every tensor autograd saves and every ATen op,
in one sequence, each tagged with the layer and the candidate region it ran in.

``Recorder`` is a dispatch mode (the ops, their FLOPs and times: measured with a clock,
or given by a cost model when the ops run on fake tensors), a saved-tensors hook
(``pack``) and a set of module hooks (the boundaries of layers and of the candidate
regions' calls). Storages are identified by ``recomp.torch._compat.storage_key``; a
wrapper subclass (DTensor) is seen through its local tensor, which holds this process's
memory.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter

from ..torch import _compat
from ..torch._collective_cache import kept_results
from ..torch._compat import TorchDispatchMode
from .modelcall import flop_formulas, tensors_of
from .policy import expensive_ops

# The seconds an op takes on a modelled device: (op, args, kwargs, output, FLOPs) -> s.
OpCost = Callable[[Any, tuple[Any, ...], dict[str, Any], Any, int], float]


@dataclass
class SavedTensor:
    """A tensor autograd saved: its storage (key and size), whether a parameter."""

    seq: int
    key: Hashable
    nbytes: int
    is_parameter: bool
    span: int | None  # index in the layer's ``spans`` of the region call it was saved in
    # A tensor subclass wrapping a local tensor (DTensor): recomp's swap leaves it be.
    wrapped: bool = False


@dataclass
class RecordedOp:
    """An ATen op of the forward: its FLOPs, its time, what a checkpoint may keep of it."""

    seq: int
    span: int | None  # index in the layer's ``spans`` of the region call it ran in
    flops: int
    seconds: float
    expensive: bool = False  # a selective option keeps its outputs (recomp.plan.policy)
    outputs: list[tuple[Hashable, int]] = field(default_factory=list)  # (storage, bytes)
    # A collective whose results a checkpoint keeps: their (storage, bytes); else None.
    collective: list[tuple[Hashable, int]] | None = None
    # Outside the layers only: the floating-point inputs (storage, bytes of the tensor)
    # and outputs' bytes, the gradients its backward holds at once (the loss's backward).
    float_inputs: list[tuple[Hashable, int]] = field(default_factory=list)
    float_output_bytes: int = 0


@dataclass
class RegionSpan:
    """One call of a candidate region inside a layer's forward: where it starts and ends
    in the sequence, the storages it took and returned, its parameters' storages."""

    candidate: int
    start: int
    end: int = -1
    inputs: list[tuple[Hashable, bool]] = field(default_factory=list)  # (storage, parameter)
    outputs: list[tuple[Hashable, int, bool]] = field(default_factory=list)  # (.., bytes, grad)
    parameter_keys: set[Hashable] = field(default_factory=set)
    wrapped_outputs: set[Hashable] = field(default_factory=set)  # outputs that are DTensors


@dataclass
class LayerRecord:
    """What one layer's forward saved and ran (or, for ``Recorder.outside``, what ran
    outside every layer), with the candidate regions' calls in it."""

    start: int = -1
    end: int = -1
    calls_seen: int = 0
    input_keys: dict[Hashable, int] = field(default_factory=dict)
    output_keys: dict[Hashable, int] = field(default_factory=dict)
    wrapped_inputs: set[Hashable] = field(default_factory=set)  # inputs that are DTensors
    # Storages of the tensors among its positional arguments (not nested in containers),
    # which a checkpoint saves as autograd saved tensors (the others it holds itself).
    positional_keys: set[Hashable] = field(default_factory=set)
    held_keys: set[Hashable] = field(default_factory=set)  # storages of the other inputs
    # The plain floating-point tensors among its positional arguments, in order: (storage,
    # elements, bytes per element); what ``partition_inputs`` splits.
    float_positional: list[tuple[Hashable, int, int]] = field(default_factory=list)
    saves: list[SavedTensor] = field(default_factory=list)
    ops: list[RecordedOp] = field(default_factory=list)
    spans: list[RegionSpan] = field(default_factory=list)


def storage_of(t: torch.Tensor) -> tuple[Hashable, int] | None:
    """The (key, bytes) of the storage ``t`` lives in, or None where it has none."""
    inner = local_tensor(t)
    if inner is not None:
        return storage_of(inner)
    key = _compat.storage_key(t)
    if key is None:
        return None
    return key, int(t.untyped_storage().nbytes())


def is_wrapper_subclass(t: type) -> bool:
    # DTensor and the like: tensor subclasses that wrap local tensors.
    return t is not torch.Tensor and hasattr(t, "__tensor_flatten__")


def local_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """The one tensor a wrapper subclass holds (a DTensor's local shard), else None.

    A DTensor reports a storage of its global size that holds no memory; what this
    process holds is its local tensor's storage, which the local ops see."""
    if not is_wrapper_subclass(type(t)):
        return None
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = [v for v in (getattr(t, name) for name in names) if isinstance(v, torch.Tensor)]
    return inner[0] if len(inner) == 1 else None


class Recorder(TorchDispatchMode):
    """Saved tensors and ATen ops of one forward, in one sequence, tagged by layer and
    candidate region.

    An op on a wrapper subclass (DTensor) is left to the subclass, whose ops on local
    tensors come back here: FLOPs, times and storages are this process's, and the
    collectives that DTensor issues are seen, with the tensors a checkpoint's collective
    record would keep (``recomp.torch._collective_cache``)."""

    def __init__(self, clock: Callable[[], float], cost: OpCost | None = None) -> None:
        super().__init__()
        self.clock = clock
        self.cost = cost  # given: each op's seconds come from it, not from the clock
        counter = flop_counter.FlopCounterMode(
            display=False, custom_mapping=flop_formulas(_compat.cpu_attention_ops())
        )
        self.registry = counter.flop_registry
        self.expensive = frozenset(expensive_ops())
        self.seq = 0
        self.layers: list[LayerRecord] = []
        self.outside = LayerRecord()
        self.layer: int | None = None
        self.span: int | None = None  # the open region call: an index in its layer's spans
        # Storages seen at layer and region boundaries stay alive until the analysis, so
        # that no later storage reuses their address as key.
        self.pinned: list[Any] = []

    def current_record(self) -> LayerRecord:
        return self.outside if self.layer is None else self.layers[self.layer]

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    # -- saved tensors -------------------------------------------------------

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        found = storage_of(t)
        if found is not None:
            key, nbytes = found
            self.current_record().saves.append(
                SavedTensor(
                    self.next_seq(),
                    key,
                    nbytes,
                    isinstance(t, nn.Parameter),
                    self.span,
                    is_wrapper_subclass(type(t)),
                )
            )
        return t

    # -- ops -----------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if any(is_wrapper_subclass(t) for t in types):
            return NotImplemented
        out, seconds = run_timed(self, func, args, kwargs)
        if seconds is None:  # decomposed: its parts were recorded
            return out
        flops = op_flops(self.registry, func, args, kwargs, out)
        if self.cost is not None:
            seconds = self.cost(func, args, kwargs, out, flops)
        op = RecordedOp(self.next_seq(), self.span, flops, seconds, func in self.expensive)
        if op.expensive:
            for t in tensors_of(out):
                found = storage_of(t)
                if found is not None:
                    op.outputs.append(found)
                    self.pinned.append(t)
        kept = kept_results(func, args, kwargs, out)
        if kept is not None:
            op.collective = []
            for t in kept:
                found = storage_of(t)
                if found is not None:
                    op.collective.append(found)
                    self.pinned.append(t)
        if self.layer is None:
            _float_operands(op, args, kwargs, out)
        self.current_record().ops.append(op)
        return out

    # -- module hooks ----------------------------------------------------------

    def attach(
        self, layers: list[tuple[str, nn.Module]], candidates: list[list[tuple[str, nn.Module]]]
    ) -> list[Any]:
        handles = []
        for index, (path, layer) in enumerate(layers):
            self.layers.append(LayerRecord())
            # A layer's own hooks (a tensor-parallel plan's input redistributions) run
            # outside its checkpoint, a region's inside its exclusion: the layer's
            # boundaries lie within its hooks, a region's around them.
            handles.append(
                layer.register_forward_pre_hook(self.layer_enter(index, path), with_kwargs=True)
            )
            handles.append(
                layer.register_forward_hook(self.layer_exit(index), always_call=True, prepend=True)
            )
            for c, (_, region) in enumerate(candidates[index]):
                handles.append(
                    region.register_forward_pre_hook(
                        self.region_enter(index, c, region), with_kwargs=True, prepend=True
                    )
                )
                handles.append(
                    region.register_forward_hook(self.region_exit(index), always_call=True)
                )
        return handles

    def layer_enter(self, index: int, path: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            record = self.layers[index]
            record.calls_seen += 1
            if record.calls_seen > 1:
                raise ValueError(
                    f"layer {path!r} was called more than once in one forward; the planner "
                    "plans one checkpoint per layer call. Plan the modules that are called "
                    "once (layers=...)."
                )
            if self.layer is not None:
                raise ValueError(
                    f"layer {path!r} runs inside another planned layer; pass layers= that do "
                    "not nest"
                )
            self.layer = index
            record.start = self.next_seq()
            for t in args:
                found = storage_of(t) if isinstance(t, torch.Tensor) else None
                if found is not None:
                    record.positional_keys.add(found[0])
                    if t.is_floating_point() and not is_wrapper_subclass(type(t)):
                        record.float_positional.append((found[0], t.numel(), t.element_size()))
            nested = [a for a in args if not isinstance(a, torch.Tensor)]
            for t in tensors_of((nested, kwargs)):
                found = storage_of(t)
                if found is not None:
                    record.held_keys.add(found[0])
            for t in tensors_of((args, kwargs)):
                found = storage_of(t)
                if found is not None:
                    record.input_keys[found[0]] = found[1]
                    if is_wrapper_subclass(type(t)):
                        record.wrapped_inputs.add(found[0])
                    self.pinned.append(t)

        return hook

    def layer_exit(self, index: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            record = self.layers[index]
            record.end = self.next_seq()
            self.layer = None
            for t in tensors_of(output):
                found = storage_of(t)
                if found is not None:
                    record.output_keys[found[0]] = found[1]
            self.pinned.extend(tensors_of(output))

        return hook

    def region_enter(self, index: int, candidate: int, region: nn.Module):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if self.layer != index or self.span is not None:
                return
            record = self.layers[index]
            span = RegionSpan(candidate, self.next_seq())
            span.parameter_keys = {
                k[0] for k in (storage_of(p) for p in region.parameters()) if k is not None
            }
            for t in tensors_of((args, kwargs)):
                found = storage_of(t)
                if found is not None:
                    span.inputs.append((found[0], isinstance(t, nn.Parameter)))
                    self.pinned.append(t)
            record.spans.append(span)
            self.span = len(record.spans) - 1

        return hook

    def region_exit(self, index: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.layer != index or self.span is None:
                return
            span = self.layers[index].spans[self.span]
            if span.end >= 0:
                return
            span.end = self.next_seq()
            for t in tensors_of(output):
                found = storage_of(t)
                if found is not None:
                    span.outputs.append((found[0], found[1], t.requires_grad))
                    if is_wrapper_subclass(type(t)):
                        span.wrapped_outputs.add(found[0])
                    self.pinned.append(t)
            self.span = None

        return hook


def _float_operands(op: RecordedOp, args: Any, kwargs: Any, out: Any) -> None:
    """Record on ``op`` its floating-point inputs and outputs (tensor bytes, not storage
    bytes: a gradient has the tensor's shape)."""
    for t in tensors_of((args, kwargs)):
        if t.is_floating_point():
            found = storage_of(t)
            if found is not None:
                op.float_inputs.append((found[0], t.numel() * t.element_size()))
    op.float_output_bytes = sum(
        t.numel() * t.element_size() for t in tensors_of(out) if t.is_floating_point()
    )


def op_flops(registry: Any, func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """The FLOPs of one call of ``func`` by ``registry`` (``FlopCounterMode``'s formulas)."""
    formula = registry.get(func.overloadpacket)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


def run_timed(mode: Any, func: Any, args: Any, kwargs: Any) -> tuple[Any, float | None]:
    """Run ``func`` under ``mode`` (which has ``registry`` and ``clock``) and time it; as
    FlopCounterMode does, an op without a FLOP formula first tries to decompose into ops
    with one, which ``mode`` then sees one by one (seconds None)."""
    if func not in mode.registry and func is not torch.ops.prim.device.default:
        with mode:
            out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out, None
    start = mode.clock()
    out = func(*args, **kwargs)
    return out, mode.clock() - start
