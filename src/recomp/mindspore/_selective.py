"""Per-op checkpoint policies on MindSpore PyNative (HyperParallel's selective checkpointing
and ``MUST_SWAP`` of an op's output).

NOTE [ Per-op policies on MindSpore ]

``mindspore.MsDispatchMode`` (experimental in MindSpore 2.10) calls ``__ms_dispatch__``
for every op run in PyNative, with the op (``func.name``: ``MatMul``, ``BiasAdd``,
``Softmax``) and its arguments, below autograd: an op whose output a mode hands back
without running it is still recorded by autograd and saves what it saves, so the
replay of a ``mindspore.recompute`` saves the same tensors in the same order (its
saved tensors are matched by position) and gradients are exact.

So a recomp checkpoint with ``policy_fn`` enters, through ``context_fn``, a recording
mode around its forward and a replaying mode around each replay:

* forward: for each op (not an ignored op, see :func:`ignore_sac_ops`), the policy is
  asked before the op runs (``policy_fn(ctx, op, *args, **kwargs)``, ``ctx.is_recompute``
  False). ``MUST_SAVE``/``PREFER_SAVE``: the output is kept (a ``stop_gradient`` alias:
  no copy); ``MUST_SWAP``: kept by the checkpoint's swap scope, which moves it to the
  host when the layer returns and brings it back when the replay reads it (its layer's
  pair, or the group before it, is brought back ahead: NOTE [ Swap on MindSpore ]);
  ``MUST_RECOMPUTE``/``PREFER_RECOMPUTE``: nothing kept.
* replay: the n-th call of an op is matched with the n-th call of that op in the forward
  (``recomp._op_policy``); a kept one is handed back instead of running the op, after a
  check that its inputs have the forward's shapes and dtypes. The policy is not asked
  again: the replay follows the forward's decisions.

A kept output is an entry of the checkpoint call's log of kept op outputs, as on PyTorch
(``recomp._op_policy``). MindSpore's checkpoint gives recomp no save counter, so the
invocation never finds an op run after the last saved tensor (rule 8 of NOTE [ How an
excluded region is kept out of the replay ]): every kept output stays until the graph is
freed.

Ops the replay never runs are hidden from both modes, so that the two see the same
ops: those of excluded regions (the backend's ``region_context``; recomp's dropout
cells draw their mask in one) and recomp's own (keeping, reading, moving). Mutations
of a kept output between its op and the replay are not detected (MindSpore's version
counters are read only after the queue is drained).
"""

from __future__ import annotations

import functools
from typing import Any

import mindspore

from .._op_policy import FreshMode, KeptOutput, OpCalls, SelectiveCheckpointContext
from .._policy import CheckpointPolicy, SwapPolicyError, as_policy
from .._pytree import flatten
from ..errors import RecompError
from ._backend import OPS_HIDDEN, ops_hidden
from ._swap import _Kept, check_swap_options, current_scope, refuse

_MsDispatchMode: Any = getattr(mindspore, "MsDispatchMode", None)

#: Op names the policies pass through without asking (recomp's and MindSpore's own
#: ``stop_gradient`` aliases, which the replay issues where the forward does not).
SAC_IGNORED_OPS: set[str] = {"StopGradient"}

_KEPT = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, CheckpointPolicy.MUST_SWAP)
_FORWARD = SelectiveCheckpointContext(is_recompute=False)


def ignore_sac_ops(ignore_ops: list[Any]) -> None:
    """Add op names (``"Cast"``, or an op with a ``name``) that per-op policies pass
    through without asking. ``None`` entries are skipped."""
    for op in ignore_ops:
        if op is not None:
            SAC_IGNORED_OPS.add(op if isinstance(op, str) else op.name)


def _layouts(args: Any) -> tuple[Any, ...]:
    leaves, _ = flatten(args)
    return tuple((tuple(x.shape), x.dtype) for x in leaves if isinstance(x, mindspore.Tensor))


def _alias(x: Any) -> Any:
    return mindspore.ops.stop_gradient(x) if isinstance(x, mindspore.Tensor) else x


def _policy_of(policy_fn_or_list: Any) -> Any:
    if isinstance(policy_fn_or_list, (list, tuple, set, frozenset)):
        saved = {op if isinstance(op, str) else getattr(op, "name", op) for op in policy_fn_or_list}

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if op.name in saved:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return policy
    if not callable(policy_fn_or_list):
        raise TypeError(
            "policy_fn_or_list must be either a function or a list of op names, got "
            f"{policy_fn_or_list!r}."
        )
    return policy_fn_or_list


