"""Per-op policies on PyTorch: HyperParallel's ``create_selective_checkpoint_contexts`` over
PyTorch's selective checkpointing, with ``MUST_SWAP`` kept by recomp (a dispatch mode
below PyTorch's, :class:`_SwapTap`, sees the op's output in the forward and hands it back
in the replay) and moved to the host by the checkpoint's swap scope (NOTE [ Swap scopes ]
in ``scope``); the native contexts for compiled code; ``ignore_sac_ops`` and
``noop_context_fn``. The matching of a replay's op calls with the forward's is
framework-free (``recomp._op_policy``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from ..._engine import ComposedContext
from ..._op_policy import FreshMode, KeptOutput, OpCalls
from ..._policy import (
    CheckpointPolicy,
    SwapPolicyError,
    as_policy,
    is_offload_member,
    swap_or_save,
)
from .. import _compat
from .pool import _check_swap_options
from .scope import SwapScope, _Kept, _read, current_scope, is_compiling

_TorchPolicy = torch.utils.checkpoint.CheckpointPolicy


def noop_context_fn() -> Callable[[], tuple[Any, Any]]:
    """PyTorch's no-op ``context_fn`` (the function itself), for code that needs an
    explicit one."""
    return torch.utils.checkpoint.noop_context_fn


def ignore_sac_ops(ignore_ops: list[Any]) -> None:
    """Add operators that selective checkpointing passes through without a policy
    (PyTorch's ``SAC_IGNORED_OPS``, which this changes for PyTorch's own selective
    checkpointing too). ``None`` entries are skipped."""
    for op in ignore_ops:
        if op is not None:
            torch.utils.checkpoint.SAC_IGNORED_OPS.add(op)


class _SwapState:
    """Shared by the forward tap, the replay tap and the policy PyTorch calls: for each
    op, the forward's calls that PyTorch does not cache, in order (None: recomputed;
    a :class:`KeptOutput`: kept by recomp). Each kept output is an entry of the
    checkpoint call's log of kept op outputs (``recomp._op_policy``): with early stop,
    one kept after the forward's last saved tensor is dropped when the forward ends
    (rule 8): no replay reaches that op, so its output is neither moved nor brought
    back."""

    def __init__(self, allow_mutation: bool) -> None:
        self.allow_mutation = allow_mutation
        self.calls = OpCalls()
        self.waiting: tuple[Any, KeptOutput, SwapScope] | None = None
        self.detach = _compat.version_sharing_detach() or (lambda t: t.detach())

    def __enter__(self) -> None:
        self.calls.forward_started()

    def __exit__(self, *exc_info: Any) -> None:
        pass

    def fill(self, entry: KeptOutput, out: Any, scope: SwapScope) -> None:
        detach, allow_mutation = self.detach, self.allow_mutation

        def keep(x: Any) -> Any:
            return scope.keep(detach(x), allow_mutation) if isinstance(x, torch.Tensor) else x

        self.calls.fill(entry, out, keep, _drop)

    def chose(self, ctx: Any, op: Any, policy: CheckpointPolicy, asked: Any = None) -> None:
        """``asked``: what the policy function returned, where that is not ``policy``."""
        if getattr(ctx, "is_recompute", False):
            return
        if policy is CheckpointPolicy.MUST_SWAP:
            scope = current_scope()
            if scope is None:
                name = getattr(asked, "name", policy.name)
                raise SwapPolicyError(
                    f"The policy returned {name} for {op} but no swap group is active: "
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
        value = user(ctx, op, *args, **kwargs)
        chosen = as_policy(value, "policy_fn")
        if chosen is CheckpointPolicy.MUST_SWAP:
            if compiled or _under_compile(args):
                if is_offload_member(value):  # PyTorch's own: its compiler's to place
                    return value
                raise SwapPolicyError(
                    f"CheckpointPolicy.MUST_SWAP (for {op}) is not supported under "
                    f"torch.compile: return MUST_SAVE for it there (or PyTorch's "
                    f"MUST_CPU_OFFLOAD), or keep the layer out of the compiled region."
                )
            if current_scope() is None:  # the same in the forward and the replay
                saved = swap_or_save(value, op, _NO_SCOPE)
                if saved is not None:
                    state.chose(ctx, op, saved)
                    return _TorchPolicy.PREFER_SAVE
            state.chose(ctx, op, chosen, value)
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


_NO_SCOPE = (
    "no recomp checkpoint is around these contexts (torch.utils.checkpoint's checkpoint "
    "has no swap group)"
)

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
