"""``recomp bench``: measure activation memory, replayed FLOPs and step time of
checkpointing strategies side by side, each measurement in a child process; print the
table, write JSON and a plot. It reports what it measured and judges nothing (the
project's own targets are judged from the JSON by ``benchmarks/targets.py``)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from . import installs
from .args import CommandParser
from .config import (
    DEFAULT_MODEL,
    MODEL_PROTOCOL,
    BenchConfig,
    add_config_arguments,
    add_model_argument,
    config_from_args,
    row_label,
)
from .jobs import Job, Progress, run_jobs
from .messages import Framework, MeasureResult, PlanResult, Task, TimingResult
from .predictions import attach_predictions
from .results import Report, Result, WrapperOverhead, write_json, write_report
from .strategies import Strategy, help_text, parse, refused, renamed_note, strategy_list
from .tables import plan_summary, table, verdicts
from .timing import StepTimes

TORCH_STRATEGIES = ("none", "full", "sac:attn", "torch-remat:attn", "exclude:attn", "exclude:mlp")
COMPILED_STRATEGIES = ("none", "full", "sac:attn", "exclude:attn")
MS_STRATEGIES = ("none", "full", "exclude:attn")
SCENARIO_MODEL = "recomp.cli.torch.models:norm_matmul_silu"
SCENARIO_STRATEGIES = ("full", "exclude:proj", "keep:proj", "sac:proj", "torch-remat:proj")
PROG = "recomp bench"


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="recomp bench",
        description=(
            "Train a few steps of a model under several activation-checkpointing strategies "
            "and report, per strategy, activation memory, peak memory, forward and replay "
            "FLOPs, excluded-region runs, step time and the gradient difference to no "
            "checkpointing."
        ),
        epilog="Strategies (the names of recomp.plan's layer options where a plan file has "
        "one; R is a child of every layer, by name: attn also finds self_attn or attention, "
        "mlp also feed_forward or ffn; R+R names several): "
        + help_text()
        + ". Names of earlier versions (exclude-attn, sac-attn, full-swap-inputs, swap-mm, "
        "...) are still accepted. "
        + MODEL_PROTOCOL,
    )
    p.add_argument("--framework", choices=("torch", "mindspore", "all"), default="torch")
    p.add_argument(
        "--strategies",
        type=strategy_list,
        metavar="S[,S...]",
        help=(
            "comma-separated, see below (default PyTorch: "
            f"{','.join(TORCH_STRATEGIES)}; MindSpore, which runs none, full and "
            f"exclude:R: {','.join(MS_STRATEGIES)})"
        ),
    )
    add_model_argument(
        p,
        "PyTorch model factory (default: the built-in Llama-style decoder; MODULE is "
        "looked for in the current directory too); a Hugging Face PreTrainedModel works as "
        "it is: see below",
    )
    add_model_argument(p, "MindSpore model factory (a Cell)", name="--ms-model")
    add_config_arguments(
        p,
        steps=BenchConfig.steps,
        steps_help="timed steps per strategy",
        device_help="cpu or cuda[:N] (PyTorch only)",
    )
    p.add_argument(
        "--ms-steps",
        type=int,
        help="timed steps for MindSpore (default: --steps, at most 5: a MindSpore step on CPU "
        "takes about five times as long as a PyTorch one)",
    )
    p.add_argument("--warmup", type=int, default=BenchConfig.warmup)
    p.add_argument(
        "--dtype",
        default=BenchConfig.dtype,
        choices=("float32", "bfloat16", "float16"),
        help="parameter and input dtype (PyTorch only)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help=(
            "also run the PyTorch strategies under torch.compile with BACKEND (default "
            f"inductor; aot_eager needs no C++ compiler): {','.join(COMPILED_STRATEGIES)} "
            "unless --strategies names others; their rows read torch+BACKEND. Compiled, "
            "plan@B is a compiled plan (PyTorch's partitioner at the memory budget that "
            "lands on B) and budget@F runs PyTorch's activation_memory_budget=F (compiled "
            "rows only)"
        ),
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="memory/FLOP measurements run in parallel (timing never)",
    )
    p.add_argument("--no-scenario", action="store_true", help="skip the deferred-input scenario")
    p.add_argument("--no-overhead", action="store_true", help="skip the wrapper-overhead timing")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot")
    p.add_argument(
        "--report",
        metavar="DIR",
        help="write each eager strategy's saved-tensor report (recomp report) to "
        "DIR/report-STRATEGY.txt and .png (MindSpore: DIR/report-mindspore-STRATEGY.*)",
    )
    p.add_argument(
        "--tp",
        type=int,
        metavar="N",
        help=(
            "instead: the built-in decoder with DTensor tensor + sequence parallelism on N "
            "gloo processes (CPU); per strategy rank 0's activation memory, the bytes "
            "recomp keeps for collectives' results, and the collectives the replay runs "
            "(strategies: none, full, exclude:attn, and full+replay-collectives, "
            "full+replay-collectives+exclude:attn with exclude_collectives=False)"
        ),
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not installs.check(PROG, _needs(args)):
        return installs.EXIT_MISSING
    base = config_from_args(args)
    if args.tp is not None:
        return run_tensor_parallel(parser, args, base, argv)
    notes: list[str] = []
    given = args.strategies or []
    old = renamed_note(given)
    if old:
        notes.append(old)
    runs, refusals = plan_runs(args, base, notes)
    if refusals:
        parser.error("; ".join(refusals))
    measured = run_benchmark(args, base, runs, notes)
    absent = missing_package(measured)
    if absent is not None:
        print(installs.install_line(PROG, absent, f"--model {args.model}"), file=sys.stderr)
        return installs.EXIT_MISSING
    print_measured(measured)
    write_outputs(args, argv, measured)
    return exit_code(measured)


def _needs(args: argparse.Namespace) -> list[str]:
    """The packages the command line needs before anything runs: the frameworks it
    measures, and torch-remat where a strategy names it."""
    needs = [m for m in ("torch", "mindspore") if args.framework in (m, "all")]
    if args.tp is not None:
        needs = ["torch"]
    if any(s.kind == "torch-remat" for s in args.strategies or []):
        needs.append("torch_remat")
    return needs


@dataclass
class Run:
    """The strategies of one framework under one configuration (the compiled PyTorch
    rows are a run of their own)."""

    framework: Framework
    config: BenchConfig
    strategies: list[str]

    @property
    def label(self) -> str:
        """The framework column of its rows: ``torch``, ``torch+inductor``, ``mindspore``."""
        return row_label(self.framework, self.config.to_dict())


@dataclass
class Measured:
    """What a benchmark run measured: rows, scenario rows, the wrapper overhead, notes,
    and the runs as measured (plans in their configuration)."""

    runs: list[Run]
    results: list[Result]
    scenario: list[Result]
    overhead: WrapperOverhead | None
    notes: list[str]
    elapsed_s: float


# --------------------------------------------------------------------------- configuration


def _names(given: list[Strategy], default: tuple[str, ...]) -> list[str]:
    return [s.name for s in given] if given else list(default)


def _installed(default: tuple[str, ...], notes: list[str]) -> tuple[str, ...]:
    """The default PyTorch strategies without torch-remat's where it is not installed:
    one strategy that cannot start would fail the timing child, which runs every
    strategy, and so every row's step time."""
    if installs.installed("torch_remat"):
        return default
    note = (
        "torch-remat is not installed, its rows are left out: "
        + installs.INSTALLS["torch_remat"][1]
    )
    if note not in notes:
        notes.append(note)
    return tuple(s for s in default if parse(s).kind != "torch-remat")


