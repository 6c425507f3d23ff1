"""``torch.distributed.pipelining``'s schedules as plain action lists, without stages; and
a built schedule's stages and compute steps, for activation swap.

Consumers: ``recomp.plan.job`` (whole-job memory per rank reads the in-flight
micro-batches of a pipeline schedule from the schedule itself) and
``recomp.torch._pipeline_swap`` (a schedule's own stages, this rank's compute slots,
and each compute step the schedule runs on a stage). Tested by
``tests/torch/compat/test_pipelining.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

Step = tuple[str, int, int]  # (kind F/B/I/W, stage, micro-batch)
Slot = tuple[Step, ...]  # one compute step of a rank; several for an overlapped one

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
) -> dict[int, list[Step]]:
    """Per pipeline rank, the compute steps of ``schedule`` in the order the rank runs
    them: ``(kind, stage, micro-batch)`` with kind ``F`` (forward), ``B`` (full
    backward), ``I`` (input gradients) or ``W`` (weight gradients). An ``OVERLAP_F_B``
    step (DualPipeV) is listed as its parts, forward first (its slot in
    :func:`pipeline_slots`). See :func:`pipeline_slots` for how they are read."""
    slots = pipeline_slots(schedule, pp, microbatches, stages_per_rank)
    return {rank: [step for slot in rank_slots for step in slot] for rank, rank_slots in slots.items()}


def pipeline_slots(
    schedule: str, pp: int, microbatches: int, stages_per_rank: int | None = None
) -> dict[int, list[Slot]]:
    """Per pipeline rank, the compute slots of ``schedule`` in the order the rank runs
    them: each a tuple of ``(kind, stage, micro-batch)`` steps, one step but for an
    ``OVERLAP_F_B`` step (DualPipeV), whose parts share one slot, forward first.

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
    slots = {int(rank): _compute_slots(actions, class_name) for rank, actions in order.items()}
    if default_local == 1:
        slots = {rank: _in_order(rank_slots) for rank, rank_slots in slots.items()}
    return slots


def _in_order(slots: list[Slot]) -> list[Slot]:
    """A single-stage schedule's steps with micro-batches numbered in the order they
    run: its ``step`` takes the next micro-batch for each forward and each backward
    (``_step_microbatches`` counts them), whatever ``pipeline_order`` labels them
    (PyTorch 2.14.1's 1F1B labels the last rank's forwards 1 to m)."""
    seen: dict[str, int] = {}
    out = []
    for slot in slots:
        parts = []
        for kind, stage, _ in slot:
            parts.append((kind, stage, seen.get(kind, 0)))
            seen[kind] = seen.get(kind, 0) + 1
        out.append(tuple(parts))
    return out


def _compute_slots(actions: Any, class_name: str) -> list[Slot]:
    slots: list[Slot] = []
    for action in actions:
        if action is None:
            continue
        parts = getattr(action, "sub_actions", None) or (action,)
        # An overlapped step: its forward counts before its backward frees anything.
        parts = sorted(parts, key=lambda part: _kind(part) != "F")
        slot = []
        for part in parts:
            kind = _kind(part)
            if kind in COMPUTE_KINDS:
                if part.microbatch_index is None:
                    raise RuntimeError(f"{class_name}: step {part!r} has no micro-batch")
                slot.append((str(kind), int(part.stage_index), int(part.microbatch_index)))
        if slot:
            slots.append(tuple(slot))
    return slots


def _kind(action: Any) -> str:
    """The step's one-letter name: a string enum's value (2.14.1), or what ``str`` of the
    enum gives (2.9.1, whose values are numbers)."""
    kind = action.computation_type
    value = getattr(kind, "value", kind)
    return value if isinstance(value, str) else str(kind)


# -- a built schedule, on the rank that runs it -------------------------------------------


