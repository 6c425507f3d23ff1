"""Per-phase collective counts, shared by ``recomp.torch.collectives`` and
``recomp.mindspore.collectives`` (each intercepts its framework's calls and
feeds a :class:`CollectiveCounts`)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from ._state import is_recomputing

#: The phases a collective is attributed to, in order.
PHASES = ("forward", "replay", "backward")


class CollectiveEvent(NamedTuple):
    """One counted collective call."""

    phase: str
    """``"forward"``, ``"replay"`` or ``"backward"``."""
    kind: str
    """Normalised kind: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ``"all_to_all"``, ..."""
    op: str
    """The entry point, e.g. ``"c10d.allreduce_.default"`` or ``"AllReduce"``."""
    numel: int = 0
    """Elements in the call's tensor arguments, where the counter sees them (PyTorch)."""


@dataclass
class CollectiveCounts:
    """Collective calls per phase.

    ``forward``, ``replay`` and ``backward`` are :class:`collections.Counter`
    objects keyed by kind (``counts.replay["all_to_all"]``); ``events`` lists
    every call in order.
    """

    forward: collections.Counter[str] = field(default_factory=collections.Counter)
    replay: collections.Counter[str] = field(default_factory=collections.Counter)
    backward: collections.Counter[str] = field(default_factory=collections.Counter)
    events: list[CollectiveEvent] = field(default_factory=list)

    def phase(self, name: str) -> collections.Counter[str]:
        """The counter of one phase, by name."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; expected one of {PHASES}")
        counter: collections.Counter[str] = getattr(self, name)
        return counter

    def total(self, phase: str | None = None, kind: str | None = None) -> int:
        """Number of calls, optionally restricted to one phase and/or one kind."""
        total = 0
        for p in PHASES if phase is None else (phase,):
            counter = self.phase(p)
            total += counter[kind] if kind is not None else sum(counter.values())
        return total

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{phase: {kind: count}}`` with every phase present; JSON-serialisable."""
        return {p: dict(sorted(self.phase(p).items())) for p in PHASES}

    def record(self, phase: str, kind: str, op: str, numel: int = 0) -> None:
        """Add one call (used by the framework counters)."""
        self.phase(phase)[kind] += 1
        self.events.append(CollectiveEvent(phase, kind, op, numel))

    def __str__(self) -> str:
        parts = []
        for p in PHASES:
            body = " ".join(f"{k}={v}" for k, v in sorted(self.phase(p).items())) or "-"
            parts.append(f"{p}: {body}")
        return " | ".join(parts)


def current_phase(is_replaying: Callable[[], bool], in_backward: Callable[[], bool]) -> str:
    """``replay`` while a checkpoint replays, else ``backward`` inside backward, else ``forward``."""
    if is_replaying():
        return "replay"
    if in_backward():
        return "backward"
    return "forward"


DEFAULT_IS_REPLAYING = is_recomputing
