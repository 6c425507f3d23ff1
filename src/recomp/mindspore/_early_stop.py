"""Explaining MindSpore 2.10's early-stop failure at a dropout, for ``early_stop=True``.

With early stop, ``mindspore.recompute`` ends a replay by raising an exception
from its pack hook when the last saved tensor is recomputed. When that tensor
is a dropout mask, the exception leaves a dropout primitive in the middle of
its run, and MindSpore's own handler then fails with ``RuntimeError: Stack
input_args_info_stack_ is empty``, which names neither the cause nor the fix.
recomp's default is ``early_stop=False``; for a user who turns it on, the replay
context raises ``RecompError`` with both instead. The canary
``test_mindspore_early_stop_at_a_dropout_mask`` tells when MindSpore no longer
fails there, and this can go.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import TracebackType
from typing import Any

from ..errors import RecompError
from ._compat import stop_recomputation_error

# Primitives that return (output, mask) and save the mask.
_DROPOUT_PRIMITIVES = frozenset({"Dropout", "Dropout2D", "Dropout3D"})


def _stopped_in_dropout(tb: TracebackType | None) -> bool:
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "_run_op" and frame.f_locals.get("op_name") in (
            _DROPOUT_PRIMITIVES
        ):
            return True
        tb = tb.tb_next
    return False


class _ExplainStopInDropout:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: TracebackType | None) -> None:
        if exc_type is stop_recomputation_error() and _stopped_in_dropout(tb):
            raise RecompError(
                "early_stop=True cannot stop this replay: the last tensor the checkpointed "
                "block saves is a dropout mask, and MindSpore 2.10 fails when early stop ends "
                "a replay inside a dropout ('Stack input_args_info_stack_ is empty'). Pass "
                "early_stop=False (recomp's default on MindSpore); it saves nothing here but "
                "the ops after that dropout."
            ) from exc


class _Both:
    """Enter two contexts, exit in reverse; re-entered by every replay."""

    def __init__(self, outer: Any, inner: Any) -> None:
        self.outer = outer
        self.inner = inner
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.outer)
            stack.enter_context(self.inner)
            self._stacks.append(stack.pop_all())

    def __exit__(self, *exc_info: Any) -> bool:
        return bool(self._stacks.pop().__exit__(*exc_info))


def explain_stop_in_dropout(
    context_fn: Callable[[], tuple[Any, Any]] | None,
) -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` whose replay context also explains an early stop inside a dropout."""

    def composed() -> tuple[Any, Any]:
        if context_fn is None:
            return contextlib.nullcontext(), _ExplainStopInDropout()
        forward, replay = context_fn()
        return forward, _Both(replay, _ExplainStopInDropout())

    return composed
