"""HyperParallel's distributed activation-memory helpers on recomp (PyTorch): attention
swap (``hyper_parallel.distributed.attention_swap``) and the selective-checkpointing
presets of ``hyper_parallel.distributed.activation_checkpoint``, exported by
``recomp.torch.hyperparallel`` under HyperParallel's names.

NOTE [ Attention swap ]
``apply_attention_swap(model, "attention")`` finds every module registered as a
``self_attn`` child (a module shared by several parents counted once; the search does
not go inside an attention) and makes each call of it a swap group
(:func:`swap_wrapper`, in place, ``group_swap=True``): what autograd saves in it and
:func:`attention_swap_policy` chooses goes to host memory when the attention returns.
Consecutive attentions are paired with :class:`SwapManager`, so that in backward the
first read of one attention's tensors brings the previous attention's back ahead of
time; the last attention ends the chain and keeps its tensors (its backward runs
first). If wrapping fails part way, every attention is given back as it was (no hooks,
no pairs) before the error propagates.

What recomp serves beyond HyperParallel is said by :func:`validate_attention_swap`'s
errors: inside a checkpointed layer an attention's saved tensors are recomputed, not
kept, so there is nothing to swap; excluding the attention from the replay and
offloading what it keeps (``exclude_fn=`` with ``offload_fn=``) is recomp's form of
that combination.

NOTE [ Selective-checkpointing presets ]
:func:`make_selective_checkpoint_context_fn` gives a ``context_fn`` whose every call
makes fresh contexts with a policy of its own: within one checkpoint region the
matmuls are saved and recomputed in turn (the first saved, the second recomputed, ...,
counted separately in the forward and in the replay so that both decide alike),
compute-heavy ops (attention kernels, batched and scaled matmuls, ``max``) and
communication ops are saved, ``topk`` is always recomputed (models change its output in
place) and every other op is recomputed. :func:`compile_selective_checkpoint_policy` is
the stateless form for compiled code: every matmul saved.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ._swap import (
    CheckpointPolicy,
    SwapManager,
    create_selective_checkpoint_contexts,
    ignore_sac_ops,
    swap_wrapper,
    unwrap_swaps,
)

__all__ = [
    "apply_attention_swap",
    "attention_swap_policy",
    "compile_selective_checkpoint_policy",
    "ensure_fsdp_ops_sac_ignored",
    "ensure_profiler_ops_sac_ignored",
    "make_selective_checkpoint_context_fn",
    "validate_attention_swap",
]

#: What a tensor must hold to be worth a copy to the host (HyperParallel's threshold).
MIN_SWAP_BYTES = 1 << 20

_MODES = ("none", "attention")


def attention_swap_policy(tensor: torch.Tensor) -> CheckpointPolicy:
    """``MUST_SWAP`` for a saved tensor that needs a gradient, has two or more dimensions,
    is the whole of its storage (a view of a larger buffer would copy the buffer) and
    holds at least 1 MiB; ``MUST_SAVE`` for every other."""
    if not tensor.requires_grad or tensor.dim() < 2:
        return CheckpointPolicy.MUST_SAVE
    size = tensor.numel() * tensor.element_size()
    if size < MIN_SWAP_BYTES or tensor.untyped_storage().nbytes() != size:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_SWAP


def validate_attention_swap(
    activation_swap: str,
    *,
    activation_checkpoint: str | None = None,
    enable_compile: bool = False,
    pp_size: int = 1,
) -> None:
    """Refuse (``ValueError``) an ``activation_swap`` mode other than ``"none"`` and
    ``"attention"``, and attention swap together with ``torch.compile``, activation
    checkpointing (``activation_checkpoint`` other than None or ``"off"``) or pipeline
    parallelism (``pp_size`` above 1). Each message says what to do instead."""
    if activation_swap not in _MODES:
        raise ValueError(
            f"activation_swap must be one of {_MODES}, got {activation_swap!r}."
        )
    if activation_swap == "none":
        return
    if enable_compile:
        raise ValueError(
            "activation_swap='attention' cannot run under torch.compile: swapping runs in "
            "eager mode only. Turn compilation off, or keep what attention saves on the "
            "device (activation_swap='none')."
        )
    if activation_checkpoint not in (None, "off"):
        raise ValueError(
            f"activation_swap='attention' with activation_checkpoint="
            f"{activation_checkpoint!r}: inside a checkpointed layer the attention's saved "
            "tensors are recomputed, not kept, so there is nothing to swap. To keep the "
            "attention out of the replay and its tensors in host memory, use "
            "recomp.torch.apply_activation_checkpointing(model, exclude_fn=<attention "
            "class>, offload_fn=<attention class>) instead."
        )
    if pp_size != 1:
        raise ValueError(
            f"activation_swap='attention' with pp_size={pp_size}: attention swap pairs "
            "the attentions of one model in order and knows nothing of a pipeline "
            "schedule's micro-batches. Use pp_size=1 or activation_swap='none'."
        )


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """Every module registered as a ``self_attn`` child, in registration order, once."""
    found: dict[int, nn.Module] = {}
    seen: set[int] = set()

    def visit(parent: nn.Module) -> None:
        if id(parent) in seen:
            return
        seen.add(id(parent))
        for name, child in parent.named_children():
            if name == "self_attn":
                found.setdefault(id(child), child)
            else:
                visit(child)

    visit(model)
    return list(found.values())


def apply_attention_swap(model: nn.Module, activation_swap: str) -> nn.Module:
    """Swap what every attention of ``model`` saves to host memory, its prefetch chained
    in model order (NOTE [ Attention swap ]). ``activation_swap`` must be
    ``"attention"``. Wraps in place (names, classes and ``state_dict`` keys unchanged)
    and returns ``model``; ``recomp.torch.unwrap`` (or ``unwrap_swaps``) undoes it."""
    if activation_swap != "attention":
        raise ValueError(
            f"apply_attention_swap takes activation_swap='attention', got "
            f"{activation_swap!r} ('none' means: do not call it)."
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_attention_swap needs an nn.Module, got {type(model).__name__}.")
    attentions = _attention_modules(model)
    if not attentions:
        raise ValueError(
            f"apply_attention_swap found no module registered as self_attn in "
            f"{type(model).__name__}: it swaps the attention children named self_attn "
            f"(Hugging Face's layers). For other models, use swap_wrapper on the modules "
            f"to swap."
        )
    manager = SwapManager()
    try:
        for attention in attentions:
            swap_wrapper(attention, policy_fn=attention_swap_policy, group_swap=True)
        for first, second in itertools.pairwise(attentions):
            manager.set_forward_prefetch_layer(first, second)
    except BaseException:
        _undo(attentions, manager)
        raise
    return model


def _undo(attentions: Iterable[nn.Module], manager: Any) -> None:
    for attention in attentions:
        manager.unregister_forward_prefetch_layer(attention)
        unwrap_swaps(attention)


# --------------------------------------------------------------------------- presets


def _ops(*names: str) -> frozenset[Any]:
    """The default overloads of the named ops this PyTorch has (``aten.mm``, ...)."""
    found = []
    for name in names:
        namespace, _, op = name.partition(".")
        packet = getattr(getattr(torch.ops, namespace, None), op, None)
        overload = getattr(packet, "default", None) if packet is not None else None
        if overload is not None:
            found.append(overload)
    return frozenset(found)


_MATMULS = _ops("aten.matmul", "aten.mm", "aten.linear", "aten._grouped_mm", "aten._scaled_grouped_mm")
_ALWAYS_RECOMPUTED = _ops("aten.topk")
_SAVED = (
    _ops(
        "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_fused_attention_overrideable",
        "aten.scaled_dot_product_attention", "aten._flex_attention", "aten.max",
        # communication
        "aten.all_to_all_single", "aten.reduce_scatter_tensor",
        "_c10d_functional.all_to_all_single", "_c10d_functional.reduce_scatter_tensor",
        "_c10d_functional.all_reduce", "_c10d_functional.all_gather_into_tensor",
        "c10d.allreduce_",
    )
    - _ALWAYS_RECOMPUTED
)


def compile_selective_checkpoint_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """The stateless preset for compiled code: ``topk`` recomputed, matmuls, compute-heavy
    and communication ops saved, every other op recomputed
    (NOTE [ Selective-checkpointing presets ])."""
    if func in _ALWAYS_RECOMPUTED:
        return CheckpointPolicy.MUST_RECOMPUTE
    if func in _MATMULS or func in _SAVED:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


def _alternating_policy() -> Callable[..., Any]:
    """One region's policy: the matmuls of each phase saved and recomputed in turn."""
    matmuls = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func in _MATMULS:
            phase = bool(getattr(ctx, "is_recompute", False))
            matmuls[phase] += 1
            return CheckpointPolicy.MUST_SAVE if matmuls[phase] % 2 else CheckpointPolicy.MUST_RECOMPUTE
        return compile_selective_checkpoint_policy(ctx, func)

    return policy


