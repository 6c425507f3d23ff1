"""``recomp.torch._compat.pipelining``: ``torch.distributed.pipelining``'s schedules built
on stand-in stages, their per-rank action lists read. Each test fails when PyTorch
changes what a schedule's constructor reads or how its actions look."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from recomp.torch import _compat  # noqa: E402
from recomp.torch._compat.pipelining import SCHEDULE_CLASSES, V_SCHEDULES  # noqa: E402

SPLIT = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def test_the_schedules_of_this_pytorch_are_found():
    names = _compat.schedule_names()
    # Every schedule recomp reads exists on 2.9.1 and 2.14.1.
    assert names == list(SCHEDULE_CLASSES)


@pytest.mark.parametrize("schedule", list(SCHEDULE_CLASSES))
def test_every_micro_batch_runs_forward_and_backward_once_per_stage(schedule):
    p, m = 4, 8
    actions = _compat.pipeline_actions(schedule, p, m)
    assert sorted(actions) == list(range(p))
    local = SCHEDULE_CLASSES[schedule][1]
    for rank, steps in actions.items():
        stages = {s for _, s, _ in steps}
        if local == 1:
            assert stages == {rank}
        elif schedule in V_SCHEDULES:
            assert stages == {rank, 2 * p - 1 - rank}
        else:
            assert stages == {rank + k * p for k in range(local)}
        for stage in stages:
            kinds = {}
            for kind, s, mb in steps:
                if s == stage:
                    kinds.setdefault(mb, []).append(kind)
            assert sorted(kinds) == list(range(m)), (schedule, rank, stage)
            for mb, done in kinds.items():
                # F first; then a whole backward, or an input- then a weight-gradient step.
                assert done[0] == "F" and done[1:] in (["B"], ["I", "W"]), (schedule, stage, mb, done)
        if schedule not in SPLIT:
            assert {k for k, _, _ in steps} == {"F", "B"}


def test_sizes_the_schedule_refuses_raise_its_own_error():
    with pytest.raises(ValueError, match="icrobatches"):
        _compat.pipeline_actions("1F1B", 4, 2)
    with pytest.raises(ValueError, match="two stages per rank"):
        _compat.pipeline_actions("ZBVZeroBubble", 2, 4, stages_per_rank=3)
