"""``recomp bench``: run the strategies in child processes, print the table, write JSON/PNG."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from typing import Any

from .config import DEFAULT_MODEL, BenchConfig, row_label
from .memory import child_env
from .report import (
    attach_predictions,
    evaluate_targets,
    plan_summary,
    table,
    targets_text,
    write_json,
    write_plot,
)

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
        help="PyTorch model factory MODULE:FACTORY (default: the built-in Llama-style decoder)",
    )
    p.add_argument("--ms-model", help="MindSpore model factory MODULE:FACTORY (a Cell)")
    p.add_argument("--layers", type=int, default=BenchConfig.layers)
    p.add_argument("--hidden", type=int, default=BenchConfig.hidden)
    p.add_argument("--heads", type=int, default=BenchConfig.heads)
    p.add_argument("--seq", type=int, default=BenchConfig.seq)
    p.add_argument("--batch", type=int, default=BenchConfig.batch)
    p.add_argument("--steps", type=int, default=BenchConfig.steps, help="timed steps per strategy")
    p.add_argument(
        "--ms-steps",
        type=int,
        help="timed steps for MindSpore (default: --steps, at most 5: a MindSpore step on CPU "
        "takes about five times as long as a PyTorch one)",
    )
    p.add_argument("--warmup", type=int, default=BenchConfig.warmup)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (PyTorch only)")
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
            "unless --strategies names others; their rows read torch+BACKEND"
        ),
    )
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
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
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


# --------------------------------------------------------------------------- progress


class Progress:
    """A plain-text progress bar on stderr (redrawn in place on a terminal)."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total = max(1, total)
        self.done = 0.0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()
        self.label = ""
        self._last_line = ""

    def update(self, done: float | None = None, label: str | None = None) -> None:
        if done is not None:
            self.done = min(done, self.total)
        if label is not None:
            self.label = label
        if not self.enabled:
            return
        frac = self.done / self.total
        width = 30
        fill = round(frac * width)
        elapsed = time.monotonic() - self.start
        text = (
            f"[{'#' * fill}{'.' * (width - fill)}] {frac * 100:5.1f}%  "
            f"{elapsed:5.0f}s  {self.label}"
        )
        if self.tty:
            sys.stderr.write("\r" + text[:110].ljust(110))
            sys.stderr.flush()
        elif self.label != self._last_line:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
            self._last_line = self.label

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


# --------------------------------------------------------------------------- child runs


class Job:
    def __init__(self, name: str, task: dict[str, Any], units: int) -> None:
        self.name = name
        self.task = task
        self.units = units
        self.done_units = 0.0
        self.result: dict[str, Any] | None = None
        self.error: str | None = None


def _run_jobs(jobs: list[Job], parallel: int, progress: Progress, offset: list[float]) -> None:
    """Run ``jobs`` as worker processes, ``parallel`` at a time, feeding the progress bar."""
    events: queue.Queue[tuple[Job, str]] = queue.Queue()
    pending = list(jobs)
    running: list[tuple[Job, subprocess.Popen[str], str]] = []
    tmp = tempfile.mkdtemp(prefix="recomp-bench-")

    def reader(job: Job, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            events.put((job, line))
        events.put((job, "\0EOF"))

    def total_done() -> float:
        return offset[0] + sum(j.done_units for j in jobs)

    finished = 0
    while pending or running:
        while pending and len(running) < max(1, parallel):
            job = pending.pop(0)
            task_path = os.path.join(tmp, f"{id(job)}-task.json")
            result_path = os.path.join(tmp, f"{id(job)}-result.json")
            with open(task_path, "w") as f:
                json.dump(job.task, f)
            err_path = result_path + ".err"
            err = open(err_path, "w")  # noqa: SIM115 - closed when the job ends
            proc = subprocess.Popen(
                [sys.executable, "-m", "recomp.bench.worker", task_path, result_path],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=child_env(job.task["config"]["threads"]),
            )
            err.close()
            running.append((job, proc, result_path))
            threading.Thread(target=reader, args=(job, proc), daemon=True).start()
            progress.update(total_done(), job.name)
        job, line = events.get()
        if line.startswith("PROGRESS"):
            _, done, total = line.split()
            job.done_units = job.units * int(done) / max(1, int(total))
            progress.update(total_done(), f"{job.name} {done}/{total}")
        elif line == "\0EOF":
            entry = next(e for e in running if e[0] is job)
            running.remove(entry)
            _, proc, result_path = entry
            code = proc.wait()
            job.done_units = job.units
            finished += 1
            if code == 0 and os.path.exists(result_path):
                with open(result_path) as f:
                    job.result = json.load(f)
            else:
                with open(result_path + ".err") as f:
                    tail = f.read().strip().splitlines()
                job.error = (tail[-1] if tail else f"exit code {code}")[:300]
            progress.update(total_done(), f"{job.name} done")
    offset[0] += sum(j.units for j in jobs)


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
    args = build_parser().parse_args(argv)
    base = BenchConfig(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq=args.seq,
        batch=args.batch,
        steps=args.steps,
        warmup=args.warmup,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        model=args.model,
    )
    frameworks = ["torch", "mindspore"] if args.framework == "all" else [args.framework]
    plan: list[tuple[str, BenchConfig, list[str]]] = []
    notes: list[str] = []
    for fw in frameworks:
        if fw == "torch":
            plan.append((fw, base, _split(args.strategies, _installed(TORCH_STRATEGIES, notes))))
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
        _run_jobs([j for _, j in plan_job_list], 1, progress, offset)
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
        plan_info.update({s: {**p, "clock": job.result["clock"]} for s, p in good.items()})
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
    _run_jobs(measure_jobs, args.jobs, progress, offset)
    _run_jobs(time_jobs, 1, progress, offset)
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

    report = {
        "command": "recomp bench " + " ".join(sys.argv[2:] if argv is None else argv),
        "environment": _environment(),
        "elapsed_s": elapsed,
        "results": results,
        "scenario": scenario,
        "overhead": overhead,
        "targets": targets,
        "notes": notes,
    }
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            write_plot(args.plot, results)
            print(f"wrote {args.plot}")
        except ImportError:
            print("no plot: matplotlib is not installed (pip install recomp[bench])")
    failed = [r for r in results + scenario if "error" in r]
    return 1 if failed and len(failed) == len(results + scenario) else 0


def _collect(
    plan: list[tuple[str, BenchConfig, list[str]]], measure_jobs: list[Job], time_jobs: list[Job]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from .runner_stats import summarize_times

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
    results: list[dict[str, Any]] = []
    scenario: list[dict[str, Any]] = []
    for job in measure_jobs:
        target = scenario if job.task["config"]["model"] == SCENARIO_MODEL else results
        if job.result is None:
            for s in job.task["strategies"]:
                label = row_label(job.task["framework"], job.task["config"])
                target.append({"framework": label, "strategy": s, "error": job.error or "?"})
            continue
        for r in job.result["results"]:
            fw, s = r["framework"], r["strategy"]  # framework: the row label (torch+inductor)
            if target is results and "error" not in r:
                samples = times.get(fw, {}).get(s)
                if samples:
                    median, spread = summarize_times(samples)
                    r.update(step_time_s=median, step_time_spread_s=spread, step_times_s=samples)
                    cpu = cpu_times[fw][s]
                    r.update(step_cpu_time_s=summarize_times(cpu)[0], step_cpu_times_s=cpu)
                else:
                    r.update(step_time_s=None, step_time_spread_s=None)
                    if fw in time_errors:
                        r["timing_error"] = time_errors[fw]
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
