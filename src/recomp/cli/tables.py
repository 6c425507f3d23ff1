"""The text tables of ``recomp bench``: one row per strategy, and the plans' predictions
against their measurements (no framework imports)."""

from __future__ import annotations

import math
from typing import Any

from .predictions import measured_step
from .results import Result

MiB = float(1 << 20)


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


COLUMNS = (
    ("framework", "framework"),
    ("strategy", "strategy"),
    ("loss", "loss"),
    ("act MiB", "activation"),
    ("peak MiB", "peak"),
    ("fwd GFLOP", "forward"),
    ("replay GFLOP", "replay"),
    ("excl GFLOP", "excluded"),
    ("runs/step", "runs"),
    ("host MiB/step", "host"),
    ("step ms", "time"),
    ("spread ms", "spread"),
    ("cpu ms", "cpu"),
    ("max grad diff", "grad"),
)


def _row(r: Result) -> list[str]:
    if r.error is not None:
        return [r.framework, r.strategy, "error"] + ["-"] * (len(COLUMNS) - 3)
    grad, loss = r.max_grad_diff, r.loss
    return [
        r.framework,
        r.strategy,
        "-" if loss is None else f"{loss:.5f}",
        _fmt_bytes(r.activation_bytes),
        _fmt_bytes(r.peak_bytes),
        _fmt_flops(r.forward_flops),
        _fmt_flops(r.replay_flops),
        _fmt_flops(r.excluded_flops),
        _runs(r),
        _fmt_bytes(None if r.offload is None else r.offload.host_bytes),
        _fmt_ms(r.step_time_s),
        _fmt_ms(r.step_time_spread_s),
        _fmt_ms(r.step_cpu_time_s),
        "-" if grad is None else f"{grad:.1e}",
    ]


def table(results: list[Result], markdown: bool = False) -> str:
    header = [c[0] for c in COLUMNS]
    rows = [_row(r) for r in results]
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
    errors = [f"  {r.framework} {r.strategy}: {r.error}" for r in results if r.error is not None]
    if errors:
        lines += ["errors:", *errors]
    return "\n".join(lines)


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
