"""DTensor tensor + sequence parallelism on 2 gloo ranks (cases in sequence_parallel_cases.py).

The all-gathers and reduce-scatters DTensor issues inside a checkpointed block
(``SequenceParallel`` norms, ``PrepareModuleInput``, sequence-sharded
``RowwiseParallel``) run once: the replay reads the results the forward kept.
Fails if any collective runs while ``recomp.is_recomputing()`` is true by
default, if the controls with ``exclude_collectives=False`` do not show them,
or if a local gradient shard differs by a bit from the model without checkpoints.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

KEPT = ["recomp", "recomp_attention_excluded", "recomp_full_replay"]
NOT_KEPT = ["recomp_keep_nothing", "recomp_attention_excluded_keep_nothing"]


@pytest.fixture(scope="module")
def reports(launcher):
    return launcher("sequence_parallel_cases:run")


@pytest.mark.parametrize("variant", KEPT + NOT_KEPT)
def test_gradients_bit_equal_to_the_model_without_checkpoints(reports, variant):
    for r in reports:
        v = r["variants"][variant]
        assert v["grads_vs_reference"]["bitwise_equal"], v["grads_vs_reference"]
        assert v["loss"] == r["variants"]["reference"]["loss"]


@pytest.mark.parametrize("variant", KEPT)
def test_no_collective_while_recomputing(reports, variant):
    for r in reports:
        v = r["variants"][variant]
        assert v["replay_ops"] == [], v["counts"]
        # The forward and backward communicate exactly as without checkpoints.
        ref = r["variants"]["reference"]["counts"]
        assert v["counts"]["forward"] == ref["forward"]
        assert v["counts"]["backward"] == ref["backward"]


def test_the_forward_does_communicate(reports):
    # Per block: two all-gathers (before attention and MLP), two reduce-scatters.
    layers = reports[0]["layers"]
    for r in reports:
        forward = r["variants"]["reference"]["counts"]["forward"]
        assert forward["all_gather"] >= 2 * layers
        assert forward["reduce_scatter"] >= 2 * layers


def test_without_keeping_the_replay_communicates(reports):
    layers = reports[0]["layers"]
    for r in reports:
        full = r["variants"]["recomp_keep_nothing"]["counts"]["replay"]
        # Early stop ends the replay at fc2's input: both all-gathers and the
        # attention's reduce-scatter are replayed, fc2's is not.
        assert full == {"all_gather": 2 * layers, "reduce_scatter": layers}, full
        excluded = r["variants"]["recomp_attention_excluded_keep_nothing"]["counts"]["replay"]
        # The attention is skipped, and with it its all-gather and reduce-scatter (the
        # hooks of the attention and of its projections run inside the region); the
        # MLP's all-gather is replayed, once per block.
        assert excluded == {"all_gather": layers}, excluded


def test_excluded_attention_runs_once(reports):
    for r in reports:
        for variant in ("recomp_attention_excluded", "recomp_attention_excluded_keep_nothing"):
            assert r["variants"][variant]["attention_runs"] == [1] * r["layers"]
        assert not r["is_recomputing_outside"]
