"""Offloading what an excluded region keeps to host memory, overlapped with compute.

NOTE [ Offload ordering and lifetime ]

An offloading region keeps, instead of a device alias of each tensor it saves
(and of its cached output), a handle to a host copy of the tensor's storage:

  forward (``OffloadGroup.put``, inside the region's pack hook):
    1. the side stream waits for the compute stream (the tensor's values are
       written by work queued there), then copies the whole storage into pinned
       host memory; an event marks the end of the copy;
    2. the group holds the device storage until the region has returned (so that
       other views of the same storage saved by the region share one copy), and
       the copy in flight holds it until its event has completed. Nothing else
       does: once both let go, the caching allocator gets the block back on the
       compute stream, after the copy has read it. No ``record_stream``: the
       storage is simply not freed before the copy is done.
  backward (``OffloadHandle.get``, from the engine's unpack; ``OffloadGroup.prefetch``,
  when the checkpoint's replay reaches the region):
    3. a restore allocates a device buffer on the compute stream (from that
       stream's pool), makes the side stream wait for the compute stream (the
       block may have been freed by work still queued there), copies the host
       bytes in on the side stream and records an event; the buffer is
       ``record_stream``ed on the side stream, so that if it is dropped unread
       its block is not reused before the copy into it is done. ``get`` makes
       the stream that reads the tensor wait for that event (and
       ``record_stream``s the buffer if that stream is another one), then
       rebuilds the saved view (size, stride, offset) on the buffer;
    4. the first ``get`` of a region in a backward pass (the replay taking its
       cached output, or its backward reading a saved tensor) starts restoring
       the region recorded before it (the next one in backward order), so that
       copy runs while the rest of this layer's backward computes; a storage whose
       every view this pass has read already (a cached output the replay took) is
       not brought back again by a later prefetch of its region in the same pass;
    5. the host copy lives as long as a handle to it (the autograd graph): a
       second backward (``retain_graph``) restores it again. The restored device
       buffer is dropped once every saved view of it has been read in the pass.

A tensor still being copied out when the backward reads it is used where it is
(no copy back). A tensor changed in place between its save and the end of its
copy marks the host copy stale: the engine's mutation check then raises, as
it does for a kept alias. A region that fails drains its copies
(``OffloadGroup.abort``): nothing stays in flight.

``host_copy`` mode (``RECOMP_OFFLOAD_HOST_COPY=1`` or ``Offloader(host_copy=True)``)
runs the same bookkeeping on CPU tensors, copying them synchronously into other
CPU tensors: it exists to test the mechanism where there is no GPU. Without it,
on a machine without CUDA, an offloading region keeps its tensors as usual.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

from .._offload_session import MIN_OFFLOAD_BYTES
from ..errors import internal_error
from . import _compat

ENV_HOST_COPY = "RECOMP_OFFLOAD_HOST_COPY"
# Smaller storages stay on the device: a copy costs more than it frees.
DEFAULT_MIN_BYTES = MIN_OFFLOAD_BYTES


@dataclass
class OffloadStats:
    """Counters of one :class:`Offloader` since it was created (subtract two readings
    for a step)."""

    offloaded_bytes: int = 0  # device -> host, each storage once per region call
    offloaded_storages: int = 0
    restored_bytes: int = 0  # host -> device
    prefetched_bytes: int = 0  # restored ahead of the read (the rest waited for its copy)
    copy_seconds: float = 0.0  # copy time measured (``timing=True`` or host-copy mode)

    def snapshot(self) -> OffloadStats:
        return OffloadStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __sub__(self, other: OffloadStats) -> OffloadStats:
        return OffloadStats(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)}
        )


class _Stored:
    """One storage copied to the host, and where its bytes are on the device now."""

    __slots__ = (
        "__weakref__",
        "alloc_stream",
        "back",
        "device",
        "group",
        "host",
        "in_place",
        "keep_back",
        "label",
        "nbytes",
        "offloader",
        "read_pass",
        "reads",
        "ready",
        "release",
        "resident",
        "source",
        "source_version",
        "stale",
        "views",
    )

    def __init__(self, offloader: Offloader, group: OffloadGroup, source: torch.Tensor) -> None:
        self.offloader = offloader
        self.group = weakref.ref(group)
        self.device = source.device
        self.nbytes = source.untyped_storage().nbytes()
        # The original (an alias sharing its storage and version counter) while its copy
        # out is in flight; None once the copy is done.
        self.source: torch.Tensor | None = source
        self.source_version = _compat.version(source)
        self.stale = False
        self.host: torch.Tensor | None = None
        # A restored device buffer (uint8, the whole storage) and the event it is ready at.
        self.resident: torch.Tensor | None = None
        self.ready: Any = None
        self.alloc_stream: Any = None
        self.views = 0  # handles made for it
        self.reads = 0  # reads in the current pass
        # Once brought back, the device buffer stays until ``OffloadGroup.drop_restored``
        # (a pipeline micro-batch's input- and weight-gradient steps both read it).
        self.keep_back = False
        # The backward pass (graph task) that has read every view: a prefetch of its
        # group later in that pass leaves it on the host (nothing reads it again there).
        self.read_pass: int | None = None
        # In place (``swap_tensor_wrapper``): the storage itself, emptied once copied and
        # refilled for backward, so that every tensor on it sees its bytes again; ``back``
        # once refilled (or never emptied, the backward having come first).
        self.in_place: Any = None
        self.back = False
        # What the caller called it (``swap_tensor_wrapper``'s tag), for the trace.
        self.label: str | None = None
        # Gives the host block back to its pool now (None: no pool); also runs when the
        # record dies.
        self.release: Any = None

    def changed(self) -> bool:
        src = self.source
        return self.stale or (src is not None and _compat.version(src) != self.source_version)


class OffloadHandle:
    """What the engine keeps for an offloaded tensor: the host copy of its storage and
    the view to rebuild on it."""

    __slots__ = ("dtype", "offset", "size", "stored", "stride")

    def __init__(self, stored: _Stored, t: torch.Tensor) -> None:
        self.stored = stored
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()

    def changed(self) -> bool:
        """Whether the original was changed in place before its copy was complete."""
        return self.stored.changed()

    def get(self) -> torch.Tensor:
        """The saved tensor, on its device, ready for the current stream."""
        stored = self.stored
        with _quiet():
            flat = stored.offloader._fetch(stored)
            out = torch.empty(0, dtype=self.dtype, device=flat.device)
            out.set_(flat.untyped_storage(), self.offset, self.size, self.stride)
        return out


class OffloadGroup:
    """The offloaded tensors of one region call; see NOTE [ Offload ordering and lifetime ]."""

    __slots__ = (
        "__weakref__",
        "chain",
        "chained_pass",
        "name",
        "offloaded_bytes",
        "offloader",
        "pool",
        "records",
        "restored_bytes",
        "sources",
    )

    def __init__(self, offloader: Offloader, name: str) -> None:
        self.offloader = offloader
        self.name = name
        # What this region call moved out and back (each storage once per copy).
        self.offloaded_bytes = 0
        self.restored_bytes = 0
        # Where host copies come from: None (pinned memory allocated per copy) or a
        # bounded pool reused across steps (``recomp.torch._swap.pool.PinnedMemoryPool``).
        self.pool: Any = None
        self.records: list[weakref.ref[_Stored]] = []
        # storage -> (alias of it, its record), for the region's forward only.
        self.sources: dict[Hashable, tuple[torch.Tensor, _Stored]] = {}
        self.chained_pass: int | None = None
        # Whether its first read in a backward pass brings back the group before it
        # (False: an offload session, whose plan says what comes back when).
        self.chain = True

    def put(
        self,
        t: torch.Tensor,
        force: bool = False,
        in_place: bool = False,
        label: str | None = None,
    ) -> OffloadHandle | None:
        """Start copying ``t``'s storage to the host; None if ``t`` stays where it is
        (below the size threshold unless ``force``, not on an offloaded device, not a
        plain tensor). ``force``: a swap policy chose ``t`` (``recomp.torch._swap.scope``).
        ``in_place``: the storage itself is emptied once copied, and refilled by
        :meth:`bring_back_in_place` (tensors the caller keeps, ``swap_tensor_wrapper``).
        ``label``: the tensor's name in the trace (``group/label``)."""
        off = self.offloader
        if not off._eligible(t, force):
            return None
        key = _compat.storage_key(t)
        held = self.sources.get(key)
        if held is not None and _compat.version(held[0]) == _compat.version(t):
            stored = held[1]
        else:
            source = t.detach()  # shares the storage and the version counter
            with _quiet():
                stored = off._copy_out(self, source, t.untyped_storage() if in_place else None)
            self.sources[key] = (source, stored)
            self.records.append(weakref.ref(stored))
            stored.label = label
        stored.views += 1
        return OffloadHandle(stored, t)

    def close(self) -> None:
        """The region has returned and its outputs are recorded: stop holding its storages."""
        self.sources.clear()
        self.offloader.poll()

    def abort(self) -> None:
        """The region failed: wait for its copies and forget them."""
        self.sources.clear()
        self.offloader.synchronize()

    def bring_back_in_place(self) -> None:
        """Refill this group's in-place storages now, ready for the current stream."""
        off = self.offloader
        off.poll()
        with _quiet():
            for ref in self.records:
                stored = ref()
                if stored is None or stored.in_place is None:
                    continue
                if not stored.back:
                    if stored.source is not None:
                        stored.back = True  # still being copied: never emptied
                    else:
                        off._restore(stored, ahead=False)
                if stored.ready is not None:
                    torch.cuda.current_stream(stored.device).wait_event(stored.ready)
                    stored.ready = None

    # -- one storage at a time (the offload session's moves) --------------------------

    def take(self, source: torch.Tensor) -> _Stored:
        """Start copying ``source``'s whole storage to the host; the copy in flight holds
        the storage until it completes, nothing else here does."""
        with _quiet():
            stored = self.offloader._copy_out(self, source)
        self.records.append(weakref.ref(stored))
        return stored

    def bring_back(self, stored: _Stored) -> None:
        """Start copying ``stored`` back to the device, if it is on the host only."""
        if stored.resident is None and stored.source is None and stored.host is not None:
            with _quiet():
                self.offloader._restore(stored, ahead=True)

    def read(self, stored: _Stored) -> torch.Tensor:
        """``stored``'s bytes on the device, ready for the current stream (copied back
        now if they were not brought back)."""
        with _quiet():
            return self.offloader._fetch(stored)

    def drop_restored(self, stored: _Stored) -> None:
        """Let go of ``stored``'s device buffer (brought back with ``keep_back``); a later
        read copies it back again."""
        stored.resident, stored.ready, stored.reads = None, None, 0

    def finish_copies(self) -> None:
        """This group's copies to the host: the current stream waits for them and their
        device storages go back to the allocator now, in that stream's order (no kernel
        queued after the wait can reuse a block a copy still reads)."""
        self.offloader.finish_copies(self)

    def prefetch(self) -> None:
        """Start bringing this region's tensors back to the device."""
        off = self.offloader
        off.poll()
        current_pass = _compat.graph_task_id()
        with _quiet():
            for ref in self.records:
                stored = ref()
                if (
                    stored is not None
                    and stored.resident is None
                    and stored.source is None
                    and (current_pass == -1 or stored.read_pass != current_pass)
                ):
                    off._restore(stored, ahead=True)


