"""``recomp bench``: run the strategies in child processes, print the table, write JSON/PNG."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from dataclasses import replace
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
from .report import (
    attach_predictions,
    evaluate_targets,
    plan_summary,
    table,
    targets_text,
    write_plot,
)
from .results import Report, Result, write_report

TORCH_STRATEGIES = ("none", "full", "sac", "torch-remat", "exclude-attn", "exclude-mlp")
COMPILED_STRATEGIES = ("none", "full", "sac", "exclude-attn")
MS_STRATEGIES = ("none", "full", "exclude-attn")
SCENARIO_MODEL = "recomp.bench.models:norm_matmul_silu"
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


def _plan_strategies(strategies: list[str]) -> list[str]:
    return [s for s in strategies if s.startswith("plan@")]


def _ms_supported(strategy: str) -> bool:
    return strategy in ("none", "full") or (
        strategy.startswith("exclude-") and not strategy.endswith("-offload")
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    base = config_from_args(args)
    if args.tp is not None:
        return _main_tensor_parallel(parser, args, base, argv)
    frameworks = ["torch", "mindspore"] if args.framework == "all" else [args.framework]
    plan: list[tuple[str, BenchConfig, list[str]]] = []
    notes: list[str] = []
    for fw in frameworks:
        if fw == "torch":
            eager = _split(args.strategies, _installed(TORCH_STRATEGIES, notes))
            # budget@F is PyTorch's compiled memory budget: compiled rows only.
            plan.append((fw, base, [s for s in eager if not s.startswith("budget@")]))
            if args.compile:
                compiled = replace(base, compile=args.compile)
                plan.append((fw, compiled, _split(args.strategies, COMPILED_STRATEGIES)))
        else:
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
            plan.append((fw, cfg, [s for s in wanted if _ms_supported(s)]))

    # Plans are made once, in a child process, so that every process runs the same plan.
    plan_info: dict[str, Any] = {}
    plan_job_list = []
    for i, (fw, cfg, strategies) in enumerate(plan):
        wanted = _plan_strategies(strategies) if fw == "torch" else []
        if wanted:
            job = Job(
                f"{fw}: profile and plan",
                {"kind": "plan", "framework": fw, "config": cfg.to_dict(), "strategies": wanted},
                3,
            )
            plan_job_list.append((i, job))

    measure_jobs: list[Job] = []
    time_jobs: list[Job] = []
    total_units = sum(j.units for _, j in plan_job_list)
    progress = Progress(total_units, enabled=not args.quiet)
    started = time.monotonic()
    offset = [0.0]
    if plan_job_list:
        run_jobs([j for _, j in plan_job_list], 1, progress, offset)
    for i, job in plan_job_list:
        fw, cfg, strategies = plan[i]
        if job.result is None:
            notes.append(f"{fw}: no plans: {job.error}")
            plan[i] = (fw, cfg, [s for s in strategies if not s.startswith("plan@")])
            continue
        made = job.result["plans"]
        unplanned = {s: p["error"] for s, p in made.items() if "error" in p}
        for s, error in unplanned.items():
            notes.append(f"{fw} {s}: {error}")
        good = {s: p for s, p in made.items() if "error" not in p}
        # Keyed as attach_predictions looks them up: eager plans by strategy, compiled
        # ones by row label and strategy.
        prefix = f"{row_label(fw, cfg.to_dict())} " if cfg.compile else ""
        plan_info.update(
            {prefix + s: {**p, "clock": job.result["clock"]} for s, p in good.items()}
        )
        extra = {**cfg.extra, "plans": good}
        plan[i] = (fw, replace(cfg, extra=extra), [s for s in strategies if s not in unplanned])

    for fw, cfg, strategies in plan:
        label = row_label(fw, cfg.to_dict())
        for s in strategies:
            measure_jobs.append(
                Job(
                    f"{label} {s}: memory, FLOPs, gradients",
                    {
                        "kind": "measure",
                        "framework": fw,
                        "config": cfg.to_dict(),
                        "strategies": [s],
                    },
                    2,
                )
            )
        if strategies:
            time_jobs.append(
                Job(
                    f"{label}: timing (interleaved)",
                    {
                        "kind": "time",
                        "framework": fw,
                        "config": cfg.to_dict(),
                        "strategies": strategies,
                        "overhead": label == "torch" and not args.no_overhead,
                    },
                    cfg.steps * len(strategies) // 2 + 2,
                )
            )
    scenario_cfg = replace(base, model=SCENARIO_MODEL)
    if "torch" in frameworks and not args.no_scenario and args.model == DEFAULT_MODEL:
        measure_jobs.append(
            Job(
                "torch scenario norm->matmul->silu",
                {
                    "kind": "measure",
                    "framework": "torch",
                    "config": scenario_cfg.to_dict(),
                    "strategies": list(_installed(SCENARIO_STRATEGIES, notes)),
                },
                3,
            )
        )

    progress.total = max(1, total_units + sum(j.units for j in measure_jobs + time_jobs))
    run_jobs(measure_jobs, args.jobs, progress, offset)
    run_jobs(time_jobs, 1, progress, offset)
    progress.close()

    results, scenario = _collect(plan, measure_jobs, time_jobs)
    attach_predictions(results, plan_info)
    overhead = next(
        (j.result["overhead"] for j in time_jobs if j.result and "overhead" in j.result), None
    )
    targets = evaluate_targets(results, scenario, overhead)
    elapsed = time.monotonic() - started

    print(table(results))
    if scenario:
        print("\nDeferred-input scenario (per layer: RMSNorm, excluded matmul `proj`, SiLU):")
        print(table(scenario))
    if overhead:
        print(
            f"\nWrapper overhead on a tiny op ({overhead['op']}): "
            f"{overhead['in_checkpoint_us']:.1f} us/call in a checkpointed step "
            f"(CPU time {overhead['in_checkpoint_cpu_us']:.1f} us), "
            f"{overhead['outside_us']:.1f} us/call outside a checkpoint "
            f"(the op itself: {overhead['plain_op_us']:.1f} us)"
        )
    plans_text = plan_summary(results)
    if plans_text:
        print("\nPlans (recomp.plan): predicted against measured")
        print(plans_text)
    print("\nTargets:")
    print(targets_text(targets))
    for note in notes:
        print("note: " + note)
    print(f"\n{len(results)} strategies in {elapsed:.0f} s")

    report = Report(
        command="recomp bench " + " ".join(sys.argv[2:] if argv is None else argv),
        environment=_environment(),
        elapsed_s=elapsed,
        results=results,
        scenario=scenario,
        overhead=overhead,
        targets=targets,
        notes=notes,
    )
    if args.json:
        write_report(args.json, report)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            write_plot(args.plot, results)
            print(f"wrote {args.plot}")
        except ImportError:
            print("no plot: matplotlib is not installed (pip install recomp[bench])")
    if args.report:
        from .memory_cli import write_strategy_reports

        for fw, cfg, strategies in plan:
            if not cfg.compile:
                for path in write_strategy_reports(args.report, cfg, strategies, fw):
                    print(f"wrote {path}")
    failed = [r for r in results + scenario if r.error is not None]
    return 1 if failed and len(failed) == len(results + scenario) else 0


def _main_tensor_parallel(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    base: BenchConfig,
    argv: list[str] | None,
) -> int:
    """``recomp bench --tp N``: the tensor + sequence parallel comparison only."""
    from . import tensor_parallel

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
        import json

        report = {
            "command": "recomp bench " + " ".join(sys.argv[2:] if argv is None else argv),
            "environment": _environment(),
            "tp": args.tp,
            "config": base.to_dict(),
            "rows": rows,
            "elapsed_s": elapsed,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _collect(
    plan: list[tuple[str, BenchConfig, list[str]]], measure_jobs: list[Job], time_jobs: list[Job]
) -> tuple[list[Result], list[Result]]:
    times: dict[str, dict[str, list[float]]] = {}
    cpu_times: dict[str, dict[str, list[float]]] = {}
    time_errors: dict[str, str] = {}
    for job in time_jobs:
        fw = row_label(job.task["framework"], job.task["config"])
        if job.result:
            times[fw] = job.result["times"]["wall"]
            cpu_times[fw] = job.result["times"]["cpu"]
        else:
            time_errors[fw] = job.error or "timing failed"
    results: list[Result] = []
    scenario: list[Result] = []
    for job in measure_jobs:
        target = scenario if job.task["config"]["model"] == SCENARIO_MODEL else results
        if job.result is None:
            for s in job.task["strategies"]:
                label = row_label(job.task["framework"], job.task["config"])
                target.append(Result(label, s, error=job.error or "?"))
            continue
        for row in job.result["results"]:
            r = Result.from_dict(row)
            fw, s = r.framework, r.strategy  # framework: the row label (torch+inductor)
            if target is results and r.error is None:
                samples = times.get(fw, {}).get(s)
                if samples:
                    r.set_step_times(samples, cpu_times[fw][s])
                elif fw in time_errors:
                    r.timing_error = time_errors[fw]
            target.append(r)
    return results, scenario


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
