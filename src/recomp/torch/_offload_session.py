"""The offload session on PyTorch: every tensor a step saves for backward, kept on the
device up to a budget and moved to the host beyond it, first online, then by a plan.

NOTE [ Offload sessions ]

``with session:`` pushes one pair of saved-tensors hooks for the step (forward and
backward) and makes itself the place where recomp's checkpoints keep what they keep:
a checkpoint's saved inputs and what its excluded regions keep pass through the same
pack and unpack (``active_placer``, read by ``recomp.torch.checkpoint`` when the call
names no place of its own). What a checkpoint drops and replays is not saved at all.

1. Pack: each save of a tensor on a storage is one event of the step's trace
   (``recomp._offload_plan``). Saves of one storage share one record, which holds a
   detached alias of it (the device memory) until it moves. Parameters and tensors
   without a storage of their own pass through unrecorded; what cannot move (under
   ``min_offload_bytes``, not on a device the offloader serves) is recorded and stays.
2. Moving a record is the offloader's copy to the host (``recomp.torch._offload``: a
   side stream on CUDA, the host-copy mode on CPU), into a block of the session's
   bounded pinned pool; the record drops its alias and the copy in flight holds the
   device storage until it completes.
3. The first entry traces: whenever the bytes the session holds pass the budget, the
   oldest movable records move (the last ones backward reads). When the step's
   backward has read what it saved, the planner builds a plan from the trace; later
   entries replay it: a record moves after the save the plan names, and comes back
   at the event the plan names (a copy back started ahead). The budget check stays
   on in a replay, for what the plan did not foresee.
4. Unpack rebuilds the saved view on the record's storage, on the device: the alias,
   or the bytes brought back (waiting for the copy, or copying back then). A tensor
   changed in place after its save raises, as autograd does without hooks.
5. A replay compares each save with the traced one (shape, dtype, device). At the
   first difference, or a different number of saves, it warns
   (``OffloadTraceWarning``), leaves the plan for the rest of the step (the budget
   check still moves tensors) and the next entry traces again. The plan only decides
   when bytes move; each handle reads its own record, so no difference can hand
   backward a wrong tensor.
6. An exception inside the block waits for every copy, drops the step's host blocks
   (a later read of them raises), frees the pool's idle blocks and pops the hooks.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from .._offload_plan import BudgetPlanner, OffloadPlan, OffloadTrace, TraceRecorder
from .._offload_session import (
    ACTIVE,
    MIB,
    OPAQUE,
    OffloadConfig,
    OffloadStepStats,
    refuse_nesting,
)
from .._offload_session import skip_offload as skip_offload
from ..errors import CachedValueMutatedError, OffloadTraceWarning, RecompError, format_bytes
from . import _compat
from ._offload import Offloader, OffloadGroup, _quiet
from ._swap.hooks import _stays_on_device
from ._swap.pool import PinnedMemoryPool


class _Record:
    """One storage the step saved (NOTE [ Offload sessions ], 1)."""

    __slots__ = ("__weakref__", "aborted", "alias", "index", "movable", "nbytes", "origin",
                 "read", "step", "stored", "views")  # fmt: skip

    def __init__(self, step: _Step, index: int, alias: torch.Tensor, nbytes: int, movable: bool):
        self.step = step
        self.index = index  # its storage index in the step's trace
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
        return self.record.step.read(self)

    def changed(self) -> bool:  # the session raises on read instead (NOTE, 4)
        return False


class _Step:
    """One entry of a session: its trace, its counters, what it holds on the device."""

    def __init__(self, session: OffloadSession, number: int, plan: OffloadPlan | None) -> None:
        self.session = weakref.ref(session)
        self.off = session.offloader
        self.pool = session.pool
        self.budget = session.config.budget_bytes
        self.stats = OffloadStepStats(step=number, mode="replay" if plan else "warmup")
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
        self.group: OffloadGroup | None = None
        self.records: list[weakref.ref[_Record]] = []  # by storage index
        self.by_key: weakref.WeakValueDictionary[Hashable, _Record] = (
            weakref.WeakValueDictionary()
        )
        self.mark_records: list[weakref.ref[_Record] | None] = []
        self.movable: dict[int, weakref.ref[_Record]] = {}  # resident, oldest first
        self.holding: dict[int, int] = {}  # storage index -> device bytes held for it
        self.held = 0
        self.marks = 0
        self.events = 0
        self.timing: list[Any] | None = None
        self.host_full = False

    # -- saves ---------------------------------------------------------------------

    def save(self, t: torch.Tensor, where: str | None) -> Any:
        mark = (tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device.type)
        self.check_mark(mark)
        key = None if _stays_on_device(t) else _compat.storage_key(t)
        if key is None:  # a parameter, or no storage of its own: not an activation here
            if self.recorder is not None:
                self.recorder.untracked(mark)
            self.mark_records.append(None)
            self.after_event()
            return t if isinstance(t, nn.Parameter) else t.detach()
        rec = self.by_key.get(key)
        if rec is None or rec.alias is None:
            rec = self.new_record(t, where)
            self.by_key[key] = rec
        rec.views += 1
        handle = _Handle(rec, t)
        if self.recorder is not None:
            self.recorder.save(rec.index, mark)
        self.mark_records.append(weakref.ref(rec))
        if self.following and (self.marks - 1) in self.evict_at:
            self.move(rec)
        self.enforce_budget()
        self.after_event()
        return handle

    def new_record(self, t: torch.Tensor, where: str | None) -> _Record:
        nbytes = t.untyped_storage().nbytes()
        movable = self.group is not None and self.off.eligible(t)
        index = len(self.records)
        if self.recorder is not None:
            label = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            if where:
                label += f" in {where}"
            why = None if movable else self.why_kept(t, nbytes)
            host = self.pool.block_size(nbytes)
            index = self.recorder.new_storage(nbytes, label, movable, why, host)
        rec = _Record(self, index, t.detach(), nbytes, movable)
        rec.origin = weakref.ref(t)
        self.records.append(weakref.ref(rec, self._died(index)))
        if movable:
            self.movable[index] = weakref.ref(rec)
        self.stats.saved_bytes += nbytes
        self.hold(index, nbytes)
        return rec

    def why_kept(self, t: torch.Tensor, nbytes: int) -> str:
        if self.group is None:
            return (
                "nothing moves here (no CUDA device; RECOMP_OFFLOAD_HOST_COPY=1 is the CPU "
                "test mode)"
            )
        if nbytes < self.off.min_bytes:
            return f"smaller than min_offload_bytes ({format_bytes(self.off.min_bytes)})"
        return f"a {type(t).__name__} on {t.device.type} that the offloader does not move"

    def _died(self, index: int) -> Callable[[Any], None]:
        step = weakref.ref(self)

        def died(_: Any) -> None:  # the graph let go of the record
            s = step()
            if s is not None:
                s.unhold(index)
                s.movable.pop(index, None)

        return died

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
            session._retrace = True
        warnings.warn(
            f"OffloadSession step {self.stats.step} differs from the traced step: {why}. This "
            "step leaves the plan (tensors move when the budget is passed) and the next step "
            "is traced again. If the difference comes from dynamic code, mark that code "
            "with @skip_offload.",
            OffloadTraceWarning,
            stacklevel=2,
        )

    # -- device bytes --------------------------------------------------------------

    def hold(self, index: int, nbytes: int) -> None:
        self.holding[index] = self.holding.get(index, 0) + nbytes
        self.held += nbytes
        total = self.held + (self.off.pending_bytes if self.off.pending_copies else 0)
        stats = self.stats
        stats.peak_resident_bytes = max(stats.peak_resident_bytes, total)
        stats.over_budget_bytes = max(stats.over_budget_bytes, total - self.budget)

    def unhold(self, index: int) -> None:
        self.held -= self.holding.pop(index, 0)

    # -- moving --------------------------------------------------------------------

    def enforce_budget(self) -> None:
        """Move the oldest movable records while the session holds more than the budget."""
        while self.held > self.budget and self.movable:
            index = next(iter(self.movable))
            rec = self.movable.pop(index)()
            if rec is not None and self.move(rec):
                self.stats.unplanned_evictions += 1

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

    def prefetch(self, rec: _Record) -> None:
        stored = rec.stored
        if stored is None or stored.resident is not None or stored.source is not None:
            return
        self.group.bring_back(stored)  # type: ignore[union-attr]
        self.stats.prefetched_bytes += rec.nbytes
        self.stats.restored_bytes += rec.nbytes
        self.hold(rec.index, rec.nbytes)

    # -- reads ---------------------------------------------------------------------

    def read(self, handle: _Handle) -> torch.Tensor:
        rec = handle.record
        if rec.aborted:
            raise RecompError(
                "A tensor saved under an OffloadSession step that ended with an exception was "
                "read by backward: the session dropped that step's host copies. Run the step "
                "again (forward and backward) instead of reusing its graph."
            )
        rec.read = True
        if self.recorder is not None:
            self.recorder.read(rec.index)
        self.after_event()
        origin = rec.origin()
        now = _compat.version(origin if origin is not None else rec.alias)  # type: ignore[arg-type]
        if now is not None and handle.version is not None and now != handle.version:
            raise _changed(handle)
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
            raise _changed(handle)
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
        """Whether backward has read what the step saved (or the graph is gone)."""
        for ref in self.records:
            rec = ref()
            if rec is not None and not rec.read:
                return False
        return True

    def abort(self) -> None:
        """NOTE [ Offload sessions ], 6."""
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
        self.recorder = None
        self.following = False
        self.timing = None


def _changed(handle: _Handle) -> CachedValueMutatedError:
    return CachedValueMutatedError(
        f"A tensor saved for backward under an OffloadSession ({handle.dtype}"
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


class OffloadSession:
    """HyperParallel's ``OffloadSession``: a context manager around a training step
    (forward and backward) that keeps the tensors saved for backward on the device up
    to ``config.max_resident_activation_mb`` and moves the rest to pinned host memory.

    The first entry traces the step and moves the oldest saved tensors whenever the
    session holds more than the budget; when its backward has run, a planner turns the
    trace into a plan (:attr:`plan`, readable with ``print(session.plan)``). Later
    entries replay the plan: chosen tensors are copied to the host after their last
    save and brought back ahead of their first read, on a side stream (CUDA). A step
    that saves other shapes or in another order warns (``OffloadTraceWarning``), runs
    without the plan, and the next step is traced again; an exception inside the
    block waits for every copy and releases the step's host memory.

    What recomp's checkpoints keep (their saved inputs, what their excluded regions
    keep) goes through the session like any saved tensor. ``last_step`` holds the
    counters of the latest step (an ``OffloadStepStats``). On a machine without CUDA
    nothing moves unless the ``RECOMP_OFFLOAD_HOST_COPY=1`` test mode is on; the trace
    and the plan are made all the same. Sessions do not nest."""

    def __init__(self, config: OffloadConfig | None = None) -> None:
        if config is None:
            config = OffloadConfig()
        if not isinstance(config, OffloadConfig):
            raise TypeError(
                f"OffloadSession takes an OffloadConfig, got {config!r}: write "
                "OffloadSession(OffloadConfig(max_resident_activation_mb=...)), or use "
                "recomp.torch.offload_session(budget_bytes)."
            )
        config.check()
        self.config = config
        self.planner = config.planner if config.planner is not None else BudgetPlanner()
        self.pool = PinnedMemoryPool(max(1, config.host_limit_bytes))
        self.offloader = Offloader(min_bytes=config.min_offload_bytes)
        self.plan: OffloadPlan | None = None
        self.trace: OffloadTrace | None = None
        self.last_step: OffloadStepStats | None = None
        self.steps = 0
        self.placer = _SessionPlacer(self)
        self._step: _Step | None = None
        self._pending: _Step | None = None  # a traced step whose backward is not done yet
        self._retrace = False
        self._hooks: Any = None
        self._token: Any = None

    @property
    def mode(self) -> str:
        """``"warmup"`` while the next entry traces, ``"replay"`` once a plan is made."""
        return "replay" if self.plan is not None and not self._retrace else "warmup"

    @staticmethod
    def get_active() -> OffloadSession | None:
        """The session whose block is running in this context, or None."""
        return ACTIVE.get()

    def __enter__(self) -> OffloadSession:
        refuse_nesting(self)
        if self._pending is not None:
            self._make_plan(self._pending)
        self.steps += 1
        step = _Step(self, self.steps, None if self.mode == "warmup" else self.plan)
        group = self.offloader.open_group(f"offload step {self.steps}")
        if group is not None:
            group.pool = self.pool
            group.chain = False
            if step.plan is None and not self.offloader.host_mode:
                step.timing = []
        step.group = group
        self._step = step
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        hooks.__enter__()
        self._hooks = hooks
        self._token = ACTIVE.set(self)
        self.last_step = step.stats
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        step = self._step
        try:
            if self._hooks is not None:
                self._hooks.__exit__(exc_type, exc, tb)
        finally:
            self._hooks = None
            if self._token is not None:
                ACTIVE.reset(self._token)
            self._token = None
            self._step = None
        if step is None:
            return
        if exc_type is not None:
            step.abort()
            self.pool.clear()
            return
        self.offloader.poll()
        traced = step.plan.trace.marks if step.plan is not None else None
        if step.following and step.marks != len(traced):  # type: ignore[arg-type]
            step.leave_plan(f"it saved {step.marks} tensors, the traced step {len(traced)}")  # type: ignore[arg-type]
        if step.plan is None:
            if step.settled():
                self._make_plan(step)
            else:
                self._pending = step  # planned at the next entry, once backward has run

    def _make_plan(self, step: _Step) -> None:
        self._pending = None
        recorder = step.recorder
        if recorder is None:
            return
        trace = recorder.trace
        step.recorder = None
        trace.budget_bytes = self.config.budget_bytes
        trace.host_limit_bytes = self.config.host_limit_bytes
        trace.host_bandwidth = self.config.host_bandwidth
        if step.timing:
            trace.seconds = _seconds(step.timing)
            if trace.host_bandwidth is None:
                trace.host_bandwidth = _measured_bandwidth()
        step.timing = None
        plan = self.planner.build(trace)
        if step.host_full:
            plan.notes.append(
                f"The host pool ({format_bytes(self.config.host_limit_bytes)}) was full in the "
                "traced step: raise max_offload_activation_mb to move more."
            )
        self.trace, self.plan = trace, plan
        self._retrace = False

    # -- hooks -------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor, where: str | None = None) -> Any:
        step = self._step
        if step is None or OPAQUE.get():
            return t.detach()
        return step.save(t, where)

    def run_opaque(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``skip_offload``'s region: one event, its saves kept as they are."""
        if OPAQUE.get() or self._step is None:
            return fn(*args, **kwargs)
        self._step.region(name)
        token = OPAQUE.set(True)
        try:
            with torch.autograd.graph.saved_tensors_hooks(_detached, _unpack):
                return fn(*args, **kwargs)
        finally:
            OPAQUE.reset(token)


