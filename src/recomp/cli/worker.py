"""Child-process entry point: ``python -m recomp.cli.worker TASK.json RESULT.json``.

Reads a :class:`~recomp.cli.messages.Task`, runs it with the framework's runner
(``recomp.cli.torch.runner`` or ``recomp.cli.mindspore.runner``), prints
:class:`~recomp.cli.messages.ProgressMessage` lines on stdout as it goes and writes the
result to RESULT.json. SIGTERM (the parent stopping it) ends it as an exception would,
so that its own temporary files are removed on the way out.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

from .config import BenchConfig, row_label
from .messages import (
    MeasureResult,
    ProgressMessage,
    Task,
    TaskResult,
    TimingResult,
    result_to_json,
)
from .results import Result


def report_progress(done: int, total: int) -> None:
    print(ProgressMessage(done, total).to_line(), flush=True)


def _runner(framework: str) -> ModuleType:
    if framework == "torch":
        from .torch import runner
    else:
        from .mindspore import runner  # type: ignore[no-redef]
    return runner


def _measure_one(
    measure: Callable[[BenchConfig, str], Result], task: Task, strategy: str
) -> Result:
    """One strategy's row; an error row (with the traceback on stderr) if it fails."""
    try:
        return measure(task.config, strategy)
    except Exception as exc:
        traceback.print_exc()
        label = row_label(task.framework, task.config.to_dict())
        return Result(label, strategy, error=f"{type(exc).__name__}: {exc}")


def _measure(task: Task) -> MeasureResult:
    measure = _runner(task.framework).measure_strategy
    rows = []
    for i, strategy in enumerate(task.strategies):
        rows.append(_measure_one(measure, task, strategy))
        report_progress(i + 1, len(task.strategies))
    return MeasureResult(rows)


def _time(task: Task) -> TimingResult:
    runner = _runner(task.framework)
    times = runner.time_strategies(task.config, list(task.strategies), report_progress)
    if not task.overhead:
        return TimingResult(times)
    from .torch.overhead import measure_overhead

    return TimingResult(times, measure_overhead())


def run_task(task: Task) -> TaskResult:
    if task.kind == "measure":
        return _measure(task)
    if task.kind == "time":
        return _time(task)
    from .torch.runner import make_plans

    return make_plans(task.config, list(task.strategies))


def _exit_on_terminate(signum: int, frame: FrameType | None) -> Any:
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    task_path, result_path = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, _exit_on_terminate)
    with open(task_path) as f:
        task = Task.from_json(f.read())
    text = result_to_json(task.kind, run_task(task))
    # Written whole or not at all: a child stopped while writing leaves no half file.
    with open(result_path + ".part", "w") as f:
        f.write(text)
    os.replace(result_path + ".part", result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
