"""``recomp plan``: profile a model, print the fastest plan that fits the budget, then run
it and print the measured activation memory and step time beside the predicted ones.

The profile and the measurements of the plan run in child processes
(``recomp.cli.worker``), as ``recomp bench``'s do, since allocator readings need a
process of their own. The planner itself, ``recomp.plan``, is a library below the
command line and imports nothing of it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from typing import Any

from ..plan.budget import TORCH_BUDGET_NOTE, parse_budget
from . import installs
from .args import CommandParser
from .config import (
    MODEL_PROTOCOL,
    BenchConfig,
    add_config_arguments,
    add_model_argument,
    config_from_args,
)
from .jobs import Job, Progress, run_jobs
from .messages import MeasureResult, PlanResult, Task, TimingResult
from .predictions import attach_predictions, paired_ratio
from .results import Result, write_json

PROG = "recomp plan"


def build_parser() -> CommandParser:
    p = CommandParser(
        prog=PROG,
        description=(
            "Choose per layer no checkpoint, full checkpoint, a checkpoint with some "
            "sub-modules excluded from the replay, a selective checkpoint that keeps the "
            "outputs of matmuls, attention and collectives, or a selective one with "
            "exclusions, and on a device with a host link what holds activations on the host "
            "(swap, offload, exclude-offload: an exclusion whose regions keep what they keep "
            "there), so that the predicted step time is least while the predicted "
            "activation memory fits the budget (plans within 1% of the step are ties, "
            "decided by fewer replay FLOPs, then bytes). Prints the plan, writes it as JSON, "
            "then runs it and prints measured beside predicted figures."
        ),
        epilog=MODEL_PROTOCOL
        + " Candidate regions: each layer's direct children that hold parameters (for a "
        "Hugging Face decoder layer: self_attn, mlp and the norms). The plan names layers and "
        "regions by their paths in the model (model.layers.0, self_attn), so "
        "recomp.plan.apply_plan(model, plan) applies it to a fresh model from the same factory.",
    )
    p.add_argument(
        "--budget",
        required=True,
        help="activation memory budget: a fraction between 0 and 1 (0.5) or a percentage "
        "(50%%) of the range between full checkpointing of every layer (0%%) and none "
        "(100%%), or bytes with a unit (6GiB, 512MiB, 123456B); a bare number above 1 is "
        "refused. " + TORCH_BUDGET_NOTE.replace("%", "%%"),
    )
    add_model_argument(
        p,
        "PyTorch model factory (default: the built-in Llama-style decoder; MODULE is "
        "looked for in the current directory too); a Hugging Face PreTrainedModel works as "
        "it is: see below",
    )
    p.add_argument("--json", metavar="PATH", help="write the plan here")
    p.add_argument("--profile-json", metavar="PATH", help="write the profile here")
    add_config_arguments(
        p,
        steps=4,
        steps_help="timed steps of the plan (and of none)",
        device_help="cpu or cuda[:N]",
    )
    p.add_argument(
        "--clock",
        choices=("auto", "wall", "cpu"),
        default="auto",
        help="time the profile with wall time or process CPU time (auto: CPU time for one "
        "thread on CPU, where it is steadier on a shared machine; wall time otherwise)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        choices=("inductor", "aot_eager"),
        metavar="BACKEND",
        help="plan for the model compiled with torch.compile(backend=BACKEND) (default "
        "inductor): the plan is PyTorch's partitioner at the activation_memory_budget that "
        "lands on --budget, whose percentage then runs from the least the partitioner keeps "
        "(0%%) to what it keeps by default (100%%); measured compiled, beside compiled none",
    )
    p.add_argument(
        "--keep",
        metavar="REGION[,REGION]",
        help="with --compile: children of each layer to keep whole, never recomputed (say "
        "attn); the partitioner's budget then trades only the rest",
    )
    p.add_argument("--no-measure", action="store_true", help="plan only; do not run the plan")
    p.add_argument(
        "--show-profile",
        action="store_true",
        help="also print the profile: per layer and candidate region, bytes, time, FLOPs",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--simulate",
        metavar="MODEL",
        help="deprecated: `recomp simulate MODEL` (will a published model fit?)",
    )
    return p


def simulating(argv: list[str]) -> bool:
    """Whether a command line is ``recomp plan --simulate MODEL ...`` (deprecated)."""
    return any(a == "--simulate" or a.startswith("--simulate=") for a in argv)


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if simulating(given):
        from .simulate import DEPRECATED, from_plan_argv
        from .simulate import main as simulate_main

        print(DEPRECATED, file=sys.stderr)
        return simulate_main(from_plan_argv(given))
    parser = build_parser()
    args = parser.parse_args(argv)
    config, strategy = plan_config(parser, args)
    if not installs.check(PROG, ["torch"]):
        return installs.EXIT_MISSING
    progress = Progress(3 if args.no_measure else 3 + 2 + args.steps + 2, not args.quiet)
    try:
        planned = profile_and_plan(config, strategy, progress)
        write_files(args, planned)
        rows = None if args.no_measure else measure_plan(config, planned, args.steps, progress)
    except PlanningFailed as exc:
        progress.close()
        absent = installs.missing_in(str(exc))
        if absent is not None:
            print(installs.install_line(PROG, absent, f"--model {args.model}"), file=sys.stderr)
            return installs.EXIT_MISSING
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        progress.close()
    show_plan(args, planned)
    return show_measurement(planned, rows)


class PlanningFailed(Exception):
    """No plan: the profile failed (exit code 1) or no plan meets the budget (2)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Planned:
    """The plan of strategy ``plan@BUDGET`` and the plan task that made it."""

    strategy: str
    made: PlanResult
    plan: Any  # recomp.plan.Plan

    @property
    def plan_dict(self) -> dict[str, Any]:
        return self.made.plans[self.strategy]


