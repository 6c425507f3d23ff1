"""Counters of recomp's exclude wrappers, read by the PyTorch and MindSpore runners alike
(no framework imports)."""

from __future__ import annotations

from typing import Any


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
