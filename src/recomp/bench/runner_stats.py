"""Statistics of step times (no framework imports)."""

from __future__ import annotations

import statistics


def summarize_times(times: list[float]) -> tuple[float, float]:
    """Median and spread of step times; the spread is the interquartile range (the range
    below 4 samples)."""
    if not times:
        return float("nan"), float("nan")
    if len(times) < 4:
        return statistics.median(times), max(times) - min(times)
    q = statistics.quantiles(times, n=4)
    return statistics.median(times), q[2] - q[0]
