"""recomp for PyTorch eager: checkpoints whose excluded regions are not replayed.

Same names as ``recomp.mindspore``::

    from recomp.torch import checkpoint_wrapper, checkpoint_exclude_wrapper

    layer.attn = checkpoint_exclude_wrapper(layer.attn)   # runs once, never replayed
    layer = checkpoint_wrapper(layer)                      # everything else is recomputed

Beside these: ``recomp.torch.report`` (what the graph holds for backward),
``recomp.torch.hyperparallel`` (HyperParallel's activation-memory API under its own
names), ``recomp.torch.collectives``, ``recomp.torch.megatron`` and
``recomp.torch.deepspeed``. The errors are in ``recomp.errors``.
"""

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a torch-less environment
    raise ImportError(
        "recomp.torch needs PyTorch, which is not installed. Install it with "
        "`pip install recomp[torch]`."
    ) from exc

from .._moved import moved_names
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
from ._offload import Offloader, OffloadStats, default_offloader
from ._offload_session import offload_session
from ._pipeline_swap import pipeline_swap
from ._swap import CheckpointPolicy, swap, swap_wrapper

__all__ = [
    "CheckpointPolicy",
    "CheckpointWrapper",
    "ExcludeWrapper",
    "OffloadStats",
    "Offloader",
    "RecomputeHandle",
    "apply_activation_checkpointing",
    "checkpoint",
    "checkpoint_exclude_wrapper",
    "checkpoint_wrapper",
    "clear_recompute_session",
    "default_offloader",
    "hf_activation_checkpointing",
    "offload_session",
    "pipeline_swap",
    "recompute_handle",
    "recompute_handle_collector_ctx",
    "recompute_session_ctx",
    "swap",
    "swap_wrapper",
    "unwrap",
]

# The public sub-modules, there once the package is imported.
from . import hyperparallel as hyperparallel
from . import report as report

# Names that moved (to .hyperparallel, .report, recomp.errors) answer with a
# DeprecationWarning for one release: NOTE [ Moved names ] in recomp._moved.
__getattr__ = moved_names(__name__)
