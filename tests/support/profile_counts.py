"""Every count of a planner profile that is not a time: what a simulated profile must
share with a measured one (tests/plan/test_simulate.py, tests/distributed/test_simulate_parallel.py)."""

from __future__ import annotations

from typing import Any


def profile_counts(prof: Any) -> dict[str, Any]:
    """Every count of a profile that is not a time."""
    return {
        "shared": prof.shared_bytes,
        "spread": prof.spread_bytes,
        "bookkeeping": prof.bookkeeping_bytes,
        "layers": [
            {
                "path": layer.path,
                "none": layer.no_checkpoint_bytes,
                "input": layer.checkpoint_input_bytes,
                "flops": layer.forward_flops,
                "pairs": layer.pair_bytes,
                "regions": [(r.path, r.calls, r.forward_flops, r.exclusion_bytes) for r in layer.regions],
                "options": [
                    (o.name, o.kept_bytes, o.replay_flops, o.region_saved_bytes, o.collective_bytes)
                    for o in layer.options
                ],
            }
            for layer in prof.layers
        ],
    }
