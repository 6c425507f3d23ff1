"""``recomp simulate MODEL``: will a published model fit, per rank and strategy?

The command reads the options and prints; the work is ``recomp.plan.fit.will_it_fit``:
the model (``recomp.plan.models``: Llama-3.1, Mixtral, DeepSeek-V3, Qwen3-MoE at their
published sizes) run once on fake tensors as one rank of a fake process group, a few
layers scaled to the full depth, the whole job's memory per rank from
``recomp.plan.job``, the plan made per pipeline rank. Printed: per strategy (no
checkpointing, full, selective, each uniform exclusion, and the plan that fits the
memory per device) and pipeline rank, the activations at the step's peak, the states,
the total, the replay's FLOPs, its predicted step overhead and whether it fits;
optionally a picture and the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from ..plan.budget import Budget, parse_budget
from . import installs
from .args import CommandParser

PROG = "recomp simulate"
GiB = float(1 << 30)
# Printed lines are kept this narrow (the table's columns, the notes wrapped).
WIDTH = 78
# With more pipeline ranks than this, the table shows the first two, the largest and
# the last per strategy (--all-ranks: every one).
SHOWN_RANKS = 4


def build_parser() -> CommandParser:
    from ..plan._specs import MODELS

    p = CommandParser(
        prog=PROG,
        description=(
            "Simulate one rank of a training job of a published model on fake tensors "
            "(nothing is allocated; no GPU needed) and print, per strategy and pipeline "
            "rank, the activations at the step's peak, the whole job's memory per device, "
            "the predicted step overhead of the replay and whether it fits; and the plan, "
            "made per pipeline rank, that fits every rank."
        ),
        epilog="models: "
        + ", ".join(f"{n} ({s.parameters / 1e9:.1f}B)" for n, s in MODELS.items()),
    )
    p.add_argument("model", metavar="MODEL", help="the published model (see below)")
    p.add_argument("--seq", type=int, default=8192, help="tokens per sequence (default 8192)")
    p.add_argument("--batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="default bf16")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    p.add_argument(
        "--loss-parallel",
        action="store_true",
        help="loss (vocabulary) parallelism (with --tp): each tensor-parallel rank keeps its "
        "vocabulary shard of the logits and computes the loss on it",
    )
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: each rank holds --seq / --cp tokens of each sequence "
        "(default 1)",
    )
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
    p.add_argument("--ep", type=int, help="expert-parallel degree (MoE models; default: --tp)")
    p.add_argument("--schedule", default="1F1B", help="pipeline schedule (default 1F1B)")
    p.add_argument("--microbatches", type=int, help="micro-batches per step (default: --pp)")
    p.add_argument(
        "--pipeline-swap",
        action="store_true",
        help="count recomp.torch.pipeline_swap on the schedule (with --pp): what a "
        "micro-batch's forward keeps on a stage waits on the host where the schedule leaves "
        "at least --swap-min-gap compute slots before its backward",
    )
    p.add_argument(
        "--swap-min-gap",
        type=int,
        metavar="N",
        help="with --pipeline-swap: the fewest compute slots from a forward to its backward "
        "for its micro-batch to swap, at least 3 (default 4, as the runtime's)",
    )
    p.add_argument(
        "--stage-layers",
        metavar="N,N,...",
        help="layers per pipeline stage, first to last (default: as even as possible, the "
        "first stages one more)",
    )
    p.add_argument(
        "--accelerator",
        default="H100 SXM",
        help="the target: a name (H100 SXM, H200, B200, A100 80GB, MI300X, Ascend 910B) or a "
        "JSON table (name, peak_flops, memory_bandwidth, link_bandwidth, memory_bytes); "
        "default H100 SXM",
    )
    p.add_argument(
        "--host-bandwidth",
        type=host_bandwidth,
        metavar="GB/s",
        help="the host link, GB/s each way, in place of the accelerator's (PCIe 5 x16: 64; "
        "a link shared by two devices: half); 0: no host link, no option holds activations "
        "on the host",
    )
    p.add_argument(
        "--device-memory",
        type=device_memory,
        metavar="BYTES",
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
        default=3,
        help="layers simulated, then scaled to the model's depth (default 3: what every "
        "layer keeps is told from what two neighbours share; at least one per kind of "
        "layer); 0: all of them",
    )
    p.add_argument(
        "--replay-collectives",
        action="store_true",
        help="every checkpoint runs its collectives again in the replay instead of keeping "
        "their results (recomp's exclude_collectives=False); default: the plan chooses per "
        "layer, the collectives' time over the link against the bytes kept",
    )
    p.add_argument(
        "--keep-collectives",
        action="store_true",
        help="every checkpoint keeps the results of the collectives its replay reaches "
        "(exclude_collectives=True)",
    )
    p.add_argument("--json", metavar="PATH", help="write the table and the plan here")
    p.add_argument("--png", metavar="PATH", help="draw the strategies here (matplotlib)")
    p.add_argument("--show-profile", action="store_true", help="also print the profile")
    p.add_argument(
        "--all-ranks",
        action="store_true",
        help=f"a row per pipeline rank even beyond {SHOWN_RANKS} (default: the first two, the "
        "largest and the last)",
    )
    return p


def device_memory(text: str) -> Budget:
    """``--device-memory``: bytes with a unit, as a budget of bytes."""
    try:
        parsed = parse_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if parsed.nbytes is None:
        raise argparse.ArgumentTypeError(
            f"--device-memory is bytes per device with a unit (80GiB, 75GB), got {text!r}"
        )
    return parsed


def host_bandwidth(text: str) -> float:
    """``--host-bandwidth``: GB/s each way, a number >= 0."""
    try:
        value = float(text.removesuffix("GB/s"))
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"--host-bandwidth is GB/s each way, a number >= 0 (64 for PCIe 5 x16), got {text!r}"
        )
    return value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    errors = check_args(args)
    if errors:
        parser.error("; ".join(errors))
    if not installs.check(PROG, ["torch", "transformers"]):
        return installs.EXIT_MISSING
    if args.pp > 1:
        from ..plan.job import schedule_names

        names = schedule_names()
        if args.schedule not in names:
            parser.error(f"unknown --schedule {args.schedule!r}: use one of {', '.join(names)}")
    try:
        report = run(args)
    except (ValueError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"{PROG}: {message}", file=sys.stderr)
        return 2
    if args.show_profile:
        from ..plan.planner import profile_table

        print(profile_table(report.profile) + "\n")
    print(table(report, all_ranks=args.all_ranks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        write_png(args.png, report)
        print(f"wrote {args.png}")
    return 0


def check_args(args: argparse.Namespace) -> list[str]:
    """What cannot be simulated as asked, each with its fix (without importing PyTorch)."""
    from ..plan._specs import MODELS

    errors = []
    if args.model.lower() not in MODELS:
        errors.append(f"unknown model {args.model!r}: use one of {', '.join(MODELS)}")
        return errors
    for name in ("seq", "batch", "tp", "pp", "dp", "cp"):
        if getattr(args, name) < 1:
            errors.append(f"--{name} is a positive integer")
    if args.layers < 0:
        errors.append("--layers is 0 (all) or a positive number of layers")
    if args.sp and args.tp == 1:
        errors.append("--sp splits the sequence over the tensor-parallel ranks: add --tp N")
    if args.loss_parallel and args.tp == 1:
        errors.append(
            "--loss-parallel shards the vocabulary over the tensor-parallel ranks: add --tp N"
        )
    if args.microbatches is not None and args.microbatches < 1:
        errors.append("--microbatches is a positive integer")
    if args.ep is not None and args.ep < 1:
        errors.append("--ep is a positive integer")
    if args.replay_collectives and args.keep_collectives:
        errors.append(
            "--replay-collectives and --keep-collectives each force one way on every layer: "
            "give one (neither: the plan chooses per layer)"
        )
    if args.pipeline_swap and args.pp == 1:
        errors.append("--pipeline-swap swaps inside a pipeline schedule: add --pp N (N > 1)")
    if args.swap_min_gap is not None:
        if not args.pipeline_swap:
            errors.append("--swap-min-gap is the gap of --pipeline-swap: add --pipeline-swap")
        elif args.swap_min_gap < 3:
            errors.append(
                "--swap-min-gap is at least 3 (one compute slot hides the copy to the host, "
                "another the copy back)"
            )
    if args.zero and args.dp == 1:
        errors.append(f"--zero {args.zero} shards over the data-parallel ranks: add --dp N")
    layers = MODELS[args.model.lower()].values["num_hidden_layers"]
    if args.pp > layers:
        errors.append(f"{args.model} has {layers} layers: --pp must be at most that")
    if args.stage_layers is not None:
        try:
            counts = [int(n) for n in args.stage_layers.split(",")]
        except ValueError:
            counts = []
        if not counts or min(counts) < 1 or sum(counts) != layers or len(counts) % args.pp:
            errors.append(
                f"--stage-layers gives the layers of each pipeline stage, first to last, "
                f"adding up to the {layers} layers of {args.model} (say "
                f"{_even_split(layers, args.pp)})"
            )
    return errors


def _even_split(layers: int, stages: int) -> str:
    base, extra = divmod(layers, stages)
    return ",".join(str(base + (1 if s < extra else 0)) for s in range(stages))


def run(args: argparse.Namespace) -> Any:
    """The report of ``recomp.plan.fit.will_it_fit`` for the command line ``args``."""
    from ..plan._specs import spec
    from ..plan.fit import will_it_fit
    from ..plan.job import Parallel, PipelineSwap

    model = spec(args.model)
    ep = (args.ep or args.tp) if model.moe else 1
    parallel = Parallel(
        dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=ep, zero=args.zero, sp=args.sp,
        loss_parallel=args.loss_parallel,
    )  # fmt: skip
    stage_layers = (
        None if args.stage_layers is None else [int(n) for n in args.stage_layers.split(",")]
    )
    hardware: Any = args.accelerator
    if args.host_bandwidth is not None:
        from dataclasses import replace

        from ..plan.cost import resolve_hardware

        link = args.host_bandwidth * 1e9 if args.host_bandwidth > 0 else None
        hardware = replace(resolve_hardware(args.accelerator), host_bandwidth=link)
    return will_it_fit(
        model.name,
        parallel,
        seq=args.seq,
        batch=args.batch,
        dtype=args.dtype,
        schedule=args.schedule,
        microbatches=args.microbatches,
        stage_layers=stage_layers,
        hardware=hardware,
        device_memory=args.device_memory,
        precision=args.precision,
        layers=args.layers or None,
        exclude_collectives=(
            False if args.replay_collectives else True if args.keep_collectives else "per-layer"
        ),
        pipeline_swap=(
            None
            if not args.pipeline_swap
            else PipelineSwap()
            if args.swap_min_gap is None
            else PipelineSwap(min_gap=args.swap_min_gap)
        ),
    )


def shown_ranks(ranks: list[int], totals: dict[int, int], all_ranks: bool) -> list[int]:
    """The pipeline ranks a strategy's rows show: all of few, else the first two, the
    largest and the last."""
    if all_ranks or len(ranks) <= SHOWN_RANKS:
        return ranks
    largest = max(ranks, key=lambda r: (totals[r], -r))
    return sorted({ranks[0], ranks[1], largest, ranks[-1]})


def table(report: Any, *, all_ranks: bool = False) -> str:
    """The report as text, at most ``WIDTH`` characters wide: a line per strategy and
    pipeline rank shown, then the notes."""
    pipeline = len({r.rank for r in report.rows}) > 1
    host = any(r.host for r in report.rows)
    header = ["strategy", *(["pp"] if pipeline else []), "act", "states", "total",
              *(["host"] if host else []), "TFLOP", "overhead", "fits"]  # fmt: skip
    cells: list[list[str]] = []
    hidden = False
    strategies = list(dict.fromkeys(r.strategy for r in report.rows))
    for strategy in strategies:
        rows = [r for r in report.rows if r.strategy == strategy]
        ranks = [r.rank for r in rows]
        shown = shown_ranks(ranks, {r.rank: r.total for r in rows}, all_ranks)
        hidden = hidden or len(shown) < len(ranks)
        for r in rows:
            if r.rank not in shown:
                continue
            cells.append(
                [
                    r.strategy,
                    *([str(r.rank)] if pipeline else []),
                    f"{r.activations / GiB:.2f}",
                    f"{r.states / GiB:.2f}",
                    f"{r.total / GiB:.2f}",
                    *([f"{r.host / GiB:.2f}"] if host else []),
                    f"{r.replay_flops / 1e12:.1f}",
                    "-" if r.overhead is None else f"+{r.overhead * 100:.1f}%",
                    "" if r.fits is None else ("yes" if r.fits else "NO"),
                ]
            )
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    # Two spaces between columns, one where that would pass the width.
    gap = "  " if sum(widths) + 2 * (len(widths) - 1) <= WIDTH else " "

    def line(row: list[str]) -> str:
        return gap.join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        ).rstrip()

    budget = "none" if report.budget_bytes is None else f"{report.budget_bytes / GiB:.4g} GiB"
    lines = [f"{report.model} on {report.hardware}, {budget} per device"]
    lines += wrapped(f"layout: {report.layout}", indent="  ")
    lines += [line(header), line(["-" * w for w in widths]), *map(line, cells)]
    explained = (
        "GiB per device. act: the activations at the step's peak on that pipeline rank "
        "(what the micro-batches in flight keep, with what a backward step holds for a "
        "while); states: parameters, gradients, optimizer states (and gathered parameters "
        "under ZeRO-3); TFLOP: what the replay repeats; overhead: its predicted time over "
        "the modelled step without checkpointing."
    )
    if host:
        explained += (
            " host: the host memory the activations swapped or offloaded there take at once "
            "(beside the device's total)."
        )
    if any(job.pipeline_swap is not None for job in report.jobs.values()):
        explained += (
            " Under pipeline swap act counts the micro-batches the schedule leaves room for "
            "on the host while they are there, host their copies."
        )
    if hidden:
        explained += " Per strategy the first two pipeline ranks, the largest and the last: "
        explained += "--all-ranks or --json for every one."
    lines += wrapped(explained)
    for note in report.notes:
        lines += wrapped(f"note: {note}", indent="  ")
    return "\n".join(lines)


def wrapped(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(
        text, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def write_png(path: str, report: Any) -> None:
    """Per strategy, the whole job's bytes per device (states and activations stacked,
    the worst pipeline rank) with the memory per device as a line, and the predicted
    overhead."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worst: dict[str, Any] = {}
    for r in report.rows:
        if r.strategy not in worst or r.total > worst[r.strategy].total:
            worst[r.strategy] = r
    names = list(worst)
    states = [worst[n].states / GiB for n in names]
    acts = [worst[n].activations / GiB for n in names]
    fig, (ax, ox) = plt.subplots(1, 2, figsize=(11, 4.5), width_ratios=[3, 2])
    ax.bar(names, states, color="#7f7f7f", label="parameters, gradients, optimizer")
    ax.bar(names, acts, bottom=states, color="#1f77b4", label="activations (peak)")
    if report.budget_bytes is not None:
        ax.axhline(report.budget_bytes / GiB, ls="--", color="#d62728", label="device memory")
    top = max([s + a for s, a in zip(states, acts)] + [(report.budget_bytes or 0) / GiB])
    ax.set_ylim(0, top * 1.35)  # room for the legend above the bars
    ax.set_ylabel("per device (GiB)")
    ax.set_title(f"{report.model}: memory per device (worst pipeline rank)")
    ax.legend(fontsize=8, loc="upper right")
    overheads = [(worst[n].overhead or 0.0) * 100 for n in names]
    ox.bar(names, overheads, color="#ff7f0e")
    ox.set_ylabel("predicted replay over the step (%)")
    ox.set_title(f"step overhead on {report.hardware}")
    for a in (ax, ox):
        a.tick_params(axis="x", rotation=40)
        for label in a.get_xticklabels():
            label.set_horizontalalignment("right")
        a.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------- recomp plan --simulate (old)


def from_plan_argv(argv: list[str]) -> list[str]:
    """``recomp plan --simulate MODEL ...``'s command line as ``recomp simulate``'s:
    the model as the first argument, ``--budget`` (the memory per device there) as
    ``--device-memory``."""
    out: list[str] = []
    model: list[str] = []
    rest = iter(argv)
    for arg in rest:
        if arg == "--simulate":
            value = next(rest, None)
            model = [] if value is None else [value]
        elif arg.startswith("--simulate="):
            model = [arg.split("=", 1)[1]]
        elif arg == "--budget":
            out.append("--device-memory")
        elif arg.startswith("--budget="):
            out.append("--device-memory=" + arg.split("=", 1)[1])
        else:
            out.append(arg)
    return model + out


DEPRECATED = (
    "recomp plan --simulate is deprecated and goes away in the next release: use "
    "`recomp simulate MODEL ...` (the same options; this --budget is its --device-memory)"
)
