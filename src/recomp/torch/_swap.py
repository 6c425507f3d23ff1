"""Swap (activation offload) under HyperParallel's names, on recomp's one offload mechanism.

NOTE [ Swap scopes ]

A **swap scope** is one layer's worth of tensors chosen to live on the host between the
forward and the backward: a recomp checkpoint call with ``policy_fn=`` or
``swap_inputs=True`` (or any ``context_fn``), a ``swap`` / ``swap_wrapper`` call, or an
``async_save_on_cpu`` block. Tensors are chosen in two ways:

* per op, inside a checkpoint (``create_selective_checkpoint_contexts``): an op whose
  policy is ``MUST_SWAP`` has its output kept like a save, but by recomp rather than by
  PyTorch's selective-checkpoint cache (PyTorch is told ``MUST_RECOMPUTE``). A dispatch
  mode below PyTorch's (:class:`_SwapTap`) sees the op's output in the forward, and in
  the replay hands the kept output back instead of running the op: it is never
  recomputed. The other four policies are PyTorch's own selective checkpointing.
* per tensor (``async_save_on_cpu``, ``swap``, ``swap_wrapper``, ``swap_inputs=True``):
  a saved-tensors hook; parameters, views of parameters and empty tensors stay on the
  device.
* tensors the layer keeps itself (``swap_tensor_wrapper``): their storages are emptied
  in place once copied and refilled when the gradient of the layer's output is
  computed.

Nothing moves while the layer's forward runs (its later ops may still read what was
chosen). When the layer returns (:meth:`SwapScope.finish`) every chosen tensor that does
not share storage with the layer's output is handed to one ``OffloadGroup`` of the
offloader (``recomp.torch._offload``, NOTE [ Offload ordering and lifetime ]): copied
to the host on its side stream, its device storage released once copied, brought back
when the backward (or the replay) reads it, and the layer recorded before it prefetched
at that moment. Where the offloader does nothing (no CUDA, no host-copy test mode) the
chosen tensors stay on the device.

``group_swap`` packs a layer's small whole-storage tensors of one dtype into one buffer
(one copy each way); ``cpu_pool`` (:class:`PinnedMemoryPool`) supplies the host memory
and gets it back when the graph is freed. :class:`SwapManager` names the groups per
layer and tells the offloader which group a layer's backward brings back ahead (its
``set_forward_prefetch_layer`` pair, else the group recorded before).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from .._engine import ComposedContext
from .._hooks import CallPart
from .._op_policy import FreshMode, KeptOutput, OpCalls, SelectivePart
from .._policy import CheckpointPolicy, SwapPolicyError, as_policy, tensor_swapped
from .._swap_pairs import OwnScopes, ScopeSlot, SwapHooks, SwapManagerBase, SwapWrappers
from .._wrapping import instance_required
from ..errors import RecompError
from . import _compat
from ._backend import BACKEND
from ._offload import Offloader, OffloadHandle, default_offloader
from ._plain import PlainFunction

_TorchPolicy = torch.utils.checkpoint.CheckpointPolicy


def noop_context_fn() -> Callable[[], tuple[Any, Any]]:
    """PyTorch's no-op ``context_fn`` (the function itself), for code that needs an
    explicit one."""
    return torch.utils.checkpoint.noop_context_fn


def is_compiling() -> bool:
    """Whether the caller runs inside a ``torch.compile`` capture."""
    return bool(torch.compiler.is_compiling())


def ignore_sac_ops(ignore_ops: list[Any]) -> None:
    """Add operators that selective checkpointing passes through without a policy
    (PyTorch's ``SAC_IGNORED_OPS``, which this changes for PyTorch's own selective
    checkpointing too). ``None`` entries are skipped."""
    for op in ignore_ops:
        if op is not None:
            torch.utils.checkpoint.SAC_IGNORED_OPS.add(op)


# --------------------------------------------------------------------------- scopes


class _Kept:
    """A tensor a swap scope chose: the tensor until the layer's forward ends, then its
    host copy (or still the tensor, where it stays on the device)."""

    __slots__ = ("allow_mutation", "group", "held", "mutated", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, allow_mutation: bool) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.held: OffloadHandle | _InBucket | None = None
        # The offload group, alive as long as what it moved (the offloader holds it
        # weakly, and finds through it the layer to bring back next).
        self.group: Any = None
        self.version = _compat.version(tensor)
        self.allow_mutation = allow_mutation
        self.mutated = False

    def get(self) -> torch.Tensor:
        held = self.held
        if self.mutated or (held is not None and held.changed() and not self.allow_mutation):
            raise RecompError(
                "A tensor chosen for swapping (CheckpointPolicy.MUST_SWAP or a swap "
                "policy) was changed in place after it was saved, before it was copied "
                "to the host. Change a copy instead, or return MUST_SAVE for it with "
                "allow_cache_entry_mutation=True."
            )
        if held is not None:
            return held.get()
        if self.tensor is None:
            raise RecompError("A swapped tensor was read after its scope was aborted.")
        return self.tensor


class SwapScope:
    """One layer's chosen tensors; see NOTE [ Swap scopes ]. ``layer``: the module whose
    call this is (for the swap manager's pairs), or None; ``function``: what it calls.
    Without a ``name``, the group is named by the swap manager when it first moves
    something."""

    __slots__ = (
        "cpu_pool",
        "function",
        "group_swap",
        "in_place",
        "layer",
        "name",
        "offloader",
        "pending",
    )

    def __init__(
        self,
        name: str | None = None,
        *,
        group_swap: bool = False,
        cpu_pool: Any = None,
        offloader: Offloader | None = None,
        layer: nn.Module | None = None,
        function: Any = None,
    ) -> None:
        self.name = name
        self.function = function
        self.group_swap = group_swap
        self.cpu_pool = cpu_pool
        self.offloader = offloader
        self.layer = layer
        self.pending: list[_Kept] = []
        # Tensors the caller keeps (``swap_tensor_wrapper``), with their tags: emptied
        # and refilled in place.
        self.in_place: list[tuple[torch.Tensor, str | None]] = []

    def keep(self, tensor: torch.Tensor, allow_mutation: bool = False) -> _Kept:
        kept = _Kept(tensor, allow_mutation)
        self.pending.append(kept)
        return kept

    def finish(self, outputs: Any) -> None:
        """The layer returned ``outputs``: move every chosen tensor that does not share
        storage with them to the host, in one offload group."""
        pending, self.pending = self.pending, []
        in_place, self.in_place = self.in_place, []
        if not pending and not in_place:
            return
        offloader = self.offloader or default_offloader()
        manager = SwapManager()
        name = self.name or manager.group_name(self.layer, self.function)
        group = offloader.open_group(name)
        if group is None:
            return
        group.pool = self.cpu_pool
        manager.group_recorded(self.layer, group)
        if manager.is_last_layer(self.layer):
            # Its backward comes next: moving it out and back gains nothing. Its
            # backward's start (the gradient of its output) brings its pair back.
            manager.prefetch_on_backward(self.layer, outputs)
            return
        protected = {_compat.storage_key(t) for t in _tensors_in(outputs)}
        moving: list[_Kept] = []
        for kept in pending:
            t = kept.tensor
            if t is None or _compat.storage_key(t) in protected:
                continue
            if _compat.version(t) != kept.version and not kept.allow_mutation:
                kept.mutated = True
                continue
            kept.group = group
            moving.append(kept)
        try:
            if self.group_swap:
                moving = _bucket(group, moving)
            for kept in moving:
                handle = group.put(kept.tensor, force=True)  # type: ignore[arg-type]
                if handle is not None:
                    kept.held, kept.tensor = handle, None
            _put_in_place(group, in_place, outputs, protected)
        except BaseException:
            group.abort()
            raise
        group.close()

    def abort(self) -> None:
        self.pending = []
        self.in_place = []


def _put_in_place(
    group: Any, tensors: list[tuple[torch.Tensor, str | None]], outputs: Any, protected: set[Any]
) -> None:
    """Empty the storages of ``tensors`` once copied; refill them when the gradient of the
    layer's output is computed (the start of its backward). With no output that needs a
    gradient there is no such moment: they stay."""
    anchor = next((t for t in _tensors_in(outputs) if t.requires_grad), None)
    if anchor is None:
        return
    handles = []
    for t, tag in tensors:
        if _compat.storage_key(t) in protected:
            continue
        handle = group.put(t, force=True, in_place=True, label=tag)
        if handle is not None:
            handles.append(handle)
    if not handles:
        return

    def refill(grad: torch.Tensor) -> None:
        del grad
        if handles:
            group.bring_back_in_place()

    anchor.register_hook(refill)


#: group_swap: tensors below this size share one copy per dtype and device; a bucket
#: holds at most this many bytes and at least two tensors.
BUCKET_BYTES = 32 << 20


class _Bucket:
    """Small tensors of one layer packed into one buffer: one copy out, one copy back
    per backward pass (the members are views of the restored buffer)."""

    __slots__ = ("handle", "members", "reads", "resident")

    def __init__(self, handle: OffloadHandle, members: int) -> None:
        self.handle = handle
        self.members = members
        self.reads = 0
        self.resident: torch.Tensor | None = None

    def read(self) -> torch.Tensor:
        buffer = self.resident
        if buffer is None:
            buffer = self.resident = self.handle.get()
        self.reads += 1
        if self.reads >= self.members:  # every member read in this pass
            self.resident, self.reads = None, 0
        return buffer


class _InBucket:
    """A member of a :class:`_Bucket`: where its elements are in the buffer."""

    __slots__ = ("bucket", "offset", "size", "stride")

    def __init__(self, bucket: _Bucket, offset: int, t: torch.Tensor) -> None:
        self.bucket = bucket
        self.offset = offset
        self.size = t.size()
        self.stride = t.stride()

    def changed(self) -> bool:
        return False  # the buffer is recomp's own: nothing else writes it

    def get(self) -> torch.Tensor:
        return self.bucket.read().as_strided(self.size, self.stride, self.offset)


def _bucketable(t: torch.Tensor) -> bool:
    if type(t) is not torch.Tensor or t.layout is not torch.strided:
        return False
    nbytes = t.numel() * t.element_size()
    return bool(
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == nbytes
        and 0 < nbytes < BUCKET_BYTES
    )


def _bucket(group: Any, moving: list[_Kept]) -> list[_Kept]:
    """Pack the small whole-storage tensors of ``moving`` into buckets put in ``group``;
    return the rest, to be put one by one."""
    rest: list[_Kept] = []
    by_kind: dict[tuple[torch.dtype, torch.device], list[_Kept]] = {}
    seen: set[Any] = set()
    for kept in moving:
        t = kept.tensor
        key = _compat.storage_key(t) if t is not None else None
        if t is None or not _bucketable(t) or key in seen:
            rest.append(kept)
            continue
        seen.add(key)
        by_kind.setdefault((t.dtype, t.device), []).append(kept)
    for members in by_kind.values():
        chunks: list[list[_Kept]] = [[]]
        size = 0
        for kept in members:
            n = kept.tensor.numel() * kept.tensor.element_size()  # type: ignore[union-attr]
            if size + n > BUCKET_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(kept)
            size += n
        for chunk in chunks:
            if len(chunk) < 2:
                rest.extend(chunk)
                continue
            with torch.no_grad(), _compat.no_dispatch_modes():
                flat = torch.cat([k.tensor.reshape(-1) for k in chunk])  # type: ignore[union-attr]
            handle = group.put(flat, force=True)
            if handle is None:
                rest.extend(chunk)
                continue
            bucket = _Bucket(handle, len(chunk))
            offset = 0
            for kept in chunk:
                t = kept.tensor
                kept.held, kept.tensor = _InBucket(bucket, offset, t), None  # type: ignore[arg-type]
                offset += t.numel()  # type: ignore[union-attr]
    return rest


_SCOPES = ScopeSlot("recomp_swap_scope")
current_scope = _SCOPES.current


def _tensors_in(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors_in(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors_in(item)


# --------------------------------------------------------------------------- per tensor


def _stays_on_device(t: torch.Tensor) -> bool:
    if isinstance(t, nn.Parameter) or isinstance(_compat.view_base(t), nn.Parameter):
        return True
    try:
        return t.untyped_storage().nbytes() == 0
    except (RuntimeError, NotImplementedError):
        return True


class AsyncSaveOnCpu(torch.autograd.graph.saved_tensors_hooks):
    """What ``async_save_on_cpu`` returns: a saved-tensors hook that chooses, tensor by
    tensor, what goes to the host (NOTE [ Swap scopes ])."""

    def __init__(
        self,
        policy_fn: Callable[[torch.Tensor], Any] | None = None,
        group_swap: bool = False,
        cpu_pool: Any = None,
    ) -> None:
        _check_swap_options(group_swap, cpu_pool)
        if policy_fn is not None and not callable(policy_fn):
            raise TypeError(f"policy_fn must be callable or None, got {policy_fn!r}.")
        self.policy_fn = policy_fn
        self.own = OwnScopes(
            _SCOPES,
            lambda: SwapScope("async_save_on_cpu", group_swap=group_swap, cpu_pool=cpu_pool),
        )
        super().__init__(self.pack_to_host, self.unpack_from_host)

    def __enter__(self) -> None:
        # No layer around it: the block is the scope, finished when it ends.
        self.own.enter()
        super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        self.own.exit(*exc_info)

    def pack_to_host(self, t: torch.Tensor) -> Any:
        if _stays_on_device(t):
            return t
        if self.policy_fn is not None and not tensor_swapped(self.policy_fn(t)):
            return t
        scope = current_scope()
        if scope is None:
            return t
        return scope.keep(t)

    @staticmethod
    def unpack_from_host(packed: Any) -> Any:
        return packed.get() if isinstance(packed, _Kept) else packed


def async_save_on_cpu(
    policy_fn: Callable[[torch.Tensor], Any] | None = None,
    group_swap: bool = False,
    cpu_pool: Any = None,
) -> AsyncSaveOnCpu:
    """A context in which the tensors autograd saves go to the host until backward.

    ``policy_fn(tensor)`` returns ``MUST_SAVE`` (stays on the device) or ``MUST_SWAP``
    (default for every tensor). Parameters, views of parameters and tensors sharing
    storage with the layer's output stay on the device. Inside a recomp checkpoint
    call or a swap wrapper the tensors move when that layer returns; elsewhere when
    the block ends. On a machine without CUDA nothing moves (unless the
    ``RECOMP_OFFLOAD_HOST_COPY=1`` test mode is on)."""
    return AsyncSaveOnCpu(policy_fn, group_swap, cpu_pool)


def _check_swap_options(group_swap: Any, cpu_pool: Any) -> None:
    if not isinstance(group_swap, bool):
        raise TypeError(f"group_swap must be a bool, got {group_swap!r}.")
    if cpu_pool is not None and not isinstance(cpu_pool, PinnedMemoryPool):
        raise TypeError(
            f"cpu_pool must be a recomp.torch.PinnedMemoryPool or None, got {cpu_pool!r}."
        )


# --------------------------------------------------------------------------- per op


class _SwapState:
    """Shared by the forward tap, the replay tap and the policy PyTorch calls: for each
    op, the forward's calls that PyTorch does not cache, in order (None: recomputed;
    a :class:`KeptOutput`: kept by recomp). With early stop, what an op's output was
    kept after the forward's last saved tensor is dropped when the forward ends: no
    replay reaches that op, so its output is neither moved nor brought back."""

    def __init__(self, allow_mutation: bool) -> None:
        self.allow_mutation = allow_mutation
        self.calls = OpCalls()
        self.waiting: tuple[Any, KeptOutput, SwapScope] | None = None
        self.detach = _compat.version_sharing_detach() or (lambda t: t.detach())
        # The checkpoint's save counter where its replay stops early (else None), and
        # each kept output with the number of tensors saved before its op's own saves.
        self.saves: Callable[[], int] | None = None
        self.kept_at: list[tuple[int, KeptOutput]] = []

    def __enter__(self) -> None:
        # The forward begins directly under the checkpoint's saved-tensors hook.
        self.saves = BACKEND.save_counter()
        self.kept_at = []

    def __exit__(self, *exc_info: Any) -> None:
        saves, self.saves = self.saves, None
        kept_at, self.kept_at = self.kept_at, []
        if saves is None or exc_info[0] is not None:
            return
        total = saves()
        for before, entry in kept_at:
            if before >= total:  # the replay stops before this op runs
                entry.fill(entry.out, _drop)

    def fill(self, entry: KeptOutput, out: Any, scope: SwapScope) -> None:
        detach, allow_mutation = self.detach, self.allow_mutation

        def keep(x: Any) -> Any:
            return scope.keep(detach(x), allow_mutation) if isinstance(x, torch.Tensor) else x

        entry.fill(out, keep)
        if self.saves is not None:
            self.kept_at.append((self.saves(), entry))

    def chose(self, ctx: Any, op: Any, policy: CheckpointPolicy) -> None:
        if getattr(ctx, "is_recompute", False):
            return
        if policy is CheckpointPolicy.MUST_SWAP:
            scope = current_scope()
            if scope is None:
                raise SwapPolicyError(
                    f"The policy returned MUST_SWAP for {op} but no swap group is active: "
                    f"use recomp.torch.checkpoint(..., policy_fn=...) or checkpoint_wrapper "
                    f"(recomp.torch's, not torch.utils.checkpoint's) around it."
                )
            entry = KeptOutput()
            self.calls.add(op, entry)
            if hasattr(ctx, "op_output"):  # PyTorch asks after the op ran
                self.fill(entry, ctx.op_output, scope)
            else:  # before: the forward tap fills it
                self.waiting = (op, entry, scope)
        elif policy in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE):
            self.calls.add(op, None)


class _SwapTap(_compat.TorchDispatchMode):
    """Below PyTorch's selective-checkpoint modes; see NOTE [ Swap scopes ]."""

    def __init__(self, state: _SwapState, replay: bool) -> None:
        super().__init__()
        self.state = state
        self.replay = replay
        self.cursor = state.calls.cursor()

    def __enter__(self) -> Any:
        self.cursor = self.state.calls.cursor()
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in torch.utils.checkpoint.SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        state = self.state
        if not self.replay:
            out = func(*args, **kwargs)
            waiting = state.waiting
            if waiting is not None and waiting[0] is func:
                state.waiting = None
                state.fill(waiting[1], out, waiting[2])
            return out
        entry = self.cursor.next(func)
        if entry is None:
            return func(*args, **kwargs)
        return entry.get(_read)  # kept by the forward: not recomputed


