"""Profile a PyTorch model for planning: what each layer option keeps and replays.

``profile(model, inputs)`` works on a deep copy of the model and restores the random
number generators afterwards, so the model, its parameters, buffers and gradients and
the random stream the training run sees are left as they were. On the copy it runs:

1. a warm-up step and ``steps`` timed steps (forward, loss, backward) without
   checkpointing: the baseline step time, and forward times of each layer and each
   candidate region (module hooks);
2. one instrumented forward, under a saved-tensors hook that records every tensor
   autograd saves (its storage and size) and a dispatch mode that records every ATen op
   (its FLOPs, by ``FlopCounterMode``'s formulas, and its time), each tagged with the
   layer and candidate region it ran in, in one sequence.

From that one sequence it derives, for every option, what the option keeps and what its
replay runs, following the rules recomp and ``torch.utils.checkpoint`` apply:

* no checkpoint: every activation storage the layer's forward saves;
* checkpoint: the storages of the layer's inputs (the checkpoint holds them);
* checkpoint with regions excluded: the inputs, plus per excluded call its saved tensors
  except its deferred inputs (inputs computed inside the checkpoint by recomputed code),
  plus its output, dropped again when the checkpoint saves nothing after the call;
* a checkpoint that keeps collectives' results (``exclude_collectives=True``, under a
  process group): also the results of the collectives outside excluded regions that
  come before its last saved tensor, which its replay reads instead of communicating;
* the replay runs the layer's ops that come before the checkpoint's last saved tensor
  (early stop), except those inside excluded regions; its time is the ops' share of the
  layer's measured forward time.

Storages are counted once: one kept by two adjacent layers (a layer output the next one
saves) enters the plan as a pair term; one kept outside the layers, or by layers further
apart, is shared. Parameters, buffers and the inputs exist before the forward and are
not activations.
"""

from __future__ import annotations

import copy
import gc
import itertools
import statistics
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter

from ..torch import _compat
from ..torch._collective_cache import kept_results
from ..torch._compat import TorchDispatchMode
from ._layers import LayerSpec, _fresh_inputs, _tensors, find_layers
from .modelcall import call_model, default_loss, flop_formulas
from .planfile import NO_CHECKPOINT, exclude_option
from .planner import LayerProfile, OptionProfile, OptionSlot, Profile, RegionProfile
from .policy import expensive_ops, selective_context_fn

# More candidates than this: only single exclusions and all of them together are options.
MAX_COMBINED = 5


# --------------------------------------------------------------------------- finding layers


def find_candidates(
    layer: nn.Module, exclude: Callable[[nn.Module], bool] | None = None
) -> list[tuple[str, nn.Module]]:
    """Candidate regions of a layer: the outermost sub-modules ``exclude`` accepts, or by
    default the direct children that hold parameters."""
    if exclude is None:
        return [
            (name, child)
            for name, child in layer.named_children()
            if next(child.parameters(), None) is not None
        ]
    found: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, path: str) -> None:
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            if exclude(child):
                found.append((child_path, child))
            else:
                visit(child, child_path)

    visit(layer, "")
    return found


def option_sets(count: int) -> list[tuple[int, ...]]:
    """Sets of candidate indices to offer as exclusions (all non-empty ones when few)."""
    if count == 0:
        return []
    if count <= MAX_COMBINED:
        return [
            combo
            for size in range(1, count + 1)
            for combo in itertools.combinations(range(count), size)
        ]
    return [(i,) for i in range(count)] + [tuple(range(count))]


def layer_option_sets(count: int) -> list[tuple[tuple[int, ...] | None, bool]]:
    """The options of a layer with ``count`` candidates, as (excluded candidate indices,
    selective), in the order of ``OptionSlot``: no checkpoint (``None``), full
    checkpoint (nothing excluded, ``()``), the sets of candidate indices of
    ``option_sets``; then the same checkpoints selective (expensive ops' outputs kept:
    ``recomp.plan.policy``)."""
    fixed: dict[OptionSlot, tuple[int, ...] | None] = {OptionSlot.NONE: None, OptionSlot.FULL: ()}
    checkpoints = [(), *option_sets(count)]
    return (
        [(fixed[slot], False) for slot in sorted(fixed)]
        + [(s, False) for s in checkpoints[1:]]
        + [(s, True) for s in checkpoints]
    )


