"""Child-process entry point: ``python -m recomp.bench.worker TASK.json RESULT.json``.

A task is ``{"kind": "measure" | "time" | "plan", "framework": "torch" | "mindspore",
"config": {...}, "strategies": [...], "overhead": bool}``. Progress goes to stdout as
``PROGRESS <done> <total>`` lines; the result is written as JSON to RESULT.json.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

from .config import BenchConfig, row_label
from .results import Result


def _progress(done: int, total: int) -> None:
    print(f"PROGRESS {done} {total}", flush=True)


def run_task(task: dict[str, Any]) -> dict[str, Any]:
    config = BenchConfig.from_dict(task["config"])
    framework = task["framework"]
    strategies = list(task["strategies"])
    if framework == "torch":
        from . import runner as fw
    elif framework == "mindspore":
        from . import ms_runner as fw  # type: ignore[no-redef]
    else:
        raise ValueError(f"unknown framework {framework!r}")
    if task["kind"] == "measure":
        results = []
        for i, strategy in enumerate(strategies):
            try:
                result = fw.measure_strategy(config, strategy)
            except Exception as exc:
                traceback.print_exc()
                label = row_label(framework, task["config"])
                result = Result(label, strategy, error=f"{type(exc).__name__}: {exc}")
            results.append(result.to_dict())
            _progress(i + 1, len(strategies))
        return {"results": results}
    if task["kind"] == "plan":
        if framework != "torch":
            raise ValueError("plans are made for PyTorch models only")
        from .runner import make_plans

        return make_plans(config, strategies)
    if task["kind"] == "time":
        out: dict[str, Any] = {"times": fw.time_strategies(config, strategies, _progress)}
        if task.get("overhead") and framework == "torch":
            from .overhead import measure_overhead

            out["overhead"] = measure_overhead()
        return out
    raise ValueError(f"unknown task kind {task['kind']!r}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    task_path, result_path = args
    with open(task_path) as f:
        task = json.load(f)
    result = run_task(task)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