def _mode_type() -> Any:
    if _MsDispatchMode is None:
        raise refuse(
            "a per-op checkpoint policy (policy_fn)",
            "this MindSpore has no mindspore.MsDispatchMode, through which recomp sees each "
            "op of a checkpoint's forward and replay",
            "Use MindSpore 2.10 or later, or keep an op's output with "
            "checkpoint_exclude_wrapper around it.",
        )
    return _MsDispatchMode


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Any,
    allow_cache_entry_mutation: bool = False,
    group_swap: bool = False,
    cpu_pool: Any = None,
) -> tuple[Any, Any]:
    """HyperParallel's selective checkpointing on MindSpore: the forward context and the
    replay context for a checkpoint's ``context_fn`` (NOTE [ Per-op policies on
    MindSpore ]). ``policy_fn_or_list``: ``policy_fn(ctx, op, *args, **kwargs)`` (``op``
    is MindSpore's op, ``op.name`` its name) returning a :class:`CheckpointPolicy` or a
    bool, or a list of op names to save. ``MUST_SWAP`` needs a recomp checkpoint (its
    swap scope) around it. ``group_swap``/``cpu_pool`` are refused on MindSpore."""
    check_swap_options("create_selective_checkpoint_contexts", group_swap, cpu_pool)
    if not isinstance(allow_cache_entry_mutation, bool):
        raise TypeError(
            f"allow_cache_entry_mutation must be a bool, got {allow_cache_entry_mutation!r}."
        )
    policy = _policy_of(policy_fn_or_list)
    recording, replaying = _mode_classes()
    calls = OpCalls()
    return (
        FreshMode(functools.partial(recording, policy, calls)),
        FreshMode(functools.partial(replaying, calls), only_if=calls),
    )


@functools.cache
def _mode_classes() -> tuple[type, type]:
    """The two dispatch modes, made once: a class made per call would keep what the
    forward kept until the garbage collector frees the class (a class is in a
    reference cycle of its own), not when the checkpoint's graph is freed."""
    mode = _mode_type()

    class Recording(mode):  # type: ignore[misc,valid-type]
        def __init__(self, policy: Any, calls: OpCalls) -> None:
            self.policy = policy
            self.calls = calls
            calls.forward_started()  # made as the forward's context is entered

        def __ms_dispatch__(self, func: Any, args: Any, kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if OPS_HIDDEN.get() or func.name in SAC_IGNORED_OPS:
                return func(*args, **kwargs)
            with ops_hidden():
                chosen = as_policy(self.policy(_FORWARD, func, *args, **kwargs), "policy_fn")
                inputs = _layouts((args, kwargs)) if chosen in _KEPT else None
            out = func(*args, **kwargs)
            if inputs is None:
                self.calls.add(func.name, None)
                return out
            with ops_hidden():
                entry = KeptOutput(inputs)
                keep = _swap_keeper(func.name) if chosen is CheckpointPolicy.MUST_SWAP else _alias
                self.calls.fill(entry, out, keep)
            self.calls.add(func.name, entry)
            return out

    class Replaying(mode):  # type: ignore[misc,valid-type]
        def __init__(self, calls: OpCalls) -> None:
            self.cursor = calls.cursor()

        def __ms_dispatch__(self, func: Any, args: Any, kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if OPS_HIDDEN.get() or func.name in SAC_IGNORED_OPS:
                return func(*args, **kwargs)
            entry = self.cursor.next(func.name)
            if entry is None:
                return func(*args, **kwargs)
            with ops_hidden():
                if _layouts((args, kwargs)) != entry.inputs:
                    raise RecompError(
                        f"The replay of a checkpoint with a per-op policy called {func.name} "
                        f"on inputs of other shapes or dtypes than the forward's call it is "
                        f"matched with ({entry.inputs} in the forward, "
                        f"{_layouts((args, kwargs))} now): the replay runs other ops than "
                        f"the forward. Add the op names that differ to ignore_sac_ops, or "
                        f"keep the code that differs in a checkpoint_exclude_wrapper."
                    )
                return entry.get(_read)

    return Recording, Replaying


def _swap_keeper(op_name: str) -> Any:
    scope = current_scope()
    if scope is None:
        raise SwapPolicyError(
            f"The policy returned MUST_SWAP for {op_name} but no swap group is active: use "
            f"recomp.mindspore.checkpoint(..., policy_fn=...) or checkpoint_wrapper around it."
        )

    def keep(x: Any) -> Any:
        return scope.keep(_alias(x)) if isinstance(x, mindspore.Tensor) else x

    return keep


def _read(x: Any) -> Any:
    return x.get() if isinstance(x, _Kept) else x