def make_selective_checkpoint_context_fn() -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``checkpoint`` / ``checkpoint_wrapper``: each call makes the
    contexts of one checkpoint region with a fresh alternating-matmul policy
    (NOTE [ Selective-checkpointing presets ]). Also keeps the profiler's and FSDP's
    bookkeeping ops out of the matching of a replay's ops with the forward's."""
    ensure_profiler_ops_sac_ignored()
    ensure_fsdp_ops_sac_ignored()

    def context_fn() -> tuple[Any, Any]:
        return create_selective_checkpoint_contexts(_alternating_policy())  # type: ignore[no-any-return]

    return context_fn


def ensure_profiler_ops_sac_ignored() -> None:
    """Selective checkpointing passes the profiler's range ops (``record_function``'s
    enter and exit, every overload) through without a policy: FSDP's hooks run them a
    different number of times in the forward and in the replay, and they carry no
    activation."""
    packets = getattr(torch.ops, "profiler", None)
    if packets is None:
        return
    ops: list[Any] = []
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(packets, name, None)
        if packet is not None:
            ops.extend(getattr(packet, overload) for overload in packet.overloads())
    ignore_sac_ops(ops)


def ensure_fsdp_ops_sac_ignored() -> None:
    """Selective checkpointing passes FSDP's parameter bookkeeping (its all-gather copies,
    splits and ``copy_``, the all-gather itself, ``empty``, ``empty_like``, ``view``)
    through without a policy: FSDP may unshard parameters before a region in the
    forward and inside it in the replay."""
    ops = _ops(
        "fsdp.all_gather_copy_in", "fsdp.split_with_sizes_copy", "fsdp.chunk_cat",
        "fsdp.copy_", "c10d._allgather_base_", "aten.empty_like", "aten.view",
    )
    ignore_sac_ops([*ops, getattr(torch.ops.aten.empty, "memory_format", None)])
