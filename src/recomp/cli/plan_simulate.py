"""``recomp plan --simulate MODEL``: will a published model fit, per rank and strategy?

The model (``recomp.plan.models``: Llama-3.1, Mixtral, DeepSeek-V3, Qwen3-MoE at their
published sizes) is built and run once under fake tensors and a fake process group
(``recomp.plan.simulate``), on a few layers scaled to the full depth; the whole job's
memory per rank (parameters, gradients and optimizer states by sharding, activations
under the pipeline schedule) comes from ``recomp.plan.job``. Printed: per strategy (no
checkpointing, full, selective, each uniform exclusion, and the plan that fits the
per-device budget) and pipeline rank, the activation bytes, the whole job's bytes, the
predicted step overhead and whether it fits; optionally a picture.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any

GiB = float(1 << 30)

#: The uniform strategies shown beside the plan, when the profile has them.
UNIFORM = (
    "none", "full", "selective", "exclude:self_attn", "exclude:mlp", "full+swap-inputs", "swap",
)

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def build_parser() -> argparse.ArgumentParser:
    from ..plan.models import MODELS
    from .args import CommandParser

    p = CommandParser(
        prog="recomp plan --simulate",
        description=(
            "Simulate one rank of a training job of a published model on fake tensors "
            "(nothing is allocated; no GPU needed) and print, per strategy and pipeline "
            "rank, the activation memory, the whole job's memory per device, the predicted "
            "step overhead of the replay and whether it fits the per-device budget."
        ),
        epilog="models: "
        + ", ".join(f"{n} ({s.parameters / 1e9:.1f}B)" for n, s in MODELS.items()),
    )
    p.add_argument("--simulate", metavar="MODEL", required=True, help="the model (see below)")
    p.add_argument("--seq", type=int, default=8192, help="tokens per sequence (default 8192)")
    p.add_argument("--batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="default bf16")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (default 1)")
    p.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2, 3),
        default=0,
        help="ZeRO stage over the data-parallel ranks: 1 optimizer states, 2 and gradients, "
        "3 and parameters (FSDP); default 0",
    )
    p.add_argument(
        "--ep", type=int, help="expert-parallel degree (MoE models; default: --tp)"
    )
    p.add_argument("--schedule", default="1F1B", help="pipeline schedule (default 1F1B)")
    p.add_argument("--microbatches", type=int, help="micro-batches per step (default: --pp)")
    p.add_argument(
        "--accelerator",
        default="H100 SXM",
        help="the target: a name (H100 SXM, H200, B200, A100 80GB, MI300X, Ascend 910B) or a "
        "JSON table (name, peak_flops, memory_bandwidth, link_bandwidth, memory_bytes); "
        "default H100 SXM",
    )
    p.add_argument(
        "--budget",
        help="memory per device, bytes with a unit (80GiB, 75GB); default: the accelerator's",
    )
    p.add_argument(
        "--precision",
        default="bf16-adam",
        help="parameter/gradient/optimizer bytes: a recomp.plan.job preset (default "
        "bf16-adam: bf16 weights, fp32 gradients, fp32 master weights and Adam states)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=2,
        help="layers simulated, then scaled to the model's depth (default 2; at least one "
        "per kind of layer); 0: all of them",
    )
    p.add_argument(
        "--replay-collectives",
        action="store_true",
        help="checkpoints run their collectives again in the replay instead of keeping "
        "their results (recomp's exclude_collectives=False)",
    )
    p.add_argument("--json", metavar="PATH", help="write the table and the plan here")
    p.add_argument("--png", metavar="PATH", help="draw the strategies here (matplotlib)")
    p.add_argument("--show-profile", action="store_true", help="also print the profile")
    return p


@dataclass
class Row:
    """One strategy on one pipeline rank."""

    strategy: str
    rank: int
    activations_per_microbatch: int  # the whole model's, one micro-batch (this rank's shard)
    activations: int  # this pipeline rank's at its peak
    states: int  # parameters + gradients + optimizer + gathered
    total: int
    replay_flops: int
    replay_s: float
    overhead: float | None  # replay over the step without checkpointing
    fits: bool | None


@dataclass
class Outcome:
    model: str
    rows: list[Row]
    budget_bytes: int | None
    hardware: str
    parallel: str
    notes: list[str] = field(default_factory=list)
    plan: Any = None  # recomp.plan.Plan
    profile: Any = None

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {
            "model": self.model,
            "budget_bytes": self.budget_bytes,
            "hardware": self.hardware,
            "parallel": self.parallel,
            "rows": [asdict(r) for r in self.rows],
            "notes": self.notes,
        }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    errors = check_args(args)
    if errors:
        parser.error("; ".join(errors))
    try:
        outcome = run(args)
    except (ValueError, KeyError) as exc:
        print(f"recomp plan --simulate: {exc}", file=sys.stderr)
        return 2
    if args.show_profile:
        from ..plan.planner import profile_table

        print(profile_table(outcome.profile) + "\n")
    print(table(outcome))
    if args.json:
        with open(args.json, "w") as f:
            data = outcome.to_dict()
            data["plan"] = None if outcome.plan is None else outcome.plan.to_dict()
            json.dump(data, f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        write_png(args.png, outcome)
        print(f"wrote {args.png}")
    return 0


def check_args(args: argparse.Namespace) -> list[str]:
    """What cannot be simulated as asked, each with its fix."""
    from ..plan.models import MODELS

    errors = []
    if args.simulate.lower() not in MODELS:
        errors.append(f"unknown model {args.simulate!r}: use one of {', '.join(MODELS)}")
        return errors
    for name in ("seq", "batch", "tp", "pp", "dp"):
        if getattr(args, name) < 1:
            errors.append(f"--{name} is a positive integer")
    if args.layers < 0:
        errors.append("--layers is 0 (all) or a positive number of layers")
    if args.sp and args.tp == 1:
        errors.append("--sp splits the sequence over the tensor-parallel ranks: add --tp N")
    if args.microbatches is not None and args.microbatches < 1:
        errors.append("--microbatches is a positive integer")
    if args.zero and args.dp == 1:
        errors.append(f"--zero {args.zero} shards over the data-parallel ranks: add --dp N")
    layers = MODELS[args.simulate.lower()].values["num_hidden_layers"]
    if args.pp > layers:
        errors.append(f"{args.simulate} has {layers} layers: --pp must be at most that")
    if args.pp > 1:
        from ..torch._compat import schedule_names

        names = schedule_names()
        if args.schedule not in names:
            errors.append(f"unknown --schedule {args.schedule!r}: use one of {', '.join(names)}")
    return errors


def simulated_model(args: argparse.Namespace) -> Any:
    import torch

    from ..plan.models import SimulatedModel

    return SimulatedModel(
        args.simulate.lower(),
        layers=args.layers or None,
        batch=args.batch,
        seq=args.seq,
        dtype=getattr(torch, _DTYPES[args.dtype]),
        tp=args.tp,
        sp=args.sp,
        ep=args.ep,
    )


def candidate_regions(module: Any) -> bool:
    """The regions an exclusion may keep out of the replay: a layer's attention and its
    MLP or mixture-of-experts block (not the norms: fewer options, same plans)."""
    return type(module).__name__.endswith(("Attention", "MLP", "MoE", "SparseMoeBlock"))


def run(args: argparse.Namespace) -> Outcome:
    from ..plan import simulate
    from ..plan.budget import parse_budget
    from ..plan.cost import resolve_hardware
    from ..plan.job import Parallel, job_memory, model_params

    model = simulated_model(args)
    hardware = resolve_hardware(args.accelerator)
    budget_bytes = None
    if args.budget is not None:
        parsed = parse_budget(args.budget)
        if parsed.nbytes is None:
            raise ValueError(f"--budget is bytes per device with a unit (80GiB), got {args.budget!r}")
        budget_bytes = int(parsed.nbytes)
    elif hardware.memory_bytes:
        budget_bytes = int(hardware.memory_bytes)
    profile = simulate(
        model.build,
        model.inputs,
        world_size=args.tp,
        exclude=candidate_regions,
        exclude_collectives=not args.replay_collectives,
        hardware=hardware,
    )
    profile = model.scale_profile(profile)
    parallel = Parallel(
        dp=args.dp, tp=args.tp, pp=args.pp, ep=model.expert_parallel if model.spec.moe else 1,
        zero=args.zero,
    )
    params = model_params(_meta_model(model))
    microbatches = args.microbatches or args.pp
    common = {
        "precision": args.precision,
        "schedule": args.schedule,
        "microbatches": microbatches,
        "budget": None if budget_bytes is None else f"{budget_bytes}B",
    }
    names = [o.name for o in profile.layers[0].options]
    rows: list[Row] = []
    notes = list(profile.notes)
    for option in [o for o in UNIFORM if o in names]:
        predicted = profile.predict([option] * len(profile.layers))
        job = job_memory(params, parallel, activations=profile, option=option, **common)
        rows.extend(_rows(option, predicted, profile, job))
    plan = None
    if budget_bytes is not None:
        plan, more = stage_plans(profile, params, parallel, budget_bytes, common)
        notes.extend(more)
        if plan is not None:
            options = [lp.option for lp in plan.layers]
            predicted = profile.predict(options)
            job = job_memory(params, parallel, activations=profile, plan=plan, **common)
            rows.extend(_rows(f"plan@{_gib(budget_bytes)}", predicted, profile, job))
            notes.extend(n for n in job.notes if n not in notes)
    notes.append(
        f"step without checkpointing (modelled): {profile.baseline_step_s * 1e3:.1f} ms; "
        + str(getattr(profile, "timing", "") or "")
    )
    return Outcome(
        model.spec.name,
        rows,
        budget_bytes,
        hardware.name,
        f"{parallel.describe()}, sp={'on' if args.sp else 'off'}, seq {args.seq}, "
        f"micro-batch {args.batch}, {microbatches} micro-batch(es), schedule {args.schedule}",
        notes,
        plan,
        profile,
    )


def stage_plans(
    profile: Any, params: Any, parallel: Any, budget_bytes: int, common: dict[str, Any]
) -> tuple[Any, list[str]]:
    """One plan for the whole model, made stage by stage: each pipeline rank's layers get
    the budget that rank has left after its parameters, gradients and optimizer states,
    divided by the micro-batches its schedule holds at its peak (one without pipeline
    parallelism); of the activations outside the layers, the embeddings' count on the
    first stage, the head's and the loss's on the last.
    None (and why) where a rank has no room or no plan fits it."""
    from dataclasses import replace as copy_with

    from ..plan import make_plan
    from ..plan.job import OutsideLayers, job_memory, split_layers
    from ..plan.planfile import Plan

    static = job_memory(params, parallel, **common)
    none_job = job_memory(params, parallel, activations=profile, option="none", **common)
    num_stages = sum(len(r.stages) for r in static.ranks)
    stage_of = split_layers(len(profile.layers), num_stages)
    chosen: dict[int, Any] = {}
    for rank, none_rank in zip(static.ranks, none_job.ranks):
        held = none_rank.peak.microbatches if none_rank.peak is not None else 1
        # A backward step holds more for a while: the loss's buffers on the last stage's
        # rank, a checkpointed layer's replay (at most a full checkpoint's) on every one.
        index = [i for i, st in enumerate(stage_of) if st in rank.stages]
        replay = max(
            (max(0, profile.layers[i].no_checkpoint_bytes - profile.layers[i].options[1].kept_bytes)
             for i in index), default=0,
        )  # fmt: skip
        loss = OutsideLayers.of(profile).loss_backward if num_stages - 1 in rank.stages else 0
        room = (budget_bytes - rank.total - max(loss, replay)) // max(held, 1)
        where = f"pipeline rank {rank.rank}: " if len(static.ranks) > 1 else ""
        if room <= 0:
            return None, [
                f"no plan: {where}parameters, gradients and optimizer states alone take "
                f"{rank.total / GiB:.2f} GiB of the {budget_bytes / GiB:.2f} GiB per device; "
                "shard them over data-parallel ranks (--dp N --zero 1, 2 or 3) or split the "
                "layers (--pp N)"
            ]
        index = [i for i, st in enumerate(stage_of) if st in rank.stages]
        outside = OutsideLayers.of(profile)
        part = copy_with(
            profile,
            layers=[profile.layers[i] for i in index],
            shared_bytes=max(outside.on_stage(s, num_stages - 1) for s in rank.stages),
        )
        try:
            stage_plan = make_plan(part, f"{int(room)}B")
        except ValueError as exc:
            return None, [
                f"no plan: {where}{str(exc).splitlines()[0]} (the budget left after the "
                f"states, per micro-batch: {held} micro-batch(es) are held at the "
                "schedule's peak)"
            ]
        for i, layer_plan in zip(index, stage_plan.layers):
            chosen[i] = layer_plan
    layers = [chosen[i] for i in range(len(profile.layers))]
    predicted = profile.predict([lp.option for lp in layers])
    plan = Plan(
        budget_bytes=budget_bytes,
        layers=layers,
        budget=_gib(budget_bytes),
        predicted={**predicted, "note": "per device, whole job; made per pipeline rank"},
        exclude_collectives=profile.exclude_collectives,
    )
    return plan, []


def _meta_model(model: Any) -> Any:
    """The full model on the meta device (shapes only), for its parameter counts."""
    import torch

    from ..plan.models import _classes, hf_config

    _, model_class = _classes(model.spec.family)
    with torch.device("meta"):
        return model_class(hf_config(model.spec))


def _rows(strategy: str, predicted: dict[str, Any], profile: Any, job: Any) -> list[Row]:
    base = profile.baseline_step_s
    overhead = predicted["replay_s"] / base if base > 0 else None
    return [
        Row(
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
        )
        for r in job.ranks
    ]


def _gib(n: int) -> str:
    return f"{n / GiB:.4g}GiB"


def table(outcome: Outcome) -> str:
    header = [
        "strategy", "pp rank", "act/mb GiB", "act peak GiB", "states GiB", "total GiB",
        "replay TFLOP", "overhead", "fits",
    ]  # fmt: skip
    cells = []
    for r in outcome.rows:
        cells.append(
            [
                r.strategy,
                str(r.rank),
                f"{r.activations_per_microbatch / GiB:.2f}",
                f"{r.activations / GiB:.2f}",
                f"{r.states / GiB:.2f}",
                f"{r.total / GiB:.2f}",
                f"{r.replay_flops / 1e12:.1f}",
                "-" if r.overhead is None else f"+{r.overhead * 100:.1f}%",
                "" if r.fits is None else ("yes" if r.fits else "NO"),
            ]
        )
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]

    def line(row: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        ).rstrip()

    budget = "none" if outcome.budget_bytes is None else _gib(outcome.budget_bytes)
    lines = [
        f"{outcome.model} on {outcome.hardware}: {outcome.parallel}; budget {budget} per device",
        line(header),
        line(["-" * w for w in widths]),
        *map(line, cells),
        "act/mb: what one micro-batch keeps over all the layers (this rank's shard); act peak: this "
        "pipeline rank's at the schedule's peak; states: parameters, gradients, optimizer "
        "states (and gathered parameters under ZeRO-3); overhead: predicted replay time over "
        "the modelled step without checkpointing",
    ]
    lines.extend(f"note: {n}" for n in outcome.notes)
    return "\n".join(lines)


def write_png(path: str, outcome: Outcome) -> None:
    """Per strategy, the whole job's bytes per device (states and activations stacked,
    the worst pipeline rank) with the budget as a line, and the predicted overhead."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worst: dict[str, Row] = {}
    for r in outcome.rows:
        if r.strategy not in worst or r.total > worst[r.strategy].total:
            worst[r.strategy] = r
    names = list(worst)
    states = [worst[n].states / GiB for n in names]
    acts = [worst[n].activations / GiB for n in names]
    fig, (ax, ox) = plt.subplots(1, 2, figsize=(11, 4.5), width_ratios=[3, 2])
    ax.bar(names, states, color="#7f7f7f", label="parameters, gradients, optimizer")
    ax.bar(names, acts, bottom=states, color="#1f77b4", label="activations (peak)")
    if outcome.budget_bytes is not None:
        ax.axhline(outcome.budget_bytes / GiB, ls="--", color="#d62728", label="budget")
    top = max([s + a for s, a in zip(states, acts)] + [(outcome.budget_bytes or 0) / GiB])
    ax.set_ylim(0, top * 1.35)  # room for the legend above the bars
    ax.set_ylabel("per device (GiB)")
    ax.set_title(f"{outcome.model}: memory per device (worst pipeline rank)")
    ax.legend(fontsize=8, loc="upper right")
    overheads = [(worst[n].overhead or 0.0) * 100 for n in names]
    ox.bar(names, overheads, color="#ff7f0e")
    ox.set_ylabel("predicted replay over the step (%)")
    ox.set_title(f"step overhead on {outcome.hardware}")
    for a in (ax, ox):
        a.tick_params(axis="x", rotation=40)
        for label in a.get_xticklabels():
            label.set_horizontalalignment("right")
        a.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
