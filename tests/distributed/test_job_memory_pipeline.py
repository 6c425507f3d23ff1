"""The activation peak ``recomp.plan.job`` reads from a pipeline schedule's action list
equals the live saved activations of a real 2-rank gloo run of that schedule
(job_memory_cases.py does the work): 1F1B, Interleaved1F1B and ZBVZeroBubble, whose
split backward keeps a micro-batch's tensors until its weight-gradient step."""

from __future__ import annotations

import pytest

from pipelines import pipeline_run_marks

pytestmark = pipeline_run_marks(timeout=300)


@pytest.fixture(scope="module")
def two_ranks(launcher):
    return launcher("job_memory_cases:run", timeout=240)


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_peak_from_the_schedule_equals_the_measured_one(two_ranks, schedule):
    from job_memory_cases import predicted

    per_stage = {}
    for rank in two_ranks:
        per_stage.update({int(s): b for s, b in rank[schedule]["per_stage"].items()})
    assert min(per_stage.values()) > 0
    expected = predicted(schedule, len(two_ranks), per_stage)
    measured = {r: rank[schedule]["measured_peak"] for r, rank in enumerate(two_ranks)}
    assert measured == expected, (schedule, per_stage)
    if schedule == "1F1B":  # stage i of p holds min(p - i, m) micro-batches
        assert measured == {0: 2 * per_stage[0], 1: per_stage[1]}
