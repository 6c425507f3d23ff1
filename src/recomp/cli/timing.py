"""Step timing that the PyTorch and MindSpore runners share (no framework imports): the
interleaved timing loop and step-time statistics."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol


class Stepper(Protocol):
    """One strategy's training step, as the timing loop drives it."""

    def step(self) -> None:
        """One training step (forward, backward, update)."""

    def sync(self) -> None:
        """Wait until the device has finished the work queued so far."""


@dataclass
class StepTimes:
    """Step times of a timing run in seconds, by strategy: wall time and process CPU time."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]


def time_interleaved(
    steppers: Mapping[str, Stepper],
    steps: int,
    warmup: int,
    progress: Callable[[int, int], None] | None = None,
) -> StepTimes:
    """Wall and process CPU time of ``steps`` steps of every stepper, interleaved: round
    ``r`` times one step of each in turn (in reverse order every other round, so that no
    strategy always follows the same one), so that drifts of the machine hit them alike.
    ``warmup`` untimed rounds come first (at least one)."""
    names = list(steppers)
    for _ in range(max(1, warmup)):
        for stepper in steppers.values():
            stepper.step()
    wall: dict[str, list[float]] = {s: [] for s in names}
    cpu: dict[str, list[float]] = {s: [] for s in names}
    for r in range(steps):
        order = names if r % 2 == 0 else list(reversed(names))
        for s in order:
            stepper = steppers[s]
            stepper.sync()
            t0, c0 = time.perf_counter(), time.process_time()
            stepper.step()
            stepper.sync()
            wall[s].append(time.perf_counter() - t0)
            cpu[s].append(time.process_time() - c0)
        if progress is not None:
            progress(r + 1, steps)
    return StepTimes(wall, cpu)


def summarize_times(times: list[float]) -> tuple[float, float]:
    """Median and spread of step times; the spread is the interquartile range (the range
    below 4 samples)."""
    if not times:
        return float("nan"), float("nan")
    if len(times) < 4:
        return statistics.median(times), max(times) - min(times)
    q = statistics.quantiles(times, n=4)
    return statistics.median(times), q[2] - q[0]
