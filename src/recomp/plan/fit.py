"""Will it fit? Per strategy and pipeline rank, a job's memory per device and the step
overhead of its replays, and the plan that fits: the library behind ``recomp simulate``.

::

    from recomp.plan import Parallel
    from recomp.plan.fit import will_it_fit

    report = will_it_fit(
        "llama-3.1-70b",                        # a published model (recomp.plan.models)
        Parallel(tp=8, sp=True, dp=8, zero=3),  # the job's layout
        seq=8192, hardware="H100 SXM",          # the device memory: the accelerator's
    )
    for row in report.rows:                     # per strategy and pipeline rank
        print(row.strategy, row.rank, row.total, row.fits)
    report.plan                                 # the plan that fits every rank, or None

The model is built at its published size and run once on fake tensors as one rank of a
fake process group (:meth:`recomp.plan.models.SimulatedModel.simulate`), a few layers
scaled to the full depth; the whole job's memory per rank comes from
:func:`recomp.plan.job.job_memory`, the plan from :func:`plan_per_rank`, which gives
each pipeline rank's layers the memory that rank has left. Everything about bytes is
counted in those two places: this module only puts them together.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..errors import BudgetTooSmallError
from .budget import Budget, format_bytes, parse_budget
from .job import (
    JobMemory,
    ModelParams,
    OutsideLayers,
    Parallel,
    PipelineSwap,
    job_memory,
    layer_swapped,
    model_params,
    replay_bytes,
    schedule_slots,
    split_layers,
    stage_ends,
)
from .planfile import NO_CHECKPOINT, PER_LAYER, Plan, checkpointed, moves_to_host
from .planner import TIE_TOLERANCE, Profile, make_plan
from .solver import minimum_bytes

__all__ = [
    "UNIFORM",
    "FitReport",
    "NoPlan",
    "StrategyRow",
    "plan_per_rank",
    "plan_summary",
    "will_it_fit",
]

GiB = float(1 << 30)

#: The uniform strategies shown beside the plan, where the profile has them.
UNIFORM = (
    "none", "full", "full+replay-collectives", "selective", "exclude:self_attn", "exclude:mlp",
    "full+partition-inputs", "offload", "exclude-offload:self_attn", "full+swap-inputs", "swap",
)  # fmt: skip

# A plan made per rank is checked by the whole-job walk; a rank found over is planned
# again with less room, at most this many times.
_REPLANS = 4


@dataclass(frozen=True)
class StrategyRow:
    """One strategy on one pipeline rank (bytes per device)."""

    strategy: str
    rank: int
    activations_per_microbatch: int  # the whole model's, one micro-batch (this rank's shard)
    activations: int  # this pipeline rank's at the step's peak
    states: int  # parameters + gradients + optimizer states + gathered parameters
    total: int
    replay_flops: int
    replay_s: float
    overhead: float | None  # replay time over the step without checkpointing
    fits: bool | None
    host: int = 0  # host memory its swapped and offloaded activations take (not in total)


@dataclass(frozen=True)
class NoPlan:
    """Why no plan fits: the first pipeline rank without room. ``states_bytes``: its
    parameters, gradients and optimizer states; ``least_bytes``: the least its
    activations can be at the step's peak (each of its layers keeping the least it can,
    ``held`` micro-batches at once, with what a backward step holds for a while); None
    where the states alone leave no room."""

    rank: int
    budget_bytes: int
    states_bytes: int
    least_bytes: int | None
    held: int
    pipeline: bool
    computes_loss: bool = True  # the rank holds the last stage

    def describe(self) -> str:
        where = f"pipeline rank {self.rank}" if self.pipeline else "each rank"
        if self.least_bytes is None:
            return (
                f"no plan: on {where} parameters, gradients and optimizer states alone take "
                f"{format_bytes(self.states_bytes)} of the {format_bytes(self.budget_bytes)} "
                "per device"
            )
        return (
            f"no plan: {where} needs at least {format_bytes(self.states_bytes + self.least_bytes)}"
            f" of the {format_bytes(self.budget_bytes)} per device: "
            f"{format_bytes(self.states_bytes)} of states and at least "
            f"{format_bytes(self.least_bytes)} of activations ({self.held} micro-batch(es) held "
            "at the schedule's peak, each layer keeping the least it can)"
        )


def plan_per_rank(
    profile: Profile,
    params: Any,
    parallel: Parallel,
    budget: str | int | Budget,
    *,
    precision: Any = "bf16-adam",
    schedule: str = "1F1B",
    microbatches: int | None = None,
    stage_layers: list[int] | None = None,
    pipeline_swap: PipelineSwap | None = None,
) -> tuple[Plan | None, NoPlan | None]:
    """One plan for the whole model, made pipeline rank by pipeline rank, that fits
    ``budget`` (bytes per device) on every rank of the job.

    Each rank's layers get the memory the rank has left after its parameters,
    gradients and optimizer states and after what a backward step holds for a while (the
    loss's backward on the rank of the last stage, a checkpointed layer's replay),
    divided by the micro-batches its schedule holds at once; of the bytes kept outside
    the layers, the first stage's and the last stage's count where they are held
    (:class:`recomp.plan.job.OutsideLayers`). A simulated profile's times are the cost
    model's, without noise: each rank's plan is the fastest that fits (no tie
    tolerance); a measured one's plans within ``1 / ranks`` of ``make_plan``'s tie
    tolerance of the step are ties, so that the whole plan is within that tolerance of
    the fastest. The plan is then counted by
    :func:`recomp.plan.job.job_memory`, and a rank it finds over the budget is planned
    again with that much less. With ``pipeline_swap``, of what a layer's option keeps,
    the part swap moves counts for the groups on the device at the rank's peak
    (``RankSwapPlan.resident_peak``) only, the rest for every group held; the whole-job
    count that checks the plan counts the swap itself. Returns the plan, or None and why
    (:class:`NoPlan`)."""
    parsed = parse_budget(budget)
    if parsed.nbytes is None:
        raise ValueError(f"the budget is bytes per device with a unit (80GiB), got {budget!r}")
    budget_bytes = parsed.nbytes
    common: dict[str, Any] = {
        "precision": precision,
        "schedule": schedule,
        "microbatches": microbatches or parallel.pp,
        "stage_layers": stage_layers,
        "pipeline_swap": pipeline_swap,
    }
    model = params if isinstance(params, ModelParams) else model_params(params)
    unchecked = job_memory(model, parallel, activations=profile, option=NO_CHECKPOINT, **common)
    resident = _resident_groups(parallel, schedule, common["microbatches"], pipeline_swap)
    num_stages = sum(len(r.stages) for r in unchecked.ranks)
    stage_of = split_layers(len(profile.layers), num_stages, stage_layers)
    outside = OutsideLayers.of(profile)
    pipeline = len(unchecked.ranks) > 1
    rooms: dict[int, int] = {}
    parts: dict[int, _RankPart] = {}
    for rank in unchecked.ranks:
        index = [i for i, s in enumerate(stage_of) if s in rank.stages]
        peak = rank.peak
        held = max([peak.in_flight.get(s, 0) for s in rank.stages] if peak else [1]) or 1
        states = rank.total - rank.activations
        # What a backward step holds for a while, at most: the loss's backward where the
        # rank computes the loss, the replay of a layer keeping the least it can.
        transient = max(
            [outside.loss_backward if num_stages - 1 in rank.stages else 0]
            + [replay_bytes(profile.layers[i], _least_checkpointed(profile, i)) for i in index]
        )
        layers = [profile.layers[i] for i in index]
        if pipeline_swap is not None and resident.get(rank.rank, held) < held:
            layers = [
                _weighted_for_swap(
                    profile.layers[i],
                    stage_ends(model, stage_of, i),
                    pipeline_swap.min_bytes,
                    held,
                    resident[rank.rank],
                )
                for i in index
            ]
        part = replace(
            profile,
            layers=layers,
            shared_bytes=max(outside.on_stage(s, num_stages - 1) for s in rank.stages),
        )
        room = (budget_bytes - states - transient) // held
        if room <= 0:
            least = None
            if states < budget_bytes:
                least = held * minimum_bytes(part.layer_options(), part.shared_bytes).kept_bytes
                least += transient
            return None, NoPlan(
                rank.rank, budget_bytes, states, least, held, pipeline, num_stages - 1 in rank.stages
            )
        rooms[rank.rank] = room
        parts[rank.rank] = _RankPart(
            index, part, held, states, transient, num_stages - 1 in rank.stages
        )
    chosen: dict[int, Any] = {}
    for _ in range(_REPLANS):
        for rank_index, rp in parts.items():
            room = rooms[rank_index]
            try:
                stage_plan = make_plan(
                    rp.profile,
                    Budget(text=format_bytes(room), nbytes=room),
                    tie_tolerance=0.0 if profile.timing else TIE_TOLERANCE / len(parts),
                )
            except BudgetTooSmallError as exc:
                least = exc.minimum_bytes * rp.held + rp.transient
                return None, rp.no_plan(rank_index, budget_bytes, least, pipeline)
            for i, part_layer, layer_plan in zip(rp.layers, rp.profile.layers, stage_plan.layers):
                # Under pipeline swap the part's bytes were weighted for planning: the
                # plan records what the option keeps (the count takes the swap off).
                away = (
                    profile.layers[i].option(layer_plan.option).kept_bytes
                    - part_layer.option(layer_plan.option).kept_bytes
                )
                chosen[i] = (
                    replace(layer_plan, kept_bytes=layer_plan.kept_bytes + away)
                    if away
                    else layer_plan
                )
        plan = _whole_plan(profile, [chosen[i] for i in range(len(profile.layers))], budget_bytes)
        counted = job_memory(model, parallel, activations=profile, plan=plan, **common)
        over = {r.rank: r.total - budget_bytes for r in counted.ranks if r.total > budget_bytes}
        if not over:
            return plan, None
        for rank_index, excess in over.items():
            rp = parts[rank_index]
            rooms[rank_index] -= math.ceil(excess / rp.held)
            if rooms[rank_index] <= 0:
                least = counted.ranks[rank_index].activations
                return None, rp.no_plan(rank_index, budget_bytes, least, pipeline)
    rank_index = min(over)
    least = counted.ranks[rank_index].activations
    return None, parts[rank_index].no_plan(rank_index, budget_bytes, least, pipeline)


def _weighted_for_swap(
    layer: Any, ends: tuple[bool, bool], min_bytes: int, held: int, resident: int
) -> Any:
    """``layer`` with each option's kept bytes per micro-batch as pipeline swap leaves
    them on the device at the rank's peak, averaged over the ``held`` groups: what swap
    moves counts for the ``resident`` ones only."""
    options = []
    for option in layer.options:
        moved = layer_swapped(option.swappable or (), ends, min_bytes)
        away = moved * (held - resident) // held
        options.append(replace(option, kept_bytes=option.kept_bytes - away))
    return replace(layer, options=options)


def _resident_groups(
    parallel: Parallel, schedule: str, microbatches: int, swap: PipelineSwap | None
) -> dict[int, int]:
    """Per pipeline rank, the (stage, micro-batch) groups on its device at its peak under
    ``swap`` (none without it)."""
    if swap is None:
        return {}
    from .._pipeline_swap import plan_rank_swap

    slots = schedule_slots(schedule, parallel.pp, microbatches, parallel.stages_per_rank)
    return {
        rank: plan_rank_swap(one, swap.min_gap, rank).resident_peak()[0]
        for rank, one in slots.items()
    }


@dataclass(frozen=True)
class _RankPart:
    """One pipeline rank's share of the planning: its layers' indices, the profile of
    them (with the bytes outside the layers its stages hold), the micro-batches its
    schedule holds at once, its states and the most a backward step holds for a while."""

    layers: list[int]
    profile: Profile
    held: int
    states: int
    transient: int
    computes_loss: bool

    def no_plan(self, rank: int, budget_bytes: int, least: int, pipeline: bool) -> NoPlan:
        return NoPlan(
            rank, budget_bytes, self.states, least, self.held, pipeline, self.computes_loss
        )


def _least_checkpointed(profile: Profile, index: int) -> int:
    """The least a checkpointed option of layer ``index`` keeps (its largest replay)."""
    layer = profile.layers[index]
    kept = [o.kept_bytes for o in layer.options if checkpointed(o.name)]
    return min(kept, default=layer.no_checkpoint_bytes)


def _whole_plan(profile: Profile, layers: list[Any], budget_bytes: int) -> Plan:
    predicted = profile.predict([lp.option for lp in layers])
    return Plan(
        budget_bytes=budget_bytes,
        layers=layers,
        budget=format_bytes(budget_bytes),
        predicted={**predicted, "note": "per device, whole job; made per pipeline rank"},
        exclude_collectives=profile.exclude_collectives is not False,
    )


# ------------------------------------------------------------------- will it fit


@dataclass
class FitReport:
    """What :func:`will_it_fit` found: per strategy and pipeline rank a
    :class:`StrategyRow`; ``plan``, the plan that fits every rank (None: none, and
    ``no_plan`` says why); the simulated ``profile`` (one micro-batch on one rank, the
    full depth); ``jobs``, the whole-job count of each strategy; ``notes``: what the
    figures rest on."""

    model: str
    layout: str
    hardware: str
    budget_bytes: int | None
    rows: list[StrategyRow]
    profile: Profile
    jobs: dict[str, JobMemory]
    plan: Plan | None = None
    no_plan: NoPlan | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def plan_strategy(self) -> str | None:
        """The plan's rows' strategy name (``plan@80GiB``), or None without a budget."""
        return None if self.budget_bytes is None else f"plan@{_gib(self.budget_bytes)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "budget_bytes": self.budget_bytes,
            "hardware": self.hardware,
            "parallel": self.layout,
            "rows": [asdict(r) for r in self.rows],
            "notes": self.notes,
            "plan": None if self.plan is None else self.plan.to_dict(),
        }


def will_it_fit(
    model: str,
    parallel: Parallel | None = None,
    *,
    seq: int = 8192,
    batch: int = 1,
    dtype: Any = "bf16",
    schedule: str = "1F1B",
    microbatches: int | None = None,
    stage_layers: list[int] | None = None,
    hardware: Any = "H100 SXM",
    device_memory: str | int | Budget | None = None,
    precision: Any = "bf16-adam",
    layers: int | None = 3,
    exclude_collectives: bool | str = PER_LAYER,
    pipeline_swap: PipelineSwap | None = None,
) -> FitReport:
    """Simulate one rank of a training job of the published ``model``
    (``recomp.plan.models.MODELS``) and count, per strategy and pipeline rank, its
    memory per device and the step overhead of its replay, and the plan that fits.

    ``parallel``: the layout (tensor, sequence, context, pipeline, data, expert and
    loss parallelism, ZeRO); ``seq`` tokens per sequence (before context parallelism
    splits them) and ``batch`` sequences per micro-batch;
    ``dtype``: ``"bf16"``, ``"fp16"``, ``"fp32"`` or a ``torch.dtype``; ``schedule``,
    ``microbatches`` (default ``parallel.pp``) and ``stage_layers`` as for
    :func:`recomp.plan.job.job_memory`; ``hardware``: the accelerator of the cost model
    (``recomp.plan.cost``); ``device_memory``: bytes per device (a :class:`Budget` of
    bytes, or ``"80GiB"``; default: the accelerator's memory; None without one: no plan,
    no verdict); ``precision``: the states' bytes (``recomp.plan.job`` presets);
    ``layers``: layers simulated, then scaled to the model's depth (None: all; three
    tell what every layer keeps, such as the rotary embedding's tables, from what two
    neighbours share);
    ``exclude_collectives``: what the checkpoints do with the results of collectives:
    ``"per-layer"`` (the default) lets the plan choose, layer by layer, between keeping
    them and running the collectives again in the replay; True keeps them, False runs
    them again everywhere (as for ``recomp.plan.simulate``);
    ``pipeline_swap``: a :class:`recomp.plan.job.PipelineSwap`, to count
    ``recomp.torch.pipeline_swap`` on the schedule in every strategy and the plan.
    Without it, where no plan fits a pipeline, the notes say whether one would with it.

    Raises ``ValueError`` (or ``KeyError`` for an unknown model) naming what to change
    where the layout and the model do not go together."""
    from .cost import resolve_hardware
    from .job import model_params
    from .models import SimulatedModel

    parallel = parallel or Parallel()
    torch_dtype = _torch_dtype(dtype)
    simulated = SimulatedModel(
        model,
        layers=layers,
        batch=batch,
        seq=seq,
        dtype=torch_dtype,
        tp=parallel.tp,
        sp=parallel.sp,
        ep=parallel.ep,
        cp=parallel.cp,
        loss_parallel=parallel.loss_parallel,
    )
    spec = resolve_hardware(hardware)
    budget = _device_budget(device_memory, spec.memory_bytes)
    profile = simulated.simulate(hardware=spec, exclude_collectives=exclude_collectives)
    params = model_params(simulated.meta_model())
    microbatches = microbatches or parallel.pp
    common: dict[str, Any] = {
        "precision": precision,
        "schedule": schedule,
        "microbatches": microbatches,
        "stage_layers": stage_layers,
        "pipeline_swap": pipeline_swap,
    }
    names = [o.name for o in profile.layers[0].options]
    rows: list[StrategyRow] = []
    jobs: dict[str, JobMemory] = {}
    notes = list(profile.notes)
    for option in [o for o in UNIFORM if o in names]:
        job = job_memory(params, parallel, activations=profile, option=option, budget=budget,
                         **common)  # fmt: skip
        jobs[option] = job
        rows.extend(_rows(option, profile.predict([option] * len(profile.layers)), profile, job))
    plan = no_plan = None
    if budget is not None:
        plan, no_plan = plan_per_rank(profile, params, parallel, budget, **common)
        if plan is not None:
            strategy = f"plan@{_gib(budget.nbytes or 0)}"
            job = job_memory(params, parallel, activations=profile, plan=plan, budget=budget,
                             **common)  # fmt: skip
            jobs[strategy] = job
            options = [lp.option for lp in plan.layers]
            rows.extend(_rows(strategy, profile.predict(options), profile, job))
            notes.append(f"{strategy}: {plan_summary(plan)}")
            notes.extend(n for n in job.notes if n not in notes)
        else:
            assert no_plan is not None
            offload = None
            if profile.host_bandwidth is None and no_plan.least_bytes is not None:
                offload = _offload_lever(simulated, spec, params, parallel, budget, common,
                                         exclude_collectives)  # fmt: skip
            swap = None
            if pipeline_swap is None and parallel.pp > 1 and no_plan.least_bytes is not None:
                swap = _pipeline_swap_lever(profile, params, parallel, budget, common)
            levers = _levers(no_plan, profile, parallel, batch, seq, offload, swap)
            notes.append(no_plan.describe() + "; " + levers)
    notes.append(
        f"step without checkpointing (modelled): {profile.baseline_step_s * 1e3:.1f} ms; "
        + profile.timing
    )
    layout = (
        f"{parallel.describe()}, seq {seq}, micro-batch {batch}, {microbatches} micro-batch(es), "
        f"schedule {schedule}"
        + ("" if pipeline_swap is None else f", {pipeline_swap.describe()}")
    )
    return FitReport(
        simulated.spec.name,
        layout,
        spec.name,
        None if budget is None else budget.nbytes,
        rows,
        profile,
        jobs,
        plan,
        no_plan,
        notes,
    )


def plan_summary(plan: Plan, runs: int = 6) -> str:
    """What a plan gives the layers, by layer index: ``layers 0-39 full, 40-79
    offload``, or where the options change more than ``runs`` times, how many layers
    take each (``full x 40, offload x 40``)."""
    options = [lp.option for lp in plan.layers]
    spans: list[tuple[int, int, str]] = []
    for index, option in enumerate(options):
        if spans and spans[-1][2] == option:
            spans[-1] = (spans[-1][0], index, option)
        else:
            spans.append((index, index, option))
    if len(spans) <= runs:
        parts = [f"{a}-{b} {o}" if a != b else f"{a} {o}" for a, b, o in spans]
        return "layers " + ", ".join(parts)
    counts = {o: options.count(o) for o in dict.fromkeys(options)}
    return ", ".join(f"{o} x {n}" for o, n in counts.items()) + " (layers apart)"


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype not in names:
        raise ValueError(f"dtype is one of {', '.join(names)} or a torch.dtype, got {dtype!r}")
    return names[dtype]


def _device_budget(given: str | int | Budget | None, accelerator: int | None) -> Budget | None:
    """The memory per device as a budget of bytes: as given, else the accelerator's."""
    if given is None:
        return None if accelerator is None else Budget(_gib(accelerator), nbytes=int(accelerator))
    parsed = parse_budget(given)
    if parsed.nbytes is None:
        raise ValueError(
            f"the memory per device is bytes with a unit (80GiB, 75GB), got {parsed.text!r}"
        )
    return parsed


