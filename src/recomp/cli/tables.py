"""The text tables of ``recomp bench``: one row per strategy, a verdict per strategy
against the alternatives, and the plans' predictions against their measurements (no
framework imports).

Step times are shown on one clock per table: process CPU time where the run is one
thread on the CPU (the machine may be shared: CPU time does not count the time other
processes take the core), wall time otherwise (:func:`clock_of`); the JSON keeps both.
A column with nothing in it (host bytes without offloading, FLOPs of compiled runs) is
left out, and the first step's loss, the same for every strategy when all is well, is
one line below the table instead of a column (or a flag naming those that differ).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .predictions import measured_step
from .results import Result
from .timing import summarize_times

MiB = float(1 << 20)

#: Relative difference of first-step losses below which they count as the same.
LOSS_TOLERANCE = 1e-4


def _fmt_bytes(v: Any) -> str:
    return "-" if v is None else f"{v / MiB:.2f}"


def _fmt_flops(v: Any) -> str:
    return "-" if v is None else f"{v / 1e9:.3f}"


def _fmt_ms(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 1e3:.1f}"


def _runs(r: Result) -> str:
    runs = r.region_runs or {}
    if not runs:
        calls = r.region_calls or {}
        if not calls:
            return "-"
        values = sorted(set(calls.values()))
        return "calls " + "/".join(str(v) for v in values)
    values = sorted(set(runs.values()))
    return "/".join(str(v) for v in values)


# --------------------------------------------------------------------------- clocks


def clock_of(results: list[Result]) -> str:
    """``cpu`` if every timed row ran one thread on the CPU, else ``wall``."""
    timed = [r for r in results if r.error is None and r.config is not None]
    if timed and all(r.config.device == "cpu" and r.config.threads == 1 for r in timed):  # type: ignore[union-attr]
        return "cpu"
    return "wall"


def step_time(r: Result, clock: str) -> tuple[float | None, float | None]:
    """Median step time and its spread (interquartile range) on ``clock``."""
    if clock == "wall":
        return r.step_time_s, r.step_time_spread_s
    if r.step_cpu_times_s:
        return summarize_times(r.step_cpu_times_s)
    return r.step_cpu_time_s, None


CLOCK_NAMES = {"cpu": "CPU time", "wall": "wall time"}


# --------------------------------------------------------------------------- the table


def _columns(clock: str) -> list[tuple[str, Callable[[Result], str]]]:
    def time_cell(r: Result) -> str:
        return _fmt_ms(step_time(r, clock)[0])

    def spread_cell(r: Result) -> str:
        return _fmt_ms(step_time(r, clock)[1])

    def grad_cell(r: Result) -> str:
        return "-" if r.max_grad_diff is None else f"{r.max_grad_diff:.1e}"

    return [
        ("act MiB", lambda r: _fmt_bytes(r.activation_bytes)),
        ("peak MiB", lambda r: _fmt_bytes(r.peak_bytes)),
        ("fwd GFLOP", lambda r: _fmt_flops(r.forward_flops)),
        ("replay GFLOP", lambda r: _fmt_flops(r.replay_flops)),
        ("excl GFLOP", lambda r: _fmt_flops(r.excluded_flops)),
        ("runs/step", _runs),
        ("host MiB/step", lambda r: _fmt_bytes(None if r.offload is None else r.offload.host_bytes)),
        (f"step ms ({'CPU' if clock == 'cpu' else 'wall'})", time_cell),
        ("spread ms", spread_cell),
        ("max grad diff", grad_cell),
    ]


def table(results: list[Result], markdown: bool = False) -> str:
    """One row per strategy; then the line on losses, the clock, and the errors."""
    clock = clock_of(results)
    measured = [r for r in results if r.error is None]
    columns = [
        (name, cell)
        for name, cell in _columns(clock)
        if any(cell(r) != "-" for r in measured)  # a column with nothing in it is left out
    ]
    header = ["framework", "strategy", *(name for name, _ in columns)]
    rows = [
        [r.framework, r.strategy]
        + (
            [cell(r) for _, cell in columns]
            if r.error is None
            else (["error"] + ["-"] * len(columns))[: len(columns)]
        )
        for r in results
    ]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    lines = [line(header), line(["-" * w for w in widths]), *map(line, rows)]
    lines += [text for text in (loss_line(measured), clock_line(measured, clock)) if text]
    errors = [f"  {r.framework} {r.strategy}: {r.error}" for r in results if r.error is not None]
    if errors:
        lines += ["errors:", *errors]
    return "\n".join(lines)


def loss_line(results: list[Result]) -> str:
    """``first-step loss 1.00000 in every row``, or the rows whose loss differs from the
    most common one (checkpointing must not change it)."""
    losses = [(r, r.loss) for r in results if r.loss is not None]
    if not losses:
        return ""
    values = [v for _, v in losses]
    common = max(values, key=lambda v: sum(_same(v, w) for w in values))
    differ = [f"{r.framework} {r.strategy} {v:.5f}" for r, v in losses if not _same(v, common)]
    if not differ:
        return f"first-step loss {common:.5f} in every row"
    return (
        f"LOSS DIFFERS from {common:.5f} (the first step's, the same for every strategy when "
        f"checkpointing changes nothing): {', '.join(differ)}"
    )


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=LOSS_TOLERANCE, abs_tol=1e-12)


def clock_line(results: list[Result], clock: str) -> str:
    if not any(step_time(r, clock)[0] is not None for r in results):
        return ""
    if clock == "cpu":
        return (
            "step: median of the timed steps in process CPU time (one thread on a CPU that "
            "other work may share: steadier than wall time); spread: interquartile range"
        )
    return "step: median of the timed steps in wall time; spread: interquartile range"


# --------------------------------------------------------------------------- verdicts


def verdicts(results: list[Result]) -> str:
    """One line per strategy against the alternatives in its run (``none`` and ``full``
    of the same framework label): its activation memory, its replayed work and its step
    time with the spread; empty if a run has neither to compare with."""
    clock = clock_of(results)
    labels = list(dict.fromkeys(r.framework for r in results))
    lines: list[str] = []
    for label in labels:
        rows = {r.strategy: r for r in results if r.framework == label and r.error is None}
        none, full = rows.get("none"), rows.get("full")
        if none is None and full is None:
            continue
        width = max(len(s) for s in rows)
        for name, r in rows.items():
            parts = _verdict(r, none, full, clock)
            if parts:
                prefix = f"{label} " if len(labels) > 1 else ""
                lines.append(f"  {prefix}{name.ljust(width)}  {'; '.join(parts)}")
    if not lines:
        return ""
    head = (
        "Against the alternatives (memory and step time against none, replayed work "
        f"against full; {CLOCK_NAMES[clock]}):"
    )
    return "\n".join([head, *lines])


def _verdict(r: Result, none: Result | None, full: Result | None, clock: str) -> list[str]:
    parts = []
    if r is none:
        parts.append("the reference: no checkpoint, nothing replayed")
    elif none is not None and r.activation_bytes is not None and none.activation_bytes:
        share = r.activation_bytes / none.activation_bytes
        parts.append(f"keeps {share:.0%} of none's activation memory")
    if r is not none and r.replay_flops is not None:
        if full is not None and full.replay_flops and r is not full:
            parts.append(f"replays {r.replay_flops / full.replay_flops:.0%} of full's work")
        elif r.replay_flops == 0:
            parts.append("replays nothing")
        elif r is full:
            parts.append(f"replays {_fmt_flops(r.replay_flops)} GFLOP per step")
    if r is not none and none is not None:
        parts.append(_time_verdict(r, none, clock))
    return [p for p in parts if p]


def _time_verdict(r: Result, none: Result, clock: str) -> str:
    t, spread = step_time(r, clock)
    t0, spread0 = step_time(none, clock)
    if t is None or t0 is None or not t0 or math.isnan(t) or math.isnan(t0):
        return ""
    change = t / t0 - 1
    noise = ((spread or 0.0) + (spread0 or 0.0)) / t0
    if math.isnan(noise):
        noise = 0.0
    versus = f"+{change:.0%} over" if change >= 0 else f"{-change:.0%} under"
    text = f"step {versus} none (spread ±{noise:.0%})"
    if abs(change) <= noise:
        text += ", within the spread"
    return text


# --------------------------------------------------------------------------- plans


def plan_summary(results: list[Result]) -> str:
    lines = []
    for r in results:
        p = r.plan
        if p is None or r.error is not None:
            continue
        assert r.activation_bytes is not None
        step = measured_step(r, p.clock)
        step_text = f"step {p.predicted_step_time_s * 1e3:.1f} ms predicted ({p.clock} clock), " + (
            "-" if step is None else f"{step * 1e3:.1f} ms measured"
        )
        if p.measured_ratio_to_none is not None and p.predicted_ratio_to_none is not None:
            step_text += (
                f"; over no checkpointing {p.predicted_ratio_to_none:.3f}x predicted, "
                f"{p.measured_ratio_to_none:.3f}x measured"
            )
        lines.append(
            f"  {r.strategy}: budget {p.budget_bytes / MiB:.2f} MiB; activation "
            f"{(p.predicted_activation_bytes or 0) / MiB:.2f} MiB predicted, "
            f"{r.activation_bytes / MiB:.2f} measured; replay "
            f"{(p.predicted_replay_flops or 0) / 1e9:.3f} GFLOP predicted, "
            f"{_fmt_flops(r.replay_flops)} measured; {step_text}"
        )
        options = ", ".join(f"{k}={v}" for k, v in p.options.items())
        lines.append(f"    {options}")
    return "\n".join(lines)
