"""One replay per checkpoint per micro-batch: recomputed tensors kept for later backward passes.

PyTorch's non-reentrant checkpoint replays its forward once per backward pass
(graph task) that needs one of its saved tensors. A zero-bubble pipeline schedule
runs several passes over one micro-batch's graph: one for the stage's input
gradients (``retain_graph=True``), then one per parameter group for the weight
gradients, and each re-runs nodes whose saved tensors the first pass already
read. So every pass replays the block again.

:class:`RecomputeHandle` (one per recomp checkpoint call) sits between PyTorch's
checkpoint and autograd, and costs a plain backward next to nothing:

* in the forward, the unpack hook of the checkpoint's saved tensors becomes
  :meth:`RecomputeHandle.unpack` (PyTorch's pack hook stays on top of the stack);
* an unpack reads a kept tensor if there is one; otherwise it is PyTorch's own, which
  replays once in this pass and hands each tensor over once. After the read, a tensor
  whose reading node gives more gradients in a later pass over the retained graph (the
  input-gradient pass of a zero-bubble schedule) is kept for that pass; a node that
  gives all its gradients in this pass (a plain backward, or the last pass that needs
  it) leaves nothing;
* when a pass ends, what its replay recomputed and no node of it read (the tensors of
  the weight-gradient nodes, in an input-gradient pass) is taken from PyTorch's
  checkpoint and kept under its holder for the next pass;
* a later pass reads what is kept and drops it once its node gives all its gradients.
  A second read of a dropped tensor (a true double backward, or a later pass from the
  loss that re-runs a node an earlier pass finished) replays, as before. A pass run
  from a hook inside a running pass replays for itself and leaves that pass's tensors.

Kept tensors live under the holder, so they go with the graph: a pass with
``retain_graph=False`` frees each holder as its node runs, and freeing the graph
frees the rest. Nothing is left per step.

Sessions (:func:`recompute_session_ctx` and the functions beside it, names and
semantics after HyperParallel's activation-checkpoint API) let a schedule that
drives backward itself run a micro-batch's replay ahead of its backward
(:func:`recompute_handle`) and keep every kept tensor through all its passes
(``retain_on_unpack=True``) until :func:`clear_recompute_session`. A handle's
session is stored on the handle, not in a context variable: autograd's worker
threads see it too.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointError

from .._engine import SWITCHES
from .._hooks import CallPart, CheckpointCallView, Stage
from ..errors import ParameterChangedError, RecompError
from . import _compat
from ._replay_errors import as_replay_mismatch

__all__ = [
    "KEPT_REPLAYS",
    "RecomputeHandle",
    "clear_recompute_session",
    "recompute_handle",
    "recompute_handle_collector_ctx",
    "recompute_session_ctx",
]


#: What a handle's two dictionaries and its set of running passes are until it keeps
#: something: read, never written. Most handles never keep anything, and each lives as long
#: as its checkpoint's graph: an object made per handle would count towards the
#: collector's next run (NOTE [ What a call keeps ] in ``recomp._engine``).
_EMPTY: Any = weakref.WeakKeyDictionary()
_NO_PASSES: frozenset[int] = frozenset()


class RecomputeHandle:
    """One recomp checkpoint call's replay: what it recomputed and no pass has read yet.

    Opaque to users: collected by :func:`recompute_handle_collector_ctx`, passed to
    :func:`recompute_handle`. Holds its checkpoint's graph only weakly.
    """

    __slots__ = (
        "__weakref__",
        "_checkpoint_pack",
        "_checkpoint_unpack",
        "_collectable",
        "_collector",
        "_consumed",
        "_frame",
        "_kept",
        "_running",
        "_store",
        "session",
    )

    def __init__(self, collectable: bool = True) -> None:
        self._collectable = collectable
        self._store: _compat.ReplayStore | None = None
        # PyTorch's checkpoint hooks; the store is read from the pack hook's frame where
        # needed (PyTorch's unpack hook holds that frame too).
        self._checkpoint_pack: Callable[[Any], Any] | None = None
        self._checkpoint_unpack: Callable[[Any], Any] | None = None
        # The checkpoint's frame where recomp runs its replay (NOTE [ Replaying PyTorch's
        # checkpoint ] in ``_compat.checkpoint``), False where PyTorch's unpack does;
        # looked for at the first read (None until then: the forward makes nothing).
        self._frame: Any = None if SWITCHES.own_replay else False
        self._collector: list[RecomputeHandle] | None = None
        # Holder -> the backward pass (graph task) whose replay kept it -> the tensor, with
        # its version when kept: a parameter the replay saved that changes before a later
        # pass reads it is refused (NOTE [ State changed before backward ] in
        # ``recomp._module_state``). Filled only where a later pass may read it: a tensor
        # read by a node that gives more gradients in a later pass, what a pass's replay
        # recomputed and did not read (taken from PyTorch when the pass ends), a replay
        # run ahead of backward, a session that retains. A plain backward fills nothing.
        # (Both dictionaries are made on first use: most handles never need them.)
        self._kept: weakref.WeakKeyDictionary[Any, dict[int, tuple[torch.Tensor, int | None]]]
        self._kept = _EMPTY
        # Holder -> the backward pass that read and dropped its kept tensor: what that
        # pass's replay recomputed for it is not kept again (no node reads it twice).
        self._consumed: weakref.WeakKeyDictionary[Any, int] = _EMPTY
        # The backward passes that read through this handle and have not ended: another
        # pass (one run from a hook inside them) does not read what they kept, and replays
        # for itself.
        self._running: set[int] | frozenset[int] = _NO_PASSES
        self.session: _Session | None = None

    #: Guards what handles keep (taken on the rare paths only: a backward that keeps the
    #: graph, a session, a replay run ahead). One for all handles, re-entrant: a tensor
    #: freed under it may run code that reads another handle.
    _lock = threading.RLock()

    # ----------------------------------------------------------------- contexts

    # The handle is the forward context: entered directly inside PyTorch's checkpoint
    # hook, around the forward, it makes the checkpoint's saved tensors unpack through
    # :meth:`unpack` (PyTorch's pack hook stays on top of the stack). Nothing puts
    # PyTorch's pair back on exit: the checkpoint's hook is left right after the forward
    # context (``with _checkpoint_hook(frame), forward_context:``), and leaving it pops
    # whatever pair is on top, recomp's with it.

    def __enter__(self) -> None:
        hooks = _compat.take_checkpoint_unpack(self.unpack)
        if hooks is None:
            return  # not directly under PyTorch's checkpoint hook: PyTorch's unpack stays
        self._checkpoint_pack, self._checkpoint_unpack = hooks
        if self._collectable:
            collector = self._collector = _COLLECTOR.get()
            if collector is not None:
                collector.append(self)

    def __exit__(self, *exc_info: Any) -> None:
        collector = self._collector
        if collector is not None:
            self._collector = None  # the collector's list holds the handle: no cycle
            if exc_info[0] is not None and self in collector:
                collector.remove(self)  # a forward that failed has nothing to replay

    # ----------------------------------------------------------------- unpack

    def unpack(self, holder: Any) -> Any:
        session = self.session
        if session is None and self._kept is _EMPTY and not _compat.pass_keeps_graph():
            # A plain backward: a pass that frees the graph, with nothing kept and no
            # session, keeps nothing and leaves nothing for a later pass (no pass reads
            # after it): the checkpoint's own read, with nothing of recomp's around it.
            try:
                return self._read(holder)
            except CheckpointError as exc:
                _raise_mismatch(exc)
                raise
        current = _compat.graph_task_id()
        # A pass that frees the graph keeps nothing, and no pass reads after it what its
        # replay left unread: it needs no end-of-pass record.
        if (
            current != -1
            and current not in self._running
            and (session is not None or _compat.pass_keeps_graph())
        ):
            self._pass_started(current)
        if self._kept is not _EMPTY:  # a later pass, or a session: the rare path
            with self._lock:
                found = self._find(holder, current)
                consumed = self._consumed.get(holder) == current != -1
            if found is not None:
                return self._read_kept(holder, current, *found)
            if consumed:
                raise CheckpointError(
                    "torch.utils.checkpoint: Unpack is being triggered for a tensor that was "
                    "already unpacked once in this backward pass. If you are calling "
                    "ctx.saved_tensors in backward, make sure to do so only once."
                )
        value = self._replayed(holder)
        if (session is not None and session.retain_on_unpack) or (
            # A pass that frees the graph never runs this node again.
            current in self._running and not _compat.node_finishes_in_this_pass()
        ):
            with self._lock:
                self._keep(holder, value, current)
        return value

    def _replayed(self, holder: Any) -> Any:
        """The checkpoint's unpack of ``holder``: replays once in this pass, then reads."""
        try:
            return self._read(holder)
        except CheckpointError as exc:
            _raise_mismatch(exc)
            raise

    def _read(self, holder: Any) -> Any:
        frame = self._frame
        if frame is None:
            if self._checkpoint_unpack is None:  # not reached: installed only with it
                raise RecompError("recomp: a kept-replay unpack ran without its checkpoint")
            found = _compat.replay_frame(self._checkpoint_pack, self._checkpoint_unpack)  # type: ignore[arg-type]
            frame = self._frame = False if found is None else found
        if frame is False:
            return self._checkpoint_unpack(holder)  # type: ignore[misc]
        return _compat.replay_unpack(frame, self._checkpoint_unpack, holder)  # type: ignore[arg-type]

    def _read_kept(
        self, holder: Any, current: int, keeper: int, kept: tuple[torch.Tensor, int | None]
    ) -> Any:
        value, version = kept
        if _compat.version(value) != version:
            raise ParameterChangedError(
                "A tensor that the replay of a checkpoint kept for a later backward pass was "
                "changed in place before that pass read it: a parameter or buffer the "
                "checkpointed code saves for backward, changed by an optimizer step, weight "
                "clipping or another in-place update between the two backward passes. That "
                "pass would use the new values and the gradients would be wrong. Run every "
                "backward that needs this forward before changing its parameters."
            )
        session = self.session
        retain = session is not None and session.retain_on_unpack
        if not retain and _compat.node_finishes_in_this_pass():
            with self._lock:
                by_pass = self._kept.get(holder)
                if by_pass is not None:
                    by_pass.pop(keeper, None)
                    if not by_pass:
                        del self._kept[holder]
                if current != -1:
                    self._consumed[holder] = current
        return value

    def _find(
        self, holder: Any, current: int
    ) -> tuple[int, tuple[torch.Tensor, int | None]] | None:
        """What is kept for ``holder``: this pass's own first, else that of a pass that
        has ended (an earlier pass of a zero-bubble schedule, or a replay run ahead of
        backward); with the pass that kept it. A pass still running (this one runs from a
        hook inside it) keeps its tensors: this pass replays for itself."""
        by_pass = self._kept.get(holder)
        if not by_pass:
            return None
        if current in by_pass:
            return current, by_pass[current]
        for keeper, value in by_pass.items():
            if keeper not in self._running:
                return keeper, value
        return None

    def _keep(self, holder: Any, value: torch.Tensor, task: int) -> None:
        """Keep ``value`` for ``holder`` on behalf of pass ``task`` (under the lock)."""
        if self._kept is _EMPTY:
            self._kept = weakref.WeakKeyDictionary()
            self._consumed = weakref.WeakKeyDictionary()
        self._kept.setdefault(holder, {})[task] = (value, _compat.version(value))

    def _pass_started(self, task: int) -> None:
        with self._lock:
            if self._running is _NO_PASSES:
                self._running = set()
            self._running.add(task)  # type: ignore[union-attr]  # made above
        if not _compat.at_pass_end(lambda: self._pass_ended(task)):
            with self._lock:
                self._running.discard(task)  # type: ignore[union-attr]  # added: a set

    def _pass_ended(self, task: int) -> None:
        """What the pass's replay recomputed and no node read is kept for a later pass
        (taken from PyTorch's checkpoint, which would hold it until the graph goes)."""
        store = self._replay_store()
        leftovers = store.take_leftovers(task) if store is not None else []
        with self._lock:
            self._running.discard(task)  # type: ignore[union-attr]  # started: a set
            for holder, value in leftovers:
                if self._consumed.get(holder) != task:
                    self._keep(holder, value, task)

    def _replay_store(self) -> _compat.ReplayStore | None:
        """PyTorch's record of this call's replays (made on first use)."""
        if self._store is None and self._checkpoint_pack is not None:
            self._store = _compat.replay_store(self._checkpoint_pack)
        return self._store

    def replay_now(self) -> None:
        """Run the replay outside backward; its tensors are kept until read."""
        store = self._replay_store()
        unpack = self._checkpoint_unpack
        holders = store.holders() if store is not None else []
        first = next((h for h in holders if h is not None), None)
        if first is None or unpack is None or store is None:
            raise RecompError(
                "recompute_handle: this checkpoint has nothing left to recompute: its "
                "backward already ran (or its output was dropped), or it ran with "
                "gradients disabled. Collect handles in the step whose backward follows."
            )
        with self._lock:
            if first in self._kept:
                return  # its replay already ran and nothing has been read since
        current = _compat.graph_task_id()
        value = self._read(first)
        # Outside backward PyTorch files the replay under a pass id of its own: every pass
        # but those running here is that one.
        leftovers = store.take_leftovers(current if current != -1 else None, self._running)
        with self._lock:
            self._keep(first, value, current)
            for holder, kept in leftovers:
                self._keep(holder, kept, current)

    def release(self) -> None:
        """Drop every kept tensor (the graph keeps its holders; a later read replays)."""
        with self._lock:
            if self._kept is not _EMPTY:
                self._kept.clear()
                self._consumed.clear()

    @property
    def checkpoint_unpack(self) -> Callable[[Any], Any] | None:
        """PyTorch's unpack hook of this checkpoint, which the handle's ``unpack`` wraps."""
        return self._checkpoint_unpack

    def kept_value(self, holder: Any) -> torch.Tensor | None:
        """What the handle keeps for ``holder`` now (for reports): one of the tensors the
        passes that replayed it keep."""
        with self._lock:
            by_pass = self._kept.get(holder)
            return next(iter(by_pass.values()))[0] if by_pass else None

    def kept_count(self) -> int:
        """How many recomputed tensors the handle keeps now (for tests and reports)."""
        with self._lock:
            return sum(len(by_pass) for by_pass in self._kept.values())


