"""Swap (activation offload) under HyperParallel's names, on recomp's one offload mechanism
(``recomp.torch._offload``). The index of the package, which re-exports every name of its
modules, from the bottom up:

* ``pool``        ``cpu_pool``: the pinned host pool; the check of ``group_swap``/``cpu_pool``;
* ``manager``     ``SwapManager``: group names, layer pairs, what the offloader brings back ahead;
* ``buckets``     ``group_swap``: small tensors packed into one copy each way;
* ``scope``       swap scopes, one layer's chosen tensors moved when the layer returns
                  (NOTE [ Swap scopes ]);
* ``hooks``       per tensor: ``async_save_on_cpu``, ``swap``, ``swap_wrapper``,
                  ``swap_tensor_wrapper``;
* ``selective``   per op: ``create_selective_checkpoint_contexts`` and ``MUST_SWAP``;
* ``checkpoint``  the swap side of a recomp checkpoint call (``CheckpointSwap``).
"""

from ..._policy import CheckpointPolicy, SwapPolicyError, as_policy, tensor_swapped
from .buckets import BUCKET_BYTES, _Bucket, _bucket, _bucketable, _InBucket
from .checkpoint import CheckpointSwap, _identity, get_class_activation_wrapper
from .hooks import (
    _WRAPPED,
    AsyncSaveOnCpu,
    _stays_on_device,
    _swapped_call,
    _wrapped_call,
    async_save_on_cpu,
    swap,
    swap_tensor_wrapper,
    swap_wrapper,
    unwrap_swaps,
)
from .manager import SwapManager, _tensors_in
from .pool import PinnedMemoryPool, _check_swap_options
from .scope import _SCOPES, SwapScope, _Kept, _put_in_place, _read, current_scope, is_compiling
from .selective import (
    _POLICY_SEES_OUTPUT,
    _drop,
    _selective_contexts,
    _SwapState,
    _SwapTap,
    _TorchPolicy,
    _under_compile,
    create_native_selective_checkpoint_contexts,
    create_selective_checkpoint_contexts,
    ignore_sac_ops,
    noop_context_fn,
)

__all__ = [
    "BUCKET_BYTES",
    "_POLICY_SEES_OUTPUT",
    "_SCOPES",
    "_WRAPPED",
    "AsyncSaveOnCpu",
    "CheckpointPolicy",
    "CheckpointSwap",
    "PinnedMemoryPool",
    "SwapManager",
    "SwapPolicyError",
    "SwapScope",
    "_Bucket",
    "_InBucket",
    "_Kept",
    "_SwapState",
    "_SwapTap",
    "_TorchPolicy",
    "_bucket",
    "_bucketable",
    "_check_swap_options",
    "_drop",
    "_identity",
    "_put_in_place",
    "_read",
    "_selective_contexts",
    "_stays_on_device",
    "_swapped_call",
    "_tensors_in",
    "_under_compile",
    "_wrapped_call",
    "as_policy",
    "async_save_on_cpu",
    "create_native_selective_checkpoint_contexts",
    "create_selective_checkpoint_contexts",
    "current_scope",
    "get_class_activation_wrapper",
    "ignore_sac_ops",
    "is_compiling",
    "noop_context_fn",
    "swap",
    "swap_tensor_wrapper",
    "swap_wrapper",
    "tensor_swapped",
    "unwrap_swaps",
]
