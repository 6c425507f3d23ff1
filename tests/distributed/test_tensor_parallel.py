"""Megatron-style tensor parallelism on 2 gloo ranks (examples/tp.py).

Each checkpointed layer has two row-parallel linears whose all-reduce (the
``g`` autograd function) is an excluded region. The test fails if the replay
issues any collective with the exclusion, if it does not issue the expected
all-reduces without it (so the counter demonstrably sees replayed
collectives), or if any gradient differs from the non-checkpointed
tensor-parallel model by a single bit.
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

pytestmark = [pytest.mark.distributed, pytest.mark.system, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def reports(launcher):
    return launcher("tp:run")


def test_runs_on_two_ranks(reports):
    assert [r["rank"] for r in reports] == [0, 1]


@pytest.mark.parametrize("variant", ["recomp", "recomp_full_replay"])
def test_excluded_all_reduce_is_not_replayed(reports, variant):
    layers = reports[0]["layers"]
    for r in reports:
        v = r["variants"][variant]
        assert v["counts"]["replay"] == {}, v["counts"]
        # Forward: one all-reduce per row-parallel linear; backward: one per f.
        assert v["counts"]["forward"] == {"all_reduce": 2 * layers}
        assert v["counts"]["backward"] == {"all_reduce": 2 * layers}
        # Every excluded all-reduce ran exactly once, in the forward.
        assert len(v["exclusions"]) == 2 * layers
        assert all(s["runs"] == 1 for s in v["exclusions"].values()), v["exclusions"]


def test_exclusions_are_skipped_in_the_replay(reports):
    for r in reports:
        full = r["variants"]["recomp_full_replay"]["exclusions"]
        assert all(s["skips"] == 1 for s in full.values()), full
        # With torch's early stop the replay ends at fc2's input: the MLP
        # all-reduce after it is never reached, the attention one is skipped.
        early = r["variants"]["recomp"]["exclusions"]
        assert {n: s["skips"] for n, s in early.items()} == {
            n: (1 if ".attn." in n else 0) for n in early
        }


@pytest.mark.parametrize("variant", [*VARIANTS, "recomp_collectives_kept"])
def test_gradients_equal_the_non_checkpointed_model(reports, variant):
    assert_gradients_equal_the_reference(reports, variant)


def test_without_exclusion_the_replay_all_reduces(reports):
    assert_replay_all_reduces_without_exclusion(reports)


def test_tensor_parallel_model_matches_dense(reports):
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
