"""What one recomp checkpoint call records, shared by its forward and its replays.

An :class:`Invocation` is created per checkpoint call (see ``_engine.begin``)
and carried by the recompute state of that call's forward and replays; the
engine's ``CheckpointCall`` tells it when the forward starts and ends and when a
replay starts. What the forward records is kept in logs (:class:`EntryLog`),
one per kind of call, which the invocation rewinds and prunes together: each
excluded-region call appends one entry to ``regions`` (a
``recomp._region.RegionCall``, known here as a :class:`RegionEntry`),
and parts of the call keep logs of their own (the collectives of
``recomp.torch._collective_cache``, the op outputs that per-op policies keep,
``recomp._op_policy``).
Also here: the pieces a region call is made of (:class:`Snapshot`,
:class:`CachedOutput`, :class:`MutatedInput`, :class:`StorageRegistry`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from ._state import CallIdentity, RecomputeState
from .errors import OutputNotSavedError, ReplayMismatchError, internal_error

if TYPE_CHECKING:
    from ._backend import Backend
    from ._hooks import Held


class Snapshot:
    """A tensor kept by recomp, and a way to tell whether it was changed in place since.

    What is kept is either ``value``, an alias without autograd history (see
    ``Backend.keep_saved``), or ``held``, where a placement (offload) moved it
    (``recomp._hooks.Held``). The version counters of the original and of
    ``value`` are both checked: some frameworks give an alias a counter of its
    own. The original is referenced weakly, except that a cached output holds it
    (``hold=True``) until the end of its checkpoint's forward, when the first
    check runs (``release``): holding it longer would tie the cache to the
    autograd graph in a cycle the collector cannot see (rule 3 of NOTE
    [ How an excluded region is kept out of the replay ]).

    Version counters are read by :meth:`read_versions`, which the engine calls
    once per batch of snapshots (after one ``Backend.sync``), not per tensor.
    """

    __slots__ = ("held", "holding", "origin", "origin_version", "value", "value_version")

    def __init__(
        self, tensor: Any, value: Any, hold: bool = False, held: Held | None = None
    ) -> None:
        self.held = held
        self.value = value if held is None else None
        self.holding = tensor if hold else None
        # Weak from the start: a kept tensor's autograd node holds this snapshot, so a
        # strong reference would close a cycle through the graph (a region that raises
        # before its versions are read would leak it).
        self.origin: Any = weakref.ref(tensor)
        self.origin_version: int | None = None
        self.value_version: int | None = None

    def read_versions(self, backend: Backend) -> None:
        """Record the current versions (the framework's queue already drained)."""
        origin = self.holding if self.holding is not None else self.origin()
        self.value_version = backend.version(self.value)
        self.origin_version = None if origin is None else backend.version(origin)
        if self.origin_version is None:
            self.origin = None

    def retarget(self, tensor: Any, backend: Backend) -> None:
        """Watch ``tensor`` instead of the original: the alias of it that the caller
        receives (frameworks whose aliases have their own version counters)."""
        if self.holding is not None:
            self.holding = tensor
        self.origin = weakref.ref(tensor)
        self.read_versions(backend)

    def changed(self, backend: Backend) -> bool:
        origin = self.holding if self.holding is not None else self.origin and self.origin()
        if origin is not None and backend.version(origin) != self.origin_version:
            return True
        if self.held is not None:
            return self.held.changed()
        return backend.version(self.value) != self.value_version

    def get(self) -> Any:
        """The kept tensor (brought back by its placement if one took it)."""
        return self.value if self.held is None else self.held.get()

    def release(self) -> None:
        self.holding = None


class CachedOutput:
    """One tensor a region returned, as the replay will hand it back."""

    __slots__ = ("copied", "nbytes", "requires_grad", "snapshot")

    def __init__(
        self, snapshot: Snapshot | None, requires_grad: bool, nbytes: int, copied: bool
    ) -> None:
        self.snapshot = snapshot  # None when save_output=False or dropped
        self.requires_grad = requires_grad
        self.nbytes = nbytes
        self.copied = copied  # the cache holds a copy: each replay gets a fresh one


class MutatedInput:
    """A region input the region changed in place: the replay repeats the change."""

    __slots__ = ("index", "snapshot")

    def __init__(self, index: int, snapshot: Snapshot) -> None:
        self.index = index
        self.snapshot = snapshot


class StorageRegistry(dict):  # type: ignore[type-arg]
    """Storages seen in a checkpoint's forward, by ``Backend.storage_key``, each mapped
    to a tensor that owns it, held until the forward ends: while a key is in here its
    memory cannot be freed and its address reused by another tensor (rule 4). A dict,
    so that the look-ups made on every region call cost no Python call."""

    __slots__ = ()


#: What an invocation's registry of region outputs, its uncached outputs and its set of
#: consumed storages are until a region writes one: read, never written (NOTE [ What a
#: call keeps ]).
_NO_STORAGES = StorageRegistry()
_NO_UNSAVED: Mapping[Hashable, str] = MappingProxyType({})
_NO_KEYS: frozenset[Hashable] = frozenset()


def callee_identity(fn: Any) -> Any:
    """What identifies the code a region runs, across wrapper objects: the module or
    object of a bound method with its function, a function's code, else the callable.
    A module made around a plain function (``_recomp_function``) is that function."""
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", None)
    if owner is not None and func is not None:
        inner = getattr(owner, "_recomp_function", None)
        return callee_identity(inner) if inner is not None else (owner, func)
    return getattr(fn, "__code__", None) or fn


def describe_callee(callee: Any) -> str:
    """A readable name for a :func:`callee_identity`."""
    if isinstance(callee, tuple):
        owner, func = callee
        return (
            f"{type(owner).__name__}.{getattr(func, '__name__', func)} of object at {id(owner):#x}"
        )
    code = getattr(callee, "co_name", None)
    if code is not None:
        return f"function {code} at {callee.co_filename}:{callee.co_firstlineno}"
    return repr(callee)


class LogEntry(Protocol):
    """What an :class:`EntryLog` needs of one recorded call, whatever its kind."""

    #: how many tensors the checkpoint had saved when the call was recorded (None: unknown)
    saves_after: int | None

    def drop_cache(self) -> None:
        """No replay will reach this call (early stop): stop holding what it recorded."""

    def release(self) -> None:
        """The forward is over: stop holding what only the forward needed."""


E = TypeVar("E", bound=LogEntry)


class EntryLog(Generic[E]):
    """The calls of one kind that a checkpoint call's forward recorded, in call order.

    Each replay reads them back from the first (rule 2 of NOTE [ How an excluded region
    is kept out of the replay ]): the invocation rewinds every log when a replay starts
    and prunes every log at the end of the forward (rule 8), whatever kind of call the
    log holds (excluded-region calls, collectives, kept op outputs). ``rerun_reads``:
    whether a re-run of the call by an enclosing recomp checkpoint's replay reads the
    log back (then a nested call's log is not pruned, rule 8)."""

    __slots__ = ("__weakref__", "cursor", "entries", "kind", "rerun_reads")

    def __init__(self, kind: str, rerun_reads: bool = True) -> None:
        self.kind = kind
        self.rerun_reads = rerun_reads
        # A list from the first entry on (``add``); most logs of most calls stay empty.
        self.entries: list[E] | tuple[()] = ()
        self.cursor = 0

    def add(self, entry: E) -> None:
        if self.entries:
            self.entries.append(entry)  # type: ignore[union-attr]  # not empty: a list
        else:
            self.entries = [entry]

    def peek(self) -> E | None:
        """The entry the replay reaches next, or None when all were read."""
        cursor = self.cursor
        return self.entries[cursor] if cursor < len(self.entries) else None

    def advance(self) -> None:
        self.cursor += 1

    def __iter__(self) -> Iterator[E]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


#: An invocation's log of excluded-region calls until the first is recorded: never written
#: (rewinding it sets its cursor to where it is).
_NO_REGIONS: EntryLog[Any] = EntryLog("excluded regions")


class RegionEntry(LogEntry, Protocol):
    """What an :class:`Invocation` needs of one recorded excluded-region call, an entry
    of its ``regions`` log (``recomp._region.RegionCall``)."""

    def matches(self, region: Any, fn: Any) -> bool:
        """Whether a replay's call of ``region`` running ``fn`` is this call."""

    def describe(self) -> str:
        """The region and what it called, for error messages."""

    def replay(self, region: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Hand the cached outputs to the replay's call instead of running the region."""

    def check_outputs_unchanged(self) -> None:
        """Raise if a cached output was changed in place since the call returned."""


class Invocation(CallIdentity):
    """Everything one checkpoint call shares between its forward and its replays.

    Held by the recompute state that the framework's checkpoint keeps in its
    frame (through ``context_fn``), so it lives exactly as long as the
    checkpoint's autograd graph (rule 2 of NOTE [ How an excluded region is kept
    out of the replay ]). Only its own methods change it.
    """

    __slots__ = (
        "__weakref__",
        "_consumed",
        "_input_keys",
        "_inputs",
        "_logs",
        "_rerun_whole",
        "_save_counter",
        "_unsaved_outputs",
        "align_rng",
        "backend",
        "child_cursor",
        "children",
        "excluded_outputs",
        "placer",
        "regions",
        "replays",
        "rewind",
        "root",
    )

    def __init__(self, backend: Backend, *, align_rng: bool = True, rewind: bool = True) -> None:
        # What the user sees of this call (its id, its resources), the same in every phase:
        # the invocation itself (one object fewer per call: NOTE [ What a call keeps ]).
        CallIdentity.__init__(self)
        self.backend = backend
        # Whether the replay restores the RNG state of the forward; only then
        # does skipping a region need to fast-forward the generators.
        self.align_rng = align_rng
        # Whether each replay starts from the first entry (always, but for the test
        # seam that shows why it must).
        self.rewind = rewind
        # Where the excluded regions called inside keep their tensors when they name no
        # place of their own (``checkpoint(..., saved_tensors_hooks=...)``); None: the device.
        self.placer: Any = None
        # Exclusion cache: one entry per excluded-region call, in call order (the shared
        # empty log until the first call is recorded: NOTE [ What a call keeps ]).
        self.regions: EntryLog[RegionEntry] = _NO_REGIONS
        # The other logs of the call, which parts add (``log``); a tuple, most often empty.
        self._logs: tuple[EntryLog[Any], ...] = ()
        self.replays = 0  # replays started so far (one per backward that needs this call)
        # The module the checkpoint runs (weakly; None for a plain function), for messages
        # that name modules by their paths in it.
        self.root: Callable[[], Any] = _nothing
        # The checkpoint's own tensor inputs and the storages of the outputs of excluded
        # regions (forward only): region inputs that alias these are already held
        # elsewhere, so a region saves them as they are instead of deferring. The
        # inputs' storages are looked up when a region first asks
        # (``checkpoint_inputs``): most calls run no region.
        self._inputs: Sequence[Any] = ()
        self._input_keys: StorageRegistry | None = None
        # (Made when a region first returns one: the shared empty registry till then.)
        self.excluded_outputs: StorageRegistry = _NO_STORAGES
        # save_output=False outputs (storage -> region name) and the storages that
        # later excluded regions took as inputs: each of the former must be among the latter.
        self._unsaved_outputs: dict[Hashable, str] | Mapping[Hashable, str] = _NO_UNSAVED
        self._consumed: set[Hashable] | frozenset[Hashable] = _NO_KEYS
        # Recomp checkpoints called inside this one's forward, in call order. The
        # replay re-runs those calls; each reuses its invocation (see next_child).
        self.children: list[Invocation] | tuple[()] = ()
        self.child_cursor = 0
        # How many tensors the framework's checkpoint has saved so far, when its
        # replay stops after the last of them (early stop); None if unknown or not
        # applicable. Asked once, when the forward starts (``on_forward_start``),
        # directly under the checkpoint's own saved-tensor hook.
        self._save_counter: Callable[[], int | None] | None = None
        # An enclosing recomp checkpoint's replay re-runs this call whole (``add_child``).
        self._rerun_whole = False

    # -- what the forward records --------------------------------------------------

    def set_checkpoint_inputs(self, tensors: Sequence[Any]) -> None:
        """The tensors the checkpoint takes as input (held by the checkpoint anyway)."""
        self._inputs = tensors
        self._input_keys = None

    @property
    def checkpoint_inputs(self) -> StorageRegistry:
        """The storages of the checkpoint's tensor inputs (``Backend.storage_key``), each
        with a tensor on it, until the forward ends."""
        keys = self._input_keys
        if keys is None:
            keys = self._input_keys = StorageRegistry()
            storage_key = self.backend.storage_key
            for tensor in self._inputs:
                key = storage_key(tensor)
                if key is not None:
                    keys.setdefault(key, tensor)
        return keys

    def add_child(self, child: Invocation) -> None:
        """A recomp checkpoint called inside this one's forward. The parent's replay
        re-runs it in full, beyond where its own replay would stop, so it keeps every
        entry of the logs that re-run reads back (rule 8)."""
        if self.children:
            self.children.append(child)  # type: ignore[union-attr]  # not empty: a list
        else:
            self.children = [child]
        child._rerun_whole = True

    def log(self, kind: str, *, rerun_reads: bool = True) -> EntryLog[Any]:
        """The log of calls of ``kind`` (made on first use, with ``rerun_reads``, see
        :class:`EntryLog`), rewound and pruned with the others and the regions' log."""
        for log in self._logs:
            if log.kind == kind:
                return log
        log = EntryLog[Any](kind, rerun_reads)
        self._logs = (*self._logs, log)
        return log

    def existing_log(self, kind: str) -> EntryLog[Any] | None:
        """The log of calls of ``kind`` if the forward made one (not the regions')."""
        return next((log for log in self._logs if log.kind == kind), None)

    def record(self, log: EntryLog[E], entry: E) -> None:
        """Append ``entry`` to ``log`` with the number of tensors saved so far (rule 8)."""
        counter = self._save_counter
        entry.saves_after = None if counter is None else counter()
        log.add(entry)

    def record_call(self, call: RegionEntry) -> None:
        """An excluded-region call returned and everything it keeps is recorded (rule 7)."""
        counter = self._save_counter
        call.saves_after = None if counter is None else counter()
        if self.regions is _NO_REGIONS:
            self.regions = EntryLog(_NO_REGIONS.kind)
        self.regions.add(call)

    def note_input(self, key: Hashable) -> bool:
        """A region takes a tensor on storage ``key`` as input: whether the replay
        recomputes it (so the region may defer it, NOTE [ Deferred inputs ]). Not the
        checkpoint's own inputs, nor earlier regions' outputs, which now count as
        consumed (D2)."""
        if key in self.excluded_outputs:
            if self._consumed is _NO_KEYS:
                self._consumed = set()
            self._consumed.add(key)  # type: ignore[union-attr]  # made above
            return False
        return key not in self.checkpoint_inputs

    def note_output(self, key: Hashable, tensor: Any, unsaved_by: str | None) -> None:
        """A region returned ``tensor``; ``unsaved_by`` names the region if its output is
        not cached (``save_output=False``), which a later region must then consume."""
        if self.excluded_outputs is _NO_STORAGES:
            self.excluded_outputs = StorageRegistry()
        self.excluded_outputs.setdefault(key, tensor)
        if unsaved_by is not None:
            if self._unsaved_outputs is _NO_UNSAVED:
                self._unsaved_outputs = {}
            self._unsaved_outputs[key] = unsaved_by  # type: ignore[index]  # made above

    # -- what a replay reads -------------------------------------------------------

    def next_entry(self, region: Any, fn: Any, name: str) -> RegionEntry:
        """The recorded call that the replay's call of ``region`` (running ``fn``) stands
        for: entries are consumed in call order (rule 2)."""
        regions = self.regions
        cursor = regions.cursor  # read inline: this runs for every region call of a replay
        if cursor >= len(regions.entries):
            raise ReplayMismatchError(
                f"The checkpoint's replay called excluded region {name!r}, but its forward "
                f"recorded only {len(regions)} excluded call(s), all already replayed. The "
                "checkpointed function must call its excluded regions in the same order and "
                "number in the forward and in the replay (no control flow that depends on "
                "is_recomputing() or on values that change between the two)."
            )
        entry = regions.entries[cursor]
        if not entry.matches(region, fn):
            raise ReplayMismatchError(
                f"The checkpoint's replay called excluded region {name!r} "
                f"({describe_callee(callee_identity(fn))}) where its forward called "
                f"{entry.describe()} (excluded call #{cursor + 1}). The checkpointed "
                "function must call its excluded regions in the same order in the forward and "
                "in the replay."
            )
        regions.cursor = cursor + 1
        return entry

    def next_child(self) -> Invocation:
        """The invocation of the nested checkpoint that this replay is re-running."""
        if self.child_cursor >= len(self.children):
            raise ReplayMismatchError(
                f"The replay of a checkpoint called a nested recomp checkpoint that its forward "
                f"did not ({len(self.children)} nested call(s) recorded). The checkpointed "
                "function must make the same checkpoint calls in the forward and the replay."
            )
        child = self.children[self.child_cursor]
        self.child_cursor += 1
        return child

    # -- phases (told by the checkpoint call, ``recomp._engine.CheckpointCall``) ---------

    def on_forward_start(self) -> None:
        """The forward begins directly under the checkpoint's saved-tensor hook: the one
        place where the save counter is asked for."""
        self._save_counter = self.backend.save_counter()

    def on_replay_start(self) -> None:
        """Each replay starts from the first entry of every log (rule 2)."""
        self.replays += 1
        if self.rewind:
            self.regions.cursor = 0
            for log in self._logs:
                log.cursor = 0
            self.child_cursor = 0

    def on_forward_end(self, ok: bool) -> None:
        """End of the checkpoint's forward: prune, check and release every log."""
        counter, self._save_counter = self._save_counter, None
        self._inputs = ()
        if self._input_keys is not None:
            self._input_keys.clear()  # region calls hold the registry itself
        if (
            not self._logs
            and not self.regions.entries
            and not self.excluded_outputs
            and not self._unsaved_outputs
        ):
            return  # no region ran, nothing else was recorded: nothing to check or release
        unsaved, consumed = self._unsaved_outputs, self._consumed
        self._unsaved_outputs, self._consumed = _NO_UNSAVED, _NO_KEYS
        self.excluded_outputs = _NO_STORAGES
        try:
            if not ok:
                return
            logs = (self.regions, *self._logs)
            recorded = False  # any call recorded (no comprehension: read at every call)
            for log in logs:
                if log.entries:
                    recorded = True
                    break
            if counter is not None and recorded:
                # A replay that stops at the last saved tensor never reaches the calls
                # recorded after it: what they hold would only take memory (rule 8);
                # but a re-run by an enclosing replay reads some logs to their end.
                total = counter()
                for log in logs if total is not None else ():
                    if self._rerun_whole and log.rerun_reads:
                        continue
                    for entry in log.entries:
                        if entry.saves_after == total:
                            entry.drop_cache()
            if self.regions.entries:
                self.backend.sync()
            for call in self.regions.entries:
                call.check_outputs_unchanged()
        finally:
            for log in (self.regions, *self._logs):
                for entry in log.entries:
                    entry.release()
        for key, name in unsaved.items():
            if key not in consumed:
                raise OutputNotSavedError(
                    f"The output of excluded region {name!r} was created with save_output=False "
                    "but did not go into another excluded region of the same checkpoint. Without "
                    "a cached copy the replay cannot hand it to other code. Use save_output=True "
                    "for this region."
                )


def invocation_of(state: RecomputeState) -> Invocation:
    """The engine's record of the checkpoint call ``state`` belongs to."""
    record = state.record
    if not isinstance(record, Invocation):
        raise internal_error("a recompute state carries no invocation")
    return record


# --------------------------------------------------------------------------- checkpoint


def _nothing() -> None:
    return None


def weak_or_nothing(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj``, or a function returning None where ``obj`` is None or
    cannot be referenced weakly."""
    if obj is None:
        return _nothing
    try:
        return weakref.ref(obj)
    except TypeError:
        return _nothing
