"""Activation swap inside ``torch.distributed.pipelining`` schedules: one swap group per
(stage, micro-batch), moved to the host after its forward and brought back before its
backward where the schedule leaves room (NOTE [ Pipeline swap ] in
``recomp._pipeline_swap`` says when; this module does it on PyTorch).

``pipeline_swap(schedule)`` reads this rank's compute slots from the schedule and puts
three things on it, all undone by the handle's ``remove()``:

- on ``schedule.step``: one run per step (the slots' progress, the groups, the
  counters); an exception in the step waits for every copy, drops the step's host
  copies and the losses the schedule kept of it before it propagates;
- on each stage's compute steps (``_compat.wrap_stage_steps``): the swap steps of the
  slot a step belongs to, before and after it, and, around the forward of a group that
  swaps, the group's saved-tensors hooks, which every tensor the forward saves for
  backward goes through, and its place for what recomp's checkpoints keep (their saved
  inputs, what their excluded regions keep: ``_offload_session.active_placer``);
- nothing else: the schedule's action lists, its sends and receives, the stages'
  caches are as they were.

The moves are those of an offload session's step (``_offload_step.SavedStorages``):
one record per saved storage, a side stream and pinned host blocks from a bounded pool
on CUDA, the host-copy mode on CPU (``RECOMP_OFFLOAD_HOST_COPY=1``, for tests).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from .._pipeline_swap import (
    MIN_SWAP_GAP,
    Chunk,
    ChunkSwapStats,
    PipelineSwapStats,
    RankSwapPlan,
    check_min_gap,
    plan_rank_swap,
)
from ..errors import RecompError
from . import _compat
from ._offload import DEFAULT_MIN_BYTES, Offloader
from ._offload_step import SCOPED_PLACER, HookPlacer, SavedStorages, _Handle, unpack_saved
from ._swap.pool import PinnedMemoryPool


class _ChunkGroup(SavedStorages):
    """What one (stage, micro-batch) forward saved, and its moves."""

    owner_name = "pipeline swap in a schedule step"

    def __init__(self, swap: PipelineSwap, key: Chunk, stats: ChunkSwapStats) -> None:
        super().__init__(swap.offloader, swap.pool, stats)
        group = swap.offloader.open_group(f"pipeline stage {key[0]} micro-batch {key[1]}")
        if group is not None:
            group.pool = swap.pool
            group.chain = False  # the schedule says when it comes back
        self.group = group
        self.placer = HookPlacer(self.pack)
        self.moved: list[weakref.ref[Any]] = []

    def pack(self, t: torch.Tensor, where: str | None = None) -> Any:
        rec = self.record(t, where)
        if rec is None:
            return t if isinstance(t, nn.Parameter) else t.detach()
        if self.off.pending_copies:
            self.off.poll()
        return _Handle(rec, t)

    def forward(self, run: Callable[[], Any]) -> Any:
        """Run a stage's forward with every save going through this group."""
        token = SCOPED_PLACER.set(self.placer)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, unpack_saved):
                return run()
        finally:
            SCOPED_PLACER.reset(token)

    def offload(self, held: set[Hashable]) -> None:
        """Start copying what the forward saved to the host, but what is on a storage
        in ``held`` (the pipeline runtime's, parameters, buffers) or cannot move."""
        stats = self.stats
        for key, rec in list(self.by_key.items()):
            if rec.alias is None:
                continue
            if key in held or not self.move(rec):
                stats.kept_bytes += rec.nbytes
            else:
                self.moved.append(weakref.ref(rec))
        self.by_key = weakref.WeakValueDictionary()  # a later save is not this forward's

    def finish_copies(self) -> None:
        if self.group is not None:
            self.group.finish_copies()

    def load(self) -> None:
        """Start bringing the group back; it stays until :meth:`release`."""
        for ref in self.moved:
            rec = ref()
            if rec is not None and rec.stored is not None:
                rec.stored.keep_back = True
                self.prefetch(rec)

    def release(self) -> None:
        """Its backward is done: let go of what was brought back."""
        group = self.group
        for ref in self.moved:
            rec = ref()
            stored = None if rec is None else rec.stored
            if stored is None or group is None:
                continue
            stored.keep_back = False
            if stored.resident is not None:
                group.drop_restored(stored)
                self.unhold(rec.index)  # type: ignore[union-attr]


