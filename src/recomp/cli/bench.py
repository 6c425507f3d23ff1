"""``recomp bench``: measure activation memory, replayed FLOPs and step time of
checkpointing strategies side by side, each measurement in a child process; print the
table, write JSON and a plot. It reports what it measured and judges nothing (the
project's own targets are judged from the JSON by ``benchmarks/targets.py``)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from .config import (
    DEFAULT_MODEL,
    MODEL_PROTOCOL,
    BenchConfig,
    add_config_arguments,
    config_from_args,
    row_label,
)
from .jobs import Job, Progress, run_jobs
from .messages import Framework, MeasureResult, PlanResult, Task, TimingResult
from .predictions import attach_predictions
from .results import Report, Result, WrapperOverhead, write_json, write_report
from .tables import plan_summary, table
from .timing import StepTimes

TORCH_STRATEGIES = ("none", "full", "sac", "torch-remat", "exclude-attn", "exclude-mlp")
COMPILED_STRATEGIES = ("none", "full", "sac", "exclude-attn")
MS_STRATEGIES = ("none", "full", "exclude-attn")
SCENARIO_MODEL = "recomp.cli.torch.models:norm_matmul_silu"
SCENARIO_STRATEGIES = ("full", "exclude-proj", "keep-proj", "sac-proj", "torch-remat-proj")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="recomp bench",
        description=(
            "Train a few steps of a model under several activation-checkpointing strategies "
            "and report, per strategy, activation memory, peak memory, forward and replay "
            "FLOPs, excluded-region runs, step time and the gradient difference to no "
            "checkpointing."
        ),
        epilog=MODEL_PROTOCOL
        + " Strategy exclude-R excludes the child R of every layer (attn also finds self_attn "
        "or attention; mlp also finds feed_forward or ffn).",
    )
    p.add_argument("--framework", choices=("torch", "mindspore", "all"), default="torch")
    p.add_argument(
        "--strategies",
        help=(
            "comma-separated; torch: none, full, sac[-R], torch-remat[-R], exclude-R, "
            "exclude-R-offload, keep-R, every@K (checkpoint every K-th layer), "
            "plan@BUDGET (recomp.plan; 50%%, 6GiB); "
            f"mindspore: none, full, exclude-R (default torch: {','.join(TORCH_STRATEGIES)}; "
            f"mindspore: {','.join(MS_STRATEGIES)})"
        ),
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="PyTorch model factory MODULE:FACTORY (default: the built-in Llama-style "
        "decoder); a Hugging Face PreTrainedModel works as it is: see below",
    )
    p.add_argument("--ms-model", help="MindSpore model factory MODULE:FACTORY (a Cell)")
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
            "(strategies: none, full, exclude-attn, and full:no-keep, exclude-attn:no-keep "
            "with exclude_collectives=False)"
        ),
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    base = config_from_args(args)
    if args.tp is not None:
        return run_tensor_parallel(parser, args, base, argv)
    notes: list[str] = []
    runs = plan_runs(args, base, notes)
    measured = run_benchmark(args, base, runs, notes)
    print_measured(measured)
    write_outputs(args, argv, measured)
    return exit_code(measured)


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


def _split(value: str | None, default: tuple[str, ...]) -> list[str]:
    if not value:
        return list(default)
    return [s.strip() for s in value.split(",") if s.strip()]


def _installed(default: tuple[str, ...], notes: list[str]) -> tuple[str, ...]:
    """The default PyTorch strategies without torch-remat's where it is not installed (it
    runs on PyTorch 2.14 only): one strategy that cannot start would fail the timing
    child, which runs every strategy, and so every row's step time."""
    if importlib.util.find_spec("torch_remat") is not None:
        return default
    note = "torch-remat is not installed (it needs PyTorch 2.14): its rows are left out"
    if note not in notes:
        notes.append(note)
    return tuple(s for s in default if not s.startswith("torch-remat"))


def _ms_supported(strategy: str) -> bool:
    return strategy in ("none", "full") or (
        strategy.startswith("exclude-") and not strategy.endswith("-offload")
    )


def _frameworks(args: argparse.Namespace) -> list[Framework]:
    return ["torch", "mindspore"] if args.framework == "all" else [args.framework]


def plan_runs(args: argparse.Namespace, base: BenchConfig, notes: list[str]) -> list[Run]:
    """The runs the options ask for: PyTorch eager (and compiled with ``--compile``),
    MindSpore with the strategies it supports."""
    runs: list[Run] = []
    for fw in _frameworks(args):
        if fw == "torch":
            eager = _split(args.strategies, _installed(TORCH_STRATEGIES, notes))
            # budget@F is PyTorch's compiled memory budget: compiled rows only.
            runs.append(Run(fw, base, [s for s in eager if not s.startswith("budget@")]))
            if args.compile:
                compiled = replace(base, compile=args.compile)
                runs.append(Run(fw, compiled, _split(args.strategies, COMPILED_STRATEGIES)))
            continue
        cfg = replace(
            base,
            device="cpu",
            steps=args.ms_steps or min(base.steps, 5),
            extra={"ms_model": args.ms_model} if args.ms_model else {},
        )
        wanted = _split(args.strategies, MS_STRATEGIES)
        skipped = [s for s in wanted if not _ms_supported(s)]
        if skipped:
            notes.append(f"mindspore: skipped {', '.join(skipped)} (PyTorch-only strategies)")
        runs.append(Run(fw, cfg, [s for s in wanted if _ms_supported(s)]))
    return runs


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


def print_measured(measured: Measured) -> None:
    print(table(measured.results))
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
        print("no plot: matplotlib is not installed (pip install recomp[bench])")
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
    strategies = _split(args.strategies, tensor_parallel.TP_STRATEGIES)
    try:
        tensor_parallel.check_config(base, args.tp, strategies)
    except ValueError as exc:
        parser.error(str(exc))
    return strategies