def _read(x: Any) -> Any:
    return x.get() if isinstance(x, _Kept) else x


def _drop(x: Any) -> Any:
    """A kept output no replay reads: its scope does not move it (nothing left to move)."""
    if isinstance(x, _Kept):
        x.tensor = None
    return x


_compat.register_selective_mode_type(_SwapTap)


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Any,
    allow_cache_entry_mutation: bool = False,
    group_swap: bool = False,
    cpu_pool: Any = None,
) -> tuple[Any, Any]:
    """PyTorch's selective checkpointing with HyperParallel's policies.

    ``policy_fn_or_list``: a function ``(ctx, op, *args, **kwargs)`` returning a
    :class:`CheckpointPolicy` (or PyTorch's, or a bool), or a list of ops to save.
    ``MUST_SWAP`` keeps the op's output like a save, moves it to the host when the
    layer's forward returns and brings it back for the backward; it is never
    recomputed. It needs a recomp checkpoint around it, and is refused under
    ``torch.compile``."""
    _check_swap_options(group_swap, cpu_pool)
    if isinstance(policy_fn_or_list, list):
        return torch.utils.checkpoint.create_selective_checkpoint_contexts(
            policy_fn_or_list, allow_cache_entry_mutation
        )
    if not callable(policy_fn_or_list):
        raise TypeError("policy_fn_or_list must be either a function or a list of ops.")
    return _selective_contexts(policy_fn_or_list, allow_cache_entry_mutation, is_compiling())