def plan_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[BenchConfig, str]:
    """The configuration to profile and the strategy ``plan@BUDGET`` (the parser exits
    on a budget it cannot read or on options that do not go together)."""
    try:
        budget = parse_budget(args.budget)
    except ValueError as exc:
        parser.error(str(exc))
    if args.keep and not args.compile:
        parser.error("--keep is for compiled plans (--compile); an eager plan chooses exclusions")
    extra: dict[str, Any] = {} if args.clock == "auto" else {"plan_clock": args.clock}
    if args.keep:
        extra["keep"] = [r.strip() for r in args.keep.split(",") if r.strip()]
    config = config_from_args(args, **extra)
    if args.compile:
        config = replace(config, compile=args.compile)
    return config, f"plan@{budget.text}"


def profile_and_plan(config: BenchConfig, strategy: str, progress: Progress) -> Planned:
    """Profile the model and make its plan in a child process."""
    from ..plan.planfile import load_plan

    job = Job("profile and plan", Task("plan", "torch", config, (strategy,)), 3)
    run_jobs([job], 1, progress)
    made = job.outcome(PlanResult)
    if made is None:
        raise PlanningFailed(f"profiling failed: {job.error}", 1)
    if strategy in made.errors:
        raise PlanningFailed(made.errors[strategy].split(": ", 1)[-1], 2)
    return Planned(strategy, made, load_plan(made.plans[strategy]))


def write_files(args: argparse.Namespace, planned: Planned) -> None:
    from ..plan.planfile import save_plan

    if args.json:
        save_plan(planned.plan, args.json)
    if args.profile_json:
        write_json(args.profile_json, planned.made.profile)


def show_plan(args: argparse.Namespace, planned: Planned) -> None:
    from ..plan.planner import Profile, plan_table, profile_table

    if args.show_profile:
        profile = planned.made.profile
        if profile.get("compiled"):
            print(json.dumps(profile, indent=1) + "\n")
        else:
            print(profile_table(Profile.from_dict(profile)) + "\n")
    print(plan_table(planned.plan))
    if args.json:
        print(f"wrote {args.json}")
        print(apply_hint(args.json, compiled=planned.plan.compiled is not None))


def apply_hint(path: str, compiled: bool) -> str:
    """How to apply the plan file just written, to a fresh model of the same factory."""
    call = (
        f"model = recomp.plan.compile_with_plan(model, {json.dumps(path)})"
        if compiled
        else f"recomp.plan.apply_plan(model, {json.dumps(path)})"
    )
    return f"apply it to a fresh model from the same factory: {call}"


def show_measurement(planned: Planned, rows: tuple[Result, Result] | str | None) -> int:
    """Measured beside predicted (nothing with ``--no-measure``); 1 if the plan failed."""
    if rows is None:
        return 0
    if isinstance(rows, str):
        print(f"{PROG}: running the plan failed: {rows}")
        return 1
    plan_row, none_row = rows
    print()
    if planned.plan.compiled:
        print(compiled_comparison(plan_row, none_row))
    else:
        print(comparison(plan_row, none_row))
    return 0


def measure_plan(
    config: BenchConfig, planned: Planned, steps: int, progress: Progress
) -> tuple[Result, Result] | str:
    """The plan's row and no checkpointing's, timed interleaved, with the plan's
    predictions attached; or why they could not be measured."""
    strategy = planned.strategy
    config = replace(config, extra={**config.extra, "plans": {strategy: planned.plan_dict}})
    measuring = Job("measure the plan", Task("measure", "torch", config, (strategy,)), 2)
    timed_task = Task("time", "torch", config, ("none", strategy))
    timing = Job("time the plan and none", timed_task, steps + 2)
    run_jobs([measuring], 1, progress)
    run_jobs([timing], 1, progress)
    measured, timed = measuring.outcome(MeasureResult), timing.outcome(TimingResult)
    if measured is None or timed is None:
        return str(measuring.error or timing.error)
    row = measured.results[0]
    if row.error is not None:
        return row.error
    none = Result(row.framework, "none")
    for r in (row, none):
        r.set_step_times(timed.times.wall[r.strategy], timed.times.cpu[r.strategy])
    key = f"{row.framework} {strategy}" if planned.plan.compiled else strategy
    attach_predictions([row, none], {key: {**planned.plan_dict, "clock": planned.made.clock}})
    return row, none