# --------------------------------------------------------------------------- recording


@dataclass
class _Save:
    seq: int
    key: Hashable
    nbytes: int
    is_parameter: bool
    call: int | None  # index of the region call it happened in


@dataclass
class _Op:
    seq: int
    call: int | None
    flops: int
    seconds: float
    expensive: bool = False  # a selective option keeps its outputs (recomp.plan.policy)
    outputs: list[tuple[Hashable, int]] = field(default_factory=list)  # (storage, bytes)
    # A collective whose results a checkpoint keeps: their (storage, bytes); else None.
    collective: list[tuple[Hashable, int]] | None = None


@dataclass
class _RegionCall:
    candidate: int
    start: int
    end: int = -1
    inputs: list[tuple[Hashable, bool]] = field(default_factory=list)  # (storage, parameter)
    outputs: list[tuple[Hashable, int, bool]] = field(default_factory=list)  # (.., bytes, grad)
    parameter_keys: set[Hashable] = field(default_factory=set)


@dataclass
class _LayerRecord:
    start: int = -1
    end: int = -1
    calls_seen: int = 0
    input_keys: dict[Hashable, int] = field(default_factory=dict)
    saves: list[_Save] = field(default_factory=list)
    ops: list[_Op] = field(default_factory=list)
    calls: list[_RegionCall] = field(default_factory=list)


def _storage(t: torch.Tensor) -> tuple[Hashable, int] | None:
    inner = _local_tensor(t)
    if inner is not None:
        return _storage(inner)
    key = _compat.storage_key(t)
    if key is None:
        return None
    return key, int(t.untyped_storage().nbytes())


def _is_wrapper_subclass(t: type) -> bool:
    # DTensor and the like: tensor subclasses that wrap local tensors.
    return t is not torch.Tensor and hasattr(t, "__tensor_flatten__")


def _local_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """The one tensor a wrapper subclass holds (a DTensor's local shard), else None.

    A DTensor reports a storage of its global size that holds no memory; what this
    process holds is its local tensor's storage, which the local ops see."""
    if not _is_wrapper_subclass(type(t)):
        return None
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = [v for v in (getattr(t, name) for name in names) if isinstance(v, torch.Tensor)]
    return inner[0] if len(inner) == 1 else None


