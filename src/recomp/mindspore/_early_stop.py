"""Explaining MindSpore 2.10's early-stop failure inside an op, for ``early_stop=True``.

With early stop, ``mindspore.recompute`` ends a replay by raising an exception
from its pack hook when the last saved tensor is recomputed. When that tensor
is saved while an op that MindSpore runs through its Python op runner is in the
middle of its run (seen: ``Dropout``'s mask, ``BatchNorm``, ``LayerNorm``), the
exception leaves that op unfinished, and MindSpore's own handler then fails with
``RuntimeError: Stack input_args_info_stack_ is empty``, which names neither the
cause nor the fix. Ops that return one tensor (``tanh``, ``matmul``, ``softmax``)
stop cleanly. recomp's default is ``early_stop=False``; for a user who turns it
on, the replay context raises ``RecompError`` naming the op and the fix instead.
The canaries ``test_mindspore_early_stop_at_a_dropout_mask`` and
``test_mindspore_early_stop_at_layernorm`` tell when MindSpore no longer fails
there, and this can go.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from .._hooks import CallPart, CheckpointCallView, Stage
from ..errors import RecompError
from ._compat import stop_recomputation_error


def _op_stopped_in(tb: TracebackType | None) -> str | None:
    """The op MindSpore's Python op runner was running when the replay stopped, if any."""
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "_run_op":
            return str(frame.f_locals.get("op_name", "an op"))
        tb = tb.tb_next
    return None


class ExplainEarlyStop(CallPart):
    """The part of a checkpoint call with ``early_stop=True`` whose replay context turns
    an early stop inside an op into a ``RecompError`` naming the op and the fix."""

    stage = Stage.REPLAY_ERRORS

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        return None, self

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: TracebackType | None) -> None:
        if exc_type is not stop_recomputation_error():
            return
        op = _op_stopped_in(tb)
        if op is not None:
            raise RecompError(
                f"early_stop=True cannot stop this replay: the last tensor the checkpointed "
                f"block saves is saved inside {op}, and MindSpore 2.10 fails when early stop "
                "ends a replay inside such an op ('Stack input_args_info_stack_ is empty'). "
                "Pass early_stop=False (recomp's default on MindSpore); it saves only the ops "
                f"after that {op}."
            ) from exc


#: Holds nothing of a call (its replay context is re-entrant): one serves every call.
EXPLAIN_EARLY_STOP = ExplainEarlyStop()
