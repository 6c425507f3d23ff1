"""Where activation memory goes: every storage the autograd graph holds for backward.

``saved_tensors_report(loss)`` walks the graph behind ``loss`` (or any tensors) and
reads, without unpacking anything, what each autograd node saved: a tensor saved
as it is, a placeholder of a non-reentrant checkpoint (which holds nothing until
its replay), or one of recomp's handles (a tensor an excluded region keeps, or a
deferred input the replay rebuilds). Through each checkpoint placeholder it
reaches the checkpoint call itself: the inputs the checkpoint keeps (tensors saved
as such, and whatever tensors its other arguments hold: keyword arguments, tuples,
cache objects), recomp's record of the call (the cached outputs of its excluded
regions, deferred inputs a replay has bound), the cache of a selective checkpoint,
and, during a replay, the replayed tensors waiting for backward.

Every storage is billed once, to the first kind that holds it, in the order of
``HELD_KINDS`` (a region that keeps it, an offloaded host copy, a cached output, a
selective checkpoint's cache, a checkpoint input, a replayed tensor, a tensor saved
outside any checkpoint or by a compiled graph, another saved-tensor hook's value),
and among holders of one kind to the first in forward order (the first layer).
Parameters, buffers and the given inputs are not billed (they exist before the
forward). The graph walk reads PyTorch's private structures only through
``recomp.torch._compat``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._engine import ArgumentsAtCall, ComposedContext
from .._record import Invocation
from .._region import ExcludedRegion, RegionCall, saved_by_region
from .._report import (
    CACHED,
    CHECKPOINT_INPUT,
    COMPILED,
    DEFERRED,
    HELD_KINDS,
    KEPT,
    OFFLOADED,
    OTHER_HOOK,
    OUTSIDE,
    REPLAYED,
    RNG,
    SELECTIVE,
    ReportRow,
    SavedTensorsReport,
)
from .._state import RecomputeState
from . import _compat
from ._backend import BACKEND
from ._offload import OffloadHandle


def saved_tensors_report(
    loss: Any, model: nn.Module | None = None, inputs: Any = None
) -> SavedTensorsReport:
    """Every storage held for backward by the graph behind ``loss``, each billed once.

    Call it after the forward and before backward (a report inside a replay shows what
    is held at that moment; after backward it is empty). ``loss`` is a tensor, or a
    list/tuple/dict of them (every graph root that is still to be backpropagated).
    ``model`` names layers and regions by their module paths and keeps its parameters
    and buffers out of the bill (trainable parameters are recognised without it, frozen
    ones only with it). ``inputs``: tensors the caller created before the forward (token
    ids, masks) that are saved but are not activations. Nothing is unpacked, so taking a
    report never triggers a checkpoint's replay.
    """
    if not _compat.saved_values_readable():
        raise RuntimeError(
            "saved_tensors_report needs a PyTorch whose autograd exposes saved values without "
            f"unpacking them (SavedTensor.data, in PyTorch 2.14); this is {torch.__version__}. "
            "Upgrade PyTorch to use the memory report."
        )
    walk = _GraphWalk(model)
    for t in _tensors(inputs):
        walk.not_billed(t)
    walk.run([t.grad_fn for t in _tensors(loss) if t.grad_fn is not None])
    return walk.report()


def print_saved_tensors_report(
    loss: Any,
    model: nn.Module | None = None,
    inputs: Any = None,
    *,
    summary: bool = False,
    **format_options: Any,
) -> SavedTensorsReport:
    """Print :func:`saved_tensors_report` as a table (options of ``format``: ``largest_first``,
    ``max_rows``) or, with ``summary=True``, one line per layer, region and kind; return it."""
    report = saved_tensors_report(loss, model, inputs)
    if summary:
        if format_options:
            raise TypeError(f"summary=True takes no format options, got {sorted(format_options)}")
        print(report.summary())
    else:
        print(report.format(**format_options))
    return report


@contextlib.contextmanager
def label_layers(model: nn.Module, layers: Iterable[str]) -> Iterator[None]:
    """Name the layer of each tensor saved outside checkpoints during the block's forward.

    A checkpointed layer is found through its checkpoint; a layer without one is not
    visible in the graph. Inside this block, every tensor autograd saves outside a
    checkpoint is tagged with the innermost of ``layers`` (module paths in ``model``)
    running at the time, which :func:`saved_tensors_report` then shows as its layer.
    Costs one Python call per such saved tensor and two per layer call, while active.
    """
    running: list[str] = []
    handles = []
    try:
        for path in layers:
            module = model.get_submodule(path)

            def enter(_module: Any, _args: Any, path: str = path) -> None:
                running.append(path)

            def leave(_module: Any, _args: Any, _out: Any) -> None:
                if running:
                    running.pop()

            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave, always_call=True))

        def pack(t: torch.Tensor) -> _Labelled:
            # An alias without history: saving an op's own output as itself would close
            # a reference cycle through the graph.
            return _Labelled(t.detach(), running[-1] if running else None)

        with torch.autograd.graph.saved_tensors_hooks(pack, _Labelled.unpack):
            yield
    finally:
        for handle in handles:
            handle.remove()


class _Labelled:
    """A tensor saved outside checkpoints inside :func:`label_layers`, with its layer."""

    __slots__ = ("layer", "tensor")

    def __init__(self, tensor: torch.Tensor, layer: str | None) -> None:
        self.tensor = tensor
        self.layer = layer

    def unpack(self) -> torch.Tensor:
        return self.tensor


# --------------------------------------------------------------------------- the walk


@dataclass
class _Candidate:
    """A tensor something holds for backward, before storages are billed once."""

    kind: str
    tensor: Any  # a tensor; for OFFLOADED the OffloadHandle
    op: str
    frame: Any = None  # the checkpoint call it belongs to
    region: ExcludedRegion | None = None
    call: RegionCall | None = None
    layer: str | None = None  # named by label_layers (tensors saved outside checkpoints)


class _GraphWalk:
    def __init__(self, model: nn.Module | None) -> None:
        self.model = model
        self.candidates: list[_Candidate] = []
        self.deferred: dict[int, tuple[Any, str, ExcludedRegion]] = {}  # id(slot) -> ...
        self.excluded: set[Any] = set()  # storage keys not billed
        self.frames: dict[int, Any] = {}  # id -> checkpoint frame, in discovery order
        self.frame_order: dict[int, int] = {}  # id -> its index in frames
        self.frame_modules: dict[int, Any] = {}  # id(frame) -> what it checkpointed
        self.frame_labels: dict[int, str] = {}  # id(frame) -> its layer, from label_layers
        # (frame, name, value): arguments a checkpoint holds as they are (keyword
        # arguments, containers, cache objects), read once the walk has met every frame.
        self.arguments: list[tuple[Any, str, Any]] = []
        self.call_frames: dict[int, Any] = {}  # id(RegionCall) -> frame
        self.invocation_frames: dict[int, Any] = {}  # id(Invocation) -> frame
        self.keep_alive: list[Any] = []  # ids above stay unique while the walk runs
        self.module_paths: dict[int, str] = {}
        self.path_index: dict[str, int] = {}
        self.region_paths: dict[int, str] = {}
        if model is not None:
            for path, module in model.named_modules(remove_duplicate=False):
                self.module_paths.setdefault(id(module), path)
                self.path_index.setdefault(path, len(self.path_index))
                region = getattr(module, "_recomp_region", None)
                if isinstance(region, ExcludedRegion):
                    self.region_paths.setdefault(id(region), path)
            for t in [*model.parameters(), *model.buffers()]:
                self.not_billed(t)

    def not_billed(self, t: torch.Tensor) -> None:
        key = _compat.storage_key(t)
        if key is not None:
            self.excluded.add(key)
            self.keep_alive.append(t)

    def run(self, roots: list[Any]) -> None:
        seen: set[int] = set()
        stack = list(roots)
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            self.keep_alive.append(node)
            variable = getattr(node, "variable", None)
            if isinstance(variable, torch.Tensor):  # AccumulateGrad: a leaf the user owns
                self.not_billed(variable)
            op = _op_name(node)
            compiled = _compat.is_compiled_graph_node(node)
            for _name, handle in _compat.saved_handles(node):
                self.saved(handle, op, None, compiled)
            stack.extend(next_node for next_node, _ in node.next_functions)

    def saved(self, handle: Any, op: str, frame: Any, compiled: bool = False) -> None:
        """Classify one saved-tensor handle; ``frame``: it saves an input of that checkpoint;
        ``compiled``: a torch.compile graph saved it."""
        packed = _compat.packed_value(handle)
        if packed is None:  # released by a backward
            return
        if isinstance(packed, torch.Tensor):
            kind = CHECKPOINT_INPUT if frame is not None else COMPILED if compiled else OUTSIDE
            self.candidates.append(_Candidate(kind, packed, op, frame))
            return
        if isinstance(packed, _Labelled):
            if frame is not None and packed.layer is not None:  # the layer label_layers saw
                self.frame_labels.setdefault(id(frame), packed.layer)
            kind = CHECKPOINT_INPUT if frame is not None else OUTSIDE
            self.candidates.append(_Candidate(kind, packed.tensor, op, frame, layer=packed.layer))
            return
        info = saved_by_region(packed)
        if info is not None:
            self.keep_alive.append(info)
            if info.deferred_slot is not None:
                slot = info.deferred_slot
                self.deferred.setdefault(id(slot), (slot, op, info.region))
                return
            self.snapshot(info.snapshot, KEPT, op, None, info.region, info.call)
            return
        checkpoint = _compat.checkpoint_frame(handle)
        if checkpoint is not None:
            self.checkpoint(checkpoint)
            for t in _compat.replay_tensors(checkpoint, handle):
                self.candidates.append(_Candidate(REPLAYED, t, op, checkpoint))
            return
        for t in _tensors(packed):
            self.candidates.append(_Candidate(OTHER_HOOK, t, op, frame))

    def snapshot(
        self,
        snapshot: Any,
        kind: str,
        op: str,
        frame: Any,
        region: ExcludedRegion | None,
        call: RegionCall | None,
    ) -> None:
        """What a region holds through a ``Snapshot`` (a kept tensor, a cached output):
        its host copy when offloaded, else the tensor, billed as ``kind``."""
        if snapshot is None:
            return
        if isinstance(snapshot.held, OffloadHandle):
            self.candidates.append(_Candidate(OFFLOADED, snapshot.held, op, frame, region, call))
        elif isinstance(snapshot.value, torch.Tensor):
            self.candidates.append(_Candidate(kind, snapshot.value, op, frame, region, call))

    def checkpoint(self, frame: Any) -> None:
        """A checkpoint call, the first time the walk meets it: its inputs, what it
        checkpoints, recomp's record of it (cached outputs)."""
        if id(frame) in self.frames:
            return
        self.frames[id(frame)] = frame
        self.keep_alive.append(frame)
        function, replay_context = _compat.checkpoint_function(frame)
        if isinstance(function, ArgumentsAtCall):  # recomp's, around what it checkpoints
            function = function.function
        owner = None
        while isinstance(function, functools.partial):  # HF: partial(forward, layer, **kwargs)
            args = function.args
            if args and isinstance(args[0], nn.Module):
                owner, args = args[0], args[1:]
            # what the partial binds lives as long as the checkpoint, as its arguments do
            self.arguments.extend((frame, f"argument {i}", a) for i, a in enumerate(args))
            self.arguments.extend((frame, str(k), v) for k, v in function.keywords.items())
            function = function.func
        if owner is None:
            owner = getattr(function, "__self__", function)
        self.frame_modules[id(frame)] = owner
        names = _parameter_names(function)
        if not names and isinstance(owner, nn.Module):  # Module.__call__: name forward's
            names = _parameter_names(owner.forward)
        if isinstance(owner, nn.Module):
            for t in [*owner.parameters(), *owner.buffers()]:
                self.not_billed(t)
        for handle in _compat.checkpoint_input_handles(frame):
            self.saved(handle, "input", frame)
        for name, value in _compat.checkpoint_plain_arguments(frame):
            index = name.removeprefix("argument ")
            if index.isdigit() and int(index) < len(names):
                name = names[int(index)]
            self.arguments.append((frame, name, value))
        for t in _compat.checkpoint_rng_states(frame):
            self.candidates.append(_Candidate(RNG, t, "checkpoint", frame))
        invocation = _invocation_of(replay_context)
        if invocation is not None:
            self.invocation(invocation, frame)
        for op, entry in _compat.selective_checkpoint_storage(replay_context):
            for t in _reachable_tensors(entry):
                self.candidates.append(_Candidate(SELECTIVE, t, op, frame))

    def invocation(self, invocation: Invocation, frame: Any) -> None:
        self.invocation_frames[id(invocation)] = frame
        for call in invocation.regions:
            if not isinstance(call, RegionCall):
                continue
            self.call_frames[id(call)] = frame
            for t in _tensors(call.rng_state):  # where a replay resumes after the region
                self.candidates.append(_Candidate(RNG, t, "after region", frame))
            for cached in call.outputs:
                self.snapshot(cached.snapshot, CACHED, "output", frame, call.region, call)
        for child in invocation.children:
            # A nested checkpoint's own frame claims it if the walk meets it.
            if id(child) not in self.invocation_frames:
                self.invocation(child, frame)

    # -- billing ---------------------------------------------------------------------

    def held_arguments(self) -> None:
        """Tensors in the arguments checkpoints hold as they are (one that several layers
        receive, such as rotary tables or a KV cache, is billed to the first)."""
        for frame, name, value in self.arguments:
            for t in _reachable_tensors(value):
                self.candidates.append(_Candidate(CHECKPOINT_INPUT, t, f"input {name}", frame))

    def bound_inputs(self) -> None:
        """Deferred inputs a replay has supplied: held until the next replay rebinds them
        or the graph goes (after a ``retain_graph=True`` backward, during a replay)."""
        for slot, op, owner in self.deferred.values():
            if isinstance(slot.bound, torch.Tensor):
                invocation = slot.invocation()
                frame = self.invocation_frames.get(id(invocation)) if invocation else None
                self.candidates.append(_Candidate(REPLAYED, slot.bound, op, frame, owner))

    def report(self) -> SavedTensorsReport:
        self.held_arguments()
        self.bound_inputs()
        order = {kind: i for i, kind in enumerate(HELD_KINDS)}
        # Nested checkpoints are met after their parents; their calls belong to them.
        for frame in self.frames.values():
            _, context = _compat.checkpoint_function(frame)
            invocation = _invocation_of(context)
            if invocation is not None:
                for call in invocation.regions:
                    self.call_frames[id(call)] = frame
        layer_names = self._layer_names()
        # Every candidate with its layer and its place in forward order; a storage held
        # by several is billed to the first kind (HELD_KINDS), then the first in forward
        # order (rotary tables every layer keeps: the first layer).
        placed = []
        for position, c in enumerate(self.candidates):
            frame = c.frame
            if c.call is not None:
                frame = self.call_frames.get(id(c.call), frame)
            layer = layer_names.get(id(frame)) if frame is not None else c.layer
            rank = self._rank(layer, frame, c.region, position)
            placed.append(((order[c.kind], rank), c, layer))
        placed.sort(key=lambda p: p[0])
        billed: set[Any] = set()
        rows: list[tuple[tuple[int, ...], ReportRow]] = []
        for (_, rank), c, layer in placed:
            key, nbytes, shape, dtype, device = _describe(c.tensor)
            if key is None or key in billed or key in self.excluded:
                continue
            billed.add(key)
            row = ReportRow(
                layer, self._region_name(c.region), c.op, c.kind, nbytes, shape, dtype, device
            )
            rows.append((rank, row))
        deferred = []
        for slot, op, owner in self.deferred.values():
            if isinstance(slot.bound, torch.Tensor):  # held now: billed above
                continue
            invocation = slot.invocation()
            frame = self.invocation_frames.get(id(invocation)) if invocation is not None else None
            shape, stride, dtype, device = slot.layout
            nbytes = _span(shape, stride) * dtype.itemsize
            layer = layer_names.get(id(frame)) if frame is not None else None
            row = ReportRow(
                layer,
                self._region_name(owner),
                op,
                DEFERRED,
                nbytes,
                tuple(shape),
                _dtype_name(dtype),
                str(device),
            )
            deferred.append((self._rank(layer, frame, owner, 0), row))
        return SavedTensorsReport(
            [r for _, r in sorted(rows, key=lambda p: p[0])],
            [r for _, r in sorted(deferred, key=lambda p: p[0])],
        )

    def _layer_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        counts: dict[str, int] = {}
        # The walk starts at the loss: layers are met last first.
        for frame in reversed(list(self.frames.values())):
            owner = self.frame_modules.get(id(frame))
            path = self.frame_labels.get(id(frame)) or self.module_paths.get(id(owner))
            if path is None:
                base = (
                    type(owner).__name__
                    if isinstance(owner, nn.Module)
                    else getattr(owner, "__qualname__", "checkpoint")
                )
                n = counts.get(base, 0)
                counts[base] = n + 1
                path = f"{base}#{n}"
            names[id(frame)] = path or "(model)"
        return names

    def _region_name(self, region: ExcludedRegion | None) -> str | None:
        if region is None:
            return None
        return self.region_paths.get(id(region), region.name)

    def _rank(
        self, layer: str | None, frame: Any, region: ExcludedRegion | None, position: int
    ) -> tuple[int, ...]:
        """Forward order: layers in model order (or the order they ran), rows outside
        layers last; within a layer, regions in model order, then what is in no region."""
        if layer is None:
            first = (1, 0)
        elif layer in self.path_index:
            first = (0, self.path_index[layer])
        elif frame is not None and id(frame) in self.frames:
            if len(self.frame_order) != len(self.frames):
                self.frame_order = {key: i for i, key in enumerate(self.frames)}
            met = self.frame_order[id(frame)]
            first = (0, len(self.path_index) + len(self.frames) - met)
        else:
            first = (0, 1 << 30)
        region_rank = 1 << 30
        if region is not None:
            path = self.region_paths.get(id(region))
            region_rank = self.path_index.get(path, 1 << 29) if path else 1 << 29
        # The walk met tensors last first: reverse to forward order.
        return (*first, region_rank, -position)


