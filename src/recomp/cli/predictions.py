"""A plan's predictions next to what was measured of it: ``recomp bench`` rows of
``plan@B`` strategies and ``recomp plan`` (no framework imports).

The plan's profile ran in another process, at another time: on a shared machine its
speed drifts. Step times are therefore compared as slowdowns over no checkpointing, the
predicted one against the one measured round by round in the same timing run
(``paired_ratio``)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from .results import PlanCheck, Result, find_result


def attach_predictions(results: list[Result], plans: dict[str, dict[str, Any]]) -> None:
    """Give each ``plan@B`` row its plan's budget, predictions and options (``plans``:
    plan files as dicts, by strategy, each with the ``clock`` it was profiled with;
    compiled plans by row label and strategy, ``"torch+inductor plan@50%"``)."""
    for r in results:
        key = r.strategy if r.framework == "torch" else f"{r.framework} {r.strategy}"
        made = plans.get(key)
        if made is None or not r.framework.startswith("torch"):
            continue
        predicted = made.get("predicted", {})
        r.plan = PlanCheck(
            budget=made.get("budget"),
            budget_bytes=made["budget_bytes"],
            options={layer["path"]: layer["option"] for layer in made["layers"]},
            predicted_activation_bytes=predicted.get("activation_bytes"),
            predicted_replay_flops=predicted.get("replay_flops"),
            predicted_step_time_s=predicted.get("step_ms", math.nan) / 1e3,
            profiled_baseline_step_s=predicted.get("baseline_step_ms", math.nan) / 1e3,
            predicted_replay_s=predicted.get("replay_ms", math.nan) / 1e3,
            clock=made.get("clock", "wall"),
        )
    none = find_result(results, "torch", "none")
    for r in results:
        p = r.plan
        if p is None or none is None or not p.profiled_baseline_step_s > 0:
            continue
        # The profile ran in another process, at another time: on a shared machine its
        # speed drifts. What is compared instead: the predicted slowdown over no
        # checkpointing against the one measured round by round in this timing run.
        predicted = 1 + p.predicted_replay_s / p.profiled_baseline_step_s
        measured = paired_ratio(r, none, p.clock)
        base = measured_step(none, p.clock)
        p.predicted_ratio_to_none = predicted
        if measured is not None:
            p.measured_ratio_to_none = measured
        if base:
            p.predicted_step_time_same_run_s = base * predicted


def measured_step(r: Result | None, clock: str) -> float | None:
    """``r``'s median step time in ``clock`` (``cpu`` or ``wall``), if it was timed."""
    if r is None:
        return None
    value = r.step_cpu_time_s if clock == "cpu" else r.step_time_s
    return value if isinstance(value, (int, float)) and not math.isnan(value) else None


def samples(r: Result, clock: str) -> list[float]:
    """``r``'s step times in ``clock``, round by round."""
    return list((r.step_cpu_times_s if clock == "cpu" else r.step_times_s) or [])


def paired_ratio(r: Result, other: Result, clock: str) -> float | None:
    """Median over timing rounds of ``r``'s step time over ``other``'s in the same round.
    The bench times the strategies interleaved, round by round: a drift of the machine's
    speed during the run cancels in each round's ratio, where it does not in a ratio of
    medians."""
    a, b = samples(r, clock), samples(other, clock)
    if not a or len(a) != len(b):
        return None
    return statistics.median(x / y for x, y in zip(a, b))
