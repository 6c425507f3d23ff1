"""Pipeline swap (``recomp.torch.pipeline_swap``) on 2 gloo ranks, in the offloader's
host-copy mode (pipeline_swap_cases.py does the work).

Each schedule runs the toy decoder checkpointed, with its attention and all-reduce
excluded, one more all-reduce kept for the replay, dropout on and plain layers after the
blocks, and again with pipeline swap. The tests fail if a gradient differs by one bit;
if a (stage, micro-batch) that the schedule leaves room for does not move exactly what
its forward holds for backward (the graph's saved-tensor report of the same stage run
alone, its input and output left out), both ways, brought back ahead of its backward;
if one whose gap is too small moves anything or opens a group; if a stage's input or
output storage is copied at all; or if the handle's removal leaves the schedule or its
stages changed, or anything moving after it.
"""

from __future__ import annotations

import pytest

from pipeline_cases import MICRO
from pipeline_swap_cases import SCHEDULES
from pipelines import pipeline_run_marks

pytestmark = pipeline_run_marks(timeout=300)


@pytest.fixture(scope="module")
def two_ranks(launcher):
    return launcher("pipeline_swap_cases:run", timeout=240)


def _gaps(name: str, rank: int) -> dict[str, int]:
    """Per (stage, micro-batch) of ``rank``, the compute slots from its forward to the
    first slot of its backward, counted here from the schedule's slots (an overlapped
    slot once)."""
    from recomp.torch._compat import pipeline_slots

    style = SCHEDULES[name][0]
    slots = pipeline_slots(name, 2, MICRO, 1 if style == "single" else 2)[rank]
    forward, backward = {}, {}
    for i, slot in enumerate(slots):
        for kind, stage, mb in slot:
            if kind == "F":
                forward[(stage, mb)] = i
            else:
                backward.setdefault((stage, mb), i)
    return {f"{s},{m}": backward[(s, m)] - f for (s, m), f in forward.items()}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_gradients_bit_equal_to_the_schedule_without_swap(two_ranks, schedule):
    for rank in two_ranks:
        result = rank["schedules"][schedule]
        assert result["bitwise"], schedule
        assert result["unplanned_steps"] == 0
        # Each rank runs 4 of the 8 blocks; each block's two all-reduces (the excluded
        # and the kept one) ran once per micro-batch in its forward, none in a replay.
        assert result["forward_collectives"]["all_reduce"] == 2 * 4 * MICRO
        assert result["replay_collectives"] == 0


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_bytes_moved_per_stage_and_micro_batch(two_ranks, schedule):
    swapped = kept = 0
    for rank in two_ranks:
        result = rank["schedules"][schedule]
        gaps = _gaps(schedule, rank["rank"])
        assert sorted(result["chunks"]) == sorted(gaps)
        for key, chunk in result["chunks"].items():
            stage = key.split(",")[0]
            assert chunk["gap"] == gaps[key]
            if gaps[key] >= result["min_gap"]:
                swapped += 1
                expected = result["expected"][stage]
                assert expected > 0
                assert chunk["swapped"], (schedule, key, chunk)
                assert chunk["offloaded_bytes"] == chunk["restored_bytes"] == expected, (key, chunk)
                assert chunk["group"] == [expected, expected], (key, chunk)
                # Brought back a slot ahead, none of it on demand.
                assert chunk["prefetched_bytes"] == expected and chunk["on_demand_bytes"] == 0
                assert chunk["saved_bytes"] == expected + chunk["kept_bytes"]
            else:
                kept += 1
                assert not chunk["swapped"], (schedule, key, chunk)
                assert chunk["group"] is None, (schedule, key)
                assert chunk["offloaded_bytes"] == chunk["restored_bytes"] == 0
    assert swapped > 0
    if schedule in ("1F1B", "Interleaved1F1B"):
        assert kept > 0  # some micro-batches of these leave too little room


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_stage_inputs_and_outputs_never_move(two_ranks, schedule):
    for rank in two_ranks:
        result = rank["schedules"][schedule]
        assert result["taken_inputs"] == 0 and result["taken_outputs"] == 0, result
    assert sum(r["schedules"][schedule]["taken"] for r in two_ranks) > 0
    # Every micro-batch's input of the first stage and output of the last was watched.
    assert sum(r["schedules"][schedule]["first_inputs"] for r in two_ranks) == MICRO
    assert sum(r["schedules"][schedule]["last_outputs"] for r in two_ranks) == MICRO


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_removal_leaves_the_schedule_as_it_was(two_ranks, schedule):
    for rank in two_ranks:
        removed = rank["schedules"][schedule]["removed"]
        assert removed["schedule_attrs"] and all(removed["stage_attrs"])
        assert removed["groups_opened"] == 0
        assert removed["bitwise"]