def _offload_lever(
    simulated: Any,
    spec: Any,
    params: Any,
    parallel: Parallel,
    budget: Budget,
    common: dict[str, Any],
    exclude_collectives: bool | str,
) -> str | None:
    """Where the accelerator has no host link (so no option held activations on the
    host): whether, with one (PCIe 5 x16), the plan made per rank fits; the lever then,
    else None."""
    from .cost import GEN5_X16

    linked = replace(spec, host_bandwidth=GEN5_X16)
    profile = simulated.simulate(hardware=linked, exclude_collectives=exclude_collectives)
    plan, _ = plan_per_rank(profile, params, parallel, budget, **common)
    if plan is None:
        return None
    moved = sum(1 for lp in plan.layers if moves_to_host(lp.option))
    return (
        f"offloading activations to the host: with a host link of {GEN5_X16 / 1e9:g} GB/s "
        f"each way (PCIe 5 x16; the accelerator's host_bandwidth) a plan fits, {moved} of "
        f"its {len(plan.layers)} layers holding activations on the host"
    )


def _pipeline_swap_lever(
    profile: Profile,
    params: Any,
    parallel: Parallel,
    budget: Budget,
    common: dict[str, Any],
) -> str | None:
    """Where no plan fits a pipeline: whether one fits with pipeline swap (its default
    gap), the lever then (with the most host memory a rank takes), else None."""
    swap = PipelineSwap()
    given = {**common, "pipeline_swap": swap}
    plan, _ = plan_per_rank(profile, params, parallel, budget, **given)
    if plan is None:
        return None
    job = job_memory(params, parallel, activations=profile, plan=plan, **given)
    host = max(r.host for r in job.ranks)
    return (
        f"pipeline swap (recomp.torch.pipeline_swap; --pipeline-swap): with the "
        f"micro-batches the schedule leaves at least {swap.min_gap} compute slots moved to "
        f"the host between forward and backward a plan fits, {format_bytes(host)} of host "
        "memory per device at most"
    )