def _selective_contexts(user: Any, allow_cache_entry_mutation: bool, compiled: bool) -> Any:
    """``create_selective_checkpoint_contexts`` for a policy function; ``compiled``: for a
    checkpoint Dynamo traces (PyTorch's two modes only: PyTorch 2.9 calls the context
    function where ``is_compiling()`` is False and wants dispatch modes)."""
    state = _SwapState(allow_cache_entry_mutation)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        chosen = as_policy(user(ctx, op, *args, **kwargs), "policy_fn")
        if chosen is CheckpointPolicy.MUST_SWAP:
            if compiled or _under_compile(args):
                raise SwapPolicyError(
                    f"CheckpointPolicy.MUST_SWAP (for {op}) is not supported under "
                    f"torch.compile: return MUST_SAVE for it there, or keep the layer "
                    f"out of the compiled region."
                )
            state.chose(ctx, op, chosen)
            return _TorchPolicy.MUST_RECOMPUTE
        state.chose(ctx, op, chosen)
        return _TorchPolicy.__members__[chosen.name]

    forward, replay = torch.utils.checkpoint.create_selective_checkpoint_contexts(
        policy, allow_cache_entry_mutation
    )
    if compiled:
        return forward, replay
    # The taps enter first: below PyTorch's modes on the mode stack. Where PyTorch hands
    # the policy the op's output, the forward needs no tap; the replay needs one only
    # if some op was swapped.
    if not _POLICY_SEES_OUTPUT:
        forward = ComposedContext(None, _SwapTap(state, replay=False), forward)
    # The replay's tap is on the mode stack only if the forward swapped something.
    replay_tap = FreshMode(lambda: _SwapTap(state, replay=True), only_if=state.calls)
    return ComposedContext(None, state, forward), ComposedContext(None, replay_tap, replay)


