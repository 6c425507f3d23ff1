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

Nothing moves while the layer's forward runs (its later ops may still read what was
chosen). When the layer returns (:meth:`SwapScope.finish`) every chosen tensor that does
not share storage with the layer's output is handed to one ``OffloadGroup`` of the
offloader (``recomp.torch._offload``, NOTE [ Offload ordering and lifetime ]): copied
to the host on its side stream, its device storage released once copied, brought back
when the backward (or the replay) reads it, and the layer recorded before it prefetched
at that moment. Where the offloader does nothing (no CUDA, no host-copy test mode) the
chosen tensors stay on the device.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from .._hooks import CallPart, CheckpointCallView, Stage
from ..errors import RecompError
from . import _compat
from ._offload import Offloader, OffloadHandle, default_offloader

_TorchPolicy = torch.utils.checkpoint.CheckpointPolicy


class CheckpointPolicy(enum.IntEnum):
    """HyperParallel's policy values: PyTorch's four and ``MUST_SWAP`` (the op's output
    is kept like a save, moved to the host after the layer's forward and brought back
    for its backward; never recomputed). A policy function may also return a bool
    (True: ``MUST_SAVE``, False: ``PREFER_RECOMPUTE``) or PyTorch's own enum."""

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3
    MUST_SWAP = 4


class SwapPolicyError(RecompError, ValueError):
    """A policy function returned something that is not a policy, or a swap was asked
    for where none can happen."""


def as_policy(value: Any, where: str) -> CheckpointPolicy:
    """``value`` (what a policy function returned) as a :class:`CheckpointPolicy`."""
    if isinstance(value, bool):
        return CheckpointPolicy.MUST_SAVE if value else CheckpointPolicy.PREFER_RECOMPUTE
    if isinstance(value, CheckpointPolicy):
        return value
    if isinstance(value, _TorchPolicy) and value.name in CheckpointPolicy.__members__:
        return CheckpointPolicy[value.name]
    raise SwapPolicyError(
        f"{where} returned {value!r} ({type(value).__name__}), which is not a policy: "
        f"return a recomp.torch.CheckpointPolicy ("
        f"{', '.join(CheckpointPolicy.__members__)}) or a bool."
    )


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

    __slots__ = ("allow_mutation", "held", "mutated", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, allow_mutation: bool) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.held: OffloadHandle | None = None
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
    """One layer's chosen tensors; see NOTE [ Swap scopes ]."""

    __slots__ = ("cpu_pool", "group_swap", "name", "offloader", "pending")

    def __init__(
        self,
        name: str,
        *,
        group_swap: bool = False,
        cpu_pool: Any = None,
        offloader: Offloader | None = None,
    ) -> None:
        self.name = name
        self.group_swap = group_swap
        self.cpu_pool = cpu_pool
        self.offloader = offloader
        self.pending: list[_Kept] = []

    def keep(self, tensor: torch.Tensor, allow_mutation: bool = False) -> _Kept:
        kept = _Kept(tensor, allow_mutation)
        self.pending.append(kept)
        return kept

    def finish(self, outputs: Any) -> None:
        """The layer returned ``outputs``: move every chosen tensor that does not share
        storage with them to the host, in one offload group."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        offloader = self.offloader or default_offloader()
        group = offloader.open_group(self.name)
        if group is None:
            return
        protected = {_compat.storage_key(t) for t in _tensors_in(outputs)}
        try:
            for kept in pending:
                t = kept.tensor
                if t is None or _compat.storage_key(t) in protected:
                    continue
                if _compat.version(t) != kept.version and not kept.allow_mutation:
                    kept.mutated = True
                    continue
                handle = group.put(t, force=True)
                if handle is not None:
                    kept.held, kept.tensor = handle, None
        except BaseException:
            group.abort()
            raise
        group.close()

    def abort(self) -> None:
        self.pending = []


_SCOPE: contextvars.ContextVar[SwapScope | None] = contextvars.ContextVar(
    "recomp_swap_scope", default=None
)


def current_scope() -> SwapScope | None:
    return _SCOPE.get()


@contextlib.contextmanager
def _scope_active(scope: SwapScope) -> Iterator[SwapScope]:
    token = _SCOPE.set(scope)
    try:
        yield scope
    except BaseException:
        scope.abort()
        raise
    finally:
        _SCOPE.reset(token)


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
        self.own_scopes: list[tuple[SwapScope, Any]] = []
        self.swap_options = (group_swap, cpu_pool)
        super().__init__(self.pack_to_host, self.unpack_from_host)

    def __enter__(self) -> None:
        if current_scope() is None:
            # No layer around it: the block is the scope, finished when it ends.
            scope = SwapScope("async_save_on_cpu", group_swap=self.swap_options[0],
                              cpu_pool=self.swap_options[1])
            manager = _scope_active(scope)
            manager.__enter__()
            self.own_scopes.append((scope, manager))
        else:
            self.own_scopes.append((None, None))  # type: ignore[arg-type]
        super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        scope, manager = self.own_scopes.pop()
        if scope is None:
            return
        try:
            if exc_info[0] is None:
                scope.finish(None)
        finally:
            manager.__exit__(*exc_info)

    def pack_to_host(self, t: torch.Tensor) -> Any:
        if _stays_on_device(t):
            return t
        policy = (
            CheckpointPolicy.MUST_SWAP
            if self.policy_fn is None
            else as_policy(self.policy_fn(t), "the swap policy_fn")
        )
        if policy is CheckpointPolicy.MUST_SAVE:
            return t
        if policy is not CheckpointPolicy.MUST_SWAP:
            raise SwapPolicyError(
                f"The swap policy_fn returned {policy.name} for a saved tensor: a swap "
                f"policy is per tensor and returns MUST_SAVE or MUST_SWAP."
            )
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


# --------------------------------------------------------------------------- per op


class _SwapEntry:
    """The kept output of one ``MUST_SWAP`` op call: its structure with :class:`_Kept`
    leaves (filled once the op has run)."""

    __slots__ = ("out",)

    def __init__(self) -> None:
        self.out: Any = None

    def fill(self, out: Any, scope: SwapScope, allow_mutation: bool, detach: Any) -> None:
        def keep(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return scope.keep(detach(x), allow_mutation)
            return x

        self.out = _map_out(keep, out)

    def get(self) -> Any:
        return _map_out(lambda x: x.get() if isinstance(x, _Kept) else x, self.out)


def _map_out(fn: Callable[[Any], Any], out: Any) -> Any:
    if isinstance(out, (list, tuple)) and not hasattr(out, "_fields"):
        return type(out)(fn(x) for x in out)
    return fn(out)


class _SwapState:
    """Shared by the forward tap, the replay tap and the policy PyTorch calls: for each
    op, the forward's calls that PyTorch does not cache, in order (None: recomputed;
    a :class:`_SwapEntry`: kept by recomp)."""

    def __init__(self, allow_mutation: bool) -> None:
        self.allow_mutation = allow_mutation
        self.calls: dict[Any, list[_SwapEntry | None]] = {}
        self.waiting: tuple[Any, _SwapEntry, SwapScope] | None = None
        self.detach = _compat.version_sharing_detach() or (lambda t: t.detach())

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
            entry = _SwapEntry()
            self.calls.setdefault(op, []).append(entry)
            if hasattr(ctx, "op_output"):  # PyTorch asks after the op ran
                entry.fill(ctx.op_output, scope, self.allow_mutation, self.detach)
            else:  # before: the forward tap fills it
                self.waiting = (op, entry, scope)
        elif policy in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE):
            self.calls.setdefault(op, []).append(None)


class _SwapTap(_compat.TorchDispatchMode):
    """Below PyTorch's selective-checkpoint modes; see NOTE [ Swap scopes ]."""

    def __init__(self, state: _SwapState, replay: bool) -> None:
        super().__init__()
        self.state = state
        self.replay = replay
        self.counters: dict[Any, int] = {}

    def __enter__(self) -> Any:
        self.counters = {}
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
                waiting[1].fill(out, waiting[2], state.allow_mutation, state.detach)
            return out
        calls = state.calls.get(func)
        index = self.counters.get(func, 0)
        self.counters[func] = index + 1
        entry = calls[index] if calls is not None and index < len(calls) else None
        if entry is None:
            return func(*args, **kwargs)
        return entry.get()  # kept by the forward: not recomputed


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
    user = policy_fn_or_list
    compiled = is_compiling()
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
    return (
        _Stacked(_SwapTap(state, replay=False), forward),
        _Stacked(_SwapTap(state, replay=True), replay),
    )