class _Recorder(TorchDispatchMode):
    """Saved tensors and ATen ops of one forward, in one sequence, tagged by layer and
    candidate region.

    An op on a wrapper subclass (DTensor) is left to the subclass, whose ops on local
    tensors come back here: FLOPs, times and storages are this process's, and the
    collectives that DTensor issues are seen, with the tensors a checkpoint's collective
    record would keep (``recomp.torch._collective_cache``)."""

    def __init__(self, preexisting: set[Hashable], clock: Callable[[], float]) -> None:
        super().__init__()
        self.clock = clock
        counter = flop_counter.FlopCounterMode(
            display=False, custom_mapping=flop_formulas(_compat.cpu_attention_ops())
        )
        self.registry = counter.flop_registry
        self.expensive = frozenset(expensive_ops())
        self.preexisting = preexisting
        self.seq = 0
        self.layers: list[_LayerRecord] = []
        self.outside = _LayerRecord()
        self.layer: int | None = None
        self.call: int | None = None
        # Storages seen at layer and region boundaries stay alive until the analysis, so
        # that no later storage reuses their address as key.
        self.pinned: list[Any] = []

    def current_record(self) -> _LayerRecord:
        return self.outside if self.layer is None else self.layers[self.layer]

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    # -- saved tensors -------------------------------------------------------

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        found = _storage(t)
        if found is not None:
            key, nbytes = found
            self.current_record().saves.append(
                _Save(self.next_seq(), key, nbytes, isinstance(t, nn.Parameter), self.call)
            )
        return t

    # -- ops -----------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if any(_is_wrapper_subclass(t) for t in types):
            return NotImplemented
        out, seconds = _run_timed(self, func, args, kwargs)
        if seconds is None:  # decomposed: its parts were recorded
            return out
        formula = self.registry.get(func.overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        op = _Op(self.next_seq(), self.call, flops, seconds, func in self.expensive)
        if op.expensive:
            for t in _tensors(out):
                found = _storage(t)
                if found is not None:
                    op.outputs.append(found)
                    self.pinned.append(t)
        kept = kept_results(func, args, kwargs, out)
        if kept is not None:
            op.collective = []
            for t in kept:
                found = _storage(t)
                if found is not None:
                    op.collective.append(found)
                    self.pinned.append(t)
        self.current_record().ops.append(op)
        return out

    # -- module hooks ----------------------------------------------------------

    def attach(
        self, layers: list[tuple[str, nn.Module]], candidates: list[list[tuple[str, nn.Module]]]
    ) -> list[Any]:
        handles = []
        for index, (path, layer) in enumerate(layers):
            self.layers.append(_LayerRecord())
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
            for t in _tensors((args, kwargs)):
                found = _storage(t)
                if found is not None:
                    record.input_keys[found[0]] = found[1]
                    self.pinned.append(t)

        return hook

    def layer_exit(self, index: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.layers[index].end = self.next_seq()
            self.layer = None
            self.pinned.extend(_tensors(output))

        return hook

    def region_enter(self, index: int, candidate: int, region: nn.Module):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if self.layer != index or self.call is not None:
                return
            record = self.layers[index]
            call = _RegionCall(candidate, self.next_seq())
            call.parameter_keys = {
                k[0] for k in (_storage(p) for p in region.parameters()) if k is not None
            }
            for t in _tensors((args, kwargs)):
                found = _storage(t)
                if found is not None:
                    call.inputs.append((found[0], isinstance(t, nn.Parameter)))
                    self.pinned.append(t)
            record.calls.append(call)
            self.call = len(record.calls) - 1

        return hook

    def region_exit(self, index: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.layer != index or self.call is None:
                return
            call = self.layers[index].calls[self.call]
            if call.end >= 0:
                return
            call.end = self.next_seq()
            for t in _tensors(output):
                found = _storage(t)
                if found is not None:
                    call.outputs.append((found[0], found[1], t.requires_grad))
                    self.pinned.append(t)
            self.call = None

        return hook


# --------------------------------------------------------------------------- analysis


@dataclass
class _OptionResult:
    name: str
    kept: dict[Hashable, int]  # activation storages the layer keeps
    replay_ops: list[_Op]
    region_saved_bytes: dict[str, int]  # per excluded candidate path, as recomp counts
    excluded_calls: int
    hooked_saves: int = 0  # saved tensors that go through a Python hook (checkpointed)
    policy_ops: int = 0  # ops that pass a selective policy's dispatch modes (forward, replay)
    collective_bytes: int = 0  # part of kept: results of collectives the replay reads


def _analyse_option(
    record: _LayerRecord,
    candidates: list[tuple[str, nn.Module]],
    excluded: tuple[int, ...] | None,
    preexisting: set[Hashable],
    selective: bool = False,
    keep_collectives: bool = True,
) -> _OptionResult:
    """What one layer keeps and replays with ``excluded`` candidates (None: no checkpoint);
    ``selective``: the checkpoint also keeps the outputs of the expensive ops outside
    the excluded regions (which its policy does not see) and so does not replay them;
    ``keep_collectives`` (a checkpoint's ``exclude_collectives``): it keeps the results of
    the collectives outside the excluded regions that its replay reaches (those before
    its last saved tensor: early stop drops the others), and the replay does not run them."""

    def activations(keys: dict[Hashable, int]) -> dict[Hashable, int]:
        return {k: n for k, n in keys.items() if k not in preexisting}

    if excluded is None:
        assert not selective, "a selective option is a checkpoint"
        saved = {s.key: s.nbytes for s in record.saves if not s.is_parameter}
        return _OptionResult(NO_CHECKPOINT, activations(saved), [], {}, 0)

    chosen = set(excluded)
    kept: dict[Hashable, int] = dict(record.input_keys)
    checkpoint_saves = [
        s.seq
        for s in record.saves
        if s.call is None or record.calls[s.call].candidate not in chosen
    ]
    excluded_outputs: set[Hashable] = set()
    # Per excluded call: saved tensors kept, cached outputs, checkpoint saves before its end.
    entries: list[tuple[_RegionCall, dict[Hashable, int], dict[Hashable, int], int]] = []
    calls = [(i, c) for i, c in enumerate(record.calls) if c.candidate in chosen]
    for index, call in calls:
        deferrable = {
            key
            for key, is_parameter in call.inputs
            if not is_parameter and key not in excluded_outputs and key not in record.input_keys
        }
        region_kept: dict[Hashable, int] = {}
        deferred = False
        for s in record.saves:
            if s.call != index:
                continue
            if s.key in deferrable:
                deferred = True
            elif not s.is_parameter and s.key not in call.parameter_keys:
                region_kept[s.key] = s.nbytes
        outputs: dict[Hashable, int] = {}
        for key, nbytes, _ in call.outputs:
            excluded_outputs.add(key)
            if key not in region_kept:
                outputs[key] = nbytes
        if deferred and any(grad for _, _, grad in call.outputs):
            checkpoint_saves.append(call.end)  # the boundary saves the deferred inputs
        saves_after = sum(1 for seq in checkpoint_saves if seq <= call.end)
        entries.append((call, region_kept, outputs, saves_after))
    total_saves = len(checkpoint_saves)
    saved_bytes: dict[str, int] = {}
    for call, region_kept, outputs, saves_after in entries:
        path = candidates[call.candidate][0]
        # A replay that stops before reaching past the call does not need its outputs.
        reachable = saves_after < total_saves
        held = {**region_kept, **(outputs if reachable else {})}
        kept.update(held)
        saved_bytes[path] = saved_bytes.get(path, 0) + sum(held.values())
    last = max(checkpoint_saves, default=None)
    excluded_call_indices = {i for i, _ in calls}
    seen = [op for op in record.ops if op.call not in excluded_call_indices]
    reached = [] if last is None else [op for op in seen if op.seq < last]
    replay = reached
    collective_bytes = 0
    if keep_collectives:
        for op in reached:
            for key, nbytes in op.collective or ():
                if key not in kept and key not in preexisting:
                    kept[key] = nbytes
                    collective_bytes += nbytes
        replay = [op for op in replay if op.collective is None]
    if selective:
        for op in seen:
            kept.update(op.outputs)
        replay = [op for op in replay if not op.expensive]
    name = exclude_option([candidates[i][0] for i in excluded], selective)
    return _OptionResult(
        name,
        activations(kept),
        replay,
        saved_bytes,
        len(calls),
        len(record.saves),
        len(seen) + len(reached) if selective else 0,
        collective_bytes,
    )


def _attribute(
    per_layer: list[list[dict[Hashable, int]]], outside: dict[Hashable, int]
) -> tuple[list[list[int]], list[dict[tuple[int, int], int]], int, int]:
    """Split storages into per-layer-option bytes, adjacent-pair bytes and shared bytes."""
    keepers: dict[Hashable, set[int]] = {}
    size: dict[Hashable, int] = {}
    for i, options in enumerate(per_layer):
        for kept in options:
            for key, nbytes in kept.items():
                keepers.setdefault(key, set()).add(i)
                size[key] = nbytes
    private = [[0] * len(options) for options in per_layer]
    pairs: list[dict[tuple[int, int], int]] = [{} for _ in per_layer]
    shared = sum(outside.values())
    spread = 0
    for key, layers in keepers.items():
        if key in outside:
            continue
        if len(layers) == 1:
            (i,) = layers
            for o, kept in enumerate(per_layer[i]):
                if key in kept:
                    private[i][o] += size[key]
        elif len(layers) == 2 and max(layers) - min(layers) == 1:
            i = max(layers)
            for a, before in enumerate(per_layer[i - 1]):
                for b, now in enumerate(per_layer[i]):
                    if key in before or key in now:
                        pairs[i][(a, b)] = pairs[i].get((a, b), 0) + size[key]
        else:
            shared += size[key]
            spread += size[key]
    return private, pairs, shared, spread


def _run_timed(mode: Any, func: Any, args: Any, kwargs: Any) -> tuple[Any, float | None]:
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


class _OpTimer(TorchDispatchMode):
    """Times every ATen op of a forward, in order (decomposing as ``_Recorder`` does)."""

    def __init__(self, registry: Any, clock: Callable[[], float]) -> None:
        super().__init__()
        self.registry = registry
        self.clock = clock
        self.seconds: list[float] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(_is_wrapper_subclass(t) for t in types):
            return NotImplemented
        out, seconds = _run_timed(self, func, args, kwargs or {})
        if seconds is not None:
            self.seconds.append(seconds)
        return out


def _per_save_seconds(clock: Callable[[], float], chain: int = 32) -> float:
    """CPU time a checkpoint spends per saved tensor on its own bookkeeping: the Python
    hooks that pack it in the forward, pack it again in the replay and unpack it in
    backward. Measured on a chain of tiny multiplications (two saves each), checkpointed
    against plain, so that the ops themselves cost next to nothing."""
    from recomp.torch import checkpoint

    weight = torch.ones(8, requires_grad=True)
    x = torch.ones(8, requires_grad=True)

    def chain_fn(t: torch.Tensor) -> torch.Tensor:
        for _ in range(chain):
            t = t * weight
        return t

    def forward() -> None:
        chain_fn(x).sum()

    def plain() -> None:
        chain_fn(x).sum().backward()

    def checkpointed() -> None:
        checkpoint(chain_fn, x).sum().backward()

    def per_call(fn: Callable[[], None], repeat: int = 10) -> float:
        start = clock()
        for _ in range(repeat):
            fn()
        return (clock() - start) / repeat

    for fn in (forward, plain, checkpointed):
        per_call(fn, 3)
    samples = []
    for _ in range(5):
        extra = per_call(checkpointed) - per_call(plain) - per_call(forward)
        samples.append(extra / (2 * chain))
    return max(0.0, statistics.median(samples))


# clock -> (per saved tensor, per op under a selective policy) seconds, on the CPU.
_MEASURED_OVERHEADS: dict[Callable[[], float], tuple[float, float]] = {}


def _per_policy_op_seconds(clock: Callable[[], float], chain: int = 32) -> float:
    """CPU time a selective checkpoint's policy adds per op: each op of the layer passes
    its caching dispatch mode in the forward and its cached mode in the replay (Python
    calls). Measured on a chain of tiny multiplications, checkpointed with the policy
    against without."""
    from recomp.torch import checkpoint

    weight = torch.ones(8, requires_grad=True)
    x = torch.ones(8, requires_grad=True)
    context_fn = selective_context_fn()

    def chain_fn(t: torch.Tensor) -> torch.Tensor:
        for _ in range(chain):
            t = t * weight
        return t

    def plain() -> None:
        checkpoint(chain_fn, x).sum().backward()

    def selective() -> None:
        checkpoint(chain_fn, x, context_fn=context_fn).sum().backward()

    def per_call(fn: Callable[[], None], repeat: int = 10) -> float:
        start = clock()
        for _ in range(repeat):
            fn()
        return (clock() - start) / repeat

    for fn in (plain, selective):
        per_call(fn, 3)
    samples = [(per_call(selective) - per_call(plain)) / (2 * chain) for _ in range(5)]
    return max(0.0, statistics.median(samples))


def _retime_ops(
    recorder: _Recorder, forward: Callable[[], Any], repeats: int, clock: Callable[[], float]
) -> None:
    """Replace each op's time by the median over the instrumented forward and ``repeats``
    more forwards (one sample per op is noisy). Kept as is if the op sequence changes."""
    ops = sorted(
        (op for record in [recorder.outside, *recorder.layers] for op in record.ops),
        key=lambda op: op.seq,
    )
    samples: list[list[float]] = [[op.seconds] for op in ops]
    for _ in range(repeats):
        timer = _OpTimer(recorder.registry, clock)
        with timer:
            out = forward()
        del out
        if len(timer.seconds) != len(ops):
            return
        for column, seconds in zip(samples, timer.seconds):
            column.append(seconds)
    for op, column in zip(ops, samples):
        op.seconds = statistics.median(column)


def _average_alike_layers(
    layers: list[tuple[str, nn.Module]],
    candidates: list[list[tuple[str, nn.Module]]],
    records: list[_LayerRecord],
    forward_s: dict[str, float],
) -> None:
    """Layers that run the same ops (same type, same op sequence with the same FLOPs and
    regions) get the mean of their times: one noisy sample per layer would otherwise make
    the plan treat identical layers differently."""
    groups: dict[Hashable, list[int]] = {}
    for index, ((_, layer), record) in enumerate(zip(layers, records)):
        ops = tuple(
            (op.flops, -1 if op.call is None else record.calls[op.call].candidate)
            for op in record.ops
        )
        names = tuple(name for name, _ in candidates[index])
        groups.setdefault((type(layer).__name__, names, ops), []).append(index)
    for members in groups.values():
        if len(members) < 2:
            continue
        for position in range(len(records[members[0]].ops)):
            mean = statistics.fmean(records[i].ops[position].seconds for i in members)
            for i in members:
                records[i].ops[position].seconds = mean
        suffixes = ["", *(f".{name}" for name, _ in candidates[members[0]])]
        for suffix in suffixes:
            keys = [layers[i][0] + suffix for i in members]
            mean = statistics.fmean(forward_s[k] for k in keys)
            for k in keys:
                forward_s[k] = mean


# --------------------------------------------------------------------------- profile


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timer:
    """Forward times of modules, per call, by pre/post hooks."""

    def __init__(self, device: torch.device, clock: Callable[[], float]) -> None:
        self.device = device
        self.clock = clock
        self.times: dict[str, list[float]] = {}
        self._start: dict[str, float] = {}
        self.handles: list[Any] = []

    def track(self, name: str, module: nn.Module) -> None:
        self.times[name] = []

        def enter(m: nn.Module, args: Any) -> None:
            _sync(self.device)
            self._start[name] = self.clock()

        def leave(m: nn.Module, args: Any, out: Any) -> None:
            _sync(self.device)
            self.times[name].append(self.clock() - self._start[name])

        self.handles.append(module.register_forward_pre_hook(enter))
        self.handles.append(module.register_forward_hook(leave))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _device_of(model: nn.Module, inputs: Any) -> torch.device:
    for p in model.parameters():
        return p.device
    tensors = _tensors(inputs)
    return tensors[0].device if tensors else torch.device("cpu")


def profile(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    layers: LayerSpec = None,
    exclude: Callable[[nn.Module], bool] | None = None,
    steps: int = 3,
    clock: str = "wall",
    optimizer: Callable[[list[nn.Parameter]], Any] | None = None,
    exclude_collectives: bool = True,
    keep: Callable[[nn.Module], bool] | None = None,
    backend: str | None = None,
) -> Any:
    """Profile ``model`` on ``inputs`` for :func:`recomp.plan.make_plan`.

    ``inputs``: a tensor, a tuple (positional arguments) or a dict (keyword arguments).
    ``loss_fn(output)``: the loss (default: the ``loss`` of a Hugging Face ``ModelOutput``
    or mapping, which the model computes when given ``labels``, else the mean square of
    the output).
    ``layers``: the checkpointable layers (default ``model.layers``; a predicate or a list
    of sub-module paths). ``exclude``: predicate choosing candidate regions inside each
    layer (default: the layer's direct children that hold parameters).
    ``steps``: timed steps without checkpointing, after one warm-up step.
    ``clock``: ``"wall"`` (``time.perf_counter``, after a device synchronization) or
    ``"cpu"`` (the process's CPU time: steadier on a shared CPU machine, and equal to wall
    time for one intra-op thread on an idle one; not for GPUs).
    ``optimizer``: a factory ``optimizer(parameters)`` (say ``lambda ps:
    torch.optim.AdamW(ps)``), so that the timed steps include the update as training does.
    ``exclude_collectives``: what the plan's checkpoints will be given (as
    ``checkpoint_wrapper``'s option of that name; ``apply_plan`` passes it on). True:
    a checkpointed option also keeps the results of the collectives its replay would
    reach (DTensor's all-gathers and reduce-scatters, ...), and does not replay them.
    Collectives run only under a process group: in a distributed job call ``profile`` on
    every rank, where the model runs parallelised; each rank profiles its own share.

    The model is not changed: the profile runs on a deep copy, and the random number
    generators are restored afterwards.

    Given ``torch.compile(model)``, the profile is a compiled one
    (:class:`recomp.plan.compiled.CompiledProfile`): what PyTorch's partitioner keeps at
    each memory budget, for the wrapper's backend (or ``backend``: ``"inductor"`` or
    ``"aot_eager"``); ``keep`` then chooses sub-modules of the layers to keep whole
    (never recomputed), and ``exclude``, ``steps``, ``clock`` and ``optimizer`` do not
    apply. For the eager plan of a compiled model, profile the module itself.
    """
    if _compat.compiled_original(model) is not None:
        if exclude is not None or optimizer is not None:
            raise ValueError(
                "exclude= and optimizer= are for eager profiles; a compiled model's plan leaves "
                "the choice to PyTorch's partitioner: pass keep= for regions to keep whole, or "
                "profile the module itself (not torch.compile(module)) for an eager plan"
            )
        from .compiled import profile_compiled

        return profile_compiled(model, inputs, loss_fn, layers=layers, keep=keep, backend=backend)
    if keep is not None or backend is not None:
        raise ValueError(
            "keep= and backend= are for compiled models (profile(torch.compile(model), ...)); "
            "an eager profile offers exclusions itself (exclude= chooses the candidates)"
        )
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if not isinstance(exclude_collectives, bool):
        raise ValueError(f"exclude_collectives must be True or False, got {exclude_collectives!r}")
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}
    if clock not in clocks:
        raise ValueError(f"clock is 'wall' or 'cpu', got {clock!r}")
    loss_fn = loss_fn or default_loss
    rng = _rng_state()
    try:
        prof = _profile(
            copy.deepcopy(model),
            inputs,
            loss_fn,
            layers,
            exclude,
            steps,
            clocks[clock],
            optimizer,
            exclude_collectives,
        )
    finally:
        _set_rng_state(rng)
    return prof


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _profile(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    layer_spec: LayerSpec,
    exclude: Callable[[nn.Module], bool] | None,
    steps: int,
    clock: Callable[[], float],
    optimizer: Callable[[list[nn.Parameter]], Any] | None,
    exclude_collectives: bool = True,
) -> Profile:
    device = _device_of(model, inputs)
    layers = find_layers(model, layer_spec)
    candidates = [find_candidates(layer, exclude) for _, layer in layers]
    inputs = _fresh_inputs(inputs)
    model.zero_grad(set_to_none=True)

    update = optimizer([p for p in model.parameters() if p.requires_grad]) if optimizer else None

    def step() -> None:
        loss = loss_fn(call_model(model, inputs))
        loss.backward()
        if update is not None:
            update.step()
            update.zero_grad(set_to_none=False)

    # 1. Baseline step time, and forward times of layers and candidate regions.
    timer = _Timer(device, clock)
    for path, layer in layers:
        timer.track(path, layer)
    for (path, _), regions in zip(layers, candidates):
        for name, region in regions:
            timer.track(f"{path}.{name}", region)
    step_times: list[float] = []
    forward_times: dict[str, list[float]] = {k: [] for k in timer.times}
    try:
        for i in range(steps + 1):
            for samples in timer.times.values():
                samples.clear()
            _sync(device)
            start = clock()
            step()
            _sync(device)
            if i > 0:  # the first step is a warm-up
                step_times.append(clock() - start)
                for k, v in timer.times.items():
                    forward_times[k].append(sum(v))
    finally:
        timer.remove()
    forward_s = {k: statistics.median(v) if v else 0.0 for k, v in forward_times.items()}
    calls_per_step = {k: len(v) for k, v in timer.times.items()}

    # 2. One instrumented forward.
    preexisting = {
        found[0]
        for t in itertools.chain(model.parameters(), model.buffers(), _tensors(inputs))
        if (found := _storage(t)) is not None
    }
    recorder = _Recorder(preexisting, clock)
    handles = recorder.attach(layers, candidates)
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), recorder:
            loss = loss_fn(call_model(model, inputs))
    finally:
        for handle in handles:
            handle.remove()
    outside = {s.key: s.nbytes for s in recorder.outside.saves if not s.is_parameter}
    for t in _tensors(loss):
        found = _storage(t)
        if found is not None:
            outside[found[0]] = found[1]
    outside = {k: n for k, n in outside.items() if k not in preexisting}
    for index, (path, _) in enumerate(layers):
        if recorder.layers[index].calls_seen == 0:
            raise ValueError(f"layer {path!r} was not called in the forward")
    _retime_ops(recorder, lambda: loss_fn(call_model(model, inputs)), steps, clock)

    _average_alike_layers(layers, candidates, recorder.layers, forward_s)
    bookkeeping = int(torch.get_rng_state().nbytes) if device.type == "cpu" else 0
    # On a GPU the hooks' CPU time overlaps with the kernels: not added there.
    # Machine properties: measured by the first profile of a process with this clock.
    per_save, per_policy_op = 0.0, 0.0
    if device.type == "cpu":
        if clock not in _MEASURED_OVERHEADS:
            _MEASURED_OVERHEADS[clock] = (_per_save_seconds(clock), _per_policy_op_seconds(clock))
        per_save, per_policy_op = _MEASURED_OVERHEADS[clock]
    analysed: list[list[_OptionResult]] = []
    for index, record in enumerate(recorder.layers):
        sets = layer_option_sets(len(candidates[index]))
        analysed.append(
            [
                _analyse_option(
                    record, candidates[index], excluded, preexisting, selective, exclude_collectives
                )
                for excluded, selective in sets
            ]
        )
    private, pairs, shared, spread = _attribute(
        [[o.kept for o in options] for options in analysed], outside
    )

    layer_profiles = []
    for index, ((path, layer), record) in enumerate(zip(layers, recorder.layers)):
        op_seconds = sum(op.seconds for op in record.ops)
        scale = forward_s[path] / op_seconds if op_seconds > 0 else 0.0
        region_profiles = []
        exclusion_alone = {o.name: o for o in analysed[index]}
        for c, (name, region) in enumerate(candidates[index]):
            ops = [
                op
                for op in record.ops
                if op.call is not None and record.calls[op.call].candidate == c
            ]
            alone = exclusion_alone[exclude_option([name])]
            region_profiles.append(
                RegionProfile(
                    path=name,
                    type=type(region).__name__,
                    calls=calls_per_step[f"{path}.{name}"],
                    forward_s=forward_s[f"{path}.{name}"],
                    forward_flops=sum(op.flops for op in ops),
                    exclusion_bytes=alone.region_saved_bytes.get(name, 0),
                )
            )
        options = []
        for o, result in enumerate(analysed[index]):
            checkpoints = 0 if o == OptionSlot.NONE else 1
            options.append(
                OptionProfile(
                    name=result.name,
                    kept_bytes=private[index][o]
                    + bookkeeping * (checkpoints + result.excluded_calls),
                    replay_s=scale * sum(op.seconds for op in result.replay_ops)
                    + per_save * result.hooked_saves
                    + per_policy_op * result.policy_ops,
                    replay_flops=sum(op.flops for op in result.replay_ops),
                    region_saved_bytes=result.region_saved_bytes,
                    collective_bytes=result.collective_bytes,
                )
            )
        layer_profiles.append(
            LayerProfile(
                path=path,
                type=type(layer).__name__,
                forward_s=forward_s[path],
                forward_flops=sum(op.flops for op in record.ops),
                no_checkpoint_bytes=sum(analysed[index][OptionSlot.NONE].kept.values()),
                checkpoint_input_bytes=sum(analysed[index][OptionSlot.FULL].kept.values()),
                regions=region_profiles,
                options=options,
                pair_bytes=[[a, b, n] for (a, b), n in sorted(pairs[index].items()) if n],
            )
        )
    notes = []
    collectives = sum(
        1 for record in recorder.layers for op in record.ops if op.collective is not None
    )
    if collectives:
        notes.append(
            f"the layers' forward issued {collectives} collective(s): a checkpoint "
            + (
                "keeps the results of those its replay reaches (in the kept bytes) and "
                "does not run them again"
                if exclude_collectives
                else "made with exclude_collectives=False runs them again in its replay"
            )
        )
    if spread:
        notes.append(
            f"{spread} bytes are kept by several non-adjacent layers (inputs every layer "
            "receives, say) and are counted as shared whatever the plan"
        )
    del loss, recorder
    gc.collect()
    return Profile(
        device=str(device),
        baseline_step_s=statistics.median(step_times),
        shared_bytes=shared,
        layers=layer_profiles,
        spread_bytes=spread,
        bookkeeping_bytes=bookkeeping,
        per_save_s=per_save,
        per_policy_op_s=per_policy_op,
        notes=notes,
        exclude_collectives=exclude_collectives,
    )
