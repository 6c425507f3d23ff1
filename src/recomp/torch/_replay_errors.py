"""Replay mismatches on PyTorch: one error that ``except recomp.ReplayMismatchError``
and ``except torch.utils.checkpoint.CheckpointError`` both catch.

A replay that runs other code than its forward shows in two places: recomp sees
its excluded regions called differently, and PyTorch's checkpoint sees other
tensors saved (another number, shape, dtype or device). Both are the same mistake,
so both raise :class:`recomp.ReplayMismatchError`, which, once ``recomp.torch`` is
imported, also derives from PyTorch's ``CheckpointError`` (``recomp.errors`` itself
imports no framework, so the base is added here). PyTorch's own error is re-raised
as a ``ReplayMismatchError`` with recomp's explanation, ``from`` the original.
"""

from __future__ import annotations

from torch.utils.checkpoint import CheckpointError

from ..errors import RecompError, ReplayMismatchError

__all__ = ["as_replay_mismatch"]

if not issubclass(ReplayMismatchError, CheckpointError):
    ReplayMismatchError.__bases__ = (*ReplayMismatchError.__bases__, CheckpointError)

# What PyTorch's checkpoint says when the replay saved other tensors than the forward.
_MISMATCH_MESSAGES = (
    "different number of tensors was saved",
    "have different metadata",
    "more tensors during recomputation than during the original forward",
)
_TORCH_TIP = "\nTip: To see a more detailed error message"

EXPLANATION = (
    "The checkpoint's replay saved other tensors than its forward: the checkpointed code "
    "ran other ops in the replay. A Python branch that depends on state that changed "
    "between the two (a counter, a flag, is_recomputing(), a random draw outside the "
    "framework's generators) left out an excluded region or called other code in its place. "
    "Make the checkpointed code take the same path in the forward and in the replay; "
    "checkpoint(..., debug=True) lists the ops of both."
)


def as_replay_mismatch(exc: BaseException) -> RecompError | None:
    """The :class:`ReplayMismatchError` to raise ``from`` PyTorch's ``exc``, or None when
    ``exc`` is not PyTorch's report of a replay that saved other tensors (or already is
    recomp's)."""
    if isinstance(exc, RecompError) or not isinstance(exc, CheckpointError):
        return None
    text = str(exc)
    if not any(message in text for message in _MISMATCH_MESSAGES):
        return None
    torch_says = text.split(_TORCH_TIP)[0].strip()
    return ReplayMismatchError(f"{EXPLANATION}\nPyTorch's checkpoint reports: {torch_says}")