#: PyTorch (2.14 on) runs the op before asking the policy and hands it the output.
_POLICY_SEES_OUTPUT = "op_output" in inspect.signature(
    torch.utils.checkpoint.SelectiveCheckpointContext
).parameters


def _under_compile(args: tuple[Any, ...]) -> bool:
    return any(
        isinstance(a, torch.Tensor) and type(a) is not torch.Tensor and not isinstance(a, nn.Parameter)
        for a in args
    )


def create_native_selective_checkpoint_contexts(policy_fn: Callable[..., Any]) -> tuple[Any, Any]:
    """PyTorch's own selective checkpointing with a policy that returns recomp's (or
    PyTorch's) policies, for compiled code: ``MUST_SWAP`` raises there."""
    if not callable(policy_fn):
        raise TypeError(f"policy_fn must be callable, got {policy_fn!r}.")

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        chosen = as_policy(policy_fn(ctx, op, *args, **kwargs), "policy_fn")
        if chosen is CheckpointPolicy.MUST_SWAP:
            raise SwapPolicyError(
                f"CheckpointPolicy.MUST_SWAP (for {op}) has no counterpart in PyTorch's "
                f"selective checkpointing: use create_selective_checkpoint_contexts in "
                f"eager code."
            )
        return _TorchPolicy.__members__[chosen.name]

    return torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)


