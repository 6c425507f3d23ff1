"""Statistics shared by the PyTorch and MindSpore runners (no framework imports)."""

from __future__ import annotations

import statistics
from typing import Any


def summarize_times(times: list[float]) -> tuple[float, float]:
    """Median and spread of step times; the spread is the interquartile range (the range
    below 4 samples)."""
    if not times:
        return float("nan"), float("nan")
    if len(times) < 4:
        return statistics.median(times), max(times) - min(times)
    q = statistics.quantiles(times, n=4)
    return statistics.median(times), q[2] - q[0]


def region_counts(exclude_wrappers: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """``region_runs`` and ``region_skips`` of each excluded region, by name."""
    runs = {n: int(w.region_runs) for n, w in exclude_wrappers.items()}
    skips = {n: int(w.region_skips) for n, w in exclude_wrappers.items()}
    return runs, skips


def count_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Per-name difference of two counter snapshots."""
    return {k: after[k] - before.get(k, 0) for k in after}


def saved_bytes(wrappers: dict[str, Any]) -> dict[str, int]:
    """Bytes each excluded region keeps (recomp's ``region_saved_bytes``), where available."""
    return {
        name: int(w.region_saved_bytes)
        for name, w in wrappers.items()
        if hasattr(w, "region_saved_bytes")
    }
