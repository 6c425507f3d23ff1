"""The project's benchmark targets, judged from ``recomp bench`` rows by
``benchmarks/targets.py`` (the command itself judges nothing)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys
from dataclasses import replace

import pytest

import paths
from recomp.cli.results import Offload, PlanCheck, Result, WrapperOverhead, load_report

ROOT = str(paths.ROOT)
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def _load_targets():
    spec = importlib.util.spec_from_file_location(
        "benchmark_targets", os.path.join(BENCHMARKS, "targets.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


targets_script = _load_targets()
evaluate_targets = targets_script.evaluate_targets


def _result(strategy: str, **kw) -> Result:
    base = {"activation_bytes": 100, "replay_flops": 0, "excluded_flops": 0, "step_time_s": 1.0}
    return Result("torch", strategy, **{**base, **kw})


def _overhead(in_checkpoint_us: float) -> WrapperOverhead:
    return WrapperOverhead("x * 1.5", 20, 2.0, in_checkpoint_us, 2.0, in_checkpoint_us, 4.0)


def test_target_verdicts():
    results = [
        _result("full", replay_flops=1000, step_time_s=1.2),
        _result("exclude:attn", replay_flops=600, excluded_flops=400, activation_bytes=101),
        _result("sac:attn", activation_bytes=100, step_time_s=0.99),
        _result("torch-remat:attn", activation_bytes=90, step_time_s=1.1),
    ]
    targets = {t.id: t for t in evaluate_targets(results, None, _overhead(31))}
    assert targets["1"].verdict == "met"
    assert targets["2a"].verdict == "MISSED"  # 101 / 90 > 1.02
    assert targets["2b"].verdict == "n/a"
    assert targets["3a"].verdict == "met"  # 1 / 0.99 <= 1.02, < full
    assert targets["3b"].verdict == "MISSED"
    assert {t.id: t for t in evaluate_targets(results, None, _overhead(29))}["3b"].ok
    results[1].replay_flops = 610
    assert evaluate_targets(results)[0].verdict == "MISSED"


def test_target_ids_are_unique_with_offload_compiled_and_plan_rows():
    """Offload, compiled and plan targets each have an id of their own (all three were
    labelled 4 once)."""
    plan = PlanCheck("50%", 100, {"layers.0": "full"}, 90, 0, 1.0, 1.0, 0.0, "wall")
    results = [
        _result("full", peak_bytes=100),
        _result("exclude:attn"),
        _result("exclude-offload:attn", offload=Offload(10, 10, 5, 0.1), device="cuda:0"),
        _result("plan@50%", plan=plan, activation_bytes=90),
        Result("torch+inductor", "exclude:attn", activation_bytes=100, step_time_s=1.0),
        Result("torch+inductor", "sac:attn", activation_bytes=100, step_time_s=1.0),
        Result("torch+aot_eager", "exclude:attn", activation_bytes=100, step_time_s=1.0),
        # A compiled plan of the same budget: its row has a plan too, but no eager target.
        Result("torch+inductor", "plan@50%", activation_bytes=90, step_time_s=1.0, plan=plan),
    ]
    targets = evaluate_targets(results)
    ids = [t.id for t in targets]
    assert len(ids) == len(set(ids)), ids
    labels = [t.text.split(":")[0].split()[0] for t in targets]
    assert labels.count("4") == 1  # the offload target only
    assert {"4", "5 torch+inductor", "5 torch+aot_eager", "6a plan@50%"} <= set(ids)
    assert {t.id: t.verdict for t in targets}["5 torch+inductor"] == "met"


def test_offload_target_is_judged_on_a_gpu_only():
    """Rows as ``measure_strategy`` gives them for exclude-offload:attn (see
    tests/torch/test_offload.py): on the CPU host bytes are shown, nothing is judged."""
    kept = 8192
    moved = Offload(host_bytes=kept, restored_bytes=kept, prefetched_bytes=0, copy_s=0.0)
    forced = _result("exclude-offload:attn", offload=moved, device="cpu", peak_bytes=1000)
    target = evaluate_targets([forced])[-1]
    assert target.id == "4" and target.details["host_bytes_per_step"] == kept
    assert target.verdict == "n/a"  # judged on a GPU only
    full = replace(forced, strategy="full", peak_bytes=forced.peak_bytes * 0.9)
    excl = replace(forced, strategy="exclude:attn", step_time_s=0.99)
    cuda = replace(forced, device="cuda:0", offload=replace(moved, copy_s=0.02))
    target = evaluate_targets([full, excl, cuda])[-1]
    assert target.details["peak_vs_full"] == pytest.approx(1 / 0.9)
    assert target.verdict == "MISSED"  # peak 1.11 x full, step not below full
    assert target.details["copy_hidden_share"] == pytest.approx(0.5)  # 10 ms added of 20 ms


def test_compiled_target_of_each_backend():
    """Compiled rows (``torch+aot_eager``, as tests/torch/test_compile.py measures them:
    no FLOPs) get target 5 of their backend, judged on activation memory and step time."""
    rows = [
        Result("torch+aot_eager", "sac:attn", activation_bytes=1000, step_time_s=1.0),
        Result("torch+aot_eager", "exclude:attn", activation_bytes=1010, step_time_s=1.01),
    ]
    target = {t.id: t for t in evaluate_targets(rows)}["5 torch+aot_eager"]
    assert target.details["activation_ratio_sac"] == pytest.approx(1.01)
    assert target.verdict == "met"
    rows[1].activation_bytes = 1030
    assert {t.id: t for t in evaluate_targets(rows)}["5 torch+aot_eager"].verdict == "MISSED"


@pytest.fixture(scope="module")
def plan_rows():
    """The rows of none, full, every@2 and plan@50% on a tiny model (measured in this
    process), with their plan, step times and activation bytes set as
    tests/plan/test_plan.py::test_bench_plan_predictions_and_summary sets them."""
    pytest.importorskip("torch")
    from recomp.cli.config import BenchConfig
    from recomp.cli.predictions import attach_predictions
    from recomp.cli.torch.runner import make_plans, measure_strategy

    cfg = BenchConfig(layers=2, hidden=32, heads=2, seq=16, batch=2, steps=1)
    made = make_plans(cfg, ["plan@50%"])
    cfg.extra["plans"] = made.plans
    rows = [measure_strategy(cfg, s) for s in ("none", "full", "every@2", "plan@50%")]
    # Three timing rounds; the machine slows down in the second: per-round ratios hold.
    for r, cpu in zip(rows, ((0.9, 1.8, 0.9), (1.2, 2.4, 1.2), (1.1, 2.2, 1.1), (1.0, 2.0, 1.0))):
        r.step_cpu_times_s, r.step_cpu_time_s = list(cpu), cpu[0]
        r.step_times_s, r.step_time_s = [t + 0.1 for t in cpu], cpu[0] + 0.1
    attach_predictions(rows, {"plan@50%": {**made.plans["plan@50%"], "clock": "cpu"}})
    budget = rows[3].plan.budget_bytes
    # Readings in this process are not a clean heap: put in figures that fit or do not.
    for r, nbytes in zip(rows, (3 * budget, budget // 4, 2 * budget, budget)):
        r.activation_bytes = nbytes
    return rows


def test_plan_targets(plan_rows):
    rows = copy.deepcopy(plan_rows)
    p = rows[3].plan
    targets = {t.id: t for t in evaluate_targets(rows)}
    assert targets["6a plan@50%"].verdict == "met"
    # full fits every budget: the plan replays no more than full
    replay = targets["6b plan@50%"]
    assert "full" in replay.details["replay"] and replay.verdict == "met"
    assert targets["6c plan@50%"].details["clock"] == "cpu"
    assert targets["6c plan@50%"].details["ratios"]["full"] == pytest.approx(1.0 / 1.2)
    assert targets["6e plan@50%"].verdict == "n/a"  # every@2 does not fit
    assert targets["6d plan@50%"].details["bytes_error"] == pytest.approx(
        p.budget_bytes / p.predicted_activation_bytes - 1
    )
    rows[3].activation_bytes = 2 * p.budget_bytes
    again = {t.id: t for t in evaluate_targets(rows)}
    assert again["6a plan@50%"].verdict == "MISSED"


@pytest.mark.parametrize("name", ["bench_v1.json", "bench_compile.json", "plan.json"])
def test_verdicts_of_committed_files_are_found_again_from_their_rows(name):
    """The files written while ``recomp bench`` still judged its runs recorded verdicts;
    the script finds the same ones from the rows alone."""
    path = os.path.join(BENCHMARKS, name)
    with open(path) as f:
        raw = json.load(f)
    report = load_report(path)
    targets = evaluate_targets(report.results, report.scenario, report.overhead)
    old = {t["target"]: t["verdict"] for t in raw["targets"]}
    judged = [t for t in targets if t.text in old]
    assert judged
    for t in judged:
        assert t.verdict == old[t.text], t.text


def test_script_writes_the_verdict_table(capsys):
    assert targets_script.main([os.path.join(BENCHMARKS, "bench.json"), "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["| target | verdict | measured |", "|---|---|---|"]
    assert any(line.startswith("| 1 replay FLOPs") and "| met |" in line for line in lines)
    assert any(line.startswith("| 3b wrapper overhead") for line in lines)


def test_readme_quotes_the_scripts_verdicts(capsys):
    """The verdict table on the Benchmarks page (docs/benchmarks.md) is what the script writes
    for bench.json."""
    targets_script.main([os.path.join(BENCHMARKS, "bench.json"), "--markdown"])
    table = capsys.readouterr().out.strip()
    with open(os.path.join(BENCHMARKS, os.pardir, "docs", "benchmarks.md")) as f:
        assert table in f.read()