def get_class_activation_wrapper() -> type:
    """The class every module wrapped by ``checkpoint_wrapper`` or
    ``checkpoint_exclude_wrapper`` is an instance of (``swap_wrapper`` adds hooks and
    keeps the module's class)."""
    from .._wrapping import WrapperMixin

    return WrapperMixin


# --------------------------------------------------------------------------- checkpoint


class CheckpointSwap:
    """The swap options of one recomp checkpoint call (``policy_fn``, ``swap_inputs``,
    ``group_swap``, ``cpu_pool``)."""

    __slots__ = ("cpu_pool", "group_swap", "policy_fn", "swap_inputs")

    def __init__(self, policy_fn: Any, swap_inputs: Any, group_swap: Any, cpu_pool: Any) -> None:
        if policy_fn is not None and not callable(policy_fn) and not isinstance(policy_fn, list):
            raise TypeError(f"policy_fn must be a function or a list of ops, got {policy_fn!r}.")
        if not isinstance(swap_inputs, bool):
            raise TypeError(f"swap_inputs must be a bool, got {swap_inputs!r}.")
        _check_swap_options(group_swap, cpu_pool)
        self.policy_fn = policy_fn
        self.swap_inputs = swap_inputs
        self.group_swap = group_swap
        self.cpu_pool = cpu_pool

    def compiled_context_fn(self, context_fn: Any) -> Any:
        """The ``context_fn`` for a compiled checkpoint; swapping there is refused."""
        refused = [
            name
            for name, on in (
                ("swap_inputs", self.swap_inputs),
                ("group_swap", self.group_swap),
                ("cpu_pool", self.cpu_pool is not None),
                ("context_fn with policy_fn", self.policy_fn is not None and context_fn is not None),
            )
            if on
        ]
        if refused:
            raise ValueError(
                f"recomp.torch.checkpoint under torch.compile does not support "
                f"{', '.join(refused)}: swapping runs in eager mode only."
            )
        if self.policy_fn is None:
            return context_fn
        policy_fn = self.policy_fn
        if isinstance(policy_fn, list):
            return functools.partial(create_selective_checkpoint_contexts, policy_fn)
        return functools.partial(_selective_contexts, policy_fn, False, True)

    def part(self) -> CallPart | None:
        if self.policy_fn is None:
            return None  # group_swap without a policy: no selective checkpointing
        return SelectivePart(
            functools.partial(
                create_selective_checkpoint_contexts,
                self.policy_fn,
                group_swap=self.group_swap,
                cpu_pool=self.cpu_pool,
            )
        )

    def scope(self, function: Any, context_fn: Any) -> contextlib.AbstractContextManager[Any]:
        """Around the framework's checkpoint of ``function``: yields ``finish(outputs)``."""
        if self.policy_fn is None and not self.swap_inputs and context_fn is None:
            return contextlib.nullcontext(_identity)
        scope = SwapScope(
            group_swap=self.group_swap,
            cpu_pool=self.cpu_pool,
            layer=BACKEND.module_of(function),
            function=function,
        )
        hooks = None
        if self.swap_inputs:
            hooks = async_save_on_cpu(group_swap=self.group_swap, cpu_pool=self.cpu_pool)
        return _SCOPES.layer_call(scope, hooks)