def _under_compile(args: tuple[Any, ...]) -> bool:
    return any(
        isinstance(a, torch.Tensor) and type(a) is not torch.Tensor and not isinstance(a, nn.Parameter)
        for a in args
    )


class _Stacked:
    """Enter contexts in order, exit in reverse (re-enterable)."""

    def __init__(self, *contexts: Any) -> None:
        self.contexts = contexts
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            for context in self.contexts:
                stack.enter_context(context)
            self._stacks.append(stack.pop_all())

    def __exit__(self, *exc_info: Any) -> bool:
        return bool(self._stacks.pop().__exit__(*exc_info))


# --------------------------------------------------------------------------- checkpoint


class _Selective(CallPart):
    """``policy_fn=`` of a recomp checkpoint: selective checkpointing, before the user's
    ``context_fn`` (HyperParallel's order)."""

    stage = Stage.USER

    def __init__(self, policy_fn: Any, group_swap: bool, cpu_pool: Any) -> None:
        self.policy_fn = policy_fn
        self.group_swap = group_swap
        self.cpu_pool = cpu_pool

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        return create_selective_checkpoint_contexts(
            self.policy_fn, group_swap=self.group_swap, cpu_pool=self.cpu_pool
        )


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
        return functools.partial(create_selective_checkpoint_contexts, self.policy_fn)

    def part(self) -> CallPart | None:
        if self.policy_fn is None:
            return None  # group_swap without a policy: no selective checkpointing
        return _Selective(self.policy_fn, self.group_swap, self.cpu_pool)

    @contextlib.contextmanager
    def scope(self, name: str, context_fn: Any) -> Iterator[Callable[[Any], Any]]:
        """Around the framework's checkpoint: yields ``finish(outputs)``."""
        if self.policy_fn is None and not self.swap_inputs and context_fn is None:
            yield _identity
            return
        scope = SwapScope(name, group_swap=self.group_swap, cpu_pool=self.cpu_pool)

        def finish(out: Any) -> Any:
            scope.finish(out)
            return out

        with _scope_active(scope):
            if self.swap_inputs:
                with async_save_on_cpu(group_swap=self.group_swap, cpu_pool=self.cpu_pool):
                    yield finish
            else:
                yield finish


def _identity(out: Any) -> Any:
    return out
