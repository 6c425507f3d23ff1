"""HyperParallel's activation-memory API, under its own names, on recomp (PyTorch).

Code written against ``hyper_parallel.core.activation_memory.api`` (and its swap
module's ``SwapManager``, ``PinnedMemoryPool``, ``AsyncSaveOnCpu``) runs with one import
changed::

    # from hyper_parallel.core.activation_memory.api import checkpoint_wrapper, ...
    from recomp.torch.hyperparallel import (
        CheckpointPolicy, SwapManager, checkpoint_exclude_wrapper, checkpoint_wrapper,
        swap_wrapper,
    )

Every name of that module's ``__all__`` is here, the public helpers of
``hyper_parallel.distributed``'s ``attention_swap`` and ``activation_checkpoint``
modules (``recomp.torch._hp_distributed``: NOTE [ Attention swap ], NOTE [
Selective-checkpointing presets ]), and HyperOffload's ``OffloadConfig``,
``OffloadSession`` and ``skip_offload`` (``hyper_parallel.auto_parallel.hyper_offload``;
NOTE [ Offload sessions ] in ``recomp.torch._offload_session``). Where HyperParallel defines a
behaviour, these names follow it: :func:`checkpoint` and :func:`checkpoint_wrapper`
pass ``early_stop=True`` unless told otherwise and refuse a non-bool one
(``ValueError``), run non-reentrant whatever ``use_reentrant`` says (in eager mode),
and under ``torch.compile`` refuse what HyperParallel refuses there; a ``policy_fn``
is per op for a checkpoint and per tensor for :func:`swap`, :func:`swap_wrapper` and
:func:`async_save_on_cpu`; :func:`recompute_session_ctx` refuses a ``None`` session.
The rest are recomp's own functions (the same objects as in ``recomp.torch``), which
take more options than HyperParallel's (``checkpoint_exclude_wrapper``'s
``copy_output``, ``name``, ``offload``). What differs, name by name:
docs/guides/hyperparallel.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._hyperparallel import check_early_stop, noop_context_fn, without_noop, wrapper_options
from . import _api
from ._api import checkpoint_exclude_wrapper
from ._hp_distributed import (
    apply_attention_swap,
    attention_swap_policy,
    compile_selective_checkpoint_policy,
    ensure_fsdp_ops_sac_ignored,
    ensure_profiler_ops_sac_ignored,
    make_selective_checkpoint_context_fn,
    validate_attention_swap,
)
from ._kept import (
    clear_recompute_session,
    recompute_handle,
    recompute_handle_collector_ctx,
    recompute_session_ctx,
)
from ._offload_session import OffloadConfig, OffloadSession, skip_offload
from ._swap import (
    AsyncSaveOnCpu,
    CheckpointPolicy,
    PinnedMemoryPool,
    SwapManager,
    async_save_on_cpu,
    create_native_selective_checkpoint_contexts,
    create_selective_checkpoint_contexts,
    get_class_activation_wrapper,
    ignore_sac_ops,
    is_compiling,
    swap,
    swap_tensor_wrapper,
    swap_wrapper,
)

# The 18 names of hyper_parallel.core.activation_memory.api.__all__, SwapManager,
# PinnedMemoryPool and AsyncSaveOnCpu of its swap module, the public names of
# hyper_parallel.distributed's attention_swap and activation_checkpoint modules, and
# hyper_parallel.auto_parallel.hyper_offload's three.
__all__ = [
    "AsyncSaveOnCpu",
    "CheckpointPolicy",
    "OffloadConfig",
    "OffloadSession",
    "PinnedMemoryPool",
    "SwapManager",
    "apply_attention_swap",
    "async_save_on_cpu",
    "attention_swap_policy",
    "checkpoint",
    "checkpoint_exclude_wrapper",
    "checkpoint_wrapper",
    "clear_recompute_session",
    "compile_selective_checkpoint_policy",
    "create_native_selective_checkpoint_contexts",
    "create_selective_checkpoint_contexts",
    "ensure_fsdp_ops_sac_ignored",
    "ensure_profiler_ops_sac_ignored",
    "get_class_activation_wrapper",
    "ignore_sac_ops",
    "is_compiling",
    "make_selective_checkpoint_context_fn",
    "noop_context_fn",
    "recompute_handle",
    "recompute_handle_collector_ctx",
    "recompute_session_ctx",
    "skip_offload",
    "swap",
    "swap_tensor_wrapper",
    "swap_wrapper",
    "validate_attention_swap",
]


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    swap_inputs: bool = False,
    policy_fn: Callable[..., Any] | list[Any] | None = None,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    group_swap: bool = False,
    cpu_pool: PinnedMemoryPool | None = None,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """HyperParallel's ``checkpoint``: :func:`recomp.torch.checkpoint` with HyperParallel's
    signature and defaults.

    ``policy_fn(ctx, op, *args, **kwargs)`` (or a list of ops to save) chooses per op, a
    ``CheckpointPolicy.MUST_SWAP`` output kept on the host until backward and never
    recomputed; ``swap_inputs=True`` moves the tensors the checkpoint saves (its inputs)
    to the host until its replay; ``group_swap`` packs a layer's small tensors into one
    copy; ``cpu_pool`` (a :class:`PinnedMemoryPool`) gives the host memory.
    ``group_swap`` without ``policy_fn`` or ``swap_inputs`` adds nothing. ``context_fn``
    is entered inside recomp's and the policy's contexts, in the forward and in the
    replay.

    As HyperParallel's: ``early_stop`` (default True, passed to PyTorch's checkpoint on
    every call) must be a bool, else ``ValueError``; ``use_reentrant`` is not followed
    in eager mode (the checkpoint is non-reentrant); under ``torch.compile``,
    ``swap_inputs``, ``group_swap``, ``cpu_pool``, a ``context_fn`` of your own and
    ``use_reentrant=True`` raise ``ValueError`` (``policy_fn`` with the four save and
    recompute policies is PyTorch's own selective checkpointing there).
    ``recomp.torch.checkpoint`` differs in these: it refuses ``use_reentrant=True``
    and leaves ``early_stop`` to PyTorch's default. Other keyword arguments go to
    :func:`recomp.torch.checkpoint` (``preserve_rng_state``, ``determinism_check``,
    ``debug``, ``exclude_collectives``) and the rest to ``function``."""
    check_early_stop(early_stop)
    use_reentrant = kwargs.pop("use_reentrant", False)
    context_fn = without_noop(context_fn)
    if is_compiling():
        refused = [
            name
            for name, given in (
                ("swap_inputs", swap_inputs),
                ("group_swap", group_swap),
                ("cpu_pool", cpu_pool is not None),
                ("custom context_fn", context_fn is not None),
                ("use_reentrant=True", bool(use_reentrant)),
            )
            if given
        ]
        if refused:
            raise ValueError(
                f"recomp.torch.hyperparallel.checkpoint: compile mode does not support: "
                f"{', '.join(refused)}. They run in eager mode only; under torch.compile "
                f"pass policy_fn with save and recompute policies, or keep the layer out "
                f"of the compiled region."
            )
    return _api.checkpoint(
        function,
        *args,
        context_fn=context_fn,
        policy_fn=policy_fn,
        swap_inputs=swap_inputs,
        group_swap=group_swap,
        cpu_pool=cpu_pool,
        early_stop=early_stop,
        **kwargs,
    )


def checkpoint_wrapper(module: Any, **checkpoint_kwargs: Any) -> Any:
    """HyperParallel's ``checkpoint_wrapper``: every call of ``module`` is a
    :func:`checkpoint` with these options (``policy_fn``, ``swap_inputs``,
    ``group_swap``, ``cpu_pool``, ``context_fn``, ``early_stop``, and
    :func:`recomp.torch.checkpoint`'s). As there, ``early_stop`` defaults to True and
    must be a bool, and ``use_reentrant`` is not followed. The module is wrapped in
    place, as by :func:`recomp.torch.checkpoint_wrapper` (names, ``state_dict`` and
    ``isinstance`` unchanged; ``recomp.torch.unwrap`` undoes it)."""
    options = wrapper_options(checkpoint_kwargs, early_stop=True)
    return _api.checkpoint_wrapper(module, **options)