def _identity(out: Any) -> Any:
    return out


# --------------------------------------------------------------------------- swap


def swap(
    function: Callable[..., Any],
    *args: Any,
    policy_fn: Callable[[torch.Tensor], Any] | None = None,
    group_swap: bool = False,
    cpu_pool: Any = None,
    **kwargs: Any,
) -> Any:
    """Call ``function(*args, **kwargs)`` with what autograd saves in it on the host until
    backward (nothing is recomputed). ``policy_fn(tensor)`` returns ``MUST_SAVE`` or
    ``MUST_SWAP`` (default); see :func:`async_save_on_cpu`. Refused under
    ``torch.compile``."""
    if is_compiling():
        raise ValueError("recomp.torch.swap does not run under torch.compile (eager only).")
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    with _swapped_call(policy_fn, group_swap, cpu_pool, function) as finish:
        return finish(function(*args, **kwargs))


def _swapped_call(
    policy_fn: Any, group_swap: bool, cpu_pool: Any, function: Any
) -> contextlib.AbstractContextManager[Any]:
    """One call of ``function`` as a swap scope, with the per-tensor hooks."""
    scope = SwapScope(
        group_swap=group_swap,
        cpu_pool=cpu_pool,
        layer=BACKEND.module_of(function),
        function=function,
    )
    return _SCOPES.layer_call(scope, async_save_on_cpu(policy_fn, group_swap, cpu_pool))


