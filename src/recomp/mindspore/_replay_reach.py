"""A replay that runs to its end must have called every excluded region its forward
called: the part of a checkpoint call that checks it.

A Python branch that depends on state that changed between the forward and the
replay (a counter, a flag, ``is_recomputing()``) can skip a region in the replay.
recomp notices an extra or a different region call as the replay makes it
(``recomp._record``); a missing one shows only when the replay ends. Without this
check MindSpore then fails in backward with "Unpack is being triggered for a tensor,
make sure to do this only once!", which names neither the cause nor the fix. A replay
that stops early (``early_stop=True``) ends with the framework's stop exception and
is not checked: it does not run to the end.
"""

from __future__ import annotations

from typing import Any

from .._hooks import CallPart, CheckpointCallView, Stage
from ..errors import ReplayMismatchError

__all__ = ["REPLAY_REACHES_EVERY_REGION"]


class _ReplayEnd:
    """The replay context of one checkpoint call (re-entered by every replay)."""

    __slots__ = ("invocation",)

    def __init__(self, invocation: Any) -> None:
        self.invocation = invocation

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        invocation = self.invocation
        if exc_type is not None or not invocation.rewind:
            return  # it raised or stopped early; or cursors are not rewound (a test switch)
        regions = invocation.regions
        reached, recorded = regions.cursor, len(regions.entries)
        if reached < recorded:
            missed = regions.entries[reached]
            raise ReplayMismatchError(
                f"The checkpoint's replay ended without calling excluded region "
                f"{missed.describe()}, which its forward called (excluded call "
                f"#{reached + 1} of {recorded}). A Python branch that depends on state that "
                "changed between the two (a counter, a flag, is_recomputing()) skipped it. "
                "Make the checkpointed code take the same path in the forward and in the "
                "replay."
            )


class ReplayReachesEveryRegion(CallPart):
    """Raises :class:`ReplayMismatchError` at the end of a replay that did not call every
    excluded region its forward called. Holds nothing of a call: one serves every call."""

    stage = Stage.REPLAY_ERRORS

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        return None, _ReplayEnd(call.invocation)


REPLAY_REACHES_EVERY_REGION = ReplayReachesEveryRegion()
