"""Errors raised by recomp. Each message names the region involved and the fix."""

from __future__ import annotations

__all__ = [
    "CachedValueMutatedError",
    "DoubleCheckpointError",
    "ForeignCheckpointWarning",
    "NestedExclusionError",
    "OutputNotSavedError",
    "RecompError",
    "ReplayMismatchError",
    "UnreplayableDropoutWarning",
    "WrapperNotReachedWarning",
]


class RecompError(RuntimeError):
    """Base class of recomp's run-time errors."""


class NestedExclusionError(RecompError):
    """An excluded region was called while another excluded region was running."""


class ReplayMismatchError(RecompError):
    """The replay of a checkpoint did not call its excluded regions as the forward did."""


class CachedValueMutatedError(RecompError):
    """A cached output or saved tensor of an excluded region was changed in place."""


class OutputNotSavedError(RecompError):
    """A ``save_output=False`` placeholder reached code other than an excluded region."""


class DoubleCheckpointError(RecompError):
    """A layer recomp checkpoints is also checkpointed by another mechanism (HF's own)."""


class ForeignCheckpointWarning(UserWarning):
    """An excluded region is replayed by a checkpoint that recomp does not control."""


class WrapperNotReachedWarning(UserWarning):
    """The model's first forward after ``apply_activation_checkpointing`` called none of
    the modules it wrapped, so no checkpoint or exclusion took effect."""


class UnreplayableDropoutWarning(UserWarning):
    """Recomputed code holds a dropout whose random state the framework cannot restore."""