def _unpack(held: Any) -> Any:
    return held.get() if isinstance(held, _Handle) else held


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


class _SessionPlacer:
    """Where a recomp checkpoint keeps what it keeps while a session runs: its saved
    inputs and its excluded regions' kept tensors go through the session's pack."""

    def __init__(self, session: OffloadSession) -> None:
        self.session = weakref.ref(session)

    def open_group(self, name: str) -> _RegionPlacement | None:
        return _RegionPlacement(self, name)

    def input_hooks(self) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        def pack_input(t: torch.Tensor) -> Any:
            session = self.session()
            if session is None or t.numel() == 0:
                return t
            return session._pack(t, "a checkpoint's inputs")

        return pack_input, _unpack

    def pack(self, t: torch.Tensor, where: str) -> Any:
        session = self.session()
        return t.detach() if session is None else session._pack(t, where)


class _RegionPlacement:
    __slots__ = ("name", "placer")

    def __init__(self, placer: _SessionPlacer, name: str) -> None:
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


def active_placer() -> _SessionPlacer | None:
    """The running session's place for what a recomp checkpoint keeps, or None."""
    session = ACTIVE.get()
    if session is None or OPAQUE.get():
        return None
    return session.placer  # type: ignore[no-any-return]


def _seconds(events: list[Any]) -> list[float]:
    events[-1].synchronize()
    first = events[0]
    return [first.elapsed_time(e) / 1e3 for e in events]