def _raise_mismatch(exc: CheckpointError) -> None:
    """Raise recomp's replay mismatch error for PyTorch's ``exc`` where it is one."""
    mismatch = as_replay_mismatch(exc)
    if mismatch is not None:
        raise mismatch from exc


class KeptReplays(CallPart):
    """The part of a checkpoint call that gives it a :class:`RecomputeHandle`, whose
    forward context sits directly inside PyTorch's checkpoint hook (the replay is
    PyTorch's own). A checkpoint nested in another recomp checkpoint is not collected for
    sessions: the enclosing one's replay runs it."""

    stage = Stage.KEPT_REPLAYS

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        return RecomputeHandle(collectable=not call.nested), None


#: Holds nothing of a call: one serves every checkpoint call.
KEPT_REPLAYS = KeptReplays()


# --------------------------------------------------------------------------- sessions

_LOCK = threading.RLock()
_SESSIONS: dict[Hashable, _Session] = {}
_ACTIVE: contextvars.ContextVar[_Session | None] = contextvars.ContextVar(
    "recomp_recompute_session", default=None
)
_COLLECTOR: contextvars.ContextVar[list[RecomputeHandle] | None] = contextvars.ContextVar(
    "recomp_recompute_collector", default=None
)


class _Session:
    """The checkpoints bound to one session id, and its retention while it is active."""

    __slots__ = ("active", "handles", "id", "retain_on_unpack")

    def __init__(self, session_id: Hashable) -> None:
        self.id = session_id
        self.active = False
        self.retain_on_unpack = False
        self.handles: weakref.WeakSet[RecomputeHandle] = weakref.WeakSet()


