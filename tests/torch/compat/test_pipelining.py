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


# -- the parts pipeline swap reads (recomp.torch._pipeline_swap) -------------------------


@pytest.mark.parametrize("schedule", list(SCHEDULE_CLASSES))
def test_slots_are_the_actions_with_an_overlapped_step_as_one(schedule):
    slots = _compat.pipeline_slots(schedule, 2, 4)
    actions = _compat.pipeline_actions(schedule, 2, 4)
    for rank, rank_slots in slots.items():
        assert [step for slot in rank_slots for step in slot] == actions[rank]
        shared = [slot for slot in rank_slots if len(slot) > 1]
        if schedule == "DualPipeV":  # OVERLAP_F_B: a forward and a backward, forward first
            assert shared and all(s[0][0] == "F" and s[1][0] == "B" for s in shared)
        else:
            assert not shared


def _built(schedule, pp, microbatches):
    """A schedule built on stand-in stages of rank 1, as ``pipeline_slots`` builds it."""
    from torch.distributed import pipelining

    from recomp.torch._compat.pipelining import _StandInStage

    class_name, local = SCHEDULE_CLASSES[schedule]
    if local == 1:
        stages = _StandInStage(1, pp, pp, 1)
    elif schedule in V_SCHEDULES:
        stages = [_StandInStage(i, 2 * pp, pp, 1) for i in (1, 2 * pp - 2)]
    else:
        stages = [_StandInStage(1 + i * pp, 2 * pp, pp, 1) for i in range(local)]
    return getattr(pipelining, class_name)(stages, n_microbatches=microbatches), stages


@pytest.mark.parametrize("schedule", list(SCHEDULE_CLASSES))
def test_a_built_schedule_gives_its_stages_and_this_rank_s_slots(schedule):
    built, stages = _built(schedule, 2, 4)
    found = _compat.schedule_stages(built)
    assert found == (stages if isinstance(stages, list) else [stages])
    assert [_compat.stage_index(s) for s in found] == [s.stage_index for s in found]
    rank, slots = _compat.schedule_slots(built, found)
    assert rank == 1
    assert slots == _compat.pipeline_slots(schedule, 2, 4)[1]


def test_what_is_not_a_schedule_is_refused():
    with pytest.raises(TypeError, match=r"not a torch\.distributed\.pipelining schedule"):
        _compat.schedule_stages(object())


def test_the_stage_methods_a_schedule_runs_take_the_arguments_read():
    import inspect

    from torch.distributed.pipelining import PipelineStage

    from recomp.torch._compat.pipelining import _backward_kind, _forward_chunk, _weight_chunk

    forward = inspect.signature(PipelineStage.forward_one_chunk)
    backward = inspect.signature(PipelineStage.backward_one_chunk)
    weight = inspect.signature(PipelineStage.backward_weight_one_chunk)
    assert list(forward.parameters)[1] == "fwd_chunk_id"
    assert list(backward.parameters)[1:] == list(inspect.signature(_backward_kind).parameters)
    assert list(weight.parameters)[1:] == list(inspect.signature(_weight_chunk).parameters)
    assert _backward_kind(3, None, False) == ("I", 3)
    assert _backward_kind(3, full_backward=True) == ("B", 3)
    assert _forward_chunk(2, (), {}) == 2 and _weight_chunk(5) == 5


def test_a_method_wrapped_on_an_instance_and_undone():
    class Thing:
        def run(self, x):
            return x + 1

    thing = Thing()
    undo = _compat.wrap_method(thing, "run", lambda method: lambda x: method(x) * 10)
    assert thing.run(1) == 20 and "run" in vars(thing)
    undo()
    assert thing.run(1) == 2 and "run" not in vars(thing)
    # Wrapped again by someone else on top: undoing ours leaves theirs, calling through.
    undo = _compat.wrap_method(thing, "run", lambda method: lambda x: method(x) * 10)
    theirs = thing.run
    thing.run = lambda x: theirs(x) - 1
    undo()
    assert thing.run(1) == 1
