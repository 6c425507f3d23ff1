"""What saved-tensors hooks keep when they may move storages to the host: the records of
what was saved (one per storage), the handles autograd holds, the moves and the reads
(:class:`SavedStorages`); and one step of an offload session on PyTorch, which adds its
trace, its budget and its plan (:class:`_Step`; NOTE [ Offload sessions ] in
``recomp.torch._offload_session``, whose numbers the comments here cite). A pipeline
micro-batch's swap group (``recomp.torch._pipeline_swap``) is a :class:`SavedStorages`
too."""

from __future__ import annotations

import contextvars
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._offload_plan import OffloadPlan, TraceRecorder
from .._offload_session import OffloadStepStats
from ..errors import CachedValueMutatedError, OffloadTraceWarning, RecompError, format_bytes
from . import _compat
from ._offload import Offloader, OffloadGroup, _quiet
from ._swap.hooks import _stays_on_device

if TYPE_CHECKING:
    from ._offload_session import OffloadSession


class _Record:
    """One storage saved (NOTE [ Offload sessions ], 1)."""

    __slots__ = ("__weakref__", "aborted", "alias", "index", "movable", "nbytes", "origin",
                 "owner", "read", "stored", "views")  # fmt: skip

    def __init__(
        self, owner: SavedStorages, index: int, alias: torch.Tensor, nbytes: int, movable: bool
    ) -> None:
        self.owner = owner
        self.index = index  # its storage index (in a session's step, in the trace)
        self.alias: torch.Tensor | None = alias
        # The tensor first saved, weakly: its version counter (shared by every view of
        # the storage) tells a change in place after the record moved.
        self.origin: Any = None
        self.nbytes = nbytes
        self.movable = movable
        self.stored: Any = None  # the offloader's record once moved
        self.views = 0
        self.read = False
        self.aborted = False


class _Handle:
    """What autograd holds for one save: its record and the view to rebuild (recomp's
    ``Held`` too, for what a checkpoint keeps)."""

    __slots__ = ("dtype", "offset", "record", "size", "stride", "version")

    def __init__(self, record: _Record, t: torch.Tensor) -> None:
        self.record = record
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.version = _compat.version(t)

    def get(self) -> torch.Tensor:
        return self.record.owner.read(self)

    def changed(self) -> bool:  # the session raises on read instead (NOTE, 4)
        return False


