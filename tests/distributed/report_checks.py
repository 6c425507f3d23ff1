"""Assertions shared by the tensor-parallel tests (Megatron, DTensor, MindSpore), which
read per-rank reports of the same shape."""

from __future__ import annotations


def assert_replay_all_reduces_without_exclusion(reports: list[dict]) -> None:
    """Control: without exclusions the replay does issue all-reduces, so the counter sees
    replayed collectives. Early stop ends the replay at the second row-parallel linear's
    input, before its all-reduce: one per layer; without early stop, both."""
    layers = reports[0]["layers"]
    for r in reports:
        v = r["variants"]
        assert v["recomp_no_exclusion"]["counts"]["replay"] == {"all_reduce": layers}
        assert v["recomp_full_replay_no_exclusion"]["counts"]["replay"] == {
            "all_reduce": 2 * layers
        }


def assert_parallel_model_matches_dense(reports: list[dict], value: str) -> None:
    """Validates the parallel model itself against a dense one: float32 sums in another
    order, so a tolerance (1e-5 relative to the largest value; rounding is ~1e-7)."""
    for r in reports:
        d = r["dense"]
        assert d[value] < d["rtol"], d
        assert d["grad_max_rel_diff"] < d["rtol"], d


def assert_all_checks_pass(reports: list[dict]) -> None:
    for r in reports:
        assert r["ok"], r["checks"]
