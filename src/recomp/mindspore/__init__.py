"""recomp for MindSpore PyNative: checkpoints whose excluded regions are not replayed.

Same names as ``recomp.torch``::

    from recomp.mindspore import checkpoint_wrapper, checkpoint_exclude_wrapper

    layer.attn = checkpoint_exclude_wrapper(layer.attn)   # runs once, never replayed
    layer = checkpoint_wrapper(layer)                      # everything else is recomputed
"""

try:
    import mindspore as _mindspore  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a MindSpore-less environment
    raise ImportError(
        "recomp.mindspore needs MindSpore, which is not installed. Install it with "
        "`pip install recomp[mindspore]`."
    ) from exc

from ._api import (
    CheckpointWrapper,
    ExcludeWrapper,
    apply_activation_checkpointing,
    checkpoint,
    checkpoint_exclude_wrapper,
    checkpoint_wrapper,
    unwrap,
)
from ._dropout import ReplayableDropout
from ._memory_report import record_saved_tensors
from ._selective import create_selective_checkpoint_contexts, ignore_sac_ops
from ._swap import (
    AsyncSaveOnCpu,
    CheckpointPolicy,
    SwapManager,
    SwapNotSupportedError,
    SwapPolicyError,
    async_save_on_cpu,
    swap,
    swap_tensor_wrapper,
    swap_wrapper,
)

__all__ = [
    "AsyncSaveOnCpu",
    "CheckpointPolicy",
    "CheckpointWrapper",
    "ExcludeWrapper",
    "ReplayableDropout",
    "SwapManager",
    "SwapNotSupportedError",
    "SwapPolicyError",
    "apply_activation_checkpointing",
    "async_save_on_cpu",
    "checkpoint",
    "checkpoint_exclude_wrapper",
    "checkpoint_wrapper",
    "create_selective_checkpoint_contexts",
    "ignore_sac_ops",
    "record_saved_tensors",
    "swap",
    "swap_tensor_wrapper",
    "swap_wrapper",
    "unwrap",
]
