"""Errors raised by recomp. Each message names the region involved and the fix."""

from __future__ import annotations

__all__ = [
    "CachedValueMutatedError",
    "CollectiveReplayedWarning",
    "DoubleCheckpointError",
    "ForeignCheckpointWarning",
    "IneffectiveSelectionWarning",
    "NestedExclusionError",
    "OutputNotSavedError",
    "RecompError",
    "RecompInternalError",
    "ReplayMismatchError",
    "RunningStatisticsWarning",
    "UnreplayableDropoutWarning",
    "WrapperNotReachedWarning",
]


class RecompError(RuntimeError):
    """Base class of recomp's run-time errors."""


class RecompInternalError(RecompError):
    """An invariant recomp relies on did not hold: a bug in recomp, not in your code."""


def internal_error(what: str) -> RecompInternalError:
    """The error for a broken invariant of recomp's own (``what`` says which)."""
    return RecompInternalError(
        f"Internal error in recomp: {what}. This is a bug in recomp, not in your model; "
        "please report it with the code that triggered it."
    )


def internal_assert(condition: bool, what: str) -> None:
    """Check one of recomp's own invariants (the numbered rules of the NOTE blocks in
    ``recomp._region``). Unlike ``assert`` it also runs under ``python -O``; a
    failure means recomp itself is wrong, and the message says so."""
    if not condition:
        raise internal_error(what)


class NestedExclusionError(RecompError):
    """An excluded region was called while another excluded region was running."""


class ReplayMismatchError(RecompError):
    """The replay of a checkpoint did not run as the forward did (other region calls,
    other saved tensors). Once ``recomp.torch`` is imported it also derives from
    ``torch.utils.checkpoint.CheckpointError`` (see ``recomp.torch._replay_errors``)."""


class CachedValueMutatedError(RecompError):
    """A cached output or saved tensor of an excluded region was changed in place."""


class OutputNotSavedError(RecompError):
    """A ``save_output=False`` placeholder reached code other than an excluded region."""


class DoubleCheckpointError(RecompError):
    """A module recomp checkpoints (or excludes) is also checkpointed by a plain PyTorch
    checkpoint around recomp's: Hugging Face's own switch beside recomp's wrapper,
    PyTorch's ``checkpoint_wrapper`` (which Lightning's and Accelerate's activation
    checkpointing options apply), ``torch.utils.checkpoint``.
    ``recomp.torch.hf_activation_checkpointing`` makes recomp HF's checkpoint function
    instead."""


class ForeignCheckpointWarning(UserWarning):
    """An excluded region is replayed by a checkpoint that recomp does not control."""


class CollectiveReplayedWarning(UserWarning):
    """A checkpoint's replay runs a collective again instead of reading the result its
    forward kept (the result was changed in place, or was not kept); on MindSpore, a
    collective that runs in recomputed code outside every excluded region."""


class WrapperNotReachedWarning(UserWarning):
    """The model's first forward after ``apply_activation_checkpointing`` called none of
    the modules it wrapped, so no checkpoint or exclusion took effect."""


class IneffectiveSelectionWarning(UserWarning):
    """Part of what was asked for does not take effect: a ``checkpoint_fn`` that matches
    no module, an ``exclude_fn`` that excludes nothing inside a checkpoint, or an
    excluded module called through its ``forward``/``construct`` method."""


class RunningStatisticsWarning(UserWarning):
    """Recomputed code holds a BatchNorm-like module whose running statistics recomp
    cannot find, so a replay would update them a second time."""


class ReplayStateWarning(UserWarning):
    """A checkpointed forward updated module state in place that recomp kept no copy of
    (see NOTE [ Which state a checkpoint call copies ] in ``recomp._module_state``), so
    that call's replay read the updated value."""


class UnreplayableDropoutWarning(UserWarning):
    """Recomputed code holds a dropout whose random state the framework cannot restore."""