def compiled_comparison(row: Result, none: Result) -> str:
    """A compiled plan: predicted against measured memory, and its step time against the
    compiled model without a budget (timed interleaved in one run)."""
    p = row.plan
    assert p is not None, "compiled_comparison() needs a row with its plan attached"
    mib = float(1 << 20)
    predicted = p.predicted_activation_bytes
    measured = row.activation_bytes
    error = "-" if not predicted or measured is None else f"{(measured / predicted - 1) * 100:+.1f}%"
    ratio = paired_ratio(row, none, p.clock)
    flops = p.predicted_replay_flops
    return "\n".join(
        [
            f"{'':34}{'predicted':>12}{'measured':>12}{'error':>9}",
            f"{'activation memory (MiB)':34}{(predicted or 0) / mib:12.2f}"
            f"{(measured or 0) / mib:12.2f}{error:>9}",
            f"{'recompute over default (GFLOP)':34}"
            f"{'-' if flops is None else f'{flops / 1e9:.3f}':>12}{'-':>12}",
            f"step time over compiled none ({p.clock} clock): "
            + ("-" if ratio is None else f"{ratio:.3f}x")
            + " (median of per-round ratios, timed interleaved)",
            f"budget {p.budget_bytes / mib:.2f} MiB; compiled none keeps "
            f"{(none.activation_bytes or 0) / mib:.2f} MiB"
            if none.activation_bytes is not None
            else f"budget {p.budget_bytes / mib:.2f} MiB",
        ]
    )


def comparison(row: Result, none: Result) -> str:
    """Predicted against measured: activation memory, replay FLOPs, step time."""
    p = row.plan
    assert p is not None, "comparison() needs a row with its plan attached"
    clock = p.clock

    def step(r: Result) -> float:
        value = r.step_cpu_time_s if clock == "cpu" else r.step_time_s
        return math.nan if value is None else value

    def pct(measured: float | None, predicted: float | None) -> str:
        if measured is None or not predicted:
            return "-"
        return f"{(measured / predicted - 1) * 100:+.1f}%"

    def num(value: float | None, scale: float, digits: int) -> str:
        return f"{'-':>12}" if value is None else f"{value / scale:12.{digits}f}"

    mib = float(1 << 20)
    replay_error = (
        pct(row.replay_flops, p.predicted_replay_flops) if p.predicted_replay_flops else ""
    )
    lines = [
        f"{'':34}{'predicted':>12}{'measured':>12}{'error':>9}",
        f"{'activation memory (MiB)':34}{num(p.predicted_activation_bytes, mib, 2)}"
        f"{num(row.activation_bytes, mib, 2)}"
        f"{pct(row.activation_bytes, p.predicted_activation_bytes):>9}",
        f"{'replay (GFLOP)':34}{num(p.predicted_replay_flops, 1e9, 3)}"
        f"{num(row.replay_flops, 1e9, 3)}{replay_error:>9}",
        f"{f'step time, {clock} clock (ms)':34}{p.predicted_step_time_s * 1e3:12.1f}"
        f"{step(row) * 1e3:12.1f}{pct(step(row), p.predicted_step_time_s):>9}",
    ]
    if p.measured_ratio_to_none is not None and p.predicted_ratio_to_none is not None:
        predicted, measured = p.predicted_ratio_to_none, p.measured_ratio_to_none
        lines.append(
            f"{'  slowdown over no checkpointing':34}{predicted:11.3f}x{measured:11.3f}x"
            f"{pct(measured, predicted):>9}"
        )
    lines.append(
        "slowdown: the plan's step time over no checkpointing's, predicted from the profile, "
        "measured as the median of per-round ratios (the two are timed interleaved)"
    )
    wall_plan = math.nan if row.step_time_s is None else row.step_time_s
    wall_none = math.nan if none.step_time_s is None else none.step_time_s
    grad = math.nan if row.max_grad_diff is None else row.max_grad_diff
    lines.append(
        f"budget {p.budget_bytes / mib:.2f} MiB; no checkpointing in the same run: "
        f"{step(none) * 1e3:.1f} ms per step ({clock} clock), wall time: plan "
        f"{wall_plan * 1e3:.1f} ms, none {wall_none * 1e3:.1f} ms; "
        f"gradients differ from none by at most {grad:.1e}"
    )
    return "\n".join(lines)
