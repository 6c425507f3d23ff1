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
Selective-checkpointing presets ]), its declarative recompute regions:
:class:`RecomputePolicy` (of its model adapters), :class:`ActivationCheckpointSelection`
(of its trainer config), :func:`apply_recompute_policy` and
:func:`apply_submodule_checkpointing` (``recomp._recompute_policy``: NOTE [ Declared
recompute regions ]), and HyperOffload's ``OffloadConfig``, ``OffloadSession`` and
``skip_offload`` (``hyper_parallel.auto_parallel.hyper_offload``; NOTE [ Offload
sessions ] in ``recomp.torch._offload_session``). Where HyperParallel defines a
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

from torch import nn

from .. import _recompute_policy
from .._hyperparallel import check_early_stop, noop_context_fn, without_noop, wrapper_options
from .._recompute_policy import ActivationCheckpointSelection, RecomputePolicy, check_swap_inputs
from . import _api
from ._api import checkpoint_exclude_wrapper
from ._hf import guard_model_cache
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
# its declarative regions (RecomputePolicy, ActivationCheckpointSelection and what
# applies them), and hyper_parallel.auto_parallel.hyper_offload's three.
__all__ = [
    "ActivationCheckpointSelection",
    "AsyncSaveOnCpu",
    "CheckpointPolicy",
    "OffloadConfig",
    "OffloadSession",
    "PinnedMemoryPool",
    "RecomputePolicy",
    "SwapManager",
    "apply_attention_swap",
    "apply_recompute_policy",
    "apply_submodule_checkpointing",
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


def apply_recompute_policy(
    model: nn.Module,
    policy: RecomputePolicy,
    selection: ActivationCheckpointSelection | None = None,
    *,
    swap_inputs: bool = False,
    **checkpoint_kwargs: Any,
) -> nn.Module:
    """Checkpoint the recompute regions ``policy`` declares, in the layers ``selection``
    chooses, and keep its excluded modules out of the replay: what HyperParallel does
    for ``activation_checkpoint.selection.source: model_adapter_safe_regions`` with the
    model adapter's ``RecomputePolicy``::

        policy = RecomputePolicy(region_patterns=("model.layers.*",),
                                 exclude_patterns=("model.layers.*.self_attn",))
        apply_recompute_policy(model, policy, ActivationCheckpointSelection(
            source="model_adapter_safe_regions", layer_count=16))

    Each outermost module ``region_patterns`` selects in a chosen layer becomes a
    :func:`checkpoint_wrapper` (HyperParallel's defaults, ``swap_inputs`` and the other
    options passed on), each outermost module ``exclude_patterns`` selects inside the
    regions a :func:`checkpoint_exclude_wrapper` (it runs once; the replay gets its
    output). Patterns are module paths with ``fnmatch`` wildcards, matched as
    :func:`recomp.torch.apply_activation_checkpointing` matches them (against the end of
    each module's dotted path). ``selection``: an :class:`ActivationCheckpointSelection`
    (or a mapping or object with its fields), ``layer_count`` or ``layer_indices``
    counting the model's layers from 0 (a Hugging Face model's decoder layers, several
    stacks one after the other); None takes the regions anywhere in the model.

    Checks everything before wrapping anything, and raises (the model unchanged) for: no
    region pattern; a pattern that matches no module of the model
    (:class:`recomp.SelectionError`, with the closest paths); region patterns selecting
    no module in the chosen layers; exclude patterns selecting nothing inside the
    regions; a region that is itself excluded; a bad selection or one past the model's
    layers (``ValueError``). Then turns Hugging Face's own checkpointing off if it is on,
    wraps in place (names, ``state_dict`` keys and ``isinstance`` unchanged;
    :func:`recomp.torch.unwrap` undoes it), pairs the regions of consecutive layers with
    :class:`SwapManager` when ``swap_inputs=True``, calls ``policy.on_applied(model)``
    and returns the model. ``layer_count=0`` checks the policy and wraps nothing."""
    api = "apply_recompute_policy"
    check_swap_inputs(swap_inputs, api)
    options = wrapper_options({**checkpoint_kwargs, "swap_inputs": swap_inputs}, early_stop=True)
    unselected: dict[str, Any] = {"exclude_fn": None, "offload_fn": None, "copy_output_fn": None}
    exclude_region = _api.exclusion_options(api, unselected, options)
    _recompute_policy.apply_recompute_policy(
        _api.MODEL_OPS,
        model,
        policy,
        selection,
        api=api,
        wrap_checkpoint=lambda m: _api.checkpoint_wrapper(m, **options),
        wrap_exclude=exclude_region,
        pair=SwapManager().set_forward_prefetch_layer if swap_inputs else None,
    )
    guard_model_cache(model)
    return model


def apply_submodule_checkpointing(
    layers: list[nn.Module],
    has_kv_sharing: bool,
    enable_compile: bool = False,
    swap_inputs: bool = False,
) -> int:
    """HyperParallel's ``apply_submodule_checkpointing``: in each of ``layers``, checkpoint
    the MLP (the first of ``mlp``, ``feed_forward``, ``ffn``), the attention (``self_attn``,
    ``attention``, ``attn``, ``linear_attn``; left alone when ``has_kv_sharing``: an
    attention writing a cache other layers read must not run again), the two norms
    (``input_layernorm``, ``attention_norm``, ``layer_norm1``, ``norm1``;
    ``post_attention_layernorm``, ``ffn_norm``, ``layer_norm2``, ``norm2``) and any
    ``mlp_moe_gen``, ``input_layernorm_moe_gen``, ``post_attention_layernorm_moe_gen``,
    each with :func:`checkpoint_wrapper` (``swap_inputs`` passed, except with
    ``enable_compile=True``). A part recomp already wraps is left as it is. Wraps in place
    (every part checked first) and returns how many parts it wrapped."""
    api = "apply_submodule_checkpointing"
    check_swap_inputs(swap_inputs, api)
    options = {} if enable_compile else {"swap_inputs": swap_inputs}
    return _recompute_policy.apply_submodule_checkpointing(
        _api.MODEL_OPS,
        layers,
        has_kv_sharing,
        api=api,
        wrap_checkpoint=lambda m: checkpoint_wrapper(m, **options),
    )
