"""The project's benchmark targets, judged from a ``recomp bench --json`` file.

``recomp bench`` reports what it measures and judges nothing; the targets below are this
project's own goals for recomp against the other checkpointing strategies, the verdicts
that the Benchmarks page (docs/benchmarks.md) quotes. Run::

    python benchmarks/targets.py benchmarks/bench.json             # a text list
    python benchmarks/targets.py benchmarks/plan.json --markdown   # the table for docs/benchmarks.md

Every file version ``recomp.cli.results.load_report`` reads works. Each target has an id
unique in a report (``"3a"``, ``"5 torch+inductor"``, ``"6b plan@50%"``), the measured
figures it was judged on, and a verdict: met, MISSED, or n/a where a strategy it needs
was not run. The exact relations among them (replay FLOPs of ``exclude:attn`` equal to
``full``'s minus the excluded FLOPs; one activation per layer less than ``keep:R`` in the
deferred-input scenario) are also asserted, exactly, by ``tests/cli/test_bench.py``.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from recomp.cli.predictions import measured_step, paired_ratio
from recomp.cli.results import Result, WrapperOverhead, find_result, load_report

VERDICTS = {None: "n/a", True: "met", False: "MISSED"}

#: The uniform strategies a plan is compared with.
UNIFORM = ("none", "full", "exclude:attn", "exclude:mlp")


@dataclass
class Target:
    """One target: ``id``, what it asks (``text``), the measured figures (``details``) and
    whether it was met (``ok``; ``None``: not judged)."""

    id: str
    text: str
    ok: bool | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return VERDICTS[self.ok]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def evaluate_targets(
    results: list[Result],
    scenario: list[Result] | None = None,
    overhead: WrapperOverhead | None = None,
) -> list[Target]:
    """The targets, each with the measured figures and met / MISSED / n/a (n/a: not
    judged, say because a strategy was not run)."""
    out: list[Target] = []
    full = find_result(results, "torch", "full")
    excl = find_result(results, "torch", "exclude:attn")
    sac = find_result(results, "torch", "sac:attn")
    remat = find_result(results, "torch", "torch-remat:attn")

    # 1. replay(exclude:attn) == replay(full) - excluded forward FLOPs, within 0.5 %.
    t1 = Target("1", "1 replay FLOPs: exclude:attn = full - excluded (0.5%)")
    if full and excl and full.replay_flops is not None:
        assert excl.excluded_flops is not None and excl.replay_flops is not None
        expected = full.replay_flops - excl.excluded_flops
        got = excl.replay_flops
        rel = abs(got - expected) / expected if expected else float("inf")
        t1.details.update(expected=expected, measured=got, relative_error=rel)
        t1.ok = rel <= 0.005
    out.append(t1)

    # 2a. activation memory of exclude:attn <= sac and torch-remat (within 2 %).
    t2 = Target("2a", "2a activation: exclude:attn <= sac, torch-remat (2%)")
    if excl:
        memory = {
            other.strategy: _ratio(excl.activation_bytes, other.activation_bytes)
            for other in (sac, remat)
            if other
        }
        if memory:
            t2.details["ratios"] = memory
            t2.ok = all(v is not None and v <= 1.02 for v in memory.values())
    out.append(t2)

    # 2b. deferred inputs: exclude keeps one activation per layer less than keep.
    t2b = Target("2b", "2b norm->excluded matmul->silu: one activation per layer less than keep")
    if scenario:
        ex = find_result(scenario, "torch", "exclude:proj")
        keep = find_result(scenario, "torch", "keep:proj")
        if ex and keep and ex.config and ex.num_layers:
            assert keep.activation_bytes is not None and ex.activation_bytes is not None
            cfg = ex.config
            one = cfg.batch * cfg.seq * cfg.hidden * 4
            per_layer = (keep.activation_bytes - ex.activation_bytes) / ex.num_layers / one
            t2b.details["activations_per_layer_saved"] = per_layer
            t2b.ok = abs(per_layer - 1.0) <= 0.02
    out.append(t2b)

    # 3a. step time of exclude:attn <= 1.02 x sac, torch-remat, and < full.
    t3 = Target("3a", "3a step time: exclude:attn <= 1.02 x sac, torch-remat; < full")
    if excl and excl.step_time_s:
        ratios = {
            other.strategy: excl.step_time_s / other.step_time_s
            for other in (sac, remat, full)
            if other and other.step_time_s
        }
        ok = all(v <= 1.02 for k, v in ratios.items() if k != "full")
        if "full" in ratios:
            ok = ok and ratios["full"] < 1.0
        t3.details["ratios"] = ratios
        t3.ok = ok if ratios else None
        # The same ratios in process CPU time: far less sensitive to other processes on
        # the machine than wall time (one intra-op thread per process by default).
        if excl.step_cpu_time_s:
            t3.details["cpu_time_ratios"] = {
                o.strategy: excl.step_cpu_time_s / o.step_cpu_time_s
                for o in (sac, remat, full)
                if o and o.step_cpu_time_s
            }
    out.append(t3)

    # 3b. wrapper overhead on a tiny op <= 30 us per call.
    t3b = Target("3b", "3b wrapper overhead on a tiny op <= 30 us/call")
    if overhead is not None:
        t3b.details.update(
            in_checkpoint_us=overhead.in_checkpoint_us,
            in_checkpoint_cpu_us=overhead.in_checkpoint_cpu_us,
            outside_us=overhead.outside_us,
        )
        t3b.ok = overhead.in_checkpoint_us <= 30.0
    out.append(t3b)
    out.append(_offload_target(results, full, sac, excl))
    out.extend(_compiled_targets(results))
    out.extend(_plan_targets(results))
    ids = [t.id for t in out]
    assert len(set(ids)) == len(ids), f"target ids repeat: {ids}"
    return out


def _offload_target(
    results: list[Result],
    full: Result | None,
    sac: Result | None,
    excl: Result | None,
) -> Target:
    """4. exclude-offload:attn: peak within 5 % of full; step time <= 1.03 x exclude:attn and
    below full and sac. Also the share of copy time hidden behind compute, estimated as
    1 - (step time added by offloading) / (copy time measured on the copy stream)."""
    t = Target(
        "4",
        "4 exclude-offload:attn: peak <= 1.05 x full; step <= 1.03 x exclude:attn, < full, sac",
    )
    off = find_result(results, "torch", "exclude-offload:attn")
    moved = off.offload if off else None
    if off is None or moved is None or not moved.host_bytes:
        return t  # not run, or nothing offloaded (CPU without the host-copy test mode)
    t.details["host_bytes_per_step"] = moved.host_bytes
    if not str(off.device or "").startswith("cuda"):
        # CPU host-copy test mode: the "host" copies live in the same memory, so there
        # is nothing to judge.
        t.details["note"] = "host-copy test mode on CPU, not judged"
        return t
    ok: list[bool] = []
    peak = _ratio(off.peak_bytes, full.peak_bytes) if full else None
    if peak is not None:
        t.details["peak_vs_full"] = peak
        ok.append(peak <= 1.05)
    step = off.step_time_s
    if step:
        ratios = {
            o.strategy: step / o.step_time_s for o in (excl, full, sac) if o and o.step_time_s
        }
        t.details["step_ratios"] = ratios
        ok += [v <= 1.03 if k == "exclude:attn" else v < 1.0 for k, v in ratios.items()]
        if excl and excl.step_time_s and moved.copy_s:
            added = max(0.0, step - excl.step_time_s)
            t.details["copy_ms_per_step"] = moved.copy_s * 1e3
            t.details["copy_hidden_share"] = max(0.0, 1.0 - added / moved.copy_s)
    if ok:
        t.ok = all(ok)
    return t


def _compiled_targets(results: list[Result]) -> list[Target]:
    """Target 5, per compiled backend: exclude:attn against SAC saving the same tensors
    (activation memory within 2 %, step time <= 1.02 x) and against full checkpointing."""
    out = []
    labels = sorted({r.framework for r in results if r.framework.startswith("torch+")})
    for label in labels:
        excl = find_result(results, label, "exclude:attn")
        sac = find_result(results, label, "sac:attn")
        full = find_result(results, label, "full")
        t = Target(
            f"5 {label}",
            f"5 {label}: exclude:attn activation = sac (2%), step <= 1.02 x sac, < full",
        )
        memory = _ratio(excl.activation_bytes, sac.activation_bytes) if excl and sac else None
        if excl and memory is not None:
            t.details["activation_ratio_sac"] = memory
            ok = abs(memory - 1.0) <= 0.02
            if full:
                t.details["activation_ratio_full"] = _ratio(
                    excl.activation_bytes, full.activation_bytes
                )
            times = {
                o.strategy: excl.step_time_s / o.step_time_s
                for o in (sac, full)
                if o and o.step_time_s and excl.step_time_s
            }
            if times:
                t.details["time_ratios"] = times
                ok = ok and times.get("sac:attn", 0.0) <= 1.02 and times.get("full", 0.0) < 1.0
            if excl.step_cpu_time_s:
                t.details["cpu_time_ratios"] = {
                    o.strategy: excl.step_cpu_time_s / o.step_cpu_time_s
                    for o in (sac, full)
                    if o and o.step_cpu_time_s
                }
            t.ok = ok
        out.append(t)
    return out


UNIFORM = ("none", "full", "exclude:attn", "exclude:mlp")


def _fits(o: Result, budget_bytes: int) -> bool:
    return o.error is None and o.activation_bytes is not None and o.activation_bytes <= budget_bytes


def _plan_targets(results: list[Result]) -> list[Target]:
    """Targets 6a to 6e of each ``plan@B`` row against the uniform strategies and every@k
    that fit the same budget (measured activation memory <= budget). Step times are
    compared as paired ratios (``paired_ratio``) in the clock the plan was profiled with
    (process CPU time for one thread on a CPU, wall time otherwise); ratios of medians are
    reported too."""
    out: list[Target] = []
    for r in results:
        p = r.plan
        if p is None or r.error is not None or r.activation_bytes is None:
            continue
        if r.framework != "torch":
            # A compiled plan is PyTorch's own budget aimed at bytes; its rows are
            # compared in the table, not against the eager targets.
            continue
        name = r.strategy
        clock = p.clock
        fitting = [
            o
            for o in results
            if o.framework == "torch" and o.strategy in UNIFORM and _fits(o, p.budget_bytes)
        ]
        every = [o for o in results if o.strategy.startswith("every@") and _fits(o, p.budget_bytes)]
        t = Target(f"6a {name}", f"6a {name} activation <= budget + 2%")
        t.details.update(
            measured=r.activation_bytes,
            budget=p.budget_bytes,
            ratio=r.activation_bytes / p.budget_bytes if p.budget_bytes else math.inf,
        )
        t.ok = r.activation_bytes <= p.budget_bytes * 1.02
        out.append(t)
        t = Target(f"6b {name}", f"6b {name} replay FLOPs <= fitting uniform strategies")
        if fitting and r.replay_flops is not None:
            replay = {o.strategy: o.replay_flops for o in fitting}
            t.details.update(replay=replay, plan=r.replay_flops)
            t.ok = all(v is not None and r.replay_flops <= v for v in replay.values())
        out.append(t)
        for label, others in (("6c", fitting), ("6e", every)):
            what = "fastest fitting uniform" if label == "6c" else "fitting every@k"
            t = Target(f"{label} {name}", f"{label} {name} step time <= 1.02 x {what}")
            paired: dict[str, float] = {}
            for o in others:
                ratio = paired_ratio(r, o, clock)
                if ratio is not None:
                    paired[o.strategy] = ratio
            if paired:
                t.details.update(clock=clock, ratios=paired)
                t.ok = max(paired.values()) <= 1.02
                medians = {}
                for o in others:
                    mine, theirs = measured_step(r, clock), measured_step(o, clock)
                    if mine and theirs:
                        medians[o.strategy] = mine / theirs
                t.details["ratios_of_medians"] = medians
            out.append(t)
        t = Target(
            f"6d {name}",
            f"6d {name} prediction: bytes within 5%, step time within 15% (CPU) / 5% (GPU)",
        )
        step = measured_step(r, clock)
        if p.predicted_activation_bytes and step:
            byte_err = r.activation_bytes / p.predicted_activation_bytes - 1
            time_err = step / p.predicted_step_time_s - 1
            t.details.update(bytes_error=byte_err, step_time_error=time_err)
            judged = time_err
            if p.measured_ratio_to_none is not None and p.predicted_ratio_to_none:
                # See attach_predictions: the slowdown over no checkpointing, same run.
                judged = p.measured_ratio_to_none / p.predicted_ratio_to_none - 1
                t.details.update(
                    predicted_ratio_to_none=p.predicted_ratio_to_none,
                    measured_ratio_to_none=p.measured_ratio_to_none,
                    step_time_error_same_run=judged,
                )
            tolerance = 0.05 if str(r.device or "cpu").startswith("cuda") else 0.15
            t.details["clock"] = clock
            t.ok = abs(byte_err) <= 0.05 and abs(judged) <= tolerance
        out.append(t)
    return out


def targets_text(targets: list[Target]) -> str:
    lines = []
    for t in targets:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in t.details.items())
        lines.append(f"  [{t.verdict:>6}] {t.text}" + (f": {shown}" if shown else ""))
    return "\n".join(lines)


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_short(x)}" for k, x in v.items()) + "}"
    return str(v)


def markdown_table(targets: list[Target]) -> str:
    """The verdicts as a Markdown table: target, verdict, the figures it was judged on."""
    lines = ["| target | verdict | measured |", "|---|---|---|"]
    for t in targets:
        shown = ", ".join(f"{k} = {_short(v)}" for k, v in t.details.items()) or "-"
        lines.append(f"| {t.text} | {t.verdict} | {shown} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Judge a recomp bench --json file against the project's targets."
    )
    parser.add_argument("paths", nargs="+", metavar="FILE.json")
    parser.add_argument("--markdown", action="store_true", help="a Markdown table")
    args = parser.parse_args(argv)
    for path in args.paths:
        report = load_report(path)
        targets = evaluate_targets(report.results, report.scenario, report.overhead)
        if len(args.paths) > 1:
            print(f"{path}:")
        print(markdown_table(targets) if args.markdown else targets_text(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
