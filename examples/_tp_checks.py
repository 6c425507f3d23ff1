"""The pass/fail checks of a tensor-parallel report, shared by the Megatron, DTensor and
MindSpore examples (plain Python: no framework import)."""

from __future__ import annotations

from typing import Any


def tensor_parallel_checks(
    report: dict[str, Any],
    *,
    layers: int,
    variants: tuple[str, ...],
    equal_key: str,
    dense_key: str,
) -> dict[str, bool]:
    """Two row-parallel all-reduces per layer. With the exclusion the replay issues none,
    nor without it when the checkpoint keeps collective results (PyTorch's default);
    without either, early stop ends the replay before the second (one per layer), a full
    replay issues both. ``equal_key`` names the report's "output (or loss) equal" flag,
    ``dense_key`` its output (or loss) difference to the dense model."""
    v = report["variants"]
    dense = report["dense"]
    return {
        "replay issues no collective (with exclusion, or collectives kept)": all(
            v[k]["counts"]["replay"] == {}
            for k in ("recomp", "recomp_full_replay", "recomp_collectives_kept")
            if k in v
        ),
        "replay all-reduces once per layer (without exclusion)": v["recomp_no_exclusion"]["counts"][
            "replay"
        ]
        == {"all_reduce": layers},
        "full replay all-reduces twice per layer (without exclusion)": v[
            "recomp_full_replay_no_exclusion"
        ]["counts"]["replay"]
        == {"all_reduce": 2 * layers},
        "forward/backward counts unchanged by recomp": all(
            v[k]["counts"]["forward"] == v["reference"]["counts"]["forward"]
            and v[k]["counts"]["backward"] == v["reference"]["counts"]["backward"]
            for k in variants
        ),
        "gradients bit-for-bit equal to the model without recomp": all(
            v[k]["grads_vs_reference"]["bitwise_equal"] and v[k][equal_key] for k in variants
        ),
        "tensor parallel matches the dense model": dense[dense_key] < dense["rtol"]
        and dense["grad_max_rel_diff"] < dense["rtol"],
    }
