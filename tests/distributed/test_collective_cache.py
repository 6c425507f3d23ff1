"""Collectives written by hand in recomputed code run once (cases in collective_cache_cases.py).

On 2 gloo ranks: ``torch.distributed`` calls (synchronous, ``async_op=True``,
inside an autograd Function as in Megatron), functional collectives, nested
checkpoints and a second backward. Fails if the replay communicates when the
forward's result was kept, if the control with ``exclude_collectives=False``
does not, or if a gradient differs from the function run without a checkpoint.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

CASES = ["plain", "asynchronous", "functional", "excluded_and_not", "nested", "retain_graph"]


@pytest.fixture(scope="module")
def results(launcher):
    return launcher("collective_cache_cases:run")


@pytest.mark.parametrize("case", [*CASES, "mutated"])
@pytest.mark.parametrize("variant", ["recomp", "recomp_keep_nothing"])
def test_gradients_equal_the_function_without_checkpoint(results, case, variant):
    for r in results:
        assert r[case][variant]["grads"] == r[case]["reference"]["grads"]


@pytest.mark.parametrize("case", CASES)
def test_the_replay_reads_the_kept_results(results, case):
    for r in results:
        got = r[case]["recomp"]
        assert got["counts"]["replay"] == {}, got["counts"]
        assert got["counts"]["forward"] == r[case]["reference"]["counts"]["forward"]
        assert got["warnings"] == []


@pytest.mark.parametrize("case", CASES)
def test_without_keeping_the_replay_communicates(results, case):
    for r in results:
        replay = r[case]["recomp_keep_nothing"]["counts"]["replay"]
        assert sum(replay.values()) > 0, replay


def test_counts(results):
    for r in results:
        assert r["functional"]["recomp_keep_nothing"]["counts"]["replay"] == {
            "all_gather": 1,
            "all_reduce": 1,
        }
        # Two backwards, two replays.
        assert r["retain_graph"]["recomp_keep_nothing"]["counts"]["replay"] == {"all_reduce": 2}
        # The excluded region's all-reduce is never replayed, kept or not.
        assert r["excluded_and_not"]["recomp_keep_nothing"]["counts"]["replay"] == {
            "all_reduce": 1
        }
        # Once per step: without a checkpoint, and in each checkpointed forward.
        assert r["excluded_runs"] == 3


def test_a_result_changed_in_place_is_communicated_again(results):
    for r in results:
        got = r["mutated"]["recomp"]
        assert got["counts"]["replay"] == {"all_reduce": 1}
        assert got["warnings"] == ["CollectiveReplayedWarning"]


def test_another_collective_in_the_replay_is_an_error(results):
    for r in results:
        assert "replay called collective c10d.broadcast_" in r["diverging"]
        assert "c10d.allreduce_" in r["diverging"]


def test_what_no_replay_reaches_is_not_kept(results):
    for r in results:
        assert r["kept_with_early_stop"]["after_forward"] is False
        assert r["kept_without_early_stop"]["after_forward"] is True  # the replay reads it
        assert r["kept_without_early_stop_not_keeping"]["after_forward"] is False


@pytest.mark.parametrize(
    "case",
    ["kept_with_early_stop", "kept_without_early_stop", "kept_without_early_stop_not_keeping"],
)
def test_what_is_kept_is_freed_with_the_graph(results, case):
    for r in results:
        assert r[case]["after_backward"] is False


def test_a_function_without_collectives_is_rechecked(results):
    # Call 0 issues no collective: calls 1-15 run without the record (and replay their
    # all-reduce), call 16 is recorded again and from then on nothing is replayed.
    for r in results:
        assert r["replays_per_call"] == [0] + [1] * 15 + [0, 0]


def test_parameter_all_gathers_of_fsdp_are_not_kept(results):
    # fully_shard on a module inside the checkpoint: FSDP frees its all-gather output
    # after the forward; recomp does not hold it until backward.
    for r in results:
        assert r["fsdp_gathers_held_not_keeping"] == [False]
        assert r["fsdp_gathers_held"] == [False]
