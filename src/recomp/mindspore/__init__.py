"""recomp for MindSpore PyNative: checkpoints whose excluded regions are not replayed.

Same names as ``recomp.torch``::

    from recomp.mindspore import checkpoint_wrapper, checkpoint_exclude_wrapper

    layer.attn = checkpoint_exclude_wrapper(layer.attn)   # runs once, never replayed
    layer = checkpoint_wrapper(layer)                      # everything else is recomputed

Beside these: ``recomp.mindspore.report`` (what a step saves for backward),
``recomp.mindspore.hyperparallel`` (HyperParallel's activation-memory API under its
own names) and ``recomp.mindspore.collectives``. The errors are in ``recomp.errors``.
"""

try:
    import mindspore as _mindspore  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a MindSpore-less environment
    raise ImportError(
        "recomp.mindspore needs MindSpore, which is not installed. Install it with "
        "`pip install recomp[mindspore]`."
    ) from exc

from .._moved import moved_names
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
from ._swap import CheckpointPolicy, swap, swap_wrapper

__all__ = [
    "CheckpointPolicy",
    "CheckpointWrapper",
    "ExcludeWrapper",
    "ReplayableDropout",
    "apply_activation_checkpointing",
    "checkpoint",
    "checkpoint_exclude_wrapper",
    "checkpoint_wrapper",
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