def _check_session_id(session_id: Any, api: str) -> None:
    if session_id is None:
        raise ValueError(f"{api}: session_id must not be None; pass a hashable key of your own.")
    try:
        hash(session_id)
    except TypeError:
        raise ValueError(
            f"{api}: session_id must be hashable (a str, int or tuple), got "
            f"{type(session_id).__name__}."
        ) from None


def _prune(session: _Session) -> None:
    if not session.active and not len(session.handles) and _SESSIONS.get(session.id) is session:
        del _SESSIONS[session.id]


@contextlib.contextmanager
def recompute_handle_collector_ctx() -> Iterator[list[RecomputeHandle]]:
    """Collect the handles of the recomp checkpoints whose forward runs in the block.

    Yields a list that fills in call order (checkpoints nested in another recomp
    checkpoint and checkpoints run with gradients disabled are not collected)::

        with recompute_handle_collector_ctx() as handles:
            out = stage(x)
    """
    handles: list[RecomputeHandle] = []
    token = _COLLECTOR.set(handles)
    try:
        yield handles
    finally:
        _COLLECTOR.reset(token)


@contextlib.contextmanager
def recompute_session_ctx(session_id: Hashable, retain_on_unpack: bool = False) -> Iterator[Any]:
    """Make the checkpoints bound to ``session_id`` (by :func:`recompute_handle`) keep
    what their replay recomputed through every backward pass run in the block.

    ``retain_on_unpack=True``: a kept tensor stays after it is read, until
    :func:`clear_recompute_session` or until the graph frees it; without it the
    usual rule holds (dropped once no later pass needs it). Sessions do not nest,
    and one session id is active in one block at a time.
    """
    _check_session_id(session_id, "recompute_session_ctx")
    if not isinstance(retain_on_unpack, bool):
        raise ValueError(
            "recompute_session_ctx: retain_on_unpack must be True or False, got "
            f"{retain_on_unpack!r}."
        )
    outer = _ACTIVE.get()
    if outer is not None:
        raise RecompError(
            f"recompute_session_ctx({session_id!r}) inside recompute_session_ctx({outer.id!r}): "
            "recompute sessions do not nest. Leave the outer one first."
        )
    with _LOCK:
        session = _SESSIONS.setdefault(session_id, _Session(session_id))
        if session.active:
            raise RecompError(
                f"recompute_session_ctx({session_id!r}) is already active (in another thread); "
                "one session id is active in one block at a time."
            )
        session.active = True
        session.retain_on_unpack = retain_on_unpack
    token = _ACTIVE.set(session)
    try:
        yield session_id
    finally:
        _ACTIVE.reset(token)
        with _LOCK:
            session.active = False
            session.retain_on_unpack = False
            _prune(session)