def _wrapped_call(
    policy_fn: Any, group_swap: bool, cpu_pool: Any, module: nn.Module
) -> contextlib.AbstractContextManager[Any] | None:
    if not torch.is_grad_enabled() or is_compiling():
        return None
    return _swapped_call(policy_fn, group_swap, cpu_pool, module)


def swap_wrapper(
    module: Any,
    policy_fn: Callable[[torch.Tensor], Any] | None = None,
    group_swap: bool = False,
    cpu_pool: Any = None,
) -> Any:
    """Make every call of ``module`` a :func:`swap` (what autograd saves in it goes to the
    host until backward). Wraps in place with forward hooks and returns the module (a
    plain function comes back as a small module around it); names are unchanged.
    Around a :func:`checkpoint_wrapper`'d module it moves the checkpoint's inputs, as
    ``swap_inputs=True`` does."""
    if policy_fn is not None and not callable(policy_fn):
        raise TypeError(f"policy_fn must be callable or None, got {policy_fn!r}.")
    _check_swap_options(group_swap, cpu_pool)
    if isinstance(module, type):
        raise instance_required(module, "swap_wrapper", "module or a function")
    if not isinstance(module, nn.Module):
        if not callable(module):
            raise TypeError(f"swap_wrapper needs a module or a function, got {module!r}.")
        module = PlainFunction(module)
    hooks = SwapHooks(functools.partial(_wrapped_call, policy_fn, group_swap, cpu_pool))
    return _WRAPPED.install(module, hooks)


def unwrap_swaps(module: Any) -> bool:
    """Remove what :func:`swap_wrapper` put on ``module`` and on the modules below it;
    whether there was any."""
    if not isinstance(module, nn.Module):
        return False
    return _WRAPPED.remove(module.modules())


_WRAPPED = SwapWrappers()