def _levers(
    no_plan: NoPlan,
    profile: Profile,
    parallel: Parallel,
    batch: int,
    seq: int,
    offload: str | None = None,
    swap: str | None = None,
) -> str:
    """What would make room, of what the layout and the profile leave untried
    (``offload``: the offload lever, where a host link would make a rank fit; ``swap``:
    the pipeline swap lever, where swap would)."""
    levers = []
    if no_plan.least_bytes is not None:
        kept = max(
            (o.collective_bytes for layer in profile.layers for o in layer.options), default=0
        )
        if kept and profile.exclude_collectives is True:
            levers.append(
                "replaying the collectives in the checkpoints' replays instead of keeping their "
                "results (exclude_collectives=False)"
            )
    stages = parallel.pp * (parallel.stages_per_rank or 1)
    if 2 * stages <= len(profile.layers):
        levers.append(f"more pipeline stages (pp={2 * parallel.pp}: fewer layers and states per rank)")
    if parallel.zero < 3:
        if parallel.dp == 1:
            levers.append("ZeRO over data-parallel ranks (dp > 1 with zero=1, 2 or 3)")
        else:
            levers.append(f"a higher ZeRO stage over the {parallel.dp} data-parallel ranks (zero=3)")
    if no_plan.least_bytes is not None:
        if no_plan.computes_loss and parallel.tp > 1 and not parallel.loss_parallel:
            levers.append(
                "loss parallelism (loss_parallel: each tensor-parallel rank holds its "
                "vocabulary shard of the logits and of the loss's buffers)"
            )
        if batch > 1:
            levers.append(f"a smaller micro-batch ({batch // 2} sequence(s))")
        else:
            levers.append(
                f"context parallelism (cp={2 * parallel.cp}: {seq // (2 * parallel.cp)} tokens "
                f"of each sequence per rank) or shorter sequences than {seq}"
            )
    if offload is not None:
        levers.append(offload)
    if swap is not None:
        levers.append(swap)
    if not levers:
        return "nothing in this layout is left to trade"
    return "what would make room: " + "; ".join(levers)


def _rows(strategy: str, predicted: dict[str, Any], profile: Profile, job: JobMemory) -> list[StrategyRow]:
    base = profile.baseline_step_s
    overhead = predicted["replay_s"] / base if base > 0 else None
    return [
        StrategyRow(
            strategy,
            r.rank,
            int(predicted["activation_bytes"]),
            int(r.activations),
            int(r.params + r.grads + r.optimizer + r.gathered),
            int(r.total),
            int(predicted["replay_flops"]),
            float(predicted["replay_s"]),
            overhead,
            None if job.budget_bytes is None else r.total <= job.budget_bytes,
            int(r.host),
        )
        for r in job.ranks
    ]


def _gib(n: int) -> str:
    return f"{n / GiB:.4g}GiB"