class _Copy:
    """A copy to the host in flight; holds the device storage until it is done."""

    __slots__ = ("done", "source", "started", "stored")

    def __init__(self, stored: _Stored, source: torch.Tensor, started: Any, done: Any) -> None:
        self.stored = weakref.ref(stored)
        self.source: torch.Tensor | None = source
        self.started = started
        self.done = done


class Offloader:
    """Copies what offloading regions keep to host memory and brings it back.

    ``min_bytes``: storages smaller than this stay on the device (default 1 MiB). ``host_copy``:
    True / False forces the CPU test mode on / off; None (default) reads the
    ``RECOMP_OFFLOAD_HOST_COPY`` environment variable at each region call.
    ``timing``: measure copy time with CUDA events (``stats.copy_seconds``).
    One offloader is shared by all regions (``default_offloader()``), so that the
    backward of one region can prefetch the region before it.
    """

    def __init__(
        self,
        *,
        min_bytes: int | None = None,
        host_copy: bool | None = None,
        timing: bool = False,
    ) -> None:
        if min_bytes is None:
            min_bytes = DEFAULT_MIN_BYTES
        if not isinstance(min_bytes, int) or isinstance(min_bytes, bool) or min_bytes < 0:
            raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}.")
        self.min_bytes = min_bytes
        self.host_copy = host_copy
        self.timing = timing
        self.stats = OffloadStats()
        self._lock = threading.Lock()
        self._in_flight: list[_Copy] = []
        self._timed: list[tuple[Any, Any]] = []  # CUDA (start, end) events of restores
        self._groups: list[weakref.ref[OffloadGroup]] = []  # region calls, forward order
        self._streams: dict[torch.device, Any] = {}
        self._host_mode = False
        # Told (event, region name) for each copy back ("ahead" or "on read") and each
        # read of an offloaded storage: the test seam (``recomp._testing.offload_events``).
        self.trace: Callable[[str, str], None] | None = None
        # Told each group opened (the swap manager's per-layer counters, tests).
        self.group_opened: Callable[[OffloadGroup], None] | None = None
        # Asked, on the first read of a group in a backward pass, which group to bring
        # back ahead (None: the one recorded before it); the swap manager's layer pairs.
        self.prefetch_pair: Callable[[OffloadGroup], OffloadGroup | None] | None = None

    # -- what the engine calls ---------------------------------------------------

    def open_group(self, name: str) -> OffloadGroup | None:
        """Start one region call; None when nothing can be offloaded here (no CUDA, no
        host-copy mode): the region then keeps its tensors as usual."""
        host = (
            self.host_copy if self.host_copy is not None else os.environ.get(ENV_HOST_COPY) == "1"
        )
        if not host and not torch.cuda.is_initialized():
            return None
        self._host_mode = host
        self.poll()
        group = OffloadGroup(self, name)
        with self._lock:
            self._groups = [g for g in self._groups if g() is not None]
            self._groups.append(weakref.ref(group))
        if self.group_opened is not None:
            self.group_opened(group)
        return group

    @property
    def host_mode(self) -> bool:
        """Whether the last group opened runs the CPU test mode (``host_copy``)."""
        return self._host_mode

    def eligible(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage would move (a plain tensor, on a device served here,
        of at least ``min_bytes``)."""
        return self._eligible(t)

    @property
    def pending_copies(self) -> int:
        """Copies to the host not yet seen complete (their device storage is still held)."""
        return len(self._in_flight)

    @property
    def pending_bytes(self) -> int:
        """Device bytes held by the copies to the host not yet seen complete."""
        with self._lock:
            copies = list(self._in_flight)
        return sum(c.source.untyped_storage().nbytes() for c in copies if c.source is not None)

    def poll(self) -> None:
        """Release the device storage of every copy that has completed."""
        with self._lock:
            done = [c for c in self._in_flight if c.done is None or c.done.query()]
            if not done:
                return
            self._in_flight = [c for c in self._in_flight if c not in done]
        for copy in done:
            self._finish(copy)

    def finish_copies(self, group: OffloadGroup) -> None:
        """``OffloadGroup.finish_copies``: no wait on the host."""
        with self._lock:
            mine: list[_Copy] = []
            rest: list[_Copy] = []
            for copy in self._in_flight:
                stored = copy.stored()
                owner = None if stored is None else stored.group()
                (mine if owner is group else rest).append(copy)
            self._in_flight = rest
        for copy in mine:
            stored = copy.stored()
            if copy.started is not None:
                copy.done.synchronize()  # timed: its elapsed time is read now
            elif copy.done is not None and stored is not None:
                torch.cuda.current_stream(stored.device).wait_event(copy.done)
            self._finish(copy)

    def synchronize(self) -> None:
        """Wait for every copy in flight, then release them (and count timed restores)."""
        with self._lock:
            copies, self._in_flight = self._in_flight, []
        for copy in copies:
            if copy.done is not None:
                copy.done.synchronize()
            self._finish(copy)
        for _, ended in self._timed:
            ended.synchronize()
        self._collect_timings()

    # -- internals ------------------------------------------------------------------

    def _eligible(self, t: torch.Tensor, force: bool = False) -> bool:
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return False
        device = t.device.type
        if not (device == "cuda" or (device == "cpu" and self._host_mode)):
            return False
        if t.is_conj() or t.is_neg() or t.is_quantized or t.is_inference():
            return False
        try:
            return t.untyped_storage().nbytes() >= max(1, 0 if force else self.min_bytes)
        except (RuntimeError, NotImplementedError):
            return False

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _copy_out(self, group: OffloadGroup, source: torch.Tensor, in_place: Any = None) -> _Stored:
        stored = _Stored(self, group, source)
        stored.in_place = in_place
        flat = _bytes_of(source)
        if source.device.type == "cuda":
            with torch.cuda.device(source.device):
                compute = torch.cuda.current_stream()
                side = self._stream(source.device)
                host = _host_buffer(group, stored)
                side.wait_stream(compute)  # the values are written by work queued there
                with torch.cuda.stream(side):
                    started = _event(self.timing)
                    host.copy_(flat, non_blocking=True)
                    done = torch.cuda.Event(enable_timing=self.timing)
                    done.record()
        else:
            t0 = time.perf_counter()
            if group.pool is None:
                host = flat.clone()
            else:
                host = _host_buffer(group, stored)
                host.copy_(flat)
            self.stats.copy_seconds += time.perf_counter() - t0
            started = done = None
        stored.host = host
        with self._lock:
            self._in_flight.append(_Copy(stored, source, started, done))
        self.stats.offloaded_bytes += stored.nbytes
        self.stats.offloaded_storages += 1
        group.offloaded_bytes += stored.nbytes
        return stored

    def _finish(self, copy: _Copy) -> None:
        if copy.started is not None:
            self.stats.copy_seconds += copy.started.elapsed_time(copy.done) / 1e3
        stored = copy.stored()
        if stored is not None and stored.source is copy.source:
            stored.stale = stored.changed()
            stored.source = None
            if stored.in_place is not None and not stored.back:
                stored.in_place.resize_(0)  # the device bytes go back to the allocator
        copy.source = None  # the device storage goes back to the allocator here

    def _restore(self, stored: _Stored, ahead: bool) -> None:
        if self.trace is not None:
            self.trace("copy back" if ahead else "copy back on read", _group_name(stored))
        host = stored.host
        if host is None:
            raise internal_error("restoring a storage that was never copied to the host")
        if stored.in_place is not None:
            self._refill(stored, host, ahead)
            return
        if stored.device.type == "cuda":
            with torch.cuda.device(stored.device):
                compute = torch.cuda.current_stream()
                buffer = torch.empty(stored.nbytes, dtype=torch.uint8, device=stored.device)
                side = self._stream(stored.device)
                side.wait_stream(compute)  # the block may be in use by work queued there
                # If the buffer is dropped before anyone waited for the copy (the graph
                # freed right after a prefetch), its block must not be reused before the
                # copy into it is done.
                buffer.record_stream(side)
                with torch.cuda.stream(side):
                    started = _event(self.timing)
                    buffer.copy_(host, non_blocking=True)
                    ready = torch.cuda.Event(enable_timing=self.timing)
                    ready.record()
            if started is not None:
                self._timed.append((started, ready))
            stored.alloc_stream = compute
        else:
            t0 = time.perf_counter()
            buffer = host.clone()
            self.stats.copy_seconds += time.perf_counter() - t0
            ready = None
        stored.resident, stored.ready = buffer, ready
        self.stats.restored_bytes += stored.nbytes
        owner = stored.group()
        if owner is not None:
            owner.restored_bytes += stored.nbytes
        if ahead:
            self.stats.prefetched_bytes += stored.nbytes

    def _refill(self, stored: _Stored, host: torch.Tensor, ahead: bool) -> None:
        """Bring an in-place storage's bytes back into the storage itself."""
        if stored.back:
            return
        storage = stored.in_place
        if stored.device.type == "cuda":
            with torch.cuda.device(stored.device):
                compute = torch.cuda.current_stream()
                storage.resize_(stored.nbytes)  # allocated for the compute stream
                flat = torch.empty(0, dtype=torch.uint8, device=stored.device).set_(
                    storage, 0, (stored.nbytes,), (1,)
                )
                side = self._stream(stored.device)
                side.wait_stream(compute)
                with torch.cuda.stream(side):
                    flat.copy_(host, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record()
            stored.ready = ready
        else:
            storage.resize_(stored.nbytes)
            flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (stored.nbytes,), (1,))
            flat.copy_(host)
        stored.back = True
        self.stats.restored_bytes += stored.nbytes
        owner = stored.group()
        if owner is not None:
            owner.restored_bytes += stored.nbytes
        if ahead:
            self.stats.prefetched_bytes += stored.nbytes

    def _fetch(self, stored: _Stored) -> torch.Tensor:
        """The storage's bytes on the device, usable on the current stream."""
        if self.trace is not None:
            self.trace("read", _group_name(stored))
        self.poll()
        self._collect_timings()
        if stored.source is not None:  # still being copied out: use the original
            self._prefetch_previous(stored)
            return _bytes_of(stored.source)
        if stored.resident is None:
            self._restore(stored, ahead=False)
        buffer = stored.resident
        if buffer is None:
            raise internal_error("a restored storage has no device buffer")
        if stored.ready is not None:
            current = torch.cuda.current_stream(stored.device)
            current.wait_event(stored.ready)
            if current != stored.alloc_stream:
                buffer.record_stream(current)
        self._prefetch_previous(stored)
        stored.reads += 1
        if stored.reads >= stored.views and not stored.keep_back:
            # every view read in this pass: let autograd own it
            stored.resident, stored.ready, stored.reads = None, None, 0
            stored.read_pass = _compat.graph_task_id()
        return buffer

    def _prefetch_previous(self, stored: _Stored) -> None:
        """On the first read of a region in a backward pass, start restoring the region
        recorded before it: the next one in backward order."""
        group = stored.group()
        if group is None or not group.chain:
            return
        current_pass = _compat.graph_task_id()
        if group.chained_pass == current_pass:
            return
        group.chained_pass = current_pass
        if self.prefetch_pair is not None:
            paired = self.prefetch_pair(group)
            if paired is not None:
                paired.prefetch()
                return
        with self._lock:
            refs = list(self._groups)
        index = next((i for i, ref in enumerate(refs) if ref() is group), 0)
        for ref in reversed(refs[:index]):
            previous = ref()
            if previous is not None:
                previous.prefetch()
                return

    def _collect_timings(self) -> None:
        if not self._timed:
            return
        pending = []
        for started, ended in self._timed:
            if ended.query():
                self.stats.copy_seconds += started.elapsed_time(ended) / 1e3
            else:
                pending.append((started, ended))
        self._timed = pending


def _host_buffer(group: OffloadGroup, stored: _Stored) -> torch.Tensor:
    """Host memory for ``stored``'s copy: pinned, from the group's pool if it has one
    (given back when the record dies, after any copy back from it is done)."""
    pool = group.pool
    if pool is None:
        return torch.empty(stored.nbytes, dtype=torch.uint8, pin_memory=True)
    block = pool.acquire(stored.nbytes)
    stored.release = weakref.finalize(stored, pool.release, block)
    return block[: stored.nbytes]


def _group_name(stored: _Stored) -> str:
    group = stored.group()
    name = "?" if group is None else group.name
    return name if stored.label is None else f"{name}/{stored.label}"


def _event(timing: bool) -> Any:
    if not timing:
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of ``t``."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The offloader's own copies are bookkeeping, not model ops: no autograd, and no
    dispatch mode (selective checkpointing's cache, FLOP counters) sees them."""
    with torch.no_grad(), _compat.no_dispatch_modes():
        yield


_default: Offloader | None = None


def default_offloader() -> Offloader:
    """The offloader shared by every region created with ``offload=True``."""
    global _default
    if _default is None:
        _default = Offloader()
    return _default


def resolve(offload: Any) -> Offloader | None:
    """``offload=`` of ``checkpoint_exclude_wrapper``: False, True or an ``Offloader``."""
    if isinstance(offload, Offloader):
        return offload
    if offload is True:
        return default_offloader()
    if offload is False or offload is None:
        return None
    raise ValueError(
        f"offload must be True, False or a recomp.torch.Offloader, got {offload!r} "
        f"({type(offload).__name__})."
    )