def swap_tensor_wrapper(
    target: Any, tag: str | None = None, group_swap: bool = False, cpu_pool: Any = None
) -> Any:
    """Register the tensors of ``target`` (a tensor, or a list, tuple or dict of them)
    with the current layer's swap group and return ``target`` unchanged: for tensors a
    layer keeps for its backward outside autograd's saved tensors. When the layer
    returns their storages are copied to the host and emptied in place; the start of
    the layer's backward (the gradient of its output) refills them. Parameters and
    what shares storage with the layer's output stay. Outside a recomp checkpoint,
    ``swap`` or swap wrapper call, nothing happens. ``tag`` (HyperParallel's debug tag)
    names the tensors in the offloader's trace (``recomp._testing.offload_events``:
    ``<group>/<tag>``)."""
    _check_swap_options(group_swap, cpu_pool)
    if tag is not None and not isinstance(tag, str):
        raise TypeError(f"tag must be a str or None, got {tag!r}.")
    scope = current_scope()
    if scope is None or not torch.is_grad_enabled() or is_compiling():
        return target
    for t in _tensors_in(target):
        if not _stays_on_device(t):
            scope.in_place.append((t, tag))
    return target


# --------------------------------------------------------------------------- manager


class SwapManager(SwapManagerBase):
    """The process's swap manager (every ``SwapManager()`` is the same object).

    Each recomp checkpoint, swap wrapper or ``swap`` call of a layer moves its tensors
    as one group. In backward, the first read of a layer's group brings back, ahead,
    the group of the layer paired with it by :meth:`set_forward_prefetch_layer`, or,
    when none is set, the group of the layer that ran before it in the forward (the
    offloader's own order)."""

    layer_type = nn.Module
    layer_kind = "modules"
    installed: Offloader | None

    def _started(self) -> None:
        self.installed = None

    def grad_outputs(self, outputs: Any) -> Iterator[torch.Tensor]:
        return (t for t in _tensors_in(outputs) if t.requires_grad)

    def group_recorded(self, layer: nn.Module | None, group: Any) -> None:
        super().group_recorded(layer, group)
        offloader = group.offloader
        if self.installed is not offloader:
            offloader.prefetch_pair = self.paired
            self.installed = offloader


# --------------------------------------------------------------------------- host pool


class PinnedMemoryPool:
    """Host memory for swapped tensors, reused across steps and bounded: blocks of a
    power of two bytes (at least 1 KiB; sizes above ``align_limit`` exactly), pinned
    where CUDA is available. More than ``max_host_bytes`` in use raises."""

    def __init__(self, max_host_bytes: int, align_limit: int = 2 * 1024**3) -> None:
        for name, value in (("max_host_bytes", max_host_bytes), ("align_limit", align_limit)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be an int > 0, got {value!r}.")
        self.max_host_bytes = max_host_bytes
        self.align_limit = align_limit
        self.reserved_bytes = 0  # blocks allocated, free or in use
        self.in_use_bytes = 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def _block_size(self, size: int) -> int:
        if size > self.align_limit:
            return size
        return max(1024, 1 << (size - 1).bit_length())

    def acquire(self, size: int) -> torch.Tensor:
        """A uint8 host block of at least ``size`` bytes."""
        block_size = self._block_size(size)
        with self._lock:
            free = self._free.get(block_size)
            if free:
                block = free.pop()
            else:
                if self.reserved_bytes + block_size > self.max_host_bytes:
                    self._trim(block_size)
                if self.reserved_bytes + block_size > self.max_host_bytes:
                    raise RecompError(
                        f"PinnedMemoryPool capacity exceeded: {size} bytes asked, "
                        f"{self.in_use_bytes} of {self.max_host_bytes} in use. Give the "
                        f"pool more (max_host_bytes) or swap less (policy_fn)."
                    )
                block = torch.empty(
                    block_size, dtype=torch.uint8, pin_memory=torch.cuda.is_available()
                )
                self.reserved_bytes += block_size
            self.in_use_bytes += block_size
        return block

    def release(self, block: torch.Tensor) -> None:
        """Give a block back (the offloader does, when the host copy is no longer needed)."""
        with self._lock:
            self.in_use_bytes -= block.numel()
            self._free.setdefault(block.numel(), []).append(block)

    def _trim(self, needed: int) -> None:
        for size in sorted(self._free, reverse=True):
            blocks = self._free[size]
            while blocks and self.reserved_bytes + needed > self.max_host_bytes:
                blocks.pop()
                self.reserved_bytes -= size