def _frameworks(args: argparse.Namespace) -> list[Framework]:
    return ["torch", "mindspore"] if args.framework == "all" else [args.framework]


def plan_runs(
    args: argparse.Namespace, base: BenchConfig, notes: list[str]
) -> tuple[list[Run], list[str]]:
    """The runs the options ask for: PyTorch eager (and compiled with ``--compile``),
    MindSpore; and the strategies named that a run asked for cannot take (what to
    change, for the usage error). With ``--framework all`` the strategies that only
    PyTorch runs are left out of MindSpore's rows, with a note."""
    given: list[Strategy] = args.strategies or []
    runs: list[Run] = []
    refusals: list[str] = []
    for fw in _frameworks(args):
        if fw == "torch":
            eager = _names(given, _installed(TORCH_STRATEGIES, notes))
            # budget@F is PyTorch's compiled memory budget: compiled rows only.
            compiled_only = [s for s in given if refused(s, "eager") and not refused(s, "compiled")]
            if not args.compile:
                refusals += [refused(s, "eager") or "" for s in compiled_only]
            refusals += [
                why for s in given if s not in compiled_only and (why := refused(s, "eager"))
            ]
            runs.append(Run(fw, base, [s for s in eager if refused(parse(s), "eager") is None]))
            if args.compile:
                compiled = replace(base, compile=args.compile)
                names = _names(given, COMPILED_STRATEGIES)
                refusals += [why for s in given if (why := refused(s, "compiled"))]
                runs.append(Run(fw, compiled, names))
            continue
        cfg = replace(
            base,
            device="cpu",
            steps=args.ms_steps or min(base.steps, 5),
            extra={"ms_model": args.ms_model} if args.ms_model else {},
        )
        wanted = _names(given, MS_STRATEGIES)
        skipped = [s for s in wanted if refused(parse(s), "mindspore")]
        if skipped and args.framework == "all":
            notes.append(f"mindspore: skipped {', '.join(skipped)} (PyTorch-only strategies)")
        elif skipped:
            refusals.append(refused(parse(skipped[0]), "mindspore") or "")
        runs.append(Run(fw, cfg, [s for s in wanted if s not in skipped]))
    return runs, list(dict.fromkeys(refusals))


