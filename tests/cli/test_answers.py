"""What the commands answer when a command line cannot run as given: unknown strategies
and options (exit code 2, with the close matches), missing packages (one line naming
what to install), and what they say next (how to apply a plan file). Missing packages
are simulated in the command's own process (``sys.modules[name] = None``), recomp's
code left as it is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import paths

SRC = str(paths.SRC)
SIZE = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "8", "--batch", "1"]


def _recomp(*args: str, blocked: tuple[str, ...] = (), cwd: str | None = None, timeout=120):
    """``recomp ARGS`` as the console script runs it (its own directory, not the current
    one, first on the import path), with the modules ``blocked`` made unimportable."""
    script = textwrap.dedent(
        f"""\
        import sys
        sys.path.pop(0)  # the directory of this script, as a console script's
        for name in {list(blocked)!r}:
            sys.modules[name] = None
        from recomp.__main__ import main
        sys.exit(main(sys.argv[1:]))
        """
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )


# --------------------------------------------------------------------------- strategies


def test_bench_refuses_unknown_strategies_before_building_anything(tmp_path):
    # A model that cannot be imported is never reached: the strategies are judged first.
    proc = _recomp("bench", "--strategies", "none,fancy", "--quiet", cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert "unknown strategy 'fancy'" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""
    proc = _recomp("bench", "--strategies", "none,ful,exclude-atn")
    assert proc.returncode == 2
    assert "unknown strategy 'ful' (did you mean full?)" in proc.stderr


def test_strategy_names_parse_with_close_matches():
    from recomp.cli.strategies import StrategyError, parse

    assert parse("sac").name == "sac:attn"
    assert parse("exclude:attn+mlp").regions == ("attn", "mlp")
    with pytest.raises(StrategyError, match="did you mean full"):
        parse("fulll")
    with pytest.raises(StrategyError, match="names the regions"):
        parse("exclude")
    with pytest.raises(StrategyError, match=r"a number in \[0, 1\]"):
        parse("budget@2")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("exclude-attn", "exclude:attn"),
        ("sac-attn", "sac:attn"),
        ("torch-remat-mlp", "torch-remat:mlp"),
        ("keep-proj", "keep:proj"),
        ("exclude-attn-offload", "exclude-offload:attn"),
        ("full-swap-inputs", "full+swap-inputs"),
        ("swap-mm", "full+swap-matmuls"),
        ("full:no-keep", "full+replay-collectives"),
        ("exclude-attn:no-keep", "full+replay-collectives+exclude:attn"),
    ],
)
def test_earlier_spellings_are_read_under_the_names_now(old, new):
    from recomp.cli.strategies import parse

    assert parse(old).name == new and parse(old).renamed
    assert parse(new).name == new and not parse(new).renamed


def test_strategies_a_plan_file_can_hold_are_named_by_its_layer_options():
    from recomp.cli.strategies import parse
    from recomp.plan.planfile import parse_option

    for name in ("none", "full", "exclude:attn+mlp", "selective", "selective+exclude:attn",
                 "full+swap-inputs", "swap"):
        parse_option(name)  # a layer option of the plan file: raises if it is none
        assert parse(name).name == name


def test_old_benchmark_files_read_under_the_names_now(tmp_path):
    import json

    from recomp.cli.results import find_result, load_report

    path = tmp_path / "old.json"
    rows = [{"framework": "torch", "strategy": s, "activation_bytes": 1}
            for s in ("none", "exclude-attn", "sac")]
    path.write_text(json.dumps({"results": rows, "overhead": None}))
    report = load_report(path)
    assert [r.strategy for r in report.results] == ["none", "exclude:attn", "sac:attn"]
    assert find_result(report.results, "torch", "exclude-attn") is report.results[1]


def test_report_refuses_an_unknown_strategy():
    proc = _recomp("report", "--strategy", "exclde:attn")
    assert proc.returncode == 2
    assert "did you mean exclude:attn" in proc.stderr


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["plan", "--budgte", "50%"], "unknown option --budgte (did you mean --budget?)"),
        (["bench", "--stratgies", "full"], "unknown option --stratgies (did you mean --strategies?)"),
        (["bench", "--budget", "50%"], "unknown option --budget: it is an option of recomp plan"),
        # No abbreviations: --comp is not taken for --compile.
        (["bench", "--comp"], "unknown option --comp (did you mean --compile?)"),
    ],
)
def test_a_misspelt_option_is_named_with_its_close_match(args, expected):
    proc = _recomp(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[0] == f"recomp {args[0]}: {expected}"


# --------------------------------------------------------------------------- packages


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "--strategies", "full"],
        ["plan", "--budget", "50%"],
        ["report"],
    ],
)
def test_without_torch_the_commands_say_what_to_install(args):
    proc = _recomp(*args, blocked=("torch",))
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"recomp {args[0]}: needs PyTorch, which is not installed: pip install \"recomp[torch]\""
    ]
    assert proc.stdout == ""


def test_the_simulation_without_transformers_says_what_to_install():
    pytest.importorskip("torch")
    proc = _recomp("simulate", "llama-3.1-8b", blocked=("transformers",))
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "recomp simulate: needs Hugging Face transformers, which is not installed: "
        "pip install transformers"
    ]


def test_a_hugging_face_model_without_transformers_says_what_to_install():
    pytest.importorskip("torch")
    proc = _recomp(
        "report", *SIZE, "--model", "recomp.cli.torch.models:hf_llama", blocked=("transformers",)
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "recomp report: --model recomp.cli.torch.models:hf_llama needs Hugging Face "
        "transformers, which is not installed: pip install transformers"
    ]


def test_torch_remat_missing_names_the_bench_extra():
    pytest.importorskip("torch")
    proc = _recomp("bench", "--strategies", "none,torch-remat:attn", blocked=("torch_remat",))
    assert proc.returncode == 1, proc.stderr
    assert 'pip install "recomp[bench]"' in proc.stderr and "2.14" not in proc.stderr


def test_the_bench_extra_installs_torch_remat():
    import tomllib

    with open(os.path.join(os.path.dirname(SRC), "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(d.startswith("torch-remat") for d in extras["bench"])
    assert any(d.startswith("torch") and not d.startswith("torch-") for d in extras["torch"])


# --------------------------------------------------------------------------- --model


def test_report_imports_the_model_from_the_current_directory(tmp_path):
    pytest.importorskip("torch")
    from recomp.torch import _compat

    if not _compat.saved_values_readable():
        pytest.skip("the memory report needs SavedTensor.data (PyTorch 2.14); it says so")
    (tmp_path / "mymodels.py").write_text(
        "from recomp.cli.torch.models import llama\n\n"
        "def tiny_llama():\n    return llama(layers=1, hidden=32, heads=2)\n"
    )
    proc = _recomp(
        "report", "--model", "mymodels:tiny_llama", "--strategy", "full", "--seq", "8",
        "--batch", "1", "--summary", cwd=str(tmp_path), timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "strategy full, model mymodels:tiny_llama" in proc.stdout


def test_a_model_module_that_is_nowhere_is_a_usage_error(tmp_path):
    proc = _recomp("report", "--model", "nosuchmodule:build", cwd=str(tmp_path))
    assert proc.returncode == 2
    assert "no module 'nosuchmodule' in the current directory" in proc.stderr


# --------------------------------------------------------------------------- next steps


def test_plan_says_how_to_apply_the_file_it_wrote():
    from recomp import plan as plan_lib
    from recomp.cli.plan import apply_hint

    assert callable(getattr(plan_lib, "apply_plan", None)) or "apply_plan" in plan_lib.__all__
    assert apply_hint("plan50.json", compiled=False).endswith(
        'recomp.plan.apply_plan(model, "plan50.json")'
    )
    assert "recomp.plan.compile_with_plan(model, " in apply_hint("p.json", compiled=True)


# --------------------------------------------------------------------------- the table


def _row(strategy, activation, replay, seconds, loss=1.0):
    from recomp.cli.config import BenchConfig
    from recomp.cli.results import Result

    r = Result(
        "torch", strategy, activation_bytes=activation << 20, peak_bytes=2 * activation << 20,
        forward_flops=10**9, replay_flops=replay, excluded_flops=0, loss=loss,
        max_grad_diff=0.0, config=BenchConfig(),
    )
    r.set_step_times([seconds * f for f in (1.0, 1.02, 0.98, 1.01)],
                     [seconds * f for f in (1.0, 1.01, 0.99, 1.0)])
    return r


def test_table_labels_its_clock_and_drops_empty_columns():
    from recomp.cli.tables import table

    text = table([_row("none", 100, 0, 0.1), _row("full", 10, 10**9, 0.13)])
    header = text.splitlines()[0]
    assert "step ms (CPU)" in header and "cpu ms" not in header
    assert "host MiB/step" not in header and "runs/step" not in header and "loss" not in header
    assert "first-step loss 1.00000 in every row" in text
    assert "process CPU time" in text


def test_table_flags_losses_that_differ():
    from recomp.cli.tables import table

    text = table([_row("none", 100, 0, 0.1), _row("full", 10, 10**9, 0.13, loss=1.5)])
    assert "LOSS DIFFERS from 1.00000" in text and "torch full 1.50000" in text


def test_verdicts_compare_each_strategy_with_the_alternatives():
    from recomp.cli.tables import verdicts

    text = verdicts([
        _row("none", 100, 0, 0.1),
        _row("full", 10, 10**9, 0.13),
        _row("exclude:attn", 30, 4 * 10**8, 0.1005),
        _row("exclude:mlp", 60, 5 * 10**8, 0.08),
    ])
    lines = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert "keeps 10% of none's activation memory" in lines["full"]
    assert "step +30% over none" in lines["full"] and "within the spread" not in lines["full"]
    excl = lines["exclude:attn"]
    assert "keeps 30% of none's" in excl and "replays 40% of full's work" in excl
    assert "within the spread" in excl
    assert "step 20% under none" in lines["exclude:mlp"]  # faster: no "-20% over"