def schedule_stages(schedule: Any) -> list[Any]:
    """The stages ``schedule`` runs on this rank (one, or several for a looped or V
    schedule), in the order it was given them.

    Why: a schedule of ``torch.distributed.pipelining`` keeps its stages in private
    attributes: ``_stage`` (``PipelineScheduleSingle``) or ``_stages``
    (``PipelineScheduleMulti``); the stages' own attributes read here and below
    (``stage_index``, ``group_rank``, ``submod``, ``has_backward``) are plain
    attributes of ``_PipelineStageBase`` (private).
    If it changes: a schedule without either attribute raises ``TypeError`` naming
    it and this PyTorch's version (pipeline swap is then refused; nothing else is
    affected).
    Retired by: a public accessor of a schedule's stages.
    Checked on torch 2.9.1 and 2.14.1 (GPipe, 1F1B, the looped and V schedules).
    """
    import torch

    found = getattr(schedule, "__dict__", {})
    stages = found.get("_stages")
    if stages is None and found.get("_stage") is not None:
        stages = [found["_stage"]]
    if not stages or not all(hasattr(stage, "stage_index") for stage in stages):
        raise TypeError(
            f"{type(schedule).__name__} is not a torch.distributed.pipelining schedule whose "
            f"stages recomp can read on PyTorch {torch.__version__} (a schedule built from "
            "PipelineStage objects: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ...)"
        )
    return list(stages)


def stage_index(stage: Any) -> int:
    """The stage's index in the pipeline (see :func:`schedule_stages`)."""
    return int(stage.stage_index)


def stage_submodule(stage: Any) -> Any:
    """The module a stage runs (see :func:`schedule_stages`)."""
    return stage.submod


def stage_trains(stage: Any) -> bool:
    """Whether the stage's current ``step`` runs backward (False under ``eval()``, which
    sets ``has_backward`` for the step; see :func:`schedule_stages`)."""
    return bool(getattr(stage, "has_backward", True))


def schedule_slots(schedule: Any, stages: list[Any]) -> tuple[int, list[Slot]]:
    """This rank (in the pipeline group) and its compute slots of a built schedule, in
    the order its ``step`` runs them (see :func:`pipeline_slots`; micro-batches
    numbered as the stage's ``forward_one_chunk`` and ``backward_one_chunk`` receive
    them).

    Why: the order is the schedule's ``pipeline_order`` (a public attribute whose
    actions are the private ``_Action``; see :func:`pipeline_actions`), indexed by the
    rank of the stages in their pipeline group (``group_rank``). A single-stage
    schedule's ``step`` numbers micro-batches in the order it runs them.
    If it changes: a schedule without a per-rank ``pipeline_order`` raises
    ``TypeError`` (pipeline swap is refused for it).
    Retired by: a public function that returns a schedule's action lists.
    Checked on torch 2.9.1 and 2.14.1.
    """
    import torch

    order = getattr(schedule, "pipeline_order", None)
    rank = int(stages[0].group_rank)
    name = type(schedule).__name__
    if not isinstance(order, dict) or rank not in order:
        raise TypeError(
            f"{name} has no action list for rank {rank} (pipeline_order) on PyTorch "
            f"{torch.__version__}: recomp reads the order of a schedule's compute steps "
            "from it, as ScheduleGPipe, Schedule1F1B and the multi-stage schedules have it"
        )
    slots = _compute_slots(order[rank], name)
    if "_stage" in vars(schedule) and "_stages" not in vars(schedule):
        slots = _in_order(slots)
    return rank, slots


def stage_held_tensors(stage: Any, microbatch: int) -> list[Any]:
    """The tensors ``stage`` holds for ``microbatch`` from its forward to its backward:
    the inputs it ran on (the micro-batch's slice of the first stage's input, a
    received or locally passed activation) and its outputs.

    Why: ``forward_one_chunk`` keeps ``fwd_cache[chunk] = (outputs, flat inputs)``, a
    plain attribute of ``_PipelineStageBase`` (private), until ``backward_one_chunk``
    pops it; swapping a saved tensor on one of those storages would copy it without
    freeing anything.
    If it changes: no cache found gives no tensors; saved tensors on those storages
    are then copied to the host too (time and host memory, never a wrong value; the
    pipeline swap tests of first-stage inputs and last-stage outputs fail).
    Retired by: a public accessor of what a stage holds for a micro-batch.
    Checked on torch 2.9.1 and 2.14.1.
    """
    cache = getattr(stage, "fwd_cache", None)
    entry = cache.get(microbatch) if isinstance(cache, dict) else None
    found: list[Any] = []
    stack = [entry]
    while stack:
        item = stack.pop()
        if isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif item is not None and hasattr(item, "untyped_storage"):
            found.append(item)
    return found


