"""What an offload session saw of one step, and the planner that reads it: which saved
tensors wait on the host, when each comes back, and why (framework-free).

NOTE [ Offload planning ]

The trace is the order in which a step saves tensors for backward and reads them
back: one event per save (a pack of the saved-tensors hook), per read (an unpack) and
per opaque region (``skip_offload``). Saves of one storage (views of one tensor,
saved by several ops) are one :class:`TracedStorage`. The resident bytes after an
event are the bytes of every storage between its first save and its last read; a
storage never read is held to the end of the step.

Offloading a storage frees it from the event after its last save (its copy to the
host starts there) to the event at which its copy back starts (``prefetch_at``), at
the latest its first read. :class:`BudgetPlanner` chooses what to offload so that
the resident bytes stay within the budget at every event, moving as few bytes as it
can, and copies not hidden by compute cost more:

1. Candidates: storages that may move (a plain device tensor of at least the size
   threshold, not a parameter) with at least one event between their last save and
   their first read (their reuse distance).
2. Each candidate frees the events between its last save and its first read (as if
   it came back just in time; step 4 says when). Its gain is the excess over the
   budget it removes, summed over those events (``min(size, excess)`` per event); its
   cost is the bytes it moves,
   weighted up by the part of its copies (out and back, at the host link's bandwidth)
   that its reuse window cannot hide. The candidate with the best gain per cost is
   taken, the gains updated (lazily: a gain only falls as the excess does), until no
   event is over the budget or no candidate helps. A weighted cover, not a
   longest-gap-first pass: a long-lived small tensor does not beat a large one that
   covers the same events.
3. Reverse delete: the chosen storages, costliest first, are dropped again where the
   budget holds without them.
4. Copies back share one stream: from the last read backwards, each copy is placed to
   end before its read and before the next copy starts, and starts at the latest
   event whose time allows it.
5. Where a copy back started that early passes the budget, it starts later (at its
   read at the latest, where backward then waits for it). If events are still over
   the budget, steps 2-5 run again for them (three rounds at most).

Times come from the trace (device times of each event, measured on a device) and
the host link's bandwidth; an untimed trace (CPU) counts every event and every copy
as one unit, so that a copy back starts one event before its read.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import format_bytes

SAVE, READ, REGION = 0, 1, 2


@dataclass
class TracedStorage:
    """One storage the step saved: its size, where it was saved and read, and whether
    it may move (``why_kept`` says why not)."""

    index: int
    nbytes: int
    label: str
    movable: bool = True
    why_kept: str | None = None
    host_bytes: int = 0  # what its host copy takes (the pool's block), 0: nbytes
    saves: list[int] = field(default_factory=list)  # event indices
    reads: list[int] = field(default_factory=list)

    def release(self, end: int) -> int:
        """The last event it is resident at, unless it moves."""
        return self.reads[-1] if self.reads else end


@dataclass
class OffloadTrace:
    """One step as an offload session saw it (NOTE [ Offload planning ]), with what
    the planner plans against: the budget, the host link and the host memory."""

    storages: list[TracedStorage] = field(default_factory=list)
    kinds: list[int] = field(default_factory=list)  # per event: SAVE, READ or REGION
    ids: list[int] = field(default_factory=list)  # per event: storage (-1: none), region name index
    regions: list[str] = field(default_factory=list)
    # Per save and region, in order: what a later step must match (shape, dtype, device).
    marks: list[tuple[Any, ...]] = field(default_factory=list)
    seconds: list[float] | None = None  # device time of each event since the first
    budget_bytes: int = 0
    host_bandwidth: float | None = None  # bytes/s each way
    host_limit_bytes: int | None = None

    @property
    def events(self) -> int:
        return len(self.kinds)

    def resident(self) -> list[int]:
        """Resident bytes after each event, nothing moved."""
        n = self.events
        delta = [0] * (n + 1)
        for s in self.storages:
            if not s.saves:
                continue
            delta[s.saves[0]] += s.nbytes
            delta[s.release(n - 1) + 1] -= s.nbytes
        out, total = [], 0
        for e in range(n):
            total += delta[e]
            out.append(total)
        return out

    def mark_of_event(self) -> dict[int, int]:
        """Event index -> its position among saves and regions."""
        out, mark = {}, 0
        for e, kind in enumerate(self.kinds):
            if kind != READ:
                out[e] = mark
                mark += 1
        return out


class TraceRecorder:
    """Builds an :class:`OffloadTrace` event by event (the session's, and tests' own)."""

    def __init__(self) -> None:
        self.trace = OffloadTrace()

    def new_storage(
        self,
        nbytes: int,
        label: str,
        movable: bool = True,
        why_kept: str | None = None,
        host_bytes: int = 0,
    ) -> int:
        index = len(self.trace.storages)
        self.trace.storages.append(
            TracedStorage(index, nbytes, label, movable, why_kept, host_bytes)
        )
        return index

    def save(self, storage: int, mark: tuple[Any, ...] = ()) -> int:
        tr = self.trace
        tr.storages[storage].saves.append(len(tr.kinds))
        tr.kinds.append(SAVE)
        tr.ids.append(storage)
        tr.marks.append(mark)
        return len(tr.kinds) - 1

    def untracked(self, mark: tuple[Any, ...] = ()) -> int:
        """A save the session does not hold (a parameter): an event, not a storage."""
        tr = self.trace
        tr.kinds.append(SAVE)
        tr.ids.append(-1)
        tr.marks.append(mark)
        return len(tr.kinds) - 1

    def read(self, storage: int) -> int:
        tr = self.trace
        tr.storages[storage].reads.append(len(tr.kinds))
        tr.kinds.append(READ)
        tr.ids.append(storage)
        return len(tr.kinds) - 1

    def region(self, name: str) -> int:
        tr = self.trace
        tr.kinds.append(REGION)
        tr.ids.append(len(tr.regions))
        tr.regions.append(name)
        tr.marks.append(("region", name))
        return len(tr.kinds) - 1


@dataclass(frozen=True)
class OffloadDecision:
    """One storage the plan moves: its copy to the host starts after event
    ``offload_after`` (its last save), its copy back at event ``prefetch_at`` (None:
    when backward reads it, or never if it is not read in the traced step)."""

    storage: int
    nbytes: int
    offload_after: int
    prefetch_at: int | None
    hidden: bool | None  # whether its copies fit in its reuse window (None: untimed)
    reason: str


@dataclass
class OffloadPlan:
    """What to offload in each step like the traced one, the resident bytes it leads
    to, and why (:meth:`summary`)."""

    trace: OffloadTrace
    budget_bytes: int
    traced_peak_bytes: int = 0
    traced_peak_event: int = 0
    planned_peak_bytes: int = 0
    planned_peak_event: int = 0
    decisions: dict[int, OffloadDecision] = field(default_factory=dict)
    kept: dict[int, str] = field(default_factory=dict)  # storage -> why it stays
    exposed_seconds: float | None = None  # predicted copy time compute waits for
    notes: list[str] = field(default_factory=list)

    @property
    def moved_bytes(self) -> int:
        """Bytes the plan copies each way (to the host, and back for what is read)."""
        return sum(d.nbytes for d in self.decisions.values())

    @property
    def fits(self) -> bool:
        return self.planned_peak_bytes <= self.budget_bytes

    def evictions(self) -> dict[int, int]:
        """Mark position (n-th save or region) after which a storage moves -> storage."""
        marks = self.trace.mark_of_event()
        return {marks[d.offload_after]: d.storage for d in self.decisions.values()}

    def prefetches(self) -> dict[int, list[int]]:
        """Event index -> storages whose copy back starts there."""
        out: dict[int, list[int]] = {}
        for d in self.decisions.values():
            if d.prefetch_at is not None:
                out.setdefault(d.prefetch_at, []).append(d.storage)
        return out

    def summary(self, limit: int = 12) -> str:
        """Which storages move and why, and the ones that stay."""
        tr = self.trace
        lines = [
            f"Offload plan: budget {format_bytes(self.budget_bytes)}; the traced step held up "
            f"to {format_bytes(self.traced_peak_bytes)} (event {self.traced_peak_event} of "
            f"{tr.events}), {len(tr.storages)} saved storages.",
        ]
        if not self.decisions:
            lines.append("Nothing moves: " + (self.notes[0] if self.notes else "the budget holds."))
        else:
            lines.append(
                f"Offloads {len(self.decisions)} of them, {format_bytes(self.moved_bytes)} each "
                f"way; planned peak {format_bytes(self.planned_peak_bytes)} (event "
                f"{self.planned_peak_event})" + ("." if self.fits else ", over the budget.")
            )
        if tr.host_bandwidth and tr.seconds is not None and self.decisions:
            hidden = sum(1 for d in self.decisions.values() if d.hidden)
            lines.append(
                f"Host link {tr.host_bandwidth / 1e9:.3g} GB/s: {hidden} of "
                f"{len(self.decisions)} copies hidden in their reuse window; predicted wait "
                f"{(self.exposed_seconds or 0.0) * 1e3:.2f} ms."
            )
        lines.extend(n for n in self.notes[1 if not self.decisions else 0 :])
        shown = sorted(self.decisions.values(), key=lambda d: -d.nbytes)
        for d in shown[:limit]:
            lines.append(f"  offload #{d.storage}: {d.reason}")
        if len(shown) > limit:
            lines.append(f"  ... and {len(shown) - limit} more offloaded")
        kept = sorted(self.kept.items(), key=lambda kv: -tr.storages[kv[0]].nbytes)
        for index, why in kept[:limit]:
            s = tr.storages[index]
            lines.append(f"  keep #{index} {s.label} ({format_bytes(s.nbytes)}): {why}")
        if len(kept) > limit:
            lines.append(f"  ... and {len(kept) - limit} more kept")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


class Planner(Protocol):
    """What ``OffloadConfig(planner=...)`` takes: ``build(trace)`` returns the plan."""

    def build(self, trace: OffloadTrace) -> OffloadPlan: ...


class BudgetPlanner:
    """The default planner (NOTE [ Offload planning ]): a weighted cover of the events
    over the budget by storages chosen from their sizes, reuse distances and the host
    link's bandwidth, pruned by reverse delete, with copies back scheduled on one
    stream. ``exposure_weight``: how much more a byte costs whose copy cannot be
    hidden in its reuse window (0: bytes only)."""

    def __init__(self, *, exposure_weight: float = 3.0, rounds: int = 3) -> None:
        if not isinstance(exposure_weight, (int, float)) or exposure_weight < 0:
            raise ValueError(f"exposure_weight must be a number >= 0, got {exposure_weight!r}.")
        self.exposure_weight = float(exposure_weight)
        self.rounds = rounds

    def build(self, trace: OffloadTrace) -> OffloadPlan:
        return _Planning(trace, self.exposure_weight, self.rounds).run()


class _Planning:
    """One run of :class:`BudgetPlanner` on one trace."""

    def __init__(self, trace: OffloadTrace, weight: float, rounds: int) -> None:
        self.tr = trace
        self.weight = weight
        self.rounds = rounds
        self.n = trace.events
        self.timed = trace.seconds is not None and trace.host_bandwidth is not None
        self.t: Sequence[float] = trace.seconds if self.timed else range(self.n)  # type: ignore[assignment]
        self.res = trace.resident()
        self.budget = trace.budget_bytes
        self.base = list(self.res)
        self.chosen: dict[int, int] = {}  # storage -> prefetch event (n: never read)
        self.dropped: set[int] = set()
        self.host_used = 0
        self.host_full = False

    # -- times -------------------------------------------------------------------

    def copy(self, nbytes: int) -> float:
        if not self.timed:
            return 1.0
        return nbytes / float(self.tr.host_bandwidth)  # type: ignore[arg-type]

    def window(self, s: TracedStorage) -> float:
        return self.t[s.reads[0]] - self.t[s.saves[-1]]

    def exposure(self, s: TracedStorage) -> float:
        """The part of the copies out and back its reuse window cannot hide (0 to 1)."""
        if not self.timed or not s.reads:
            return 0.0
        both = 2 * self.copy(s.nbytes)
        return max(0.0, both - self.window(s)) / both if both > 0 else 0.0

    def latest_start(self, s: TracedStorage, finish: float) -> int:
        """The latest event after its last save whose time lets a copy back end by
        ``finish``; the event after its last save if none does."""
        start = finish - self.copy(s.nbytes)
        lo, hi = s.saves[-1] + 1, s.reads[0]
        best = lo
        for e in range(hi, lo - 1, -1):
            if self.t[e] <= start:
                best = e
                break
        return best

    def first_read(self, s: TracedStorage) -> int:
        return s.reads[0] if s.reads else self.n

    # -- the steps -----------------------------------------------------------------

    def run(self) -> OffloadPlan:
        tr = self.tr
        plan = OffloadPlan(tr, self.budget)
        if self.n == 0:
            plan.notes.append("the step saved nothing.")
            return plan
        peak = max(range(self.n), key=lambda e: self.res[e])
        plan.traced_peak_bytes, plan.traced_peak_event = self.res[peak], peak
        if self.res[peak] <= self.budget:
            plan.planned_peak_bytes, plan.planned_peak_event = plan.traced_peak_bytes, peak
            plan.notes.append("the traced step stays within the budget.")
            self.explain(plan)
            return plan
        prefetch: dict[int, int] = {}
        for _ in range(self.rounds):
            self.cover(prefetch)
            self.reverse_delete(prefetch)
            prefetch = self.schedule_copies_back()
            self.res = self.resident_with(prefetch)
            self.delay_copies_back(prefetch)
            if max(self.res) <= self.budget:
                break
        self.chosen = prefetch
        peak = max(range(self.n), key=lambda e: self.res[e])
        plan.planned_peak_bytes, plan.planned_peak_event = self.res[peak], peak
        if not plan.fits:
            plan.notes.append(self.why_over(peak))
        self.explain(plan)
        return plan

    def candidates(self) -> list[TracedStorage]:
        return [
            s
            for s in self.tr.storages
            if s.movable and s.saves and (not s.reads or s.reads[0] > s.saves[-1] + 1)
        ]

    def cover(self, prefetch: dict[int, int]) -> None:
        """Step 2: the weighted cover, on top of what is chosen already."""
        budget, res = self.budget, self.res
        over = sum(1 for r in res if r > budget)
        if not over:
            return
        spans: dict[int, range] = {}
        heap: list[tuple[float, int, int, int]] = []
        for s in self.candidates():
            if s.index in self.chosen:
                continue
            span = range(s.saves[-1] + 1, self.first_read(s))
            if not span:
                continue
            spans[s.index] = span
            ratio = self.gain(s, span) / self.cost(s)
            if ratio > 0:
                heapq.heappush(heap, (-ratio, -len(span), -s.nbytes, s.index))
        storages = self.tr.storages
        while over and heap:
            _, _, _, index = heapq.heappop(heap)
            s, span = storages[index], spans[index]
            ratio = self.gain(s, span) / self.cost(s)
            if ratio <= 0:
                continue
            if heap and ratio < -heap[0][0]:
                heapq.heappush(heap, (-ratio, -len(span), -s.nbytes, index))
                continue
            host = s.host_bytes or s.nbytes
            limit = self.tr.host_limit_bytes
            if limit is not None and self.host_used + host > limit:
                self.host_full = True
                continue
            self.host_used += host
            self.chosen[index] = span.stop
            prefetch[index] = span.stop
            for e in span:
                if res[e] > budget and res[e] - s.nbytes <= budget:
                    over -= 1
                res[e] -= s.nbytes

    def gain(self, s: TracedStorage, span: range) -> float:
        budget, res, size = self.budget, self.res, s.nbytes
        return float(sum(min(size, res[e] - budget) for e in span if res[e] > budget))

    def cost(self, s: TracedStorage) -> float:
        return max(1, s.nbytes) * (1.0 + self.weight * self.exposure(s))

    def reverse_delete(self, prefetch: dict[int, int]) -> None:
        """Step 3: drop what the budget does not need, costliest first."""
        storages, res, budget = self.tr.storages, self.res, self.budget
        for index in sorted(self.chosen, key=lambda i: (-self.cost(storages[i]), -i)):
            s = storages[index]
            span = range(s.saves[-1] + 1, self.chosen[index])
            if all(res[e] + s.nbytes <= budget for e in span):
                for e in span:
                    res[e] += s.nbytes
                del self.chosen[index]
                prefetch.pop(index, None)
                self.host_used -= s.host_bytes or s.nbytes
                self.dropped.add(index)

    def schedule_copies_back(self) -> dict[int, int]:
        """Step 4: copies back on one stream, from the last read backwards."""
        storages = self.tr.storages
        out = {i: self.n for i in self.chosen if not storages[i].reads}
        read = sorted((i for i in self.chosen if storages[i].reads), key=lambda i: -storages[i].reads[0])
        free = float("inf")
        for index in read:
            s = storages[index]
            finish = min(self.t[s.reads[0]], free)
            out[index] = self.latest_start(s, finish)
            free = finish - self.copy(s.nbytes)  # the copy before it ends by then
        self.chosen = dict(out)
        return out

    def delay_copies_back(self, prefetch: dict[int, int]) -> None:
        """Step 5: where a copy back started early passes the budget, start it later
        (at its read at the latest, where backward waits for it)."""
        storages, res, budget = self.tr.storages, self.res, self.budget
        for e in range(self.n):
            if res[e] <= budget:
                continue
            early = [
                i
                for i, stop in prefetch.items()
                if storages[i].reads and stop <= e < storages[i].reads[0]
            ]
            for index in sorted(early, key=lambda i: -storages[i].reads[0]):
                if res[e] <= budget:
                    break
                s, old = storages[index], prefetch[index]
                for f in range(old, e + 1):
                    res[f] -= s.nbytes
                prefetch[index] = e + 1
        self.chosen = dict(prefetch)

    def resident_with(self, prefetch: dict[int, int]) -> list[int]:
        res = list(self.base)
        for index, stop in prefetch.items():
            s = self.tr.storages[index]
            for e in range(s.saves[-1] + 1, stop):
                res[e] -= s.nbytes
        return res

    def why_over(self, peak: int) -> str:
        held = [
            s
            for s in self.tr.storages
            if s.saves and s.saves[0] <= peak <= s.release(self.n - 1) and s.index not in self.chosen
        ]
        unmovable = sum(s.nbytes for s in held if not s.movable)
        text = (
            f"the budget cannot be met: at event {peak} the plan still holds "
            f"{format_bytes(self.res[peak])}, {format_bytes(unmovable)} of it in tensors that "
            f"cannot move (parameters, tensors under the size threshold, tensors read right "
            f"after they are saved)"
        )
        if self.host_full:
            text += "; the host memory limit stopped further offloads"
        return text + "."

    # -- the reasons -------------------------------------------------------------------

    def waits(self) -> dict[int, float]:
        """Per storage read: how long after its read its copy back ends, the copies
        run one after another in the order their events start them."""
        storages, out = self.tr.storages, {}
        order = sorted(
            (i for i in self.chosen if storages[i].reads),
            key=lambda i: (self.chosen[i], storages[i].reads[0]),
        )
        free = float("-inf")
        for index in order:
            s = storages[index]
            end = max(self.t[self.chosen[index]], free) + self.copy(s.nbytes)
            out[index] = max(0.0, end - self.t[s.reads[0]])
            free = end
        return out

    def explain(self, plan: OffloadPlan) -> None:
        tr = self.tr
        exposed = 0.0
        waits = self.waits() if self.timed else {}
        for index, stop in sorted(self.chosen.items()):
            s = tr.storages[index]
            last, first = s.saves[-1], (s.reads[0] if s.reads else None)
            span = range(last + 1, stop)
            held = max((self.base[e] for e in span), default=0)
            text = f"{s.label} ({format_bytes(s.nbytes)}): last saved at event {last}, "
            if first is None:
                text += "never read in the traced step"
            else:
                text += f"first read at event {first}, {first - last} events later"
                if self.timed:
                    text += f" ({self.window(s) * 1e3:.2f} ms)"
            text += (
                f"; off the device over events {span.start}-{span.stop - 1}, where the step held "
                f"up to {format_bytes(held)}"
            )
            if first is not None:
                text += (
                    f"; back from event {stop}, ahead of its read"
                    if stop < first
                    else "; copied back when read"
                )
            hidden: bool | None = None
            if self.timed and first is not None:
                c = self.copy(s.nbytes)
                late = waits[index]
                exposed += late
                hidden = self.exposure(s) == 0.0 and late == 0.0
                text += (
                    f"; copies {c * 1e3:.2f} ms each way at "
                    f"{float(tr.host_bandwidth or 0) / 1e9:.3g} GB/s, "
                    + ("hidden" if hidden else "not all hidden")
                )
            ahead = stop if first is not None and stop < first else None
            plan.decisions[index] = OffloadDecision(index, s.nbytes, last, ahead, hidden, text)
        if self.timed:
            plan.exposed_seconds = exposed
        for s in tr.storages:
            if s.index in plan.decisions:
                continue
            if not s.movable:
                why = s.why_kept or "it cannot move"
            elif s.reads and s.reads[0] <= s.saves[-1] + 1:
                why = "read right after its last save: no time to move it"
            elif plan.traced_peak_bytes <= self.budget:
                why = "the budget holds without moving anything"
            elif s.index in self.dropped:
                why = "chosen, then not needed once the others moved"
            elif self.host_full:
                why = "not needed, or the host memory limit was reached"
            else:
                why = "not needed: the budget holds over its span once the others move"
            plan.kept[s.index] = why