# --------------------------------------------------------------------------- running


def run_benchmark(
    args: argparse.Namespace, base: BenchConfig, runs: list[Run], notes: list[str]
) -> Measured:
    """Plans first (one child), then the measurements (``--jobs`` children at a time),
    then the timing (one child per run, never in parallel)."""
    started = time.monotonic()
    progress = Progress(1, enabled=not args.quiet)
    try:
        runs, plans = plan_in_child(runs, progress, notes)
        measure_jobs = measurement_jobs(runs)
        scenario = scenario_jobs(args, base, notes)
        time_jobs = timing_jobs(runs, overhead=not args.no_overhead)
        remaining = sum(j.units for j in measure_jobs + scenario + time_jobs)
        progress.total = max(1, round(progress.finished) + remaining)
        run_jobs(measure_jobs + scenario, args.jobs, progress)
        run_jobs(time_jobs, 1, progress)
    finally:
        progress.close()
    results = collect(measure_jobs, time_jobs)
    attach_predictions(results, plans)
    return Measured(
        runs=runs,
        results=results,
        scenario=[r for job in scenario for r in _rows(job)],
        overhead=_overhead(time_jobs),
        notes=notes,
        elapsed_s=time.monotonic() - started,
    )


def plan_in_child(
    runs: list[Run], progress: Progress, notes: list[str]
) -> tuple[list[Run], dict[str, dict[str, Any]]]:
    """Make the plans of the ``plan@B`` strategies once, in a child process, so that every
    process runs the same plan. Returns the runs with their plans in their configuration
    (strategies without a plan dropped, with a note) and the plans as
    ``attach_predictions`` looks them up."""
    jobs: dict[int, Job] = {}
    for i, run in enumerate(runs):
        wanted = [s for s in run.strategies if s.startswith("plan@")]
        if wanted and run.framework == "torch":
            task = Task("plan", run.framework, run.config, tuple(wanted))
            jobs[i] = Job(f"{run.framework}: profile and plan", task, 3)
    if not jobs:
        return runs, {}
    progress.total = sum(j.units for j in jobs.values())
    run_jobs(list(jobs.values()), 1, progress)
    planned = list(runs)
    plans: dict[str, dict[str, Any]] = {}
    for i, job in jobs.items():
        planned[i] = _with_plans(runs[i], job, plans, notes)
    return planned, plans


def _with_plans(run: Run, job: Job, plans: dict[str, dict[str, Any]], notes: list[str]) -> Run:
    made = job.outcome(PlanResult)
    if made is None:
        notes.append(f"{run.framework}: no plans: {job.error}")
        return replace(run, strategies=[s for s in run.strategies if not s.startswith("plan@")])
    for strategy, error in made.errors.items():
        notes.append(f"{run.framework} {strategy}: {error}")
    # Eager plans by strategy, compiled ones by row label and strategy.
    prefix = f"{run.label} " if run.config.compile else ""
    plans.update({prefix + s: {**p, "clock": made.clock} for s, p in made.plans.items()})
    config = replace(run.config, extra={**run.config.extra, "plans": made.plans})
    return Run(run.framework, config, [s for s in run.strategies if s not in made.errors])


