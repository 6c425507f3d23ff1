"""``debug=True`` for recomp checkpoints: a log of the ops the forward and the replay ran.

PyTorch's own checkpoint refuses ``debug=True`` together with a ``context_fn``,
and recomp always passes one. So recomp takes the option itself: the
checkpoint's forward and each replay run under an op recorder, excluded
regions are marked in the forward and shown as skipped in the replay, and
when the checkpoint finds that the replay saved different tensors (or recomp
finds that it called regions differently), the error carries both op lists
and the first place where they differ.

The log is two parts of the checkpoint call (NOTE [ The parts of a checkpoint
call ] in ``recomp._engine``): the phase logs outside a user ``context_fn`` such
as selective checkpointing, the op recorder inside it, so that it sees every op
the checkpointed code calls.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from .._hooks import CallPart, CheckpointCallView, RegionCallView, RegionObserver, Stage, observing
from ..errors import RecompError
from . import _compat
from ._replay_errors import as_replay_mismatch

__all__ = ["caller_frame", "debug_options"]

_RECOMP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SKIPPED_DIRS = (_RECOMP_DIR + os.sep, _TORCH_DIR + os.sep)
_MAX_LISTED = 400  # ops listed per phase; the rest are counted


def debug_options(
    kwargs: dict[str, Any],
) -> tuple[list[CallPart], dict[str, Any], contextlib.AbstractContextManager[Any] | None]:
    """Take ``debug`` out of the checkpoint options and, if debugging is on, make the op log.

    Returns the parts of the checkpoint call that keep the log (none when debugging is
    off), the remaining options, and a context to call PyTorch's checkpoint in (None
    when debugging is off: nothing to enter).
    Debugging is on as PyTorch decides it:
    ``torch.utils.checkpoint.set_checkpoint_debug_enabled`` wins over ``debug=``. While
    that global switch is on, PyTorch's checkpoint would refuse recomp's ``context_fn``,
    so it is turned off around the call and back on inside the checkpointed function,
    where nested checkpoints should see it.
    """
    debug = kwargs.pop("debug", False)
    forced = _compat.checkpoint_debug_switch()
    if not (forced if forced is not None else debug):
        return [], kwargs, None
    log = _DebugLog(restore_switch=forced)
    hide = (
        torch_checkpoint.set_checkpoint_debug_enabled(None)
        if forced is not None
        else contextlib.nullcontext()
    )
    return [log, _OpRecording(log)], kwargs, hide


# --------------------------------------------------------------------------- the op log


class _PhaseLog(RegionObserver):
    """The ops of one forward or replay, as lines, with region markers."""

    def __init__(self, phase: str, owner: _DebugLog | None = None) -> None:
        self.phase = phase
        # Weakly: the debug log holds its phase logs, and the call's parts hold the debug
        # log as long as an error can be explained (no cycle left to the collector).
        self._owner = None if owner is None else weakref.ref(owner)
        self.lines: list[str] = []
        self.ops: list[tuple[str, bool]] = []  # (op, inside an excluded region)
        self.calls: list[str] = []  # the listed ops with their arguments, as in ``lines``
        self.region: str | None = None

    def op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        name = str(getattr(func, "__name__", func))
        qualified = f"aten.{name}" if getattr(func, "namespace", "") == "aten" else name
        self.ops.append((qualified, self.region is not None))
        if len(self.ops) > _MAX_LISTED:
            return
        indent = "    " if self.region is not None else ""
        call = f"{qualified}({_describe_call(args, kwargs)}) -> {_describe(out)}"
        self.calls.append(call)
        self.lines.append(f"{len(self.ops):5d}  {indent}{call}    {_caller()}")

    def region_started(self, call: RegionCallView) -> None:
        self.region = name = call.region_name
        self.lines.append(f"       >> excluded region {name!r} runs (kept, not replayed)")

    def region_finished(self, call: RegionCallView, ok: bool) -> None:
        self.region = None
        self.lines.append(f"       << end of excluded region {call.region_name!r}")

    def region_skipped(self, call: RegionCallView) -> None:
        name = call.region_name
        self.lines.append(f"       -- excluded region {name!r} skipped: cached output returned")
        self.region = name  # recomp's own ops handing the outputs back are not the user's

    def region_outputs_returned(self, call: RegionCallView) -> None:
        self.region = None

    def explain(self, message: str) -> str:
        # An error in a region's backward, after the replay: add the debug report.
        owner = None if self._owner is None else self._owner()
        return message if owner is None else owner.report(message)

    def render(self) -> str:
        extra = len(self.ops) - _MAX_LISTED
        more = [f"       ... and {extra} more op(s)"] if extra > 0 else []
        body = "\n".join(self.lines + more) or "       (none)"
        return f"Ops in the {self.phase} ({len(self.ops)}):\n{body}"


class _OpRecorder(_compat.TorchDispatchMode):  # type: ignore[misc]
    """Records each op that reaches the dispatcher into the current phase log."""

    def __init__(self, log: _PhaseLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        self.log.op(func, args, kwargs, out)
        return out


class _LogPhase:
    """The debug log's context for one phase: a new op log, which region events reach;
    in the forward, replay errors are reported with the logs."""

    def __init__(self, owner: _DebugLog, phase: str) -> None:
        self.owner = owner
        self.phase = phase
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            log = _PhaseLog(self.phase, self.owner)
            if self.phase == "forward":
                self.owner.forward = log
                stack.enter_context(self.owner.report_errors())
                if self.owner.restore_switch is not None:
                    stack.enter_context(
                        torch_checkpoint.set_checkpoint_debug_enabled(self.owner.restore_switch)
                    )
            else:
                self.owner.replay = log  # each replay (retain_graph) starts a new log
            stack.enter_context(observing(log))
            self._stacks.append(stack.pop_all())

    def __exit__(self, *exc_info: Any) -> bool:
        return bool(self._stacks.pop().__exit__(*exc_info))


class _RecordPhase:
    """The op recorder's context for one phase: records into that phase's current log."""

    def __init__(self, owner: _DebugLog, phase: str) -> None:
        self.owner = owner
        self.phase = phase
        self._recorders: list[_OpRecorder] = []

    def __enter__(self) -> None:
        log = self.owner.forward if self.phase == "forward" else self.owner.replay
        recorder = _OpRecorder(log or _PhaseLog(self.phase, self.owner))
        recorder.__enter__()
        self._recorders.append(recorder)

    def __exit__(self, *exc_info: Any) -> None:
        self._recorders.pop().__exit__(*exc_info)


class _DebugLog(CallPart):
    """Everything one debug checkpoint call records, and the error it raises. As a part
    of the call it installs the phase logs outside the user's contexts; its
    :class:`_OpRecording` records ops inside them."""

    stage = Stage.DEBUG_LOG

    def __init__(self, restore_switch: bool | None) -> None:
        self.restore_switch = restore_switch
        self.forward: _PhaseLog | None = None
        self.replay: _PhaseLog | None = None

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        return _LogPhase(self, "forward"), _LogPhase(self, "replay")

    @contextlib.contextmanager
    def report_errors(self) -> Iterator[None]:
        """While the forward runs, tensors saved by the checkpoint unpack through ``unpack``."""
        hooks = _compat.top_checkpoint_hooks()
        if hooks is None:  # not under a checkpoint hook as expected: log only
            yield
            return
        pack, checkpoint_unpack = hooks

        def unpack(holder: Any) -> Any:
            try:
                return checkpoint_unpack(holder)
            except RecompError as exc:  # ReplayMismatchError is also a CheckpointError
                raise type(exc)(self.report(str(exc))) from exc
            except torch_checkpoint.CheckpointError as exc:
                mismatch = as_replay_mismatch(exc)
                if mismatch is None:
                    raise torch_checkpoint.CheckpointError(self.report(str(exc))) from exc
                raise type(mismatch)(self.report(str(mismatch))) from exc

        with _compat.replace_top_hooks(pack, unpack, hooks):
            yield

    def report(self, error: str) -> str:
        forward = self.forward or _PhaseLog("forward")
        replay = self.replay or _PhaseLog("replay")
        # PyTorch's advice to turn debug on is moot here; the rest of its message stays.
        error = error.split("\nTip: To see a more detailed error message")[0].strip()
        return "\n\n".join(
            [
                error,
                "recomp checkpoint debug log (debug=True):",
                forward.render(),
                replay.render(),
                _first_difference(forward, replay),
                "Ops indented under '>>' ran inside an excluded region: they run once in the "
                "forward and are skipped in the replay, so they are left out of the comparison; "
                "those indented under '--' hand a skipped region's cached outputs back. "
                "Extra or missing 'detach' ops are the checkpoint's own and are left out too.",
            ]
        )


class _OpRecording(CallPart):
    """The op recorder of a debug checkpoint call, inside the user's contexts so that it
    sees every op the checkpointed code calls."""

    stage = Stage.OP_RECORDER

    def __init__(self, log: _DebugLog) -> None:
        self.log = log

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        return _RecordPhase(self.log, "forward"), _RecordPhase(self.log, "replay")


def _first_difference(forward: _PhaseLog, replay: _PhaseLog) -> str:
    def compared(log: _PhaseLog) -> list[tuple[int, str]]:
        return [
            (i + 1, op)
            for i, (op, in_region) in enumerate(log.ops)
            if not in_region and not op.startswith("aten.detach")
        ]

    fwd, rep = compared(forward), compared(replay)
    for (fi, fop), (ri, rop) in zip(fwd, rep):
        if fop != rop:
            return f"First difference: forward op {fi} is {fop}, replay op {ri} is {rop}."
    for (fi, _), (ri, _) in zip(fwd, rep):
        if fi > len(forward.calls) or ri > len(replay.calls):
            break
        fcall, rcall = forward.calls[fi - 1], replay.calls[ri - 1]
        if fcall != rcall:
            return (
                f"The same ops ran; the first whose arguments differ: forward op {fi} is "
                f"{fcall}, replay op {ri} is {rcall}."
            )
    if len(fwd) != len(rep):
        shorter = "replay" if len(rep) < len(fwd) else "forward"
        return (
            f"The ops agree as far as both go; the {shorter} ran fewer "
            f"({len(fwd)} in the forward, {len(rep)} in the replay; the replay may stop "
            "early after the last tensor it needs)."
        )
    return "The same ops ran in both; they saved tensors of different shapes, dtypes or devices."


def _describe_call(args: tuple[Any, ...], kwargs: Any) -> str:
    parts = [_describe(a) for a in args]
    parts += [f"{k}={_describe(v)}" for k, v in (kwargs or {}).items()]
    return ", ".join(parts)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    text = repr(value)
    return text if len(text) <= 40 else type(value).__name__


def caller_frame() -> tuple[str, int, str] | None:
    """The innermost frame outside torch and recomp, the user code that called the op:
    its file, line and function."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED_DIRS):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return None
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def _caller() -> str:
    found = caller_frame()
    if found is None:
        return ""
    filename, lineno, function = found
    return f"{os.path.basename(filename)}:{lineno} in {function}"
