"""Tests of ``recomp bench``'s measuring code: FLOP accounting, the memory reader, strategy
set-up, the JSON it writes, and the target verdicts. Tiny configurations only."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from recomp.bench.config import BenchConfig  # noqa: E402
from recomp.bench.memory import child_env  # noqa: E402
from recomp.bench.report import evaluate_targets, table  # noqa: E402
from recomp.bench.results import Result, load_report  # noqa: E402
from recomp.bench.runner_stats import summarize_times  # noqa: E402

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

TINY = BenchConfig(layers=2, hidden=32, heads=2, seq=16, batch=2, steps=2)
B, S, H, L = TINY.batch, TINY.seq, TINY.hidden, TINY.layers


def _intermediate() -> int:
    from recomp.bench.config import intermediate_size

    return intermediate_size(H)


def _mm(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


# Forward FLOPs of one layer of the built-in model, by PyTorch's conventions
# (matmuls and attention; causal masking not discounted).
ATTN_FLOPS = 4 * _mm(B * S, H, H) + 2 * _mm(B * S, S, H)
DOWN_FLOPS = _mm(B * S, _intermediate(), H)
MLP_FLOPS = 2 * _mm(B * S, H, _intermediate()) + DOWN_FLOPS
LAYER_FLOPS = ATTN_FLOPS + MLP_FLOPS


def _env() -> dict[str, str]:
    env = child_env(1)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_child(code: str, timeout: int = 120) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    """Every PyTorch strategy on the tiny configuration, in this process (FLOPs and
    gradients do not need a clean heap)."""
    from recomp.bench.runner import measure_strategy

    names = ["none", "full", "sac", "torch-remat", "exclude-attn", "exclude-mlp", "keep-attn"]
    if not HAVE_TORCH_REMAT:
        names.remove("torch-remat")
    return {s: measure_strategy(TINY, s) for s in names}


# torch-remat runs on PyTorch 2.14 only (on 2.13 and older it fails at import), and the
# environments of older PyTorch versions do not install it.
HAVE_TORCH_REMAT = importlib.util.find_spec("torch_remat") is not None
needs_torch_remat = pytest.mark.skipif(not HAVE_TORCH_REMAT, reason="torch-remat not installed")


# --------------------------------------------------------------------------- FLOPs


def test_forward_flops_match_the_model(measured):
    for r in measured.values():
        assert r.forward_flops == L * LAYER_FLOPS
        assert r.layer_forward_flops == L * LAYER_FLOPS


def test_cpu_attention_is_counted(measured):
    per_op = measured["none"].flops_by_op["forward"]
    attention = [v for k, v in per_op.items() if "scaled_dot_product" in k]
    assert attention == [L * 2 * _mm(B * S, S, H)]
    assert measured["none"].backward_flops > 2 * measured["none"].forward_flops - 1


def test_no_replay_without_checkpoint(measured):
    assert measured["none"].replay_flops == 0


def test_full_replays_the_layers_up_to_early_stop(measured):
    # torch.utils.checkpoint stops the replay once the last saved tensor is rebuilt:
    # the last matmul (down_proj) saved only its input, so it is not rerun.
    assert measured["full"].replay_flops == L * (LAYER_FLOPS - DOWN_FLOPS)


def test_full_replay_equals_layer_forward_without_early_stop():
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from recomp.bench.runner import measure_strategy

    with set_checkpoint_early_stop(False):
        r = measure_strategy(TINY, "full")
    assert r.replay_flops == r.layer_forward_flops == L * LAYER_FLOPS


def test_exclude_attn_replay_is_full_minus_excluded_exactly(measured):
    full, excl = measured["full"], measured["exclude-attn"]
    assert excl.excluded_flops == L * ATTN_FLOPS
    assert excl.replay_flops == full.replay_flops - excl.excluded_flops


def test_replay_attribution_agrees_with_recomp_state(measured):
    # Grad mode during backward (the bench's criterion) and recomp.is_recomputing()
    # must pick the same ops for recomp's checkpoints ...
    for name in ("exclude-attn", "exclude-mlp"):
        r = measured[name]
        assert r.replay_flops == r.replay_flops_recomp_state > 0
    # ... and recomp's state stays off under other libraries' checkpoints.
    assert measured["full"].replay_flops_recomp_state == 0


def test_kept_regions_are_not_replayed(measured):
    sac, keep = measured["sac"], measured["keep-attn"]
    assert sac.replay_flops == measured["exclude-attn"].replay_flops
    assert keep.replay_flops == measured["exclude-attn"].replay_flops
    assert measured["exclude-mlp"].replay_flops == L * ATTN_FLOPS


@needs_torch_remat
def test_torch_remat_replays_all_but_its_kept_region(measured):
    # torch-remat replays the whole layer body but the kept region (no early stop).
    assert measured["torch-remat"].replay_flops == L * (LAYER_FLOPS - ATTN_FLOPS)
    assert set(measured["torch-remat"].region_calls.values()) == {1}


def test_region_runs(measured):
    excl = measured["exclude-attn"]
    assert excl.region_runs == {f"layers.{i}.attn": 1 for i in range(L)}
    assert excl.region_skips == {f"layers.{i}.attn": 1 for i in range(L)}
    assert excl.region_calls == {f"layers.{i}.attn": 1 for i in range(L)}
    # SAC runs the region's Python code in the replay too (its ops come from a cache).
    assert set(measured["sac"].region_calls.values()) == {2}


# --------------------------------------------------------------------------- strategies


def test_every_strategy_gives_the_gradient_of_none(measured):
    for name, r in measured.items():
        assert r.max_grad_diff <= 1e-6, name


def test_strategy_names():
    from recomp.bench.strategies import parse

    assert parse("sac") == ("sac", "attn")
    assert parse("torch-remat-mlp") == ("torch-remat", "mlp")
    assert parse("exclude-proj") == ("exclude", "proj")
    with pytest.raises(ValueError, match="unknown strategy"):
        parse("exclude")
    with pytest.raises(ValueError, match="unknown strategy"):
        parse("selective")
    assert parse("budget@0.5") == ("budget", "0.5")


def test_torch_budget_strategy_is_compiled_only_and_checked():
    from recomp.bench.models import llama
    from recomp.bench.strategies import prepare

    with pytest.raises(ValueError, match="run it with --compile"):
        prepare("budget@0.5", llama(layers=1, hidden=32, heads=2))
    with pytest.raises(ValueError, match=r"a number in \[0, 1\], got '2'"):
        prepare("budget@2", llama(layers=1, hidden=32, heads=2), compiled=True)


def test_missing_region_is_reported():
    from recomp.bench.models import llama
    from recomp.bench.strategies import prepare

    with pytest.raises(ValueError, match="no child module 'moe'"):
        prepare("exclude-moe", llama(layers=1, hidden=32, heads=2))


def test_user_model_factory_gets_only_declared_options():
    from recomp.bench.config import call_factory, load_factory

    factory = load_factory("recomp.bench.models:norm_matmul_silu")
    model = call_factory(factory, BenchConfig(layers=3, hidden=16))
    assert len(model.layers) == 3 and model.hidden == 16
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        load_factory("recomp.bench.models")


# --------------------------------------------------------------------------- memory


def test_memory_reader_sees_a_known_tensor():
    sizes = [1 << 16, 1 << 20, 3 << 20]
    got = _run_child(
        f"""
        import json, torch
        from recomp.bench.memory import malloc_in_use
        torch.ones(1 << 12, dtype=torch.uint8)  # PyTorch 2.9's first tensor also sets up ~6 KB
        out = []
        for n in {sizes}:
            before = malloc_in_use()
            t = torch.ones(n, dtype=torch.uint8)
            during = malloc_in_use()
            del t
            after = malloc_in_use()
            out.append([during - before, after - before])
        print(json.dumps(out))
        """
    )
    for n, (held, left) in zip(sizes, got):
        assert abs(held - n) <= 4096 + n // 100, (n, held)
        assert abs(left) <= 4096, (n, left)


def test_activation_readings_count_kept_tensors():
    # Scenario model: each layer is silu(norm(x) @ W); one activation is B*S*H*4 bytes.
    # full keeps the layer inputs and the output (L activations); exclude-proj adds the
    # matmul output per layer; keep-proj (no deferred inputs) also the norm output.
    cfg = BenchConfig(
        layers=4, hidden=256, seq=256, batch=2, model="recomp.bench.models:norm_matmul_silu"
    )
    got = _run_child(
        f"""
        import json
        from recomp.bench.config import BenchConfig
        from recomp.bench.runner import measure_strategy
        cfg = BenchConfig.from_dict({cfg.to_dict()!r})
        print(json.dumps({{s: measure_strategy(cfg, s).activation_bytes
                          for s in ("full", "exclude-proj", "keep-proj")}}))
        """
    )
    one = cfg.batch * cfg.seq * cfg.hidden * 4
    a = {k: v / one for k, v in got.items()}
    # Beyond the tensors (512 KiB each): per checkpoint and per excluded call, a saved
    # CPU RNG state (5 KiB) and Python objects.
    assert 4 <= a["full"] <= 4.1, a
    assert a["exclude-proj"] - a["full"] == pytest.approx(4, abs=0.1), a
    assert a["keep-proj"] - a["exclude-proj"] == pytest.approx(4, abs=0.1), a


# --------------------------------------------------------------------------- output


FIELDS = {
    "framework",
    "strategy",
    "activation_bytes",
    "peak_bytes",
    "forward_flops",
    "replay_flops",
    "excluded_flops",
    "step_time_s",
    "step_time_spread_s",
    "max_grad_diff",
    "region_runs",
    "config",
}


def _bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    size = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recomp",
            "bench",
            *size,
            "--steps",
            "2",
            "--no-overhead",
            "--no-scenario",
            "--quiet",
            "--json",
            str(out),
            "--plot",
            str(png),
            *args,
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(out.read_text())
    assert "strategy" in proc.stdout and "Targets" in proc.stdout
    return report


def test_json_schema_torch(tmp_path):
    report = _bench(tmp_path, "--strategies", "none,full,exclude-attn")
    results = report["results"]
    assert [r["strategy"] for r in results] == ["none", "full", "exclude-attn"]
    for r in results:
        assert r.keys() >= FIELDS, FIELDS - r.keys()
        assert r["framework"] == "torch"
        assert r["config"]["hidden"] == 32 and r["config"]["layers"] == 1
        assert r["step_time_s"] > 0 and len(r["step_times_s"]) == 2
        assert r["activation_bytes"] > 0 and r["peak_bytes"] > 0
    none, full, excl = results
    assert full["activation_bytes"] < excl["activation_bytes"] < none["activation_bytes"]
    assert excl["region_runs"] == {"layers.0.attn": 1}
    assert {t["verdict"] for t in report["targets"]} <= {"met", "MISSED", "n/a"}
    ids = [t["id"] for t in report["targets"]]
    assert len(ids) == len(set(ids)) and report["version"] == 2
    # The file reads back into the same typed report.
    again = load_report(tmp_path / "bench.json")
    assert again.to_dict() == report
    assert [r.strategy for r in again.results] == ["none", "full", "exclude-attn"]


def _mindspore_ready() -> bool:
    if importlib.util.find_spec("mindspore") is None:
        return False
    try:
        import recomp.mindspore  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _mindspore_ready(), reason="recomp.mindspore not importable")
def test_json_schema_mindspore(tmp_path):
    report = _bench(tmp_path, "--framework", "mindspore")
    results = report["results"]
    assert [r["strategy"] for r in results] == ["none", "full", "exclude-attn"]
    for r in results:
        assert r.keys() >= FIELDS, r
        assert r["framework"] == "mindspore"
        assert r["forward_flops"] is None  # not counted for MindSpore
        assert r["max_grad_diff"] <= 1e-6
    none, full, excl = results
    assert full["activation_bytes"] < excl["activation_bytes"] < none["activation_bytes"]
    assert excl["region_runs"] == {"layers.0.attn": 1}


def test_import_recomp_and_cli_stay_framework_free():
    code = (
        "import sys, recomp, recomp.__main__, recomp.bench.cli;"
        "print(sorted(m for m in ('torch', 'mindspore') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# --------------------------------------------------------------------------- report


def _result(strategy: str, **kw) -> Result:
    base = {"activation_bytes": 100, "replay_flops": 0, "excluded_flops": 0, "step_time_s": 1.0}
    return Result("torch", strategy, **{**base, **kw})


def test_target_verdicts():
    results = [
        _result("full", replay_flops=1000, step_time_s=1.2),
        _result("exclude-attn", replay_flops=600, excluded_flops=400, activation_bytes=101),
        _result("sac", activation_bytes=100, step_time_s=0.99),
        _result("torch-remat", activation_bytes=90, step_time_s=1.1),
    ]
    targets = {
        t.id: t for t in evaluate_targets(results, None, {"in_checkpoint_us": 31, "outside_us": 2})
    }
    assert targets["1"].verdict == "met"
    assert targets["2a"].verdict == "MISSED"  # 101 / 90 > 1.02
    assert targets["2b"].verdict == "n/a"
    assert targets["3a"].verdict == "met"  # 1 / 0.99 <= 1.02, < full
    assert targets["3b"].verdict == "MISSED"
    results[1].replay_flops = 610
    assert evaluate_targets(results)[0].verdict == "MISSED"


def test_table_lists_errors_below():
    text = table([_result("full"), Result("torch", "sac", error="Boom: x")])
    assert "torch sac: Boom: x" in text


def test_summarize_times():
    assert summarize_times([3.0, 1.0, 2.0]) == (2.0, 2.0)
    median, spread = summarize_times([1.0, 2.0, 3.0, 4.0, 100.0])
    assert median == 3.0 and 0 < spread < 99


# --------------------------------------------------------------------------- JSON files

BENCHMARKS = os.path.join(os.path.dirname(SRC), "benchmarks")


@pytest.mark.parametrize("name", ["bench.json", "bench_compile.json", "plan.json"])
def test_committed_version_1_files_are_read(name):
    """The files written before results were typed (no version, targets without ids,
    rows with only the keys their measurement filled in) read into the typed report, and
    the report code works on them as on a fresh run."""
    path = os.path.join(BENCHMARKS, name)
    with open(path) as f:
        raw = json.load(f)
    assert "version" not in raw
    report = load_report(path)
    assert len(report.results) == len(raw["results"])
    for r, row in zip(report.results, raw["results"]):
        assert (r.framework, r.strategy) == (row["framework"], row["strategy"])
        assert r.activation_bytes == row["activation_bytes"]
        assert r.replay_flops == row.get("replay_flops")
        assert r.step_times_s == row.get("step_times_s")
        assert r.config is not None and r.config.layers == row["config"]["layers"]
        # What a version-1 row holds comes back unchanged in version 2 (its configuration
        # gains the fields added since, at their defaults).
        again = r.to_dict()
        assert {k: again[k] for k in row if k != "config"} == {
            k: v for k, v in row.items() if k != "config"
        }
        assert {k: again["config"][k] for k in row["config"]} == row["config"]
    assert [t.text for t in report.targets] == [t["target"] for t in raw["targets"]]
    assert table(report.results)
    # The verdicts of the old file are found again from its own rows.
    targets = evaluate_targets(report.results, report.scenario, report.overhead)
    old = {t["target"]: t["verdict"] for t in raw["targets"]}
    for t in targets:
        if t.text in old:
            assert t.verdict == old[t.text], t.text
    if name == "plan.json":
        planned = [r for r in report.results if r.plan is not None]
        assert planned and all(r.plan.budget_bytes > 0 for r in planned)


def test_report_version_2_round_trip_and_unknown_versions(tmp_path):
    from recomp.bench.results import Offload, Report, ReportFormatError, write_report

    rows = [
        _result("full", config=TINY, offload=None, region_runs={"layers.0.attn": 1}),
        _result("exclude-attn-offload", offload=Offload(10, 10, 5, 0.25), device="cuda:0"),
        Result("mindspore", "sac", error="ValueError: no"),
    ]
    report = Report("recomp bench", {"python": "3"}, 1.5, rows, [], None, [], ["a note"])
    path = tmp_path / "r.json"
    write_report(path, report)
    again = load_report(path)
    assert again == report
    data = json.loads(path.read_text())
    assert data["version"] == 2
    assert data["results"][2] == {
        "framework": "mindspore",
        "strategy": "sac",
        "error": "ValueError: no",
    }
    data["version"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(ReportFormatError, match="version 3"):
        load_report(path)


def test_target_ids_are_unique_with_offload_compiled_and_plan_rows():
    """Offload, compiled and plan targets each have an id of their own (all three were
    labelled 4 once)."""
    from recomp.bench.results import Offload, PlanCheck

    plan = PlanCheck("50%", 100, {"layers.0": "full"}, 90, 0, 1.0, 1.0, 0.0, "wall")
    results = [
        _result("full", peak_bytes=100),
        _result("exclude-attn"),
        _result("exclude-attn-offload", offload=Offload(10, 10, 5, 0.1), device="cuda:0"),
        _result("plan@50%", plan=plan, activation_bytes=90),
        Result("torch+inductor", "exclude-attn", activation_bytes=100, step_time_s=1.0),
        Result("torch+inductor", "sac", activation_bytes=100, step_time_s=1.0),
        Result("torch+aot_eager", "exclude-attn", activation_bytes=100, step_time_s=1.0),
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


def test_default_strategies_leave_torch_remat_out_where_it_is_missing(monkeypatch):
    # torch-remat runs on PyTorch 2.14 only; elsewhere its rows would fail the timing
    # child, which runs every strategy, and so every row's step time.
    from recomp.bench import cli

    real = importlib.util.find_spec
    notes: list[str] = []
    monkeypatch.setattr(
        cli.importlib.util, "find_spec", lambda name: None if name == "torch_remat" else real(name)
    )
    torch_default = cli._installed(cli.TORCH_STRATEGIES, notes)
    scenario_default = cli._installed(cli.SCENARIO_STRATEGIES, notes)
    assert "torch-remat" not in torch_default and "exclude-attn" in torch_default
    assert "torch-remat-proj" not in scenario_default and "exclude-proj" in scenario_default
    assert len(notes) == 1 and "torch-remat" in notes[0]