def forget_failed_step(schedule: Any) -> None:
    """Drop the losses a schedule kept from a ``step`` that raised.

    Why: a schedule appends each micro-batch's loss to ``_internal_losses`` (private)
    as its forward ends and clears the list only at the end of a step, so the step after
    one that raised backpropagates the failed step's losses first (through its graph).
    Pipeline swap drops what a failed step saved, so that graph can no longer be read:
    the list is cleared instead, and the next step starts from its own losses.
    If it changes: no such list, nothing is cleared (the next step may then read the
    failed step's graph and raise recomp's error saying it was dropped).
    Retired by: a schedule that resets its per-step state when a step raises.
    Checked on torch 2.9.1 and 2.14.1.
    """
    losses = getattr(schedule, "_internal_losses", None)
    if isinstance(losses, list):
        losses.clear()


# The stage methods a schedule calls for its compute steps.
_STAGE_STEPS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def _backward_kind(
    bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
) -> tuple[str, int]:
    return ("B" if full_backward else "I"), int(bwd_chunk_id)


def _forward_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> int:
    return int(fwd_chunk_id)


def _weight_chunk(bwd_chunk_id: int, last_backward: bool = False) -> int:
    return int(bwd_chunk_id)


def wrap_stage_steps(
    stage: Any, around: Callable[[str, int, int, Callable[[], Any]], Any]
) -> Callable[[], None]:
    """Make each compute step a schedule runs on ``stage`` a call of
    ``around(kind, stage_index, micro_batch, run)``, where ``run()`` is the step itself
    (kind ``F``, ``B``, ``I`` or ``W``). Returns the function that undoes it.

    Why: a schedule runs its compute steps through three methods of its stages:
    ``forward_one_chunk(fwd_chunk_id, args, kwargs, ...)``,
    ``backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True,
    last_backward=False)`` (``full_backward=False``: the input-gradient step of a
    zero-bubble schedule) and ``backward_weight_one_chunk(bwd_chunk_id,
    last_backward=False)``; undocumented methods of ``_PipelineStageBase`` (private),
    called by attribute on the stage, so an attribute of the instance takes their place
    for that stage only. Removing it restores the class's method.
    If it changes: other names or arguments raise ``TypeError`` at install (a method
    missing) or at the first step (arguments that do not bind), naming this PyTorch.
    Retired by: public per-step hooks on pipeline stages or schedules.
    Checked on torch 2.9.1 and 2.14.1.
    """
    import torch

    missing = [name for name in _STAGE_STEPS if not callable(getattr(stage, name, None))]
    if missing:
        raise TypeError(
            f"{type(stage).__name__} has no {', '.join(missing)} on PyTorch "
            f"{torch.__version__}: recomp runs pipeline swap around those methods"
        )
    index = stage_index(stage)

    def forward(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            mb = _forward_chunk(*args, **kwargs)
            return around("F", index, mb, lambda: method(*args, **kwargs))

        return run

    def backward(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            kind, mb = _backward_kind(*args, **kwargs)
            return around(kind, index, mb, lambda: method(*args, **kwargs))

        return run

    def weight(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            mb = _weight_chunk(*args, **kwargs)
            return around("W", index, mb, lambda: method(*args, **kwargs))

        return run

    undo = [
        wrap_method(stage, name, make)
        for name, make in zip(_STAGE_STEPS, (forward, backward, weight), strict=True)
    ]

    def remove() -> None:
        for step in reversed(undo):
            step()

    return remove


def wrap_method(
    obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[[], None]:
    """Put ``make(current method)`` on ``obj`` as an attribute of the instance; returns
    the undo, which restores what was there (the instance's own attribute, or none) if
    the wrapper is still the one installed, else leaves it calling through."""
    own = vars(obj)
    had = name in own
    previous = own.get(name)
    method = getattr(obj, name)
    wrapped = make(method)
    live = [True]

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        return wrapped(*args, **kwargs) if live[0] else method(*args, **kwargs)

    setattr(obj, name, call)

    def undo() -> None:
        live[0] = False
        if vars(obj).get(name) is call:
            if had:
                setattr(obj, name, previous)
            else:
                delattr(obj, name)

    return undo
