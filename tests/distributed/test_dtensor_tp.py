"""DTensor tensor parallelism (``parallelize_module``) on 2 gloo ranks (examples/dtensor_tp.py).

The ``RowwiseParallel`` linears (attention output, fc2), whose output hook
all-reduces the partial sums with a functional collective, are excluded.
Fails if the replay issues a collective with the exclusion or not the expected
all-reduces without it, or if a local gradient shard differs by a single bit
from the parallelized model without recomp.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def reports(launcher):
    return launcher("dtensor_tp:run")


@pytest.mark.parametrize("variant", ["recomp", "recomp_full_replay"])
def test_excluded_rowwise_linears_issue_nothing_in_replay(reports, variant):
    layers = reports[0]["layers"]
    for r in reports:
        v = r["variants"][variant]
        assert v["counts"]["replay"] == {}, v["counts"]
        # Forward: the RowwiseParallel output all-reduce, twice per layer
        # (DTensor's functional collective, seen through the dispatcher).
        assert v["counts"]["forward"] == {"all_reduce": 2 * layers}
        assert set(v["exclusions"]) == {
            f"layers.{i}.{m}" for i in range(layers) for m in ("attn.o", "mlp.fc2")
        }
        assert all(s["runs"] == 1 for s in v["exclusions"].values())


def test_without_exclusion_the_replay_all_reduces(reports):
    layers = reports[0]["layers"]
    for r in reports:
        v = r["variants"]
        # Default early stop ends the replay at fc2's input: only the attention
        # all-reduce is replayed; early_stop=False replays both.
        assert v["recomp_no_exclusion"]["counts"]["replay"] == {"all_reduce": layers}
        assert v["recomp_full_replay_no_exclusion"]["counts"]["replay"] == {
            "all_reduce": 2 * layers
        }


@pytest.mark.parametrize(
    "variant",
    ["recomp", "recomp_no_exclusion", "recomp_full_replay", "recomp_full_replay_no_exclusion"],
)
def test_gradients_bit_equal(reports, variant):
    for r in reports:
        v = r["variants"][variant]
        g = v["grads_vs_reference"]
        assert g["same_names"] and g["bitwise_equal"], g
        assert v["output_equal"]
        ref = r["variants"]["reference"]["counts"]
        assert v["counts"]["forward"] == ref["forward"]
        assert v["counts"]["backward"] == ref["backward"]


def test_dtensor_model_matches_dense(reports):
    # Sharded float32 sums vs dense: 1e-5 of the largest value (rounding ~1e-7).
    for r in reports:
        d = r["dense"]
        assert d["output_max_rel_diff"] < d["rtol"], d
        assert d["grad_max_rel_diff"] < d["rtol"], d


def test_all_checks_pass(reports):
    for r in reports:
        assert r["ok"], r["checks"]
