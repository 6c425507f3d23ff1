"""recomp for PyTorch eager: checkpoints whose excluded regions are not replayed.

Same names as ``recomp.mindspore``::

    from recomp.torch import checkpoint_wrapper, checkpoint_exclude_wrapper

    layer.attn = checkpoint_exclude_wrapper(layer.attn)   # runs once, never replayed
    layer = checkpoint_wrapper(layer)                      # everything else is recomputed
"""

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a torch-less environment
    raise ImportError(
        "recomp.torch needs PyTorch, which is not installed. Install it with "
        "`pip install recomp[torch]`."
    ) from exc

from ._api import (
    CheckpointWrapper,
    ExcludeWrapper,
    apply_activation_checkpointing,
    checkpoint,
    checkpoint_exclude_wrapper,
    checkpoint_wrapper,
    hf_activation_checkpointing,
    unwrap,
)
from ._kept import (
    RecomputeHandle,
    clear_recompute_session,
    recompute_handle,
    recompute_handle_collector_ctx,
    recompute_session_ctx,
)
from ._memory_report import (
    ReportRow,
    SavedTensorsReport,
    label_layers,
    print_saved_tensors_report,
    saved_tensors_report,
)
from ._offload import Offloader, OffloadStats, default_offloader
from ._oom_report import OomReport, install_oom_report
from ._swap import (
    AsyncSaveOnCpu,
    CheckpointPolicy,
    PinnedMemoryPool,
    SwapManager,
    SwapPolicyError,
    async_save_on_cpu,
    create_native_selective_checkpoint_contexts,
    create_selective_checkpoint_contexts,
    get_class_activation_wrapper,
    ignore_sac_ops,
    is_compiling,
    noop_context_fn,
    swap,
    swap_tensor_wrapper,
    swap_wrapper,
)

__all__ = [
    "AsyncSaveOnCpu",
    "CheckpointPolicy",
    "CheckpointWrapper",
    "ExcludeWrapper",
    "OffloadStats",
    "Offloader",
    "OomReport",
    "PinnedMemoryPool",
    "RecomputeHandle",
    "ReportRow",
    "SavedTensorsReport",
    "SwapManager",
    "SwapPolicyError",
    "apply_activation_checkpointing",
    "async_save_on_cpu",
    "checkpoint",
    "checkpoint_exclude_wrapper",
    "checkpoint_wrapper",
    "clear_recompute_session",
    "create_native_selective_checkpoint_contexts",
    "create_selective_checkpoint_contexts",
    "default_offloader",
    "get_class_activation_wrapper",
    "hf_activation_checkpointing",
    "ignore_sac_ops",
    "install_oom_report",
    "is_compiling",
    "label_layers",
    "noop_context_fn",
    "print_saved_tensors_report",
    "recompute_handle",
    "recompute_handle_collector_ctx",
    "recompute_session_ctx",
    "saved_tensors_report",
    "swap",
    "swap_tensor_wrapper",
    "swap_wrapper",
    "unwrap",
]