class _StepRun:
    """One ``schedule.step`` under pipeline swap: which slots have started and finished,
    the groups of the micro-batches that swap, the counters."""

    def __init__(self, swap: PipelineSwap, plan: RankSwapPlan, number: int) -> None:
        self.swap = swap
        self.plan = plan
        self.stats = PipelineSwapStats(step=number)
        self.groups: dict[Chunk, _ChunkGroup] = {}
        self.started: set[int] = set()
        self.remaining = [len(slot) for slot in plan.slots]
        self.seen: set[tuple[str, int, int]] = set()

    def compute(self, stage: Any, kind: str, index: int, mb: int, run: Callable[[], Any]) -> Any:
        step = (kind, index, mb)
        slot = self.plan.slot_of.get(step)
        if slot is None or step in self.seen:
            self.stats.unplanned_steps += 1
            return run()
        self.seen.add(step)
        if slot not in self.started:
            self.started.add(slot)
            for key in self.plan.loads_before.get(slot, ()):
                group = self.groups.get(key)
                if group is not None:
                    group.load()
        out = self.forward(stage, index, mb, run) if kind == "F" else run()
        self.remaining[slot] -= 1
        if self.remaining[slot] == 0:
            for key in self.plan.waits_after.get(slot, ()):
                group = self.groups.get(key)
                if group is not None:
                    group.finish_copies()
            for key in self.plan.releases_after.get(slot, ()):
                group = self.groups.pop(key, None)
                if group is not None:
                    group.release()
        return out

    def forward(self, stage: Any, index: int, mb: int, run: Callable[[], Any]) -> Any:
        key = (index, mb)
        chunk = self.plan.chunks[key]
        stats = ChunkSwapStats(index, mb, chunk.swapped)
        self.stats.chunks[key] = stats
        if not chunk.swapped or not _compat.stage_trains(stage) or not torch.is_grad_enabled():
            stats.swapped = False
            return run()
        group = _ChunkGroup(self.swap, key, stats)
        out = group.forward(run)
        group.offload(self.swap.held_storages(stage, mb))
        if group.host_full:
            self.stats.host_full += 1
        if group.moved:
            self.groups[key] = group
        return out

    def finish(self) -> None:
        """The step is done: let go of anything still brought back."""
        for group in self.groups.values():
            group.release()
        self.groups.clear()
        self.swap.offloader.poll()

    def abort(self) -> None:
        """The step raised: wait for every copy, drop the step's host copies."""
        for group in self.groups.values():
            group.abort()
        self.groups.clear()
        self.swap.offloader.synchronize()
        self.swap.pool.clear()


