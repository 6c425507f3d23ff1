"""Assertions shared by the tensor-parallel tests (Megatron, DTensor, MindSpore), which
read per-rank reports of the same shape."""

from __future__ import annotations

#: The checkpointed variants each tensor-parallel example runs besides its reference.
VARIANTS = [
    "recomp",
    "recomp_no_exclusion",
    "recomp_full_replay",
    "recomp_full_replay_no_exclusion",
]


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


def assert_gradients_equal_the_reference(reports: list[dict], variant: str) -> None:
    """The variant's gradients are bit-equal to the parallel model's without checkpoints,
    its output equal, and recomp adds or removes no communication outside the replay
    (torch reports: Megatron-style and DTensor)."""
    for r in reports:
        v = r["variants"][variant]
        g = v["grads_vs_reference"]
        assert g["same_names"] and g["bitwise_equal"], g
        assert v["output_equal"]
        ref = r["variants"]["reference"]["counts"]
        assert v["counts"]["forward"] == ref["forward"]
        assert v["counts"]["backward"] == ref["backward"]


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
