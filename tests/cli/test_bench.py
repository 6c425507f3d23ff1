"""Tests of ``recomp bench``'s measuring code: FLOP accounting, the memory reader, strategy
set-up, the JSON it writes. Tiny configurations only. (The project's targets, judged from
that JSON by ``benchmarks/targets.py``: tests/cli/test_benchmark_targets.py.)"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import paths

torch = pytest.importorskip("torch")

from recomp.cli.config import BenchConfig  # noqa: E402
from recomp.cli.memory import child_env  # noqa: E402
from recomp.cli.results import Result, load_report  # noqa: E402
from recomp.cli.strategies import canonical  # noqa: E402
from recomp.cli.tables import table  # noqa: E402
from recomp.cli.timing import summarize_times  # noqa: E402

SRC = str(paths.SRC)

TINY = BenchConfig(layers=2, hidden=32, heads=2, seq=16, batch=2, steps=2)
B, S, H, L = TINY.batch, TINY.seq, TINY.hidden, TINY.layers


def _intermediate() -> int:
    from recomp.cli.config import intermediate_size

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
    from recomp.cli.torch.runner import measure_strategy

    names = ["none", "full", "sac:attn", "torch-remat:attn", "exclude:attn", "exclude:mlp", "keep:attn"]
    if not HAVE_TORCH_REMAT:
        names.remove("torch-remat:attn")
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

    from recomp.cli.torch.runner import measure_strategy

    with set_checkpoint_early_stop(False):
        r = measure_strategy(TINY, "full")
    assert r.replay_flops == r.layer_forward_flops == L * LAYER_FLOPS


def test_exclude_attn_replay_is_full_minus_excluded_exactly(measured):
    full, excl = measured["full"], measured["exclude:attn"]
    assert excl.excluded_flops == L * ATTN_FLOPS
    assert excl.replay_flops == full.replay_flops - excl.excluded_flops


def test_replay_attribution_agrees_with_recomp_state(measured):
    # Grad mode during backward (the bench's criterion) and recomp.is_recomputing()
    # must pick the same ops for recomp's checkpoints ...
    for name in ("exclude:attn", "exclude:mlp"):
        r = measured[name]
        assert r.replay_flops == r.replay_flops_recomp_state > 0
    # ... and recomp's state stays off under other libraries' checkpoints.
    assert measured["full"].replay_flops_recomp_state == 0


def test_kept_regions_are_not_replayed(measured):
    sac, keep = measured["sac:attn"], measured["keep:attn"]
    assert sac.replay_flops == measured["exclude:attn"].replay_flops
    assert keep.replay_flops == measured["exclude:attn"].replay_flops
    assert measured["exclude:mlp"].replay_flops == L * ATTN_FLOPS


@needs_torch_remat
def test_torch_remat_replays_all_but_its_kept_region(measured):
    # torch-remat replays the whole layer body but the kept region (no early stop).
    assert measured["torch-remat:attn"].replay_flops == L * (LAYER_FLOPS - ATTN_FLOPS)
    assert set(measured["torch-remat:attn"].region_calls.values()) == {1}


def test_region_runs(measured):
    excl = measured["exclude:attn"]
    assert excl.region_runs == {f"layers.{i}.attn": 1 for i in range(L)}
    assert excl.region_skips == {f"layers.{i}.attn": 1 for i in range(L)}
    assert excl.region_calls == {f"layers.{i}.attn": 1 for i in range(L)}
    # SAC runs the region's Python code in the replay too (its ops come from a cache).
    assert set(measured["sac:attn"].region_calls.values()) == {2}


# --------------------------------------------------------------------------- strategies


def test_every_strategy_gives_the_gradient_of_none(measured):
    for name, r in measured.items():
        assert r.max_grad_diff <= 1e-6, name


def test_selective_and_swap_strategies_are_the_plan_options_for_every_layer():
    from recomp.cli.strategies import parse
    from recomp.cli.torch.models import llama
    from recomp.cli.torch.strategies import layers_of, uniform_plan

    model = llama(layers=2, hidden=32, heads=2)
    plan = uniform_plan(parse("selective+exclude:attn"), layers_of(model))
    assert [layer.option for layer in plan.layers] == ["selective+exclude:attn"] * 2
    plan = uniform_plan(parse("exclude:attn+mlp"), layers_of(model))
    assert [layer.option for layer in plan.layers] == ["exclude:attn+mlp"] * 2


def test_offload_strategy_is_the_plan_option_and_partition_a_plan_option_only():
    from recomp.cli.strategies import parse, refused
    from recomp.cli.torch.models import llama
    from recomp.cli.torch.strategies import prepare
    from recomp.torch import _swap

    model = llama(layers=2, hidden=32, heads=2)
    prepared = prepare("offload", model)
    assert prepared.offloader is not None
    assert all(_swap.unwrap_swaps(layer) for layer in model.layers)  # each one wrapped
    assert refused(parse("offload"), "eager") is None
    assert "apply_plan(..., partition_inputs=group)" in refused(
        parse("full+partition-inputs"), "eager"
    )


def test_torch_budget_strategy_is_compiled_only_and_checked():
    from recomp.cli.torch.models import llama
    from recomp.cli.torch.strategies import prepare

    with pytest.raises(ValueError, match="run it with --compile"):
        prepare("budget@0.5", llama(layers=1, hidden=32, heads=2))
    with pytest.raises(ValueError, match=r"a number in \[0, 1\], got '2'"):
        prepare("budget@2", llama(layers=1, hidden=32, heads=2), compiled=True)


def test_missing_region_is_reported():
    from recomp.cli.torch.models import llama
    from recomp.cli.torch.strategies import prepare

    with pytest.raises(ValueError, match="no child module 'moe'"):
        prepare("exclude:moe", llama(layers=1, hidden=32, heads=2))


def test_user_model_factory_gets_only_declared_options():
    from recomp.cli.config import call_factory, load_factory

    factory = load_factory("recomp.cli.torch.models:norm_matmul_silu")
    model = call_factory(factory, BenchConfig(layers=3, hidden=16))
    assert len(model.layers) == 3 and model.hidden == 16
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        load_factory("recomp.cli.torch.models")


Pair = collections.namedtuple("Pair", "x options")


class PairLayer(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        return self.attn(x)


class PairInput(torch.nn.Module):
    """Takes its input as a named tuple holding a tensor and an OrderedDict of tensors."""

    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.layers = torch.nn.ModuleList(PairLayer(hidden) for _ in range(layers))

    def example_input(self, batch, seq, generator):
        x = torch.randn(batch, seq, self.hidden, generator=generator)
        scale = torch.full((self.hidden,), 0.5)
        return Pair(x, collections.OrderedDict(scale=scale))

    def forward(self, x, options):
        for layer in self.layers:
            x = layer(x) * options["scale"]
        return x


def pair_input(layers: int = 2, hidden: int = 32) -> PairInput:
    return PairInput(layers, hidden)


def test_model_input_keeps_its_containers():
    """A named tuple and an OrderedDict in a model's input reach the model as they were
    made, on the configured device (walked with recomp's pytree)."""
    from recomp.cli.torch.runner import build, measure_strategy, to_device

    made = Pair(torch.ones(2), collections.OrderedDict(scale=torch.zeros(3), n=4))
    moved = to_device(made, torch.device("meta"))
    assert type(moved) is Pair and type(moved.options) is collections.OrderedDict
    assert moved.x.device.type == "meta" and moved.options["scale"].device.type == "meta"
    assert list(moved.options) == ["scale", "n"] and moved.options["n"] == 4

    cfg = BenchConfig(layers=2, hidden=8, seq=4, batch=2, model=f"{__name__}:pair_input")
    _, x, _ = build(cfg)
    assert type(x) is Pair and type(x.options) is collections.OrderedDict
    for strategy in ("full", "exclude:attn"):
        row = measure_strategy(cfg, strategy)
        assert row.error is None and row.max_grad_diff == 0.0, strategy
        # Each layer's matmul: (batch * seq) x hidden x hidden.
        assert row.forward_flops == 2 * _mm(2 * 4, 8, 8), strategy
    assert row.region_runs == {"layers.0.attn": 1, "layers.1.attn": 1}


# --------------------------------------------------------------------------- memory


def test_memory_reader_sees_a_known_tensor():
    sizes = [1 << 16, 1 << 20, 3 << 20]
    got = _run_child(
        f"""
        import json, torch
        from recomp.cli.memory import malloc_in_use
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
    # full keeps the layer inputs and the output (L activations); exclude:proj adds the
    # matmul output per layer; keep:proj (no deferred inputs) also the norm output.
    cfg = BenchConfig(
        layers=4, hidden=256, seq=256, batch=2, model="recomp.cli.torch.models:norm_matmul_silu"
    )
    got = _run_child(
        f"""
        import json
        from recomp.cli.config import BenchConfig
        from recomp.cli.torch.runner import measure_strategy
        cfg = BenchConfig.from_dict({cfg.to_dict()!r})
        print(json.dumps({{s: measure_strategy(cfg, s).activation_bytes
                          for s in ("full", "exclude:proj", "keep:proj")}}))
        """
    )
    one = cfg.batch * cfg.seq * cfg.hidden * 4
    a = {k: v / one for k, v in got.items()}
    # Beyond the tensors (512 KiB each): per checkpoint and per excluded call, a saved
    # CPU RNG state (5 KiB) and Python objects.
    assert 4 <= a["full"] <= 4.1, a
    assert a["exclude:proj"] - a["full"] == pytest.approx(4, abs=0.1), a
    assert a["keep:proj"] - a["exclude:proj"] == pytest.approx(4, abs=0.1), a


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


SIZE = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "1"]


def _fresh_tmpdir(tmp_path) -> dict[str, str]:
    """The environment of a command whose temporary directory starts empty."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    return {**_env(), "TMPDIR": str(tmpdir)}


def _bench(tmp_path, *args: str) -> dict:
    """A short run; its temporary directory is empty again when it has ended."""
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    env = _fresh_tmpdir(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recomp",
            "bench",
            *SIZE,
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
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert os.listdir(env["TMPDIR"]) == [], "recomp bench left temporary files"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(out.read_text())
    # Measurements only: the command judges nothing against the project's targets.
    assert "strategy" in proc.stdout and "Targets" not in proc.stdout
    return report


@pytest.mark.system  # the whole recomp bench command
def test_json_schema_torch(tmp_path):
    reports = tmp_path / "reports"
    report = _bench(tmp_path, "--strategies", "none,full,exclude:attn", "--report", str(reports))
    # --report runs in this process: its files are there, and no others (see _bench).
    assert (reports / "report-exclude-attn.txt").read_text().startswith("strategy exclude:attn")
    results = report["results"]
    assert [r["strategy"] for r in results] == ["none", "full", "exclude:attn"]
    for r in results:
        assert r.keys() >= FIELDS, FIELDS - r.keys()
        assert r["framework"] == "torch"
        assert r["config"]["hidden"] == 32 and r["config"]["layers"] == 1
        assert r["step_time_s"] > 0 and len(r["step_times_s"]) == 2
        assert r["activation_bytes"] > 0 and r["peak_bytes"] > 0
    none, full, excl = results
    assert full["activation_bytes"] < excl["activation_bytes"] < none["activation_bytes"]
    assert excl["region_runs"] == {"layers.0.attn": 1}
    assert report["version"] == 3 and "targets" not in report
    # The file reads back into the same typed report.
    again = load_report(tmp_path / "bench.json")
    assert again.to_dict() == report
    assert [r.strategy for r in again.results] == ["none", "full", "exclude:attn"]


def _mindspore_ready() -> bool:
    if importlib.util.find_spec("mindspore") is None:
        return False
    try:
        import recomp.mindspore  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.system  # the whole recomp bench command
@pytest.mark.skipif(not _mindspore_ready(), reason="recomp.mindspore not importable")
def test_json_schema_mindspore(tmp_path):
    report = _bench(tmp_path, "--framework", "mindspore")
    results = report["results"]
    assert [r["strategy"] for r in results] == ["none", "full", "exclude:attn"]
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
        "import sys, recomp, recomp.__main__, recomp.cli.bench, recomp.cli.plan, "
        "recomp.cli.report, recomp.cli.worker, recomp.cli.jobs, recomp.cli.saved_tensors;"
        "print(sorted(m for m in ('torch', 'mindspore') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# --------------------------------------------------------------------------- clean-up

# A model whose forward, in the measuring child, leaves a directory in the child's
# temporary directory, says that it started (its pid, in STARTED_FILE), then crashes
# (CHILD_CRASH set) or hangs.
STUCK_MODEL = """
import os, tempfile, time
from torch import nn

class Stuck(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden, hidden)])

    def forward(self, x):
        tempfile.mkdtemp(prefix="left-by-the-child-")
        with open(os.environ["STARTED_FILE"], "w") as f:
            f.write(str(os.getpid()))
        if os.environ.get("CHILD_CRASH"):
            os._exit(3)
        time.sleep(300)
        return self.layers[0](x)

def build(hidden=32):
    return Stuck(hidden)
"""


def _stuck_bench(tmp_path, crash: bool) -> tuple[subprocess.Popen, dict[str, str]]:
    (tmp_path / "stuck_model.py").write_text(STUCK_MODEL)
    env = _fresh_tmpdir(tmp_path)
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    env["STARTED_FILE"] = str(tmp_path / "started")
    if crash:
        env["CHILD_CRASH"] = "1"
    command = [sys.executable, "-m", "recomp", "bench", *SIZE, "--model", "stuck_model:build"]
    options = ["--strategies", "none", "--steps", "1", "--no-overhead", "--quiet", "--jobs", "1"]
    proc = subprocess.Popen(
        command + options, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    return proc, env


def _gone(pid: int, timeout: float = 15.0) -> bool:
    """Whether process ``pid`` has ended (a zombie counts as ended) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


@pytest.mark.system  # recomp bench with its child processes
def test_a_failing_child_leaves_no_temporary_files(tmp_path):
    proc, env = _stuck_bench(tmp_path, crash=True)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    # Both children (measurement and timing) crashed: every row failed.
    assert proc.returncode == 1, out[-2000:] + err[-3000:]
    assert "none: exit code 3" in out
    assert (tmp_path / "started").exists()
    assert os.listdir(env["TMPDIR"]) == []


@pytest.mark.system  # recomp bench with its child processes
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_ctrl_c_stops_the_children_and_leaves_no_temporary_files(tmp_path):
    proc, env = _stuck_bench(tmp_path, crash=False)
    started = tmp_path / "started"
    child = None
    try:
        deadline = time.monotonic() + 180
        while not (started.exists() and started.read_text()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the child never started its forward"
            time.sleep(0.2)
        child = int(started.read_text())
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        if child is not None and not _gone(child, 0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    assert proc.returncode == 130, out[-2000:] + err[-3000:]
    assert "recomp bench: interrupted" in err
    assert _gone(child), "the measuring child outlived the command"
    assert os.listdir(env["TMPDIR"]) == []


@pytest.mark.system  # the whole recomp report command
def test_report_leaves_no_temporary_files(tmp_path):
    env = _fresh_tmpdir(tmp_path)
    png = tmp_path / "report.png"
    proc = subprocess.run(
        [sys.executable, "-m", "recomp", "report", *SIZE, "--summary", "--png", str(png)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "total held for backward" in proc.stdout and png.exists()
    assert os.listdir(env["TMPDIR"]) == []


# --------------------------------------------------------------------------- report


def _result(strategy: str, **kw) -> Result:
    base = {"activation_bytes": 100, "replay_flops": 0, "excluded_flops": 0, "step_time_s": 1.0}
    return Result("torch", strategy, **{**base, **kw})


def test_table_lists_errors_below():
    text = table([_result("full"), Result("torch", "sac:attn", error="Boom: x")])
    assert "torch sac:attn: Boom: x" in text


def test_summarize_times():
    assert summarize_times([3.0, 1.0, 2.0]) == (2.0, 2.0)
    median, spread = summarize_times([1.0, 2.0, 3.0, 4.0, 100.0])
    assert median == 3.0 and 0 < spread < 99


# --------------------------------------------------------------------------- JSON files

BENCHMARKS = os.path.join(os.path.dirname(SRC), "benchmarks")


@pytest.mark.parametrize("name", ["bench_v1.json", "bench_compile.json", "plan.json"])
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
        # Strategies come back under their names now (exclude-attn is exclude:attn).
        assert (r.framework, r.strategy) == (row["framework"], canonical(row["strategy"]))
        assert r.activation_bytes == row["activation_bytes"]
        assert r.replay_flops == row.get("replay_flops")
        assert r.step_times_s == row.get("step_times_s")
        assert r.config is not None and r.config.layers == row["config"]["layers"]
        # What a version-1 row holds comes back unchanged in version 2 (its configuration
        # gains the fields added since, at their defaults).
        again = r.to_dict()
        assert {k: again[k] for k in row if k not in ("config", "strategy")} == {
            k: v for k, v in row.items() if k not in ("config", "strategy")
        }
        assert {k: again["config"][k] for k in row["config"]} == row["config"]
    assert table(report.results)
    if raw["overhead"] is not None:
        assert report.overhead is not None and report.overhead.to_dict() == raw["overhead"]
    if name == "plan.json":
        planned = [r for r in report.results if r.plan is not None]
        assert planned and all(r.plan.budget_bytes > 0 for r in planned)


def test_committed_version_2_file_is_read():
    """A version-2 file (targets with ids) reads into the report of this version; its
    verdicts are left to benchmarks/targets.py."""
    path = os.path.join(BENCHMARKS, "plan_round2.json")
    with open(path) as f:
        raw = json.load(f)
    assert raw["version"] == 2 and raw["targets"]
    report = load_report(path)
    assert report.version == 3 and "targets" not in report.to_dict()
    renamed = [{**row, "strategy": canonical(row["strategy"])} for row in raw["results"]]
    assert [r.to_dict() for r in report.results] == renamed
    assert {r["strategy"] for r in raw["results"]} != {r["strategy"] for r in renamed}


def test_report_version_3_round_trip_and_unknown_versions(tmp_path):
    from recomp.cli.results import Offload, Report, ReportFormatError, WrapperOverhead, write_report

    rows = [
        _result("full", config=TINY, offload=None, region_runs={"layers.0.attn": 1}),
        _result("exclude-offload:attn", offload=Offload(10, 10, 5, 0.25), device="cuda:0"),
        Result("mindspore", "sac:attn", error="ValueError: no"),
    ]
    overhead = WrapperOverhead("x * 1.5", 20, 3.0, 30.0, 3.1, 29.0, 5.0)
    report = Report("recomp bench", {"python": "3"}, 1.5, rows, [], overhead, ["a note"])
    path = tmp_path / "r.json"
    write_report(path, report)
    again = load_report(path)
    assert again == report
    data = json.loads(path.read_text())
    assert data["version"] == 3 and "targets" not in data
    assert data["overhead"]["in_checkpoint_us"] == 30.0
    assert data["results"][2] == {
        "framework": "mindspore",
        "strategy": "sac:attn",
        "error": "ValueError: no",
    }
    data["version"] = 4
    path.write_text(json.dumps(data))
    with pytest.raises(ReportFormatError, match="version 4"):
        load_report(path)


def test_default_strategies_leave_torch_remat_out_where_it_is_missing(monkeypatch):
    # torch-remat runs on PyTorch 2.14 only; elsewhere its rows would fail the timing
    # child, which runs every strategy, and so every row's step time.
    from recomp.cli import bench as cli

    notes: list[str] = []
    monkeypatch.setitem(sys.modules, "torch_remat", None)  # as if not installed
    torch_default = cli._installed(cli.TORCH_STRATEGIES, notes)
    scenario_default = cli._installed(cli.SCENARIO_STRATEGIES, notes)
    assert "torch-remat:attn" not in torch_default and "exclude:attn" in torch_default
    assert "torch-remat:proj" not in scenario_default and "exclude:proj" in scenario_default
    assert len(notes) == 1 and 'pip install "recomp[bench]"' in notes[0]
    assert "PyTorch 2.14" not in notes[0]
