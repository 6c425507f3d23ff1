"""Saved-tensor reports of a strategy, for ``recomp report`` and ``recomp bench --report``:
which framework's runner makes them, and the files ``--report DIR`` writes (no framework
imports here; the runners import theirs when called)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from .config import BenchConfig
from .plots import write_report_png

MINDSPORE_MODEL = "MindSpore decoder of recomp bench"

#: What the pictures mark as references: no checkpoint and full checkpointing.
REFERENCES = ("none", "full")


def reporter(framework: str, config: BenchConfig) -> tuple[Callable[[BenchConfig, str], Any], str]:
    """The report function of ``framework`` (``config, strategy -> report``) and the name
    of the model it reports on."""
    if framework == "torch":
        from .torch.runner import report_strategy

        return report_strategy, config.model
    from .mindspore.runner import report_strategy as report_mindspore

    return report_mindspore, MINDSPORE_MODEL


def write_strategy_reports(
    directory: str, config: BenchConfig, strategies: list[str], framework: str = "torch"
) -> list[str]:
    """For ``recomp bench --report``: ``report-<strategy>.txt`` and ``.png`` per strategy in
    ``directory`` (``report-mindspore-<strategy>`` for MindSpore); returns the paths
    written (no pictures without matplotlib)."""
    os.makedirs(directory, exist_ok=True)
    report_of, model = reporter(framework, config)
    prefix = "report-" if framework == "torch" else "report-mindspore-"
    references = {s: report_of(config, s) for s in REFERENCES}
    written = []
    for strategy in strategies:
        report = references[strategy] if strategy in references else report_of(config, strategy)
        stem = os.path.join(directory, prefix + re.sub(r"[^A-Za-z0-9_.-]+", "_", strategy))
        with open(stem + ".txt", "w") as f:
            f.write(f"strategy {strategy}, model {model}\n{report.format()}\n")
        written.append(stem + ".txt")
        if write_report_png(stem + ".png", report, strategy, references):
            written.append(stem + ".png")
    return written