def measurement_jobs(runs: list[Run]) -> list[Job]:
    """One child per strategy: memory, FLOPs and gradients."""
    return [
        Job(
            f"{run.label} {s}: memory, FLOPs, gradients",
            Task("measure", run.framework, run.config, (s,)),
            2,
        )
        for run in runs
        for s in run.strategies
    ]


def timing_jobs(runs: list[Run], overhead: bool) -> list[Job]:
    """One child per run that times all its strategies interleaved (the eager PyTorch one
    also the wrapper overhead)."""
    return [
        Job(
            f"{run.label}: timing (interleaved)",
            Task(
                "time",
                run.framework,
                run.config,
                tuple(run.strategies),
                overhead=overhead and run.label == "torch",
            ),
            run.config.steps * len(run.strategies) // 2 + 2,
        )
        for run in runs
        if run.strategies
    ]


def scenario_jobs(args: argparse.Namespace, base: BenchConfig, notes: list[str]) -> list[Job]:
    """The deferred-input scenario (built-in model only, unless ``--no-scenario``)."""
    if "torch" not in _frameworks(args) or args.no_scenario or args.model != DEFAULT_MODEL:
        return []
    config = replace(base, model=SCENARIO_MODEL)
    strategies = _installed(SCENARIO_STRATEGIES, notes)
    task = Task("measure", "torch", config, strategies)
    return [Job("torch scenario norm->matmul->silu", task, 3)]


def collect(measure_jobs: list[Job], time_jobs: list[Job]) -> list[Result]:
    """The rows of the measurements, each with its step times from its run's timing."""
    times: dict[str, StepTimes] = {}
    errors: dict[str, str] = {}
    for job in time_jobs:
        label = row_label(job.task.framework, job.task.config.to_dict())
        timed = job.outcome(TimingResult)
        if timed is None:
            errors[label] = job.error or "timing failed"
        else:
            times[label] = timed.times
    results = [r for job in measure_jobs for r in _rows(job)]
    for r in results:
        if r.error is not None:
            continue
        timed_run = times.get(r.framework)  # the row label (torch+inductor)
        samples = timed_run.wall.get(r.strategy) if timed_run else None
        if timed_run and samples:
            r.set_step_times(samples, timed_run.cpu[r.strategy])
        elif r.framework in errors:
            r.timing_error = errors[r.framework]
    return results


def _rows(job: Job) -> list[Result]:
    """A measurement's rows; error rows for its strategies if the child failed."""
    measured = job.outcome(MeasureResult)
    if measured is not None:
        return measured.results
    label = row_label(job.task.framework, job.task.config.to_dict())
    return [Result(label, s, error=job.error or "?") for s in job.task.strategies]


def _overhead(time_jobs: list[Job]) -> WrapperOverhead | None:
    for job in time_jobs:
        timed = job.outcome(TimingResult)
        if timed is not None and timed.overhead is not None:
            return timed.overhead
    return None


# --------------------------------------------------------------------------- output


def missing_package(measured: Measured) -> str | None:
    """The package every row failed for want of (the model factory imports it and it
    is not installed), if there is one: a table of error rows would only repeat it."""
    rows = measured.results + measured.scenario
    if not rows or any(r.error is None for r in rows):
        return None
    absent = {installs.missing_in(r.error or "") for r in rows}
    return absent.pop() if len(absent) == 1 else None