_BANDWIDTH: dict[int, float] = {}


def _measured_bandwidth() -> float:
    """The host link of the current CUDA device, bytes/s, the slower way of two 64 MiB
    copies between pinned host memory and the device (measured once per device)."""
    device = torch.cuda.current_device()
    if device not in _BANDWIDTH:
        size = 64 * MIB
        with _quiet():
            src = torch.empty(size, dtype=torch.uint8, device="cuda")
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            host.copy_(src)  # warm up
            torch.cuda.synchronize()
            times = []
            for dst, source in ((host, src), (src, host)):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(source, non_blocking=True)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        _BANDWIDTH[device] = size / max(max(times), 1e-9)
    return _BANDWIDTH[device]


def offload_session(
    budget: int,
    *,
    host_limit: int = 64 << 30,
    min_bytes: int = MIB,
    host_bandwidth: float | None = None,
    planner: Any = None,
) -> OffloadSession:
    """An offload session that keeps at most ``budget`` bytes of saved activations on the
    device (HyperParallel's ``OffloadSession`` with recomp's units)::

        session = recomp.torch.offload_session(8 << 30)
        for batch in loader:
            with session:
                loss = model(batch).loss
                loss.backward()
            optimizer.step()
        print(session.plan)            # what moves and why
        print(session.last_step)       # bytes moved, peak resident bytes

    ``host_limit``: pinned host memory the session may use, bytes. ``min_bytes``:
    smaller storages stay on the device. ``host_bandwidth``: the host link, bytes/s
    each way (None: measured once on CUDA). ``planner``: see ``OffloadConfig``.
    Everything a step saves for backward takes part, recomp's checkpoints' inputs and
    excluded regions' kept tensors included; gradients are those without the session,
    bit for bit."""
    for name, value in (("budget", budget), ("host_limit", host_limit)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(
                f"offload_session({name}={value!r}): bytes, an int >= 0 (e.g. {name}=8 << 30 "
                "for 8 GiB)."
            )
    config = OffloadConfig(
        max_resident_activation_mb=budget / MIB,
        max_offload_activation_mb=max(host_limit, 1) / MIB,
        planner=planner,
        min_offload_bytes=min_bytes,
        host_bandwidth=host_bandwidth,
    )
    return OffloadSession(config)