def recompute_handle(handle: RecomputeHandle, session_id: Hashable) -> None:
    """Bind ``handle``'s checkpoint to ``session_id`` and run its replay now, ahead of
    its backward (for instance while the next send or receive is in flight).

    The replay's tensors are kept until a backward pass reads them (or, in a
    session with ``retain_on_unpack=True``, until :func:`clear_recompute_session`),
    so that backward does not replay the checkpoint again.
    """
    if not isinstance(handle, RecomputeHandle):
        raise ValueError(
            "recompute_handle: handle must be one collected by "
            f"recompute_handle_collector_ctx(), got {type(handle).__name__}."
        )
    _check_session_id(session_id, "recompute_handle")
    current = _ACTIVE.get()
    if current is not None and current.id != session_id:
        raise RecompError(
            f"recompute_handle(..., {session_id!r}) inside recompute_session_ctx({current.id!r}): "
            "run it in its own session's block, or outside any."
        )
    with _LOCK:
        bound = handle.session
        if bound is not None and bound.id != session_id:
            raise RecompError(
                f"recompute_handle: this checkpoint already belongs to session {bound.id!r}; "
                f"one checkpoint is in one session at a time. Call "
                f"clear_recompute_session({bound.id!r}) first."
            )
        session = _SESSIONS.setdefault(session_id, _Session(session_id))
        session.handles.add(handle)
        handle.session = session
    try:
        handle.replay_now()
    except BaseException:
        with _LOCK:
            session.handles.discard(handle)
            handle.session = None
            _prune(session)
        raise


def clear_recompute_session(session_id: Hashable) -> None:
    """Drop what the checkpoints of ``session_id`` keep and unbind them; safe to repeat."""
    _check_session_id(session_id, "clear_recompute_session")
    with _LOCK:
        session = _SESSIONS.get(session_id)
        if session is None:
            return
        handles = list(session.handles)
        session.handles = weakref.WeakSet()
        for handle in handles:
            if handle.session is session:
                handle.session = None
        _prune(session)
    for handle in handles:
        handle.release()


def session_count() -> int:
    """How many session ids the registry holds (for tests: nothing is left per step)."""
    with _LOCK:
        return len(_SESSIONS)