class SavedStorages:
    """The storages one owner's saved-tensors hooks recorded, one :class:`_Record` per
    storage (every saved view of it shares the record), and what may happen to them:
    moved to the host (:meth:`move`), brought back (:meth:`prefetch`), read by backward
    (:meth:`read`), all dropped after an exception (:meth:`abort`). ``stats`` is updated
    as they go (an ``OffloadStepStats`` or an object with its byte fields); ``group`` is
    the offloader's group the moves go through (None: nothing moves here)."""

    # Who holds the saves, for the errors a read raises.
    owner_name = "an OffloadSession step"

    def __init__(self, offloader: Offloader, pool: Any, stats: Any) -> None:
        self.off = offloader
        self.pool = pool
        self.stats = stats
        self.group: OffloadGroup | None = None
        self.records: list[weakref.ref[_Record]] = []  # by storage index
        self.by_key: weakref.WeakValueDictionary[Hashable, _Record] = (
            weakref.WeakValueDictionary()
        )
        self.movable: dict[int, weakref.ref[_Record]] = {}  # resident, oldest first
        self.holding: dict[int, int] = {}  # storage index -> device bytes held for it
        self.held = 0
        self.host_full = False

    # -- saves ---------------------------------------------------------------------

    def record(self, t: torch.Tensor, where: str | None) -> _Record | None:
        """The record of ``t``'s storage (made on its first save), one view more; None
        for a parameter or a tensor without a storage of its own (not an activation)."""
        key = None if _stays_on_device(t) else _compat.storage_key(t)
        if key is None:
            return None
        rec = self.by_key.get(key)
        if rec is None or rec.alias is None:
            rec = self.new_record(t, where)
            self.by_key[key] = rec
        rec.views += 1
        return rec

    def new_record(self, t: torch.Tensor, where: str | None) -> _Record:
        nbytes = t.untyped_storage().nbytes()
        movable = self.group is not None and self.off.eligible(t)
        index = self.storage_index(t, nbytes, movable, where)
        rec = _Record(self, index, t.detach(), nbytes, movable)
        rec.origin = weakref.ref(t)
        self.records.append(weakref.ref(rec, self._died(index)))
        if movable:
            self.movable[index] = weakref.ref(rec)
        self.stats.saved_bytes += nbytes
        self.hold(index, nbytes)
        return rec

    def storage_index(self, t: torch.Tensor, nbytes: int, movable: bool, where: str | None) -> int:
        """The index of a new record (its place in :attr:`records`)."""
        return len(self.records)

    def _died(self, index: int) -> Callable[[Any], None]:
        owner = weakref.ref(self)

        def died(_: Any) -> None:  # the graph let go of the record
            s = owner()
            if s is not None:
                s.unhold(index)
                s.movable.pop(index, None)

        return died

    # -- device bytes --------------------------------------------------------------

    def hold(self, index: int, nbytes: int) -> int:
        """Count ``nbytes`` more on the device for record ``index``; returns what is held
        now, copies to the host still in flight included."""
        self.holding[index] = self.holding.get(index, 0) + nbytes
        self.held += nbytes
        total = self.held + (self.off.pending_bytes if self.off.pending_copies else 0)
        stats = self.stats
        stats.peak_resident_bytes = max(stats.peak_resident_bytes, total)
        return total

    def unhold(self, index: int) -> None:
        self.held -= self.holding.pop(index, 0)

    # -- moving --------------------------------------------------------------------

    def move(self, rec: _Record) -> bool:
        """Copy ``rec`` to the host and drop its alias; False if it cannot move."""
        group = self.group
        if rec.alias is None or not rec.movable or group is None:
            return False
        self.movable.pop(rec.index, None)
        if not self.pool.fits(rec.nbytes):
            self.host_full = True
            return False
        stored = group.take(rec.alias)
        stored.views = rec.views
        rec.stored, rec.alias = stored, None
        self.unhold(rec.index)
        self.stats.offloaded_bytes += rec.nbytes
        self.off.poll()
        return True

    def prefetch(self, rec: _Record) -> None:
        """Start bringing ``rec`` back to the device, if it is on the host only."""
        stored = rec.stored
        if stored is None or stored.resident is not None or stored.source is not None:
            return
        self.group.bring_back(stored)  # type: ignore[union-attr]
        self.stats.prefetched_bytes += rec.nbytes
        self.stats.restored_bytes += rec.nbytes
        self.hold(rec.index, rec.nbytes)

    # -- reads ---------------------------------------------------------------------

    def on_read(self, rec: _Record) -> None:
        """A read of ``rec`` begins (a session's step counts it as an event)."""
        if self.off.pending_copies:
            self.off.poll()

    def read(self, handle: _Handle) -> torch.Tensor:
        rec = handle.record
        if rec.aborted:
            raise RecompError(
                f"A tensor saved under {self.owner_name} that ended with an exception was "
                "read by backward: its host copies were dropped. Run the step again (forward "
                "and backward) instead of reusing its graph."
            )
        rec.read = True
        self.on_read(rec)
        origin = rec.origin()
        now = _compat.version(origin if origin is not None else rec.alias)  # type: ignore[arg-type]
        if now is not None and handle.version is not None and now != handle.version:
            raise _changed(handle, self.owner_name)
        flat = rec.alias if rec.stored is None else self.fetch(rec, handle)
        with _quiet():
            out = torch.empty(0, dtype=handle.dtype, device=flat.device)  # type: ignore[union-attr]
            out.set_(flat.untyped_storage(), handle.offset, handle.size, handle.stride)  # type: ignore[union-attr]
        return out

    def fetch(self, rec: _Record, handle: _Handle) -> torch.Tensor:
        stored = rec.stored
        copied = stored.source_version
        if stored.changed() or (
            copied is not None and handle.version is not None and copied != handle.version
        ):
            raise _changed(handle, self.owner_name)
        stats = self.stats
        was_back = stored.resident is not None
        in_flight = stored.source is not None
        if not was_back and not in_flight:
            stats.on_demand_bytes += rec.nbytes
            stats.restored_bytes += rec.nbytes
            stats.unhidden_copies += 1
        elif was_back and stored.ready is not None and not stored.ready.query():
            stats.unhidden_copies += 1
        flat = self.group.read(stored)  # type: ignore[union-attr]
        if not was_back and not in_flight:
            self.hold(rec.index, rec.nbytes)
        if not in_flight and stored.resident is None:
            self.unhold(rec.index)  # every view read: autograd owns the buffer now
        return flat  # type: ignore[no-any-return]

    # -- end -------------------------------------------------------------------------

    def settled(self) -> bool:
        """Whether backward has read what was saved (or the graph is gone)."""
        for ref in self.records:
            rec = ref()
            if rec is not None and not rec.read:
                return False
        return True

    def abort(self) -> None:
        """NOTE [ Offload sessions ], 6: wait for every copy, drop every host copy."""
        self.off.synchronize()
        for ref in self.records:
            rec = ref()
            if rec is None:
                continue
            stored = rec.stored
            if stored is not None:
                stored.host = stored.resident = stored.source = None
                if stored.release is not None:
                    stored.release()
            rec.stored = rec.alias = None
            rec.aborted = True
        self.movable.clear()
        self.holding.clear()
        self.held = 0


