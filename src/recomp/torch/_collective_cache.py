"""Collectives in recomputed code run once: the forward keeps their results, the replay reads them.

A recomp checkpoint's replay re-runs the checkpointed code. Collectives in that
code (the all-gathers and reduce-scatters of DTensor's sequence parallelism,
functional collectives, ``torch.distributed`` calls) would communicate a
second time. Every one of them reaches the dispatcher as an operator
(``c10d.*`` for ``torch.distributed`` calls and ``ProcessGroup`` methods,
``_c10d_functional.*`` for functional collectives and DTensor), so a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` entered with the
checkpoint's forward records what each collective produced, in call order, and
the same mode entered with the replay hands those results back instead of
running the collective:

* an operator that returns new tensors (``all_gather_into_tensor``,
  ``reduce_scatter_tensor``, ``all_reduce``, ``all_to_all_single``): the replay
  gets an alias of the forward's result;
* an operator that writes into tensors it is given (``c10d.allreduce_``,
  ``c10d._allgather_base_``, ``_c10d_functional.all_reduce_``, ...): the
  replay's tensors get the forward's values copied in, and the operator's
  ``Work`` is a completed one.

What is kept is an alias of the forward's result, not a copy, and only until
the checkpoint's graph is freed. A result that later code changed in place (or
that the forward's own code changed after the collective) cannot be handed
back: the replay then runs that collective (``CollectiveReplayedWarning``,
once per operator). With early stop, results recorded after the checkpoint's
last saved tensor are dropped at the end of the forward: no replay reaches them.

The record is a part of the checkpoint call (``CollectiveRecord``, NOTE [ The
parts of a checkpoint call ] in ``recomp._engine``) and its entries a log of the
call's invocation, which rewinds it for each replay and, with early stop, drops
at the end of the forward what no replay reaches, as it does for excluded
regions. A collective is recorded by the innermost recomp checkpoint running when
it is issued; a nested checkpoint that an enclosing replay re-runs reads its own
record. Collectives inside an excluded region are not recorded (the replay skips
the region), nor those that FSDP (or DeepSpeed ZeRO) issues to gather parameters.
The mode lets tensor subclasses such as DTensor handle an operation first, so
the collectives they issue on their local tensors come back through it. It is
entered only while a process group is initialised (without one, no collective
can run and no operator pays for the mode), and a checkpointed function whose
recorded forward issued no collective runs its next calls without it.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Any

import torch

from .._hooks import CallPart, CheckpointCallView, Stage
from .._record import EntryLog, Invocation
from .._region import active_region
from .._state import get_recompute_state
from ..errors import CollectiveReplayedWarning, ReplayMismatchError
from . import _compat
from ._backend import BACKEND
from ._compat import TorchDispatchMode
from .collectives import KEEPING_RECORDS, collective_kind

__all__ = ["collectives_may_run", "keep_collective_results", "kept_results"]

# Kinds whose operator writes nothing the program reads afterwards.
_NO_OUTPUT_KINDS = frozenset({"send", "barrier"})
# Namespaces whose operators write into their first argument (the classic API).
_WRITES_FIRST_ARGUMENT = frozenset({"c10d"})

_warned: set[str] = set()


def collectives_may_run() -> bool:
    """Whether a collective can run in this process (a default process group exists) and
    its results can be kept."""
    return _DETACH is not None and _compat.default_group_exists()


def keep_collective_results(function: Any) -> CollectiveRecord:
    """The part of a checkpoint call of ``function`` that keeps the results of the
    collectives its recomputed code issues (see the module docstring)."""
    return CollectiveRecord(_quiet_key(function))


class _Entry:
    """One collective call of the forward, and what the replay needs to stand in for it
    (an entry of the invocation's collective log, ``recomp._record.EntryLog``)."""

    __slots__ = (
        "op",
        "out_sources",
        "out_spec",
        "rerun",
        "saves_after",
        "versions",
        "written",
        "written_shapes",
    )

    def __init__(self, op: Any) -> None:
        self.op = op
        # Aliases (detached) of the tensors the forward's call wrote into, and their versions.
        self.written: list[torch.Tensor] = []
        self.written_shapes: list[tuple[int, ...]] = []
        self.versions: list[int | None] = []
        # How to rebuild the operator's return value: per leaf, ("arg", i) for the i-th
        # written argument, ("new", alias) for a tensor the operator created, ("work",
        # forward work or None) for a Work, ("value", v) for anything else.
        self.out_sources: list[tuple[str, Any]] = []
        self.out_spec: Any = None
        self.saves_after: int | None = None
        # Set when the kept result cannot be handed back: the replay communicates.
        self.rerun = False

    def changed(self) -> bool:
        return any(
            v is not None and _compat.version(t) != v
            for t, v in zip(self.written + self._new(), self.versions, strict=True)
        )

    def _new(self) -> list[torch.Tensor]:
        return [value for kind, value in self.out_sources if kind == "new"]

    def drop_cache(self) -> None:
        """No replay will reach this call, or its result cannot be handed back: stop
        holding it; a replay that reaches it communicates."""
        self.written, self.out_sources, self.versions = [], [], []
        self.rerun = True

    def release(self) -> None:
        """Nothing is held for the forward alone."""


#: A checkpointed function whose recorded forward issued no collective is recorded again
#: after this many calls.
RECHECK_EVERY = 16

# Checkpointed functions (modules) whose last recorded forward issued no collective ->
# how many more calls run without the record.
_QUIET: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _quiet_key(function: Any) -> Any:
    """What identifies a checkpointed function across calls: a bound method's object (a
    wrapped module's forward is a new bound method per call), else the function."""
    key = getattr(function, "__self__", None)
    key = function if key is None else key
    try:
        weakref.ref(key)
        hash(key)
    except TypeError:
        return None
    return key


#: The kind of the invocation's log that holds the collectives of its forward.
LOG_KIND = "collectives"


class CollectiveRecord(CallPart):
    """The part of a checkpoint call that keeps its collectives' results: the forward
    records them in the invocation's log, in call order; each replay reads them back.

    A call that an enclosing recomp checkpoint's replay re-runs reads the log its
    forward recorded (in its forward too). A collective belongs to the innermost recomp
    checkpoint running when it is issued, as an excluded region's call does: an
    enclosing checkpoint neither records it nor hands it back.
    """

    stage = Stage.COLLECTIVES

    def __init__(self, key: Any = None) -> None:
        self.key = key  # the checkpointed function, for _QUIET
        self.log: EntryLog[_Entry] | None = None

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        invocation = call.invocation
        if call.rerun:
            log = invocation.existing_log(LOG_KIND)
            if log is None:  # its forward recorded none (quiet, or no process group then)
                return None, None
            return _ReplayContext(log, invocation), _ReplayContext(log, invocation)
        key = self.key
        if key is not None:
            skips = _QUIET.get(key, 0)
            if skips:
                _QUIET[key] = skips - 1
                return None, None
        self.log = log = invocation.log(LOG_KIND)
        return _ForwardContext(log, invocation), _ReplayContext(log, invocation)

    def forward_ended(self, ok: bool) -> None:
        log = self.log
        if log is None:
            return
        if not ok:  # no backward will come: hold nothing
            for entry in log:
                entry.drop_cache()
            return
        if self.key is not None:
            if len(log):
                _QUIET.pop(self.key, None)
            else:
                _QUIET[self.key] = RECHECK_EVERY - 1
        if any(not entry.rerun for entry in log):
            KEEPING_RECORDS.add(self)

    def kept_tensors(self) -> list[torch.Tensor]:
        """Aliases of the results held for the replay (``collectives.kept_collective_bytes``)."""
        log = self.log
        return [] if log is None else [t for entry in log for t in entry.written + entry._new()]


def _owns(invocation: Invocation) -> bool:
    """Whether the innermost recomp checkpoint running here is ``invocation``'s."""
    state = get_recompute_state()
    return state is not None and state.record is invocation


def _written_leaves(func: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
    """Positions, among the tensor leaves of ``(args, kwargs)``, of those ``func`` writes into."""
    if kind in _NO_OUTPUT_KINDS:
        return []
    arguments = _compat.op_arguments(func)
    written_args = set()
    if func.namespace in _WRITES_FIRST_ARGUMENT:
        written_args.add(0)  # every classic c10d operator writes into its first argument
    else:
        written_args.update(i for i, (_, writes) in enumerate(arguments) if writes)
    positions: list[int] = []
    index = 0
    for i, (name, _) in enumerate(arguments):
        value = args[i] if i < len(args) else kwargs.get(name)
        leaves, _ = BACKEND.flatten(value)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if i in written_args:
                    positions.append(index)
                index += 1
    return positions


def _tensor_leaves(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensor leaves of the call's arguments, in schema order (as ``_written_leaves`` counts)."""
    out: list[torch.Tensor] = []
    for i, (name, _) in enumerate(_compat.op_arguments(func)):
        value = args[i] if i < len(args) else kwargs.get(name)
        leaves, _ = BACKEND.flatten(value)
        out.extend(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
    return out


# Packages that gather parameters (and reduce their gradients) by themselves. Their
# collectives are about parameters, not activations: keeping a parameter all-gather
# issued in recomputed code (``fully_shard`` on a module inside a checkpointed one)
# would hold the unsharded parameters from the forward to the backward.
_PARAMETER_SHARDING = ("torch.distributed.fsdp", "deepspeed.runtime.zero")


def _issued_by_parameter_sharding() -> bool:
    frame = inspect.currentframe()
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).startswith(_PARAMETER_SHARDING):
            return True
        frame = frame.f_back
    return False


def _kept_kind(func: Any) -> str | None:
    """The kind of collective ``func`` is, if its result can be kept; else None. The
    same answer in the forward and the replay, which must agree on what is kept."""
    kind = collective_kind(func)
    if kind is None or not _compat.op_arguments(func) or _issued_by_parameter_sharding():
        return None
    return kind


def kept_results(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
) -> list[torch.Tensor] | None:
    """The tensors whose aliases a checkpoint's record keeps for this call of ``func``
    (what it wrote into, what it created), or None when ``func`` is not a collective the
    record keeps. The planner counts their storages as what a checkpoint keeps."""
    kind = _kept_kind(func)
    if kind is None:
        return None
    written = _written_tensors(func, kind, args, kwargs)
    out_leaves, _ = BACKEND.flatten(out)
    created = [
        leaf
        for leaf in out_leaves
        if isinstance(leaf, torch.Tensor) and not any(leaf is t for t in written)
    ]
    return written + created


def _written_tensors(
    func: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    leaves = _tensor_leaves(func, args, kwargs)
    return [leaves[i] for i in _written_leaves(func, kind, args, kwargs)]


def _is_wrapper_subclass(types: Any) -> bool:
    # DTensor, AsyncCollectiveTensor: let them run first; their collectives on local
    # tensors come back through the mode.
    return any(t is not torch.Tensor and hasattr(t, "__tensor_flatten__") for t in types)


def _is_work(value: Any) -> bool:
    # The dispatcher hands a c10d operator's Work to Python modes as a script object.
    return isinstance(value, torch.ScriptObject)


# Aliases that share the version counter of what they alias (so in-place changes show).
_DETACH = _compat.version_sharing_detach()


def _detach(t: torch.Tensor) -> torch.Tensor:
    assert _DETACH is not None  # collectives_may_run() is False without it
    return _DETACH(t)


# Makes a completed Work for the replay of an operator that returns one (else the
# forward's own Work, completed by then, is kept and returned again).
_COMPLETED_WORK = _compat.completed_work_factory()


class _RecordMode(TorchDispatchMode):
    """The forward's mode: runs each collective and records what it produced."""

    def __init__(self, log: EntryLog[_Entry], invocation: Invocation, region: Any) -> None:
        super().__init__()
        self.log = log
        self.invocation = invocation
        self.region = region  # the excluded region active when the forward started

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if _is_wrapper_subclass(types):
            return NotImplemented
        out = func(*args, **kwargs)
        kind = _kept_kind(func)
        if kind is not None and active_region() is self.region and _owns(self.invocation):
            with _compat.no_dispatch_modes():
                entry = _record_call(func, kind, args, kwargs, out)
            self.invocation.record(self.log, entry)
        return out


def _record_call(
    func: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
) -> _Entry:
    entry = _Entry(func)
    written = _written_tensors(func, kind, args, kwargs)
    entry.written = [_detach(t) for t in written]
    entry.written_shapes = [tuple(t.shape) for t in written]
    out_leaves, entry.out_spec = BACKEND.flatten(out)
    keep_work = _COMPLETED_WORK is None
    for leaf in out_leaves:
        if isinstance(leaf, torch.Tensor):
            position = next((i for i, t in enumerate(written) if t is leaf), None)
            if position is not None:
                entry.out_sources.append(("arg", position))
            else:
                entry.out_sources.append(("new", _detach(leaf)))
        elif _is_work(leaf):
            entry.out_sources.append(("work", leaf if keep_work else None))
        else:
            entry.out_sources.append(("value", leaf))
    entry.versions = [_compat.version(t) for t in entry.written + entry._new()]
    return entry


class _ReplayMode(TorchDispatchMode):
    """The replay's mode: hands back each recorded result instead of communicating."""

    def __init__(self, log: EntryLog[_Entry], invocation: Invocation) -> None:
        super().__init__()
        self.log = log
        self.invocation = invocation

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if _is_wrapper_subclass(types):
            return NotImplemented
        kind = _kept_kind(func)
        if kind is None or not _owns(self.invocation):
            return func(*args, **kwargs)
        # Excluded regions are skipped in the replay: every collective seen here was recorded.
        entry = self.next_entry(func)
        written = _written_tensors(func, kind, args, kwargs)
        shapes = [tuple(t.shape) for t in written]
        if shapes != entry.written_shapes:
            raise ReplayMismatchError(
                f"The checkpoint's replay called collective {func} with output shapes {shapes}, "
                f"where its forward had {entry.written_shapes}. The checkpointed function must "
                "issue the same collectives on the same shapes in the forward and the replay."
            )
        if entry.rerun or entry.changed():
            _warn_rerun(func, entry)
            entry.drop_cache()
            return func(*args, **kwargs)
        leaves_out = []
        # Bookkeeping, not model ops: modes below (counters, selective checkpointing) see
        # nothing of a collective that the replay does not run.
        with _compat.no_dispatch_modes():
            for target, kept in zip(written, entry.written, strict=True):
                target.copy_(kept)
            for source, value in entry.out_sources:
                if source == "arg":
                    leaves_out.append(written[value])
                elif source == "new":
                    leaves_out.append(_detach(value))
                elif source == "work":
                    leaves_out.append(value if _COMPLETED_WORK is None else _COMPLETED_WORK(written))
                else:
                    leaves_out.append(value)
        return BACKEND.unflatten(leaves_out, entry.out_spec)

    def next_entry(self, func: Any) -> _Entry:
        log = self.log
        entry = log.peek()
        if entry is None:
            raise ReplayMismatchError(
                f"The checkpoint's replay called collective {func}, but its forward issued only "
                f"{len(log)} collective(s) outside excluded regions, all already replayed. The "
                "checkpointed function must issue the same collectives in the forward and the "
                "replay (or pass exclude_collectives=False to the checkpoint)."
            )
        if entry.op is not func:
            raise ReplayMismatchError(
                f"The checkpoint's replay called collective {func} where its forward called "
                f"{entry.op} (collective #{log.cursor + 1} outside excluded regions). The "
                "checkpointed function must issue the same collectives in the same order in "
                "the forward and the replay (or pass exclude_collectives=False to the checkpoint)."
            )
        log.advance()
        return entry


def _warn_rerun(func: Any, entry: _Entry) -> None:
    name = str(func)
    if name in _warned:
        return
    _warned.add(name)
    why = (
        "its result was not kept (no replay was expected to reach it)"
        if entry.rerun
        else "its result was changed in place after the collective"
    )
    warnings.warn(
        f"A recomp checkpoint's replay runs collective {name} again: {why}. Every rank runs "
        "it again, so this is correct, but it communicates twice. Change the result out of "
        "place (x = x * s instead of x.mul_(s)), or exclude the code around it with "
        "checkpoint_exclude_wrapper.",
        CollectiveReplayedWarning,
        stacklevel=2,
    )


class _ForwardContext:
    """Entered with the checkpoint's forward: records its collectives."""

    def __init__(self, log: EntryLog[_Entry], invocation: Invocation) -> None:
        self.log = log
        self.invocation = invocation
        self._modes: list[_RecordMode] = []

    def __enter__(self) -> None:
        mode = _RecordMode(self.log, self.invocation, active_region())
        mode.__enter__()
        self._modes.append(mode)

    def __exit__(self, *exc_info: Any) -> None:
        self._modes.pop().__exit__(*exc_info)


class _ReplayContext:
    """Entered with each replay: hands back the forward's results (the invocation rewinds
    the log when the replay starts)."""

    def __init__(self, log: EntryLog[_Entry], invocation: Invocation) -> None:
        self.log = log
        self.invocation = invocation
        self._modes: list[_ReplayMode | None] = []

    def __enter__(self) -> None:
        # Nothing to hand back: no mode, no cost per operator.
        mode = _ReplayMode(self.log, self.invocation) if len(self.log) else None
        if mode is not None:
            mode.__enter__()
        self._modes.append(mode)

    def __exit__(self, *exc_info: Any) -> None:
        mode = self._modes.pop()
        if mode is not None:
            mode.__exit__(*exc_info)
