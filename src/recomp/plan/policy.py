"""The policy of the planner's ``selective`` options: inside a checkpointed layer, keep
the outputs of the expensive ops (matrix products, attention, convolutions, collectives)
and recompute the cheap ones (norms, activations, residual adds, dropout: element-wise
work whose replay costs little time and no FLOPs worth counting).

It is PyTorch's selective checkpointing (``create_selective_checkpoint_contexts`` with a
list of ops to save), handed to ``recomp.torch.checkpoint_wrapper`` as ``context_fn``:
recomp composes it with its own contexts, and its excluded regions stay invisible to it,
so ``selective+exclude:attn`` keeps attention whole and the expensive outputs of the rest.
Under ``torch.compile`` the same list marks the saved nodes for the partitioner.

Also here: the policy of the ``offload`` option (which saved tensors go to the host).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint as tuc

from ..torch import _compat
from .planfile import OFFLOAD_MIN_BYTES

EXPENSIVE_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_mm",
    "aten::convolution",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "_c10d_functional::all_reduce",
    "_c10d_functional::all_gather_into_tensor",
    "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::all_to_all_single",
)


@functools.cache
def expensive_ops() -> tuple[Any, ...]:
    """The op overloads whose outputs a selective option keeps (those this PyTorch has)."""
    return _compat.ops_named(EXPENSIVE_OPS)


def selective_context_fn() -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` for a checkpoint that keeps the outputs of ``expensive_ops()``.

    A ``functools.partial``, as ``torch.compile`` requires of a checkpoint's
    ``context_fn``."""
    return functools.partial(tuc.create_selective_checkpoint_contexts, list(expensive_ops()))


def _partitioner_decides(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> tuc.CheckpointPolicy:
    return tuc.CheckpointPolicy.PREFER_SAVE


def partitioner_context_fn() -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` for the layers of a compiled plan that keep regions whole: every op
    outside the regions is ``PREFER_SAVE``, which PyTorch's partitioner treats as an
    untagged op (it saves or recomputes it as its budget decides), while recomp marks the
    regions' ops ``MUST_SAVE``. The checkpoint is there only to carry that mark; run
    eagerly, such a layer saves what it would save without a checkpoint."""
    return functools.partial(tuc.create_selective_checkpoint_contexts, _partitioner_decides)


def offload_policy(tensor: Any) -> Any:
    """``swap_wrapper``'s ``policy_fn`` for the planner's ``offload`` option: a saved
    tensor goes to the host when its storage holds at least ``OFFLOAD_MIN_BYTES`` (the
    offloader's and offload sessions' threshold), else it stays on the device."""
    from recomp.torch import CheckpointPolicy

    if tensor.untyped_storage().nbytes() >= OFFLOAD_MIN_BYTES:
        return CheckpointPolicy.MUST_SWAP
    return CheckpointPolicy.MUST_SAVE
