"""recomp: activation checkpointing that keeps chosen regions out of the recompute.

This package imports no framework. The framework APIs are ``recomp.torch``
and ``recomp.mindspore``; what is here is shared by both: the recompute state
that code inside a checkpoint can read, the registry of RNG trackers whose states
checkpoints save and restore, and the errors recomp raises (every class of
``recomp.errors``, the same objects).
"""

from ._rng_trackers import (
    RngTracker,
    RngTrackerRegistration,
    register_rng_tracker,
    unregister_rng_tracker,
)
from ._state import RecomputeState, get_recompute_state, is_recomputing
from .errors import (
    BudgetTooSmallError,
    CachedValueMutatedError,
    CollectiveReplayedWarning,
    DoubleCheckpointError,
    EarlierExclusionsWarning,
    ForeignCheckpointWarning,
    IneffectiveSelectionWarning,
    InstanceRequiredError,
    NestedExclusionError,
    OffloadTraceWarning,
    OutputNotSavedError,
    ParameterChangedError,
    PlanFormatError,
    RecompError,
    RecompInternalError,
    ReplayMismatchError,
    ReplayStateWarning,
    RunningStatisticsWarning,
    SelectionError,
    SwapNotSupportedError,
    SwapPolicyError,
    UnreplayableDropoutWarning,
    WrapperNotReachedWarning,
)

__version__ = "0.1.0"

__all__ = [
    "BudgetTooSmallError",
    "CachedValueMutatedError",
    "CollectiveReplayedWarning",
    "DoubleCheckpointError",
    "EarlierExclusionsWarning",
    "ForeignCheckpointWarning",
    "IneffectiveSelectionWarning",
    "InstanceRequiredError",
    "NestedExclusionError",
    "OffloadTraceWarning",
    "OutputNotSavedError",
    "ParameterChangedError",
    "PlanFormatError",
    "RecompError",
    "RecompInternalError",
    "RecomputeState",
    "ReplayMismatchError",
    "ReplayStateWarning",
    "RngTracker",
    "RngTrackerRegistration",
    "RunningStatisticsWarning",
    "SelectionError",
    "SwapNotSupportedError",
    "SwapPolicyError",
    "UnreplayableDropoutWarning",
    "WrapperNotReachedWarning",
    "__version__",
    "get_recompute_state",
    "is_recomputing",
    "register_rng_tracker",
    "unregister_rng_tracker",
]
