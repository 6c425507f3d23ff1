"""The messages between the commands and their child processes (``recomp.cli.messages``):
each reads back as written, and what does not fit is refused with a message that names
the field (no framework needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import paths
from recomp.cli.config import BenchConfig
from recomp.cli.messages import (
    MeasureResult,
    MessageError,
    PlanResult,
    ProgressMessage,
    Task,
    TimingResult,
    result_from_json,
    result_to_json,
)
from recomp.cli.results import Result, WrapperOverhead
from recomp.cli.timing import StepTimes

SRC = str(paths.SRC)
CONFIG = BenchConfig(layers=1, hidden=32, heads=2, seq=16, batch=1, extra={"ms_model": "m:f"})


def test_task_round_trip():
    task = Task("time", "torch", CONFIG, ("none", "full"), overhead=True)
    again = Task.from_json(task.to_json())
    assert again == task
    assert isinstance(again.config, BenchConfig) and again.strategies == ("none", "full")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kind": "run"}, "field 'kind' must be one of measure, time, plan, got 'run'"),
        ({"framework": "jax"}, "field 'framework' must be one of torch, mindspore"),
        ({"strategies": "none"}, "field 'strategies' must be list"),
        ({"strategies": ["none", 3]}, "task strategies: expected a list of strings"),
        ({"overhead": 1}, "field 'overhead' must be bool, got int 1"),
        ({"config": {"layers": "2"}}, "task config: field 'layers' must be int, got str"),
        ({"config": {"layers": True}}, "task config: field 'layers' must be int, got bool"),
        ({"config": {"depth": 2}}, "task config: unknown fields 'depth'"),
        ({"extra": 1}, "task: unknown fields 'extra'"),
        ({"kind": "plan", "framework": "mindspore"}, "plans are made for PyTorch models only"),
        ({"kind": "measure", "overhead": True}, "overhead is timed by a PyTorch time task"),
    ],
)
def test_task_is_checked_on_read(change, message):
    data = {**Task("time", "torch", CONFIG, ("none",)).to_dict(), **change}
    with pytest.raises(MessageError, match=message):
        Task.from_json(json.dumps(data))


def test_task_missing_field_and_not_json():
    data = Task("measure", "torch", CONFIG, ("none",)).to_dict()
    del data["config"]
    with pytest.raises(MessageError, match="task: missing field 'config'"):
        Task.from_dict(data)
    with pytest.raises(MessageError, match="task: not JSON"):
        Task.from_json("{kind: measure")
    with pytest.raises(MessageError, match="task: expected a JSON object, got list"):
        Task.from_json("[]")


def test_progress_lines():
    line = ProgressMessage(2, 5).to_line()
    assert ProgressMessage.from_line(line + "\n") == ProgressMessage(2, 5)
    assert ProgressMessage.from_line(line).fraction == 0.4
    # What a library prints on the child's stdout is not a message.
    assert ProgressMessage.from_line("PROGRESS 1 2\n") is None
    assert ProgressMessage.from_line("[WARNING] something\n") is None
    with pytest.raises(MessageError, match="progress message: missing field 'total'"):
        ProgressMessage.from_line(ProgressMessage.PREFIX + '{"done": 1}')
    with pytest.raises(MessageError, match=r"done \(6\) must lie between 0 and total \(5\)"):
        ProgressMessage.from_line(ProgressMessage.PREFIX + '{"done": 6, "total": 5}')


def test_results_round_trip():
    rows = [
        Result("torch", "full", activation_bytes=10, config=CONFIG, region_runs={"a": 1}),
        Result("torch", "sac", error="ValueError: no"),
    ]
    overhead = WrapperOverhead("x * 1.5", 20, 3.0, 30.0, 3.1, 29.0, 5.0)
    made = PlanResult({"plan@50%": {"budget": "50%"}}, {"layers": []}, "cpu", {"plan@1%": "no"})
    results = [
        ("measure", MeasureResult(rows)),
        ("time", TimingResult(StepTimes({"full": [1.0, 2.0]}, {"full": [0.5, 1.5]}), overhead)),
        ("time", TimingResult(StepTimes({}, {}))),
        ("plan", made),
    ]
    for kind, result in results:
        assert result_from_json(kind, result_to_json(kind, result)) == result


def test_results_are_checked_on_read():
    timed = TimingResult(StepTimes({"full": [1.0]}, {"full": [1.0]}))
    text = result_to_json("time", timed)
    with pytest.raises(MessageError, match="expected the result of a measure task, got one of a time"):
        result_from_json("measure", text)
    with pytest.raises(MessageError, match="a time task returns a TimingResult"):
        result_to_json("time", MeasureResult([]))
    broken = json.loads(text)
    broken["wall"] = {"full": ["slow"]}
    with pytest.raises(MessageError, match=r"timing result wall\['full'\]: expected a list"):
        result_from_json("time", json.dumps(broken))
    broken = json.loads(text)
    broken["cpu"] = {"sac": [1.0]}
    with pytest.raises(MessageError, match="wall and cpu times name different strategies"):
        result_from_json("time", json.dumps(broken))
    rows = {"kind": "measure", "results": [{"strategy": "full"}]}
    with pytest.raises(MessageError, match="measure result row 0: missing field 'framework'"):
        result_from_json("measure", json.dumps(rows))
    plan = json.loads(result_to_json("plan", PlanResult({}, {}, "wall")))
    plan["clock"] = "sundial"
    with pytest.raises(MessageError, match="field 'clock' must be one of wall, cpu"):
        result_from_json("plan", json.dumps(plan))


def test_worker_refuses_a_bad_task_with_the_reason(tmp_path):
    task = tmp_path / "task.json"
    task.write_text(json.dumps({"kind": "run", "framework": "torch"}))
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "recomp.cli.worker", str(task), str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("recomp.cli.messages.MessageError: task: field 'kind'"), last
    assert not (tmp_path / "out.json").exists()
