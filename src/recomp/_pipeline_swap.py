"""Activation swap inside pipeline schedules, framework-free: which micro-batch of which
stage moves what its forward saved to the host, and at which compute slots of the rank.

NOTE [ Pipeline swap ]

A rank of a pipeline schedule runs a list of compute slots: a forward (``F``), a
backward (``B``), or the two halves of a split backward (``I``: input gradients,
``W``: weight gradients) of one (stage, micro-batch); an overlapped slot (DualPipeV's
``OVERLAP_F_B``) runs a forward and a backward together and counts as one slot. What a
micro-batch's forward saves for backward (plain saved tensors, a checkpoint's inputs,
what its excluded regions keep) is one swap group. Its *gap* is the number of slots
from its forward to the first slot of its backward (``B``, or ``I``).

1. A group swaps when its gap is at least ``min_gap`` (default 4, HyperParallel's
   ``MIN_SWAP_GAP``); others stay on the device as without swap. ``min_gap`` is at
   least 3: one slot to hide the copy out, another to hide the copy back.
2. For a group that swaps, with ``f`` the slot of its forward, ``b`` the first and
   ``e`` the last slot of its backward:
   - its copy to the host starts when its forward returns (inside slot ``f``, before
     the schedule sends the forward's output);
   - after slot ``f + 1`` its copies are finished: the device memory goes back to the
     allocator (on a device, the compute stream waits for the copies there, the host
     does not);
   - before slot ``b - 1`` its copy back starts, so that it runs while that slot
     computes;
   - its backward reads the bytes brought back (waiting for the copy where it is not
     done); they stay on the device through ``I`` and ``W`` (both read them) and are
     let go after slot ``e``.
   With ``min_gap = 4`` the group is off the device for at least one whole slot
   (slots ``f + 2`` to ``b - 2``, :attr:`ChunkSwap.off_device_slots`).
3. What the pipeline runtime itself holds until the backward stays: a saved tensor on
   the storage of a stage's inputs (the micro-batch's slice of the first stage's
   input, a received activation) or outputs (the loss's input on the last stage, the
   activation sent on) would be copied without freeing anything. Parameters and
   buffers stay too.
4. The plan only says when bytes move: every saved tensor reads its own bytes back,
   so a schedule that runs its steps in another order than its action list says costs
   time (a copy back on read), never a wrong value.

The whole-job memory model reads the same plan (``recomp.plan.job.job_memory(...,
pipeline_swap=PipelineSwap(...))``): :meth:`RankSwapPlan.steps_off_device` gives, per
group, the compute steps (indices into the rank's flat step list, as
``recomp.plan.job.walk_schedule`` walks it) during which its swapped bytes are on the
host only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import format_bytes

MIN_SWAP_GAP = 4

Step = tuple[str, int, int]  # (kind F/B/I/W, stage, micro-batch)
Slot = tuple[Step, ...]
Chunk = tuple[int, int]  # (stage, micro-batch)


def check_min_gap(min_gap: Any) -> int:
    """``min_gap`` as given, or ``ValueError`` naming what to pass."""
    if not isinstance(min_gap, int) or isinstance(min_gap, bool) or min_gap < 3:
        raise ValueError(
            f"min_gap={min_gap!r}: the fewest compute slots from a micro-batch's forward to "
            "its backward for its saved tensors to move is an int >= 3 (one slot hides the "
            f"copy to the host, another the copy back); the default is {MIN_SWAP_GAP}, "
            "which leaves at least one slot with the tensors off the device."
        )
    return min_gap


@dataclass(frozen=True)
class ChunkSwap:
    """What pipeline swap does with one (stage, micro-batch) on a rank, and why.

    Slots are indices into the rank's compute slots. ``backward_slot``: the first slot
    of its backward (``B``, or ``I`` of a split backward), ``last_slot`` the last
    (``B``, or ``W``); None when the rank runs no backward for it."""

    stage: int
    microbatch: int
    forward_slot: int
    backward_slot: int | None
    last_slot: int | None
    swapped: bool
    why: str

    @property
    def gap(self) -> int | None:
        """Slots from the forward to the first slot of the backward."""
        if self.backward_slot is None:
            return None
        return self.backward_slot - self.forward_slot

    @property
    def wait_slot(self) -> int | None:
        """The slot after which its copies to the host are finished."""
        return self.forward_slot + 1 if self.swapped else None

    @property
    def load_slot(self) -> int | None:
        """The slot before which its copy back starts."""
        return self.backward_slot - 1 if self.swapped and self.backward_slot is not None else None

    @property
    def release_slot(self) -> int | None:
        """The slot after which what was brought back is let go."""
        return self.last_slot if self.swapped else None

    @property
    def off_device_slots(self) -> range:
        """The slots during which its swapped bytes are on the host only (at the worst:
        copies that take all the time they are given)."""
        if not self.swapped or self.backward_slot is None:
            return range(0)
        return range(self.forward_slot + 2, self.backward_slot - 1)


@dataclass
class RankSwapPlan:
    """Pipeline swap on one rank of a schedule (NOTE [ Pipeline swap ]): its compute
    slots and a :class:`ChunkSwap` per (stage, micro-batch). ``print(plan)`` lists them."""

    rank: int
    min_gap: int
    slots: tuple[Slot, ...]
    chunks: dict[Chunk, ChunkSwap]
    slot_of: dict[Step, int] = field(default_factory=dict, repr=False)
    loads_before: dict[int, tuple[Chunk, ...]] = field(default_factory=dict, repr=False)
    waits_after: dict[int, tuple[Chunk, ...]] = field(default_factory=dict, repr=False)
    releases_after: dict[int, tuple[Chunk, ...]] = field(default_factory=dict, repr=False)

    @property
    def swapped(self) -> list[ChunkSwap]:
        return [c for c in self.chunks.values() if c.swapped]

    def first_steps(self) -> list[int]:
        """The index of each slot's first step in the rank's flat step list (slots
        flattened in order, as ``recomp.plan.job`` reads a schedule)."""
        out, at = [], 0
        for slot in self.slots:
            out.append(at)
            at += len(slot)
        return out

    def steps_off_device(self, chunk: Chunk) -> range:
        """The flat step indices during which ``chunk``'s swapped bytes are on the host
        only: empty when it does not swap (the seam for whole-job memory)."""
        slots = self.chunks[chunk].off_device_slots
        if not slots:
            return range(0)
        starts = [*self.first_steps(), sum(len(s) for s in self.slots)]
        return range(starts[slots.start], starts[slots.stop])

    def resident_peak(self, swap: bool = True) -> tuple[int, int]:
        """The most (stage, micro-batch) groups on the device at once and the first slot
        where that many are: a group from its forward to the last slot of its backward,
        and, with ``swap``, away during its :attr:`~ChunkSwap.off_device_slots` (copies in
        flight and brought back count as on the device). A count of groups, not bytes:
        the whole-job memory model weighs each by what its stage keeps."""
        best = (0, 0)
        for index in range(len(self.slots)):
            count = 0
            for c in self.chunks.values():
                end = c.last_slot if c.last_slot is not None else len(self.slots)
                if c.forward_slot <= index <= end and not (swap and index in c.off_device_slots):
                    count += 1
            if count > best[0]:
                best = (count, index)
        return best

    def __str__(self) -> str:
        swapped = self.swapped
        lines = [
            f"pipeline swap, rank {self.rank}: {len(swapped)} of {len(self.chunks)} "
            f"(stage, micro-batch) groups swap (gap >= {self.min_gap} compute slots; "
            f"{len(self.slots)} slots); groups on the device at the rank's peak: "
            f"{self.resident_peak(False)[0]} without swap, {self.resident_peak(True)[0]} with"
        ]
        for c in sorted(self.chunks.values(), key=lambda c: (c.stage, c.microbatch)):
            if c.swapped:
                how = (
                    f"out after slot {c.forward_slot}, done after {c.wait_slot}, back before "
                    f"{c.load_slot}, released after {c.release_slot}"
                )
            else:
                how = "kept"
            lines.append(f"  stage {c.stage} micro-batch {c.microbatch}: {c.why}; {how}")
        return "\n".join(lines)


def plan_rank_swap(slots: Sequence[Slot], min_gap: int = MIN_SWAP_GAP, rank: int = 0) -> RankSwapPlan:
    """Which (stage, micro-batch) groups of one rank swap, and at which slots
    (NOTE [ Pipeline swap ]). ``slots``: the rank's compute slots in order, each a
    tuple of ``(kind, stage, micro-batch)`` steps."""
    check_min_gap(min_gap)
    slots = tuple(tuple((str(k), int(s), int(m)) for k, s, m in slot) for slot in slots)
    slot_of: dict[Step, int] = {}
    forward: dict[Chunk, int] = {}
    first: dict[Chunk, int] = {}
    last: dict[Chunk, int] = {}
    for index, slot in enumerate(slots):
        for step in slot:
            kind, stage, mb = step
            if step in slot_of:
                raise ValueError(f"rank {rank}: step {stage}{kind}{mb} runs twice in one step")
            if kind not in ("F", "B", "I", "W"):
                raise ValueError(f"rank {rank}: unknown step kind {kind!r}")
            slot_of[step] = index
            key = (stage, mb)
            if kind == "F":
                forward[key] = index
            elif key not in forward:
                raise ValueError(f"rank {rank}: step {stage}{kind}{mb} before its forward")
            else:
                first.setdefault(key, index)
                last[key] = index
    chunks: dict[Chunk, ChunkSwap] = {}
    loads: dict[int, list[Chunk]] = {}
    waits: dict[int, list[Chunk]] = {}
    releases: dict[int, list[Chunk]] = {}
    for key, f in forward.items():
        b = first.get(key)
        if b is None:
            swapped, why = False, "no backward on this rank"
        elif b - f >= min_gap:
            swapped, why = True, f"gap {b - f} >= {min_gap}"
        else:
            swapped, why = False, f"gap {b - f} < {min_gap}: too few slots to hide the copies"
        chunk = ChunkSwap(key[0], key[1], f, b, last.get(key), swapped, why)
        chunks[key] = chunk
        if swapped:
            waits.setdefault(chunk.wait_slot, []).append(key)  # type: ignore[arg-type]
            loads.setdefault(chunk.load_slot, []).append(key)  # type: ignore[arg-type]
            releases.setdefault(chunk.release_slot, []).append(key)  # type: ignore[arg-type]
    return RankSwapPlan(
        rank,
        min_gap,
        slots,
        chunks,
        slot_of,
        {k: tuple(v) for k, v in loads.items()},
        {k: tuple(v) for k, v in waits.items()},
        {k: tuple(v) for k, v in releases.items()},
    )


@dataclass
class ChunkSwapStats:
    """What one (stage, micro-batch) group saved and moved in a step. Bytes are storage
    bytes, each storage once per copy; a group that does not swap (``swapped`` False)
    records nothing and counts 0. ``kept_bytes``: saved storages of a swapping group
    that stayed on the device (what the pipeline runtime holds: the stage's inputs and
    outputs; parameters' and buffers' storages; smaller than ``min_bytes``; beyond the
    host pool).
    ``on_demand_bytes`` and ``unhidden_copies``: copies back that backward waited for
    (not brought back ahead, or, on a device, not done when read).
    ``peak_resident_bytes``: the most the group held on the device at once (with the
    rank's copies to the host still in flight)."""

    stage: int
    microbatch: int
    swapped: bool
    saved_bytes: int = 0
    kept_bytes: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0
    prefetched_bytes: int = 0
    on_demand_bytes: int = 0
    unhidden_copies: int = 0
    peak_resident_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class PipelineSwapStats:
    """The counters of one ``schedule.step`` under pipeline swap: one
    :class:`ChunkSwapStats` per (stage, micro-batch) whose forward ran on this rank.
    ``unplanned_steps``: compute steps the schedule ran that its action list did not
    have where they ran (they ran without swap steps around them).
    ``host_full``: groups that kept tensors because the host pool was full."""

    step: int = 0
    chunks: dict[Chunk, ChunkSwapStats] = field(default_factory=dict)
    unplanned_steps: int = 0
    host_full: int = 0

    @property
    def offloaded_bytes(self) -> int:
        return sum(c.offloaded_bytes for c in self.chunks.values())

    @property
    def restored_bytes(self) -> int:
        return sum(c.restored_bytes for c in self.chunks.values())

    def __str__(self) -> str:
        lines = [
            f"pipeline swap, step {self.step}: {format_bytes(self.offloaded_bytes)} to the "
            f"host, {format_bytes(self.restored_bytes)} back"
        ]
        for (stage, mb), c in sorted(self.chunks.items()):
            if c.swapped:
                lines.append(
                    f"  stage {stage} micro-batch {mb}: {format_bytes(c.offloaded_bytes)} out, "
                    f"{format_bytes(c.restored_bytes)} back "
                    f"({format_bytes(c.prefetched_bytes)} ahead), "
                    f"{format_bytes(c.kept_bytes)} kept"
                )
        if self.unplanned_steps:
            lines.append(f"  {self.unplanned_steps} steps ran outside the schedule's action list")
        return "\n".join(lines)