class _Step(SavedStorages):
    """One entry of a session: its trace, its budget, its plan, over what it saved."""

    def __init__(self, session: OffloadSession, number: int, plan: OffloadPlan | None) -> None:
        super().__init__(
            session.offloader,
            session.pool,
            OffloadStepStats(step=number, mode="replay" if plan else "warmup"),
        )
        self.session = weakref.ref(session)
        self.budget = session.config.budget_bytes
        self.recorder: TraceRecorder | None = None if plan else TraceRecorder()
        self.plan = plan
        self.following = plan is not None
        self.evict_at: dict[int, int] = {}
        self.prefetch_at: dict[int, list[int]] = {}  # event -> marks of the storages' last saves
        if plan is not None:
            self.evict_at = plan.evictions()
            mark_of = plan.trace.mark_of_event()
            storages = plan.trace.storages
            for event, indices in plan.prefetches().items():
                self.prefetch_at[event] = [mark_of[storages[i].saves[-1]] for i in indices]
        self.mark_records: list[weakref.ref[_Record] | None] = []
        self.marks = 0
        self.events = 0
        self.timing: list[Any] | None = None

    # -- saves ---------------------------------------------------------------------

    def save(self, t: torch.Tensor, where: str | None) -> Any:
        mark = (tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device.type)
        self.check_mark(mark)
        rec = self.record(t, where)
        if rec is None:  # a parameter, or no storage of its own: not an activation here
            if self.recorder is not None:
                self.recorder.untracked(mark)
            self.mark_records.append(None)
            self.after_event()
            return t if isinstance(t, nn.Parameter) else t.detach()
        handle = _Handle(rec, t)
        if self.recorder is not None:
            self.recorder.save(rec.index, mark)
        self.mark_records.append(weakref.ref(rec))
        if self.following and (self.marks - 1) in self.evict_at:
            self.move(rec)
        self.enforce_budget()
        self.after_event()
        return handle

    def storage_index(self, t: torch.Tensor, nbytes: int, movable: bool, where: str | None) -> int:
        if self.recorder is None:
            return len(self.records)
        label = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
        if where:
            label += f" in {where}"
        why = None if movable else self.why_kept(t, nbytes)
        host = self.pool.block_size(nbytes)
        return self.recorder.new_storage(nbytes, label, movable, why, host)

    def why_kept(self, t: torch.Tensor, nbytes: int) -> str:
        if self.group is None:
            return (
                "nothing moves here (no CUDA device; RECOMP_OFFLOAD_HOST_COPY=1 is the CPU "
                "test mode)"
            )
        if nbytes < self.off.min_bytes:
            return f"smaller than min_offload_bytes ({format_bytes(self.off.min_bytes)})"
        return f"a {type(t).__name__} on {t.device.type} that the offloader does not move"

    def region(self, name: str) -> None:
        self.check_mark(("region", name))
        if self.recorder is not None:
            self.recorder.region(name)
        self.mark_records.append(None)
        self.after_event()

    def check_mark(self, mark: tuple[Any, ...]) -> None:
        i = self.marks
        self.marks += 1
        if not self.following:
            return
        traced = self.plan.trace.marks  # type: ignore[union-attr]
        if i < len(traced) and traced[i] == mark:
            return
        was = (
            f"is {_describe(traced[i])}" if i < len(traced) else f"saved only {len(traced)}"
        )
        self.leave_plan(f"save #{i} is {_describe(mark)}, where the traced step's {was}")

    def leave_plan(self, why: str) -> None:
        self.following = False
        self.stats.mode = "online"
        self.stats.mismatch = why
        session = self.session()
        if session is not None:
            session.retrace = True
        warnings.warn(
            f"OffloadSession step {self.stats.step} differs from the traced step: {why}. This "
            "step leaves the plan (tensors move when the budget is passed) and the next step "
            "is traced again. If the difference comes from dynamic code, mark that code "
            "with @skip_offload.",
            OffloadTraceWarning,
            stacklevel=2,
        )

    # -- device bytes --------------------------------------------------------------

    def hold(self, index: int, nbytes: int) -> int:
        total = super().hold(index, nbytes)
        stats = self.stats
        stats.over_budget_bytes = max(stats.over_budget_bytes, total - self.budget)
        return total

    # -- moving --------------------------------------------------------------------

    def enforce_budget(self) -> None:
        """Move the oldest movable records while the session holds more than the budget."""
        while self.held > self.budget and self.movable:
            index = next(iter(self.movable))
            rec = self.movable.pop(index)()
            if rec is not None and self.move(rec):
                self.stats.unplanned_evictions += 1

    def after_event(self) -> None:
        event = self.events
        self.events += 1
        if self.off.pending_copies:
            self.off.poll()  # copies to the host that are done give their storage back
        if self.timing is not None:
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            self.timing.append(done)
        if self.following and event in self.prefetch_at:
            for mark in self.prefetch_at[event]:
                ref = self.mark_records[mark] if mark < len(self.mark_records) else None
                rec = ref() if ref is not None else None
                if rec is not None:
                    self.prefetch(rec)

    # -- reads ---------------------------------------------------------------------

    def on_read(self, rec: _Record) -> None:
        if self.recorder is not None:
            self.recorder.read(rec.index)
        self.after_event()

    # -- end -------------------------------------------------------------------------

    def abort(self) -> None:
        super().abort()
        self.recorder = None
        self.following = False
        self.timing = None


