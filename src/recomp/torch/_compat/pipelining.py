"""``torch.distributed.pipelining``'s schedules as plain action lists, without stages.

Consumer: ``recomp.plan.job`` (whole-job memory per rank reads the in-flight
micro-batches of a pipeline schedule from the schedule itself). Tested by
``tests/torch/compat/test_pipelining.py``.
"""

from __future__ import annotations

from typing import Any

# The schedules whose constructors compute their per-rank action lists, and how many
# stages each puts on a rank by default (one; or two: looped or V-shaped).
SCHEDULE_CLASSES = {
    "GPipe": ("ScheduleGPipe", 1),
    "1F1B": ("Schedule1F1B", 1),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", 2),
    "LoopedBFS": ("ScheduleLoopedBFS", 2),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", 2),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", 2),
    "DualPipeV": ("ScheduleDualPipeV", 2),
}
# Schedules whose stages sit on the ranks in a V (rank r: stages r and 2p - 1 - r).
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# The compute steps of a schedule's action list, by their one-letter names.
COMPUTE_KINDS = ("F", "B", "I", "W")


class _StandInStage:
    """What a schedule's constructor reads from its stages, with no model, device or
    process group behind it (the schedule is only built, never stepped)."""

    def __init__(self, index: int, num_stages: int, group_size: int, group_rank: int) -> None:
        self.stage_index = index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def schedule_names() -> list[str]:
    """The schedules this PyTorch has, of those recomp reads."""
    try:
        from torch.distributed import pipelining
    except ImportError:
        return []
    return [name for name, (cls, _) in SCHEDULE_CLASSES.items() if hasattr(pipelining, cls)]


def pipeline_actions(
    schedule: str, pp: int, microbatches: int, stages_per_rank: int | None = None
) -> dict[int, list[tuple[str, int, int]]]:
    """Per pipeline rank, the compute steps of ``schedule`` in the order the rank runs
    them: ``(kind, stage, micro-batch)`` with kind ``F`` (forward), ``B`` (full
    backward), ``I`` (input gradients) or ``W`` (weight gradients). An ``OVERLAP_F_B``
    step (DualPipeV) is listed as its parts, forward first.

    Why: the schedules of ``torch.distributed.pipelining`` compute their per-rank
    action lists (``pipeline_order``) in their constructors, from the number of stages,
    ranks and micro-batches only. Those constructors take stage objects
    (``_PipelineStageBase``, private) and read a few plain attributes of them
    (``stage_index``, ``num_stages``, ``group_size``, ``group_rank``, ``is_first``,
    ``is_last``, ``submod``, and they set ``stage_index_to_group_rank``); stand-ins
    with those attributes build the schedule with no model, device or process group.
    The actions are ``_Action`` named tuples (private) whose ``computation_type`` is an
    enum named ``"F"``, ``"B"``, ``"I"``, ``"W"``, ``"OVERLAP_F_B"`` or a communication
    or gradient-reduction step (its value on 2.14.1, its ``str`` on 2.9.1) and
    ``sub_actions`` the parts of an overlapped step (2.14.1).
    If it changes: a schedule that needs more of its stages, or actions of another
    shape, raise ``RuntimeError`` naming the schedule and this PyTorch's version
    (the job estimate then cannot read that schedule; nothing else is affected).
    Retired by: a public function that returns a schedule's action lists.
    Checked on torch 2.9.1 and 2.14.1 (all seven schedules).
    """
    if schedule not in SCHEDULE_CLASSES:
        raise ValueError(
            f"unknown pipeline schedule {schedule!r}: recomp reads "
            f"{', '.join(SCHEDULE_CLASSES)}"
        )
    import torch
    from torch.distributed import pipelining

    class_name, default_local = SCHEDULE_CLASSES[schedule]
    cls = getattr(pipelining, class_name, None)
    if cls is None:
        raise RuntimeError(
            f"PyTorch {torch.__version__} has no torch.distributed.pipelining.{class_name} "
            f"(schedule {schedule!r}); it has {', '.join(schedule_names()) or 'none of them'}"
        )
    local = default_local if stages_per_rank is None else stages_per_rank
    if default_local == 1 and local != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank, not {local}")
    if schedule in V_SCHEDULES and local != 2:
        raise ValueError(f"schedule {schedule!r} runs two stages per rank (a V), not {local}")
    if local < 1 or pp < 1 or microbatches < 1:
        raise ValueError(
            f"pipeline size, stages per rank and micro-batches are positive, got pp={pp}, "
            f"stages_per_rank={local}, microbatches={microbatches}"
        )
    num_stages = pp * local
    if default_local == 1:
        stages: Any = _StandInStage(0, num_stages, pp, 0)
    else:
        indices = [0, 2 * pp - 1] if schedule in V_SCHEDULES else [i * pp for i in range(local)]
        stages = [_StandInStage(i, num_stages, pp, 0) for i in indices]
    try:
        built = cls(stages, n_microbatches=microbatches)
        order = built.pipeline_order
    except ValueError:
        raise  # the schedule refuses these sizes, with its own message
    except Exception as exc:  # any change of what the schedule reads
        raise RuntimeError(
            f"cannot build torch.distributed.pipelining.{class_name} on stand-in stages with "
            f"PyTorch {torch.__version__} ({type(exc).__name__}: {exc}); recomp reads schedules "
            "this way on torch 2.9.1 to 2.14.1"
        ) from exc
    if not isinstance(order, dict):
        raise RuntimeError(
            f"{class_name}.pipeline_order is {type(order).__name__}, not a dict of action "
            f"lists, on PyTorch {torch.__version__}"
        )
    steps = {int(rank): _compute_steps(actions, class_name) for rank, actions in order.items()}
    if default_local == 1:
        steps = {rank: _in_order(rank_steps) for rank, rank_steps in steps.items()}
    return steps


def _in_order(steps: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """A single-stage schedule's steps with micro-batches numbered in the order they
    run: its ``step`` takes the next micro-batch for each forward and each backward
    (``_step_microbatches`` counts them), whatever ``pipeline_order`` labels them
    (PyTorch 2.14.1's 1F1B labels the last rank's forwards 1 to m)."""
    seen: dict[str, int] = {}
    out = []
    for kind, stage, _ in steps:
        out.append((kind, stage, seen.get(kind, 0)))
        seen[kind] = seen.get(kind, 0) + 1
    return out


def _compute_steps(actions: Any, class_name: str) -> list[tuple[str, int, int]]:
    steps: list[tuple[str, int, int]] = []
    for action in actions:
        if action is None:
            continue
        parts = getattr(action, "sub_actions", None) or (action,)
        # An overlapped step: its forward counts before its backward frees anything.
        parts = sorted(parts, key=lambda part: _kind(part) != "F")
        for part in parts:
            kind = _kind(part)
            if kind in COMPUTE_KINDS:
                if part.microbatch_index is None:
                    raise RuntimeError(f"{class_name}: step {part!r} has no micro-batch")
                steps.append((str(kind), int(part.stage_index), int(part.microbatch_index)))
    return steps


def _kind(action: Any) -> str:
    """The step's one-letter name: a string enum's value (2.14.1), or what ``str`` of the
    enum gives (2.9.1, whose values are numbers)."""
    kind = action.computation_type
    value = getattr(kind, "value", kind)
    return value if isinstance(value, str) else str(kind)
