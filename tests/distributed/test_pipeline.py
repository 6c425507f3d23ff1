"""Pipeline parallelism: every ``torch.distributed.pipelining`` schedule replays each
recomp-checkpointed block once per micro-batch (pipeline_cases.py does the work).

Zero-bubble schedules split backward into an input-gradient pass and weight-gradient
passes; PyTorch's checkpoint replays the block in each (7 replays per micro-batch on
the later stages here), and so does recomp with its kept replays switched off (5).
The tests also fail if an excluded region (and the all-reduce inside it) runs in a
replay, if a gradient differs from the same schedule without checkpointing by one bit
or from an unpipelined step, or if live tensors, handles or objects grow over steps.
"""

from __future__ import annotations

import pytest

from pipeline_cases import CONTROLS, MICRO, SCHEDULES, SPLIT_BACKWARD
from pipelines import pipeline_run_marks

pytestmark = pipeline_run_marks(timeout=400)


@pytest.fixture(scope="module")
def two_ranks(launcher):
    return launcher("pipeline_cases:run", steps=10, timeout=300)


@pytest.fixture(scope="module")
def four_ranks(launcher):
    # Pipeline 2 x tensor parallel 2: the excluded all-reduce spans a pair of ranks.
    return launcher(
        "pipeline_cases:run",
        world_size=4,
        tp=2,
        schedules=["ZBVZeroBubble"],
        controls=(),
        dropout=False,
        steps=3,
        timeout=300,
    )


def _assert_back_to_baseline(state):
    after, baseline = state["after"], state["baseline"]
    assert after["tensors"] == baseline["tensors"], state
    assert after["handles"] == baseline["handles"] == 0, state
    # Less than one Python object more per step (the census itself allocates a few).
    assert after["objects"] - baseline["objects"] < 10, state


def _replays(result, variant):
    return sorted({r for stage in result[variant]["replays"].values() for r in stage})


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_one_replay_per_micro_batch(two_ranks, schedule):
    for rank in two_ranks:
        assert _replays(rank["schedules"][schedule], "recomp") == [1.0], rank["schedules"][schedule]


@pytest.mark.parametrize("schedule", [s for s in SPLIT_BACKWARD if s in CONTROLS])
def test_controls_replay_more_under_split_backward(two_ranks, schedule):
    # Stages whose inputs need gradients (all but the first) split their backward.
    off, torch_ckpt = {"ZBVZeroBubble": (5.0, 7.0), "DualPipeV": (2.0, 2.5)}[schedule]
    for rank in two_ranks:
        result = rank["schedules"][schedule]
        later = {i: r for i, r in result["recomp_off"]["replays"].items() if i != "0"}
        assert {x for stage in later.values() for x in stage} == {off}, result
        later = {i: r for i, r in result["torch"]["replays"].items() if i != "0"}
        assert {x for stage in later.values() for x in stage} == {torch_ckpt}, result


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_excluded_collective_runs_once_per_micro_batch(two_ranks, schedule):
    for rank in two_ranks:
        result = rank["schedules"][schedule]
        runs = {r for stage in result["recomp"]["attn_runs"].values() for r in stage}
        assert runs == {MICRO}, result
        assert result["recomp"]["replay_collectives"] == 0
        if "torch" in result:  # the control: PyTorch's checkpoint runs it again
            torch_runs = {r for stage in result["torch"]["attn_runs"].values() for r in stage}
            assert min(torch_runs) > MICRO


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_gradients(two_ranks, schedule):
    for rank in two_ranks:
        result = rank["schedules"][schedule]
        assert all(result["bitwise_equal_to_none"].values()), result["bitwise_equal_to_none"]
        assert result["max_diff_to_unpipelined"] < 1e-6


def test_dropout_masks_match(two_ranks):
    assert all(rank["dropout"] for rank in two_ranks)


def test_steady_state_after_many_steps(two_ranks):
    for rank in two_ranks:
        state = rank["steady_state"]
        assert state["replays_seen"] == [1.0]
        assert state["attn_runs_seen"] == [MICRO]
        _assert_back_to_baseline(state)
        assert state["sessions"] == 0


def test_pipeline_with_tensor_parallel_all_reduce(four_ranks):
    assert len(four_ranks) == 4
    for rank in four_ranks:
        for name, result in rank["schedules"].items():
            assert _replays(result, "recomp") == [1.0], (name, result)
            runs = {r for stage in result["recomp"]["attn_runs"].values() for r in stage}
            assert runs == {MICRO}
            assert result["recomp"]["replay_collectives"] == 0
            assert all(result["bitwise_equal_to_none"].values())
            assert result["max_diff_to_unpipelined"] < 1e-6
        _assert_back_to_baseline(rank["steady_state"])
