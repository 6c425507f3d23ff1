"""DTensor tensor parallelism (``parallelize_module``) on 2 gloo ranks (examples/dtensor_tp.py).

The ``RowwiseParallel`` linears (attention output, fc2), whose output hook
all-reduces the partial sums with a functional collective, are excluded.
Fails if the replay issues a collective with the exclusion or not the expected
all-reduces without it, or if a local gradient shard differs by a single bit
from the parallelized model without recomp.
"""

from __future__ import annotations

import pytest

from report_checks import (
    VARIANTS,
    assert_all_checks_pass,
    assert_gradients_equal_the_reference,
    assert_parallel_model_matches_dense,
    assert_replay_all_reduces_without_exclusion,
)

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


@pytest.mark.parametrize("variant", [*VARIANTS, "recomp_collectives_kept"])
def test_gradients_bit_equal(reports, variant):
    assert_gradients_equal_the_reference(reports, variant)


def test_without_exclusion_the_replay_all_reduces(reports):
    assert_replay_all_reduces_without_exclusion(reports)


def test_dtensor_model_matches_dense(reports):
    assert_parallel_model_matches_dense(reports, "output_max_rel_diff")


def test_all_checks_pass(reports):
    assert_all_checks_pass(reports)


def test_without_exclusion_the_replay_reads_the_kept_all_reduces(reports):
    # No region excluded, collectives kept (the default): the replay recomputes the
    # row-parallel linears but hands back the forward's all-reduced outputs.
    for r in reports:
        v = r["variants"]["recomp_collectives_kept"]
        assert v["counts"]["replay"] == {}, v["counts"]
        assert v["counts"]["forward"] == r["variants"]["reference"]["counts"]["forward"]