# The placer of saved-tensors hooks entered for a part of a step (a pipeline stage's
# forward under pipeline swap), ahead of a session's: ``_offload_session.active_placer``.
SCOPED_PLACER: contextvars.ContextVar[HookPlacer | None] = contextvars.ContextVar(
    "recomp_scoped_placer", default=None
)


def unpack_saved(held: Any) -> Any:
    """The unpack of every hook whose pack may return a :class:`_Handle`."""
    return held.get() if isinstance(held, _Handle) else held


class HookPlacer:
    """Where a recomp checkpoint keeps what it keeps (its saved inputs, what its excluded
    regions keep) while saved-tensors hooks that record storages are on: each goes
    through ``pack(t, where)``, which returns a :class:`_Handle` or the tensor itself
    (``recomp.torch.checkpoint`` asks ``_offload_session.active_placer()`` for it)."""

    def __init__(self, pack: Callable[[torch.Tensor, str], Any]) -> None:
        self.pack = pack

    def open_group(self, name: str) -> _RegionPlacement | None:
        return _RegionPlacement(self, name)

    def input_hooks(self) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        def pack_input(t: torch.Tensor) -> Any:
            return t if t.numel() == 0 else self.pack(t, "a checkpoint's inputs")

        return pack_input, unpack_saved


class _RegionPlacement:
    __slots__ = ("name", "placer")

    # The checkpoint's saved inputs go through the same pack (one record per storage).
    holds_checkpoint_inputs = True

    def __init__(self, placer: HookPlacer, name: str) -> None:
        self.placer = placer
        self.name = name

    def put(self, t: torch.Tensor) -> Any:
        held = self.placer.pack(t, self.name)
        return held if isinstance(held, _Handle) else None

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


def _changed(handle: _Handle, owner: str) -> CachedValueMutatedError:
    return CachedValueMutatedError(
        f"A tensor saved for backward under {owner} ({handle.dtype}"
        f"{list(handle.size)}) was changed in place after it was saved, so backward would "
        "read the changed value. PyTorch raises the same without the session: make the "
        "in-place operation out-of-place (e.g. `x = x.relu()` instead of `x.relu_()`), or "
        "clone the tensor before changing it."
    )


def _describe(mark: tuple[Any, ...]) -> str:
    if mark and mark[0] == "region":
        return f"the skip_offload region {mark[1]!r}"
    shape, dtype, device = mark
    return f"a {dtype}{list(shape)} tensor on {device}"