class PipelineSwap:
    """Activation swap on a ``torch.distributed.pipelining`` schedule, made by
    :func:`pipeline_swap`; ``remove()`` takes it off (also on leaving a ``with`` block).

    ``plan``: this rank's :class:`~recomp._pipeline_swap.RankSwapPlan` (which
    (stage, micro-batch) groups swap and at which compute slots; ``print(swap.plan)``).
    ``last_step``: the counters of the latest ``schedule.step`` (a
    :class:`~recomp._pipeline_swap.PipelineSwapStats`: bytes each way per (stage,
    micro-batch)). ``offloader``: the :class:`~recomp.torch.Offloader` the copies go
    through; ``pool``: the pinned host blocks they use (a ``PinnedMemoryPool``)."""

    def __init__(
        self, schedule: Any, min_gap: int, min_bytes: int, host_limit: int
    ) -> None:
        self.schedule = schedule
        self.stages = _compat.schedule_stages(schedule)
        self.min_gap = min_gap
        self.plan = self._read_plan()
        self.offloader = Offloader(min_bytes=min_bytes)
        self.pool = PinnedMemoryPool(max(1, host_limit))
        self.last_step: PipelineSwapStats | None = None
        self.steps = 0
        self._run: _StepRun | None = None
        self._undo: list[Callable[[], None]] = []
        try:
            self._undo.append(_compat.wrap_method(schedule, "step", self._wrap_step))
            for stage in self.stages:
                self._undo.append(_compat.wrap_stage_steps(stage, self._around(stage)))
        except BaseException:
            self.remove()
            raise

    def _read_plan(self) -> RankSwapPlan:
        rank, slots = _compat.schedule_slots(self.schedule, self.stages)
        return plan_rank_swap(slots, self.min_gap, rank)

    # -- the schedule's step ---------------------------------------------------------

    def _wrap_step(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            if self._run is not None:  # a step inside a step: the outer one runs swap
                return method(*args, **kwargs)
            if list(self.plan.slots) != _compat.schedule_slots(self.schedule, self.stages)[1]:
                self.plan = self._read_plan()  # its action list was changed
            self.steps += 1
            run = _StepRun(self, self.plan, self.steps)
            self._run = run
            self.last_step = run.stats
            try:
                out = method(*args, **kwargs)
            except BaseException:
                run.abort()
                _compat.forget_failed_step(self.schedule)
                raise
            finally:
                self._run = None
            run.finish()
            return out

        return step

    def _around(self, stage: Any) -> Callable[[str, int, int, Callable[[], Any]], Any]:
        def around(kind: str, index: int, mb: int, run: Callable[[], Any]) -> Any:
            current = self._run
            if current is None:  # a stage step outside schedule.step: nothing to do
                return run()
            return current.compute(stage, kind, index, mb, run)

        return around

    def held_storages(self, stage: Any, mb: int) -> set[Hashable]:
        """The storages a saved tensor of ``stage``'s micro-batch ``mb`` may share without
        moving: what the pipeline runtime holds until the backward (the stage's inputs
        and outputs for that micro-batch), the stage's parameters and buffers."""
        held: set[Hashable] = set()
        tensors = list(_compat.stage_held_tensors(stage, mb))
        module = _compat.stage_submodule(stage)
        if isinstance(module, nn.Module):
            tensors += list(module.parameters()) + list(module.buffers())
        for t in tensors:
            if isinstance(t, torch.Tensor):
                key = _compat.storage_key(t)
                if key is not None:
                    held.add(key)
        return held

    # -- the handle ------------------------------------------------------------------

    def remove(self) -> None:
        """Take pipeline swap off the schedule: its ``step`` and its stages' steps are
        the class's own again. Refused during a step."""
        if self._run is not None:
            raise RecompError(
                "pipeline_swap(...).remove() was called during schedule.step(); remove it "
                "between steps."
            )
        undo, self._undo = self._undo, []
        for one in reversed(undo):
            one()
        if vars(self.schedule).get("_recomp_pipeline_swap") is self:
            del self.schedule._recomp_pipeline_swap
        self.pool.clear()

    @property
    def active(self) -> bool:
        """Whether it is on the schedule (not removed)."""
        return bool(self._undo)

    def __enter__(self) -> PipelineSwap:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "on" if self.active else "removed"
        return (
            f"PipelineSwap({type(self.schedule).__name__}, rank {self.plan.rank}, "
            f"{len(self.plan.swapped)} of {len(self.plan.chunks)} groups swap, {state})"
        )


def pipeline_swap(
    schedule: Any,
    *,
    min_gap: int = MIN_SWAP_GAP,
    min_bytes: int = DEFAULT_MIN_BYTES,
    host_limit: int = 64 << 30,
) -> PipelineSwap:
    """Swap activations inside a ``torch.distributed.pipelining`` schedule: what each
    micro-batch's forward saves for backward on a stage goes to pinned host memory after
    that forward and comes back one compute slot before its backward, wherever the
    schedule leaves at least ``min_gap`` compute slots between them::

        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=loss_fn)
        swap = recomp.torch.pipeline_swap(schedule)
        print(swap.plan)                  # which (stage, micro-batch) swap, and when
        for batch in loader:
            schedule.step(batch, target=target)
            print(swap.last_step)         # bytes each way per (stage, micro-batch)
        swap.remove()                     # the schedule as it was

    Everything the forward saves takes part: plain saved tensors and what recomp's
    checkpoints keep (their saved inputs, what their excluded regions keep). What the
    pipeline itself holds until the backward (a stage's inputs and outputs) and
    parameters stay. Zero-bubble schedules bring a group back before its input-gradient
    step and let it go after its weight-gradient step. Gradients are those without swap,
    bit for bit.

    ``min_gap``: the fewest compute slots from a forward to its backward (an overlapped
    forward-backward slot counts once) for a micro-batch to swap; at least 3.
    ``min_bytes``: smaller storages stay on the device. ``host_limit``: pinned host
    memory the copies may use, bytes (beyond it, tensors stay). On a machine without
    CUDA nothing moves unless ``RECOMP_OFFLOAD_HOST_COPY=1`` (the CPU test mode).
    One per schedule; call it on every rank."""
    check_min_gap(min_gap)
    for name, value in (("min_bytes", min_bytes), ("host_limit", host_limit)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"pipeline_swap({name}={value!r}): bytes, an int >= 0.")
    present = vars(schedule).get("_recomp_pipeline_swap") if hasattr(schedule, "__dict__") else None
    if present is not None and present.active:
        raise RecompError(
            f"{type(schedule).__name__} already has pipeline swap on: call remove() on the "
            "handle pipeline_swap returned before putting it on again."
        )
    swap = PipelineSwap(schedule, min_gap, min_bytes, host_limit)
    schedule._recomp_pipeline_swap = swap
    return swap