# --------------------------------------------------------------------------- helpers


def _invocation_of(context: Any) -> Invocation | None:
    """recomp's record of a checkpoint call, from the replay context it gave PyTorch: the
    recompute state a replay installs (the context itself, where the replay enters no
    other part's) or a composed context of the call's."""
    if isinstance(context, RecomputeState):
        record = context.record
        return record if isinstance(record, Invocation) else None
    call = context.call if isinstance(context, ComposedContext) else None
    return None if call is None else call.invocation


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if tree is None:
        return iter(())
    leaves, _ = BACKEND.flatten(tree)
    return (leaf for leaf in leaves if isinstance(leaf, torch.Tensor))


def _parameter_names(function: Any) -> list[str]:
    """Names of the positional parameters of ``function`` (none if it takes ``*args``)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in positional]


#: How deep :func:`_reachable_tensors` looks into objects, and at most how many it visits.
_REACH_DEPTH = 4
_REACH_OBJECTS = 10_000


def _reachable_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Tensors an argument holds: itself, the leaves of containers and pytree nodes, and
    attributes of plain objects (a KV cache's ``layers[i].keys``), a few levels deep.
    Modules are not entered (their parameters and buffers are not activations)."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack and len(seen) < _REACH_OBJECTS:
        obj, depth = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
            continue
        if depth >= _REACH_DEPTH or isinstance(obj, (nn.Module, type)) or callable(obj):
            continue
        children: Iterable[Any]
        if isinstance(obj, dict):
            children = obj.values()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = obj
        else:
            leaves, _ = BACKEND.flatten(obj)
            if len(leaves) != 1 or leaves[0] is not obj:  # a registered pytree node
                children = leaves
            else:
                attrs = getattr(obj, "__dict__", None)
                children = list(attrs.values()) if isinstance(attrs, dict) else []
                for cls in type(obj).__mro__:
                    slots = cls.__dict__.get("__slots__", ())
                    for slot in (slots,) if isinstance(slots, str) else slots:
                        if slot not in ("__dict__", "__weakref__"):
                            children.append(getattr(obj, slot, None))
        stack.extend((child, depth + 1) for child in children)


def _describe(t: Any) -> tuple[Any, int, tuple[int, ...], str, str]:
    """Storage key, storage bytes, shape, dtype and device of what a candidate holds."""
    if isinstance(t, OffloadHandle):
        stored = t.stored
        return ("host", id(stored)), stored.nbytes, tuple(t.size), _dtype_name(t.dtype), "cpu"
    key = _compat.storage_key(t)
    if key is None and not t.is_meta:  # a tensor subclass without a storage of its own
        key = ("object", id(t))
    return key, BACKEND.storage_nbytes(t), tuple(t.shape), _dtype_name(t.dtype), str(t.device)


def _span(shape: Iterable[int], stride: Iterable[int | None]) -> int:
    """Elements a strided tensor reaches (what keeping it would have held at least).
    A dimension of size 1 steps nowhere: its stride may be given as None (a layout,
    ``addressing_strides``)."""
    shape, stride = list(shape), list(stride)
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride) if n > 1 and st is not None)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


_BACKWARD_SUFFIX = re.compile(r"Backward\d*$")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def _op_name(node: Any) -> str:
    """``MmBackward0`` -> ``mm``, ``NativeLayerNormBackward0`` -> ``native_layer_norm``;
    a custom Function keeps its class name."""
    name = type(node).__name__
    if type(node).__module__ != "builtins":
        return _BACKWARD_SUFFIX.sub("", name) or name
    return _CAMEL.sub("_", _BACKWARD_SUFFIX.sub("", name)).lower() or name