def print_measured(measured: Measured) -> None:
    print(table(measured.results))
    judged = verdicts(measured.results)
    if judged:
        print("\n" + judged)
    if measured.scenario:
        print("\nDeferred-input scenario (per layer: RMSNorm, excluded matmul `proj`, SiLU):")
        print(table(measured.scenario))
    overhead = measured.overhead
    if overhead:
        print(
            f"\nWrapper overhead on a tiny op ({overhead.op}): "
            f"{overhead.in_checkpoint_us:.1f} us/call in a checkpointed step "
            f"(CPU time {overhead.in_checkpoint_cpu_us:.1f} us), "
            f"{overhead.outside_us:.1f} us/call outside a checkpoint "
            f"(the op itself: {overhead.plain_op_us:.1f} us)"
        )
    plans_text = plan_summary(measured.results)
    if plans_text:
        print("\nPlans (recomp.plan): predicted against measured")
        print(plans_text)
    for note in measured.notes:
        print("note: " + note)
    print(f"\n{len(measured.results)} strategies in {measured.elapsed_s:.0f} s")


def write_outputs(args: argparse.Namespace, argv: list[str] | None, measured: Measured) -> None:
    """``--json``, ``--plot`` and ``--report DIR``."""
    if args.json:
        report = Report(
            command=_command(argv),
            environment=_environment(),
            elapsed_s=measured.elapsed_s,
            results=measured.results,
            scenario=measured.scenario,
            overhead=measured.overhead,
            notes=measured.notes,
        )
        write_report(args.json, report)
        print(f"wrote {args.json}")
    if args.plot:
        _write_plot(args.plot, measured.results)
    if args.report:
        from .saved_tensors import write_strategy_reports

        for run in measured.runs:
            if not run.config.compile:
                for path in write_strategy_reports(
                    args.report, run.config, run.strategies, run.framework
                ):
                    print(f"wrote {path}")


def _write_plot(path: str, results: list[Result]) -> None:
    from .plots import write_plot

    try:
        write_plot(path, results)
    except ImportError:
        print("no plot: matplotlib is not installed: " + installs.INSTALLS["matplotlib"][1])
        return
    print(f"wrote {path}")


def exit_code(measured: Measured) -> int:
    """1 if every row failed, else 0."""
    rows = measured.results + measured.scenario
    failed = [r for r in rows if r.error is not None]
    return 1 if failed and len(failed) == len(rows) else 0


def _command(argv: list[str] | None) -> str:
    return "recomp bench " + " ".join(sys.argv[2:] if argv is None else argv)


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    from importlib import metadata

    for dist in ("torch", "mindspore", "torch-remat", "recomp"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist] = None
    return env


# --------------------------------------------------------------------------- --tp


def run_tensor_parallel(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    base: BenchConfig,
    argv: list[str] | None,
) -> int:
    """``recomp bench --tp N``: the tensor + sequence parallel comparison only."""
    from .torch import tensor_parallel

    strategies = _tensor_parallel_strategies(parser, args, base)
    started = time.monotonic()
    if not args.quiet:
        print(f"recomp bench --tp {args.tp}: {len(strategies)} strategies...", file=sys.stderr)
    try:
        rows = tensor_parallel.run(base, strategies, args.tp)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    elapsed = time.monotonic() - started
    print(tensor_parallel.table(rows))
    print(
        f"\n{args.tp} gloo processes, tensor + sequence parallel (DTensor); rank 0's figures: "
        "activation memory from its allocator, kept for collectives from "
        "recomp.torch.collectives.kept_collective_bytes after the forward, replay comm = the "
        f"replayed collectives' input tensors; {elapsed:.0f} s"
    )
    if args.json:
        report = {
            "command": _command(argv),
            "environment": _environment(),
            "tp": args.tp,
            "config": base.to_dict(),
            "rows": rows,
            "elapsed_s": elapsed,
        }
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


def _tensor_parallel_strategies(
    parser: argparse.ArgumentParser, args: argparse.Namespace, base: BenchConfig
) -> list[str]:
    """The strategies of ``--tp`` (the parser exits on options it cannot run)."""
    from .torch import tensor_parallel

    others = [
        flag
        for flag, given in (
            ("--framework", args.framework != "torch"),
            ("--compile", bool(args.compile)),
            ("--plot", bool(args.plot)),
            ("--report", bool(args.report)),
        )
        if given
    ]
    if others:
        parser.error(f"--tp runs PyTorch's eager decoder only: drop {', '.join(others)}")
    strategies = _names(args.strategies or [], tensor_parallel.TP_STRATEGIES)
    try:
        tensor_parallel.check_config(base, args.tp, strategies)
    except ValueError as exc:
        parser.error(str(exc))
    return strategies
