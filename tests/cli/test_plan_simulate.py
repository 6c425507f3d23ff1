"""``recomp plan --simulate``: end to end on two layers of Llama-3.1-8B under tensor and
sequence parallelism, its numbers against ``simulate()`` and ``job_memory()`` called
directly, and the errors that name the fix."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")

from recomp.cli import plan as plan_cli
from recomp.cli import plan_simulate

GiB = float(1 << 30)
ARGS = ["--simulate", "llama-3.1-8b", "--layers", "2", "--seq", "512", "--tp", "2", "--sp"]


def test_table_equals_simulate_and_job_memory(tmp_path, capsys) -> None:
    out_json, out_png = tmp_path / "sim.json", tmp_path / "sim.png"
    code = plan_cli.main([*ARGS, "--json", str(out_json), "--png", str(out_png)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "llama-3.1-8b on H100 SXM" in printed and "plan@" in printed
    data = json.loads(out_json.read_text())
    assert os.path.getsize(out_png) > 0

    # The same numbers from the library, called directly.
    from recomp.plan import simulate
    from recomp.plan.job import Parallel, job_memory, model_params

    args = plan_simulate.build_parser().parse_args(ARGS)
    model = plan_simulate.simulated_model(args)
    profile = simulate(
        model.build,
        model.inputs,
        world_size=2,
        exclude=plan_simulate.candidate_regions,
        hardware="H100 SXM",
    )
    profile = model.scale_profile(profile)
    assert len(profile.layers) == 32
    params = model_params(plan_simulate._meta_model(model))
    rows = {r["strategy"]: r for r in data["rows"]}
    assert {"none", "full", "selective", "exclude:self_attn", "exclude:mlp"} <= set(rows)
    for option in ("none", "full", "selective", "exclude:self_attn"):
        row = rows[option]
        assert row["activations_per_microbatch"] == profile.uniform_bytes(option)
        job = job_memory(
            params,
            Parallel(tp=2),
            activations=profile,
            option=option,
            microbatches=1,
            budget=f"{80 * 10**9}B",
        )
        assert row["total"] == job.ranks[0].total
        assert row["fits"] == job.fits
        predicted = profile.predict([option] * 32)
        assert row["replay_flops"] == predicted["replay_flops"]
    assert rows["none"]["replay_flops"] == 0 and rows["full"]["replay_flops"] > 0
    assert rows["full"]["activations_per_microbatch"] < rows["none"]["activations_per_microbatch"]
    # The plan fits and its row is the plan's own prediction.
    plan_row = next(r for s, r in rows.items() if s.startswith("plan@"))
    assert plan_row["fits"] is True
    assert plan_row["activations_per_microbatch"] == data["plan"]["predicted"]["activation_bytes"]


def test_pipeline_plan_is_made_per_rank(tmp_path, capsys) -> None:
    """Under a pipeline, each rank's layers are planned for what that rank has left after
    its states, divided by the micro-batches its schedule holds at once: the plan fits
    every rank, the last one's with the loss's backward buffers on top of its peak."""
    out = tmp_path / "pp.json"
    argv = [*ARGS, "--seq", "2048", "--pp", "2", "--microbatches", "4", "--budget", "38GiB"]
    assert plan_cli.main([*argv, "--json", str(out)]) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    plan_rows = [r for r in data["rows"] if r["strategy"].startswith("plan@")]
    assert [r["rank"] for r in plan_rows] == [0, 1]
    assert all(r["fits"] and r["total"] <= 38 * (1 << 30) for r in plan_rows)
    none_rows = {r["rank"]: r for r in data["rows"] if r["strategy"] == "none"}
    # 1F1B: 2 micro-batches held on the first rank, 1 on the last, whose peak falls in
    # the loss's backward (its buffers on top of the micro-batch it holds).
    assert none_rows[0]["activations"] > none_rows[0]["activations_per_microbatch"] / 2
    assert len(data["plan"]["layers"]) == 32


@pytest.mark.parametrize(
    "argv, fix",
    [
        (["--simulate", "llama-4"], "use one of llama-3.1-8b"),
        (["--simulate", "llama-3.1-8b", "--sp"], "add --tp N"),
        (["--simulate", "llama-3.1-8b", "--zero", "3"], "add --dp N"),
        (["--simulate", "llama-3.1-8b", "--pp", "2", "--schedule", "Nope"], "unknown --schedule"),
        (["--simulate", "llama-3.1-8b", "--pp", "33"], "--pp must be at most"),
    ],
)
def test_bad_options_name_the_fix(argv, fix, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main(argv)
    assert exit_info.value.code == 2
    assert fix in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, fix",
    [
        (["--simulate", "mixtral-8x22b", "--tp", "2"], "add --sp"),
        (["--simulate", "qwen3-30b-a3b", "--tp", "8", "--sp"], "--tp must divide both"),
        (["--simulate", "llama-3.1-8b", "--accelerator", "TPU9"], "unknown hardware"),
        (["--simulate", "llama-3.1-8b", "--budget", "50%"], "--budget is bytes per device"),
    ],
)
def test_model_and_target_errors_name_the_fix(argv, fix, capsys) -> None:
    assert plan_cli.main(argv) == 2
    assert fix in capsys.readouterr().err


@pytest.mark.system
@pytest.mark.parametrize(
    "argv",
    [
        ["--simulate", "llama-3.1-405b", "--tp", "8", "--sp", "--seq", "8192", "--pp", "8",
         "--microbatches", "16", "--dp", "4", "--zero", "1", "--schedule", "Interleaved1F1B"],
        ["--simulate", "deepseek-v3", "--tp", "8", "--sp", "--seq", "4096", "--dp", "8",
         "--zero", "3", "--accelerator", "H200"],
        ["--simulate", "mixtral-8x22b", "--tp", "8", "--sp", "--seq", "4096", "--dp", "4",
         "--zero", "3"],
        ["--simulate", "qwen3-235b-a22b", "--tp", "4", "--sp", "--seq", "4096", "--dp", "2",
         "--zero", "3"],
    ],
    ids=["405b-pp8", "deepseek-v3", "mixtral-8x22b", "qwen3-235b"],
)
def test_large_models_end_to_end(argv, tmp_path, capsys) -> None:
    """The largest models at full width (two layers simulated, scaled), with pipeline,
    expert and data parallelism: a row per strategy and pipeline rank, full checkpointing
    keeping less than none on every rank, and the states divided as the layout says."""
    out = tmp_path / "t.json"
    assert plan_cli.main([*argv, "--json", str(out)]) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    pp = int(argv[argv.index("--pp") + 1]) if "--pp" in argv else 1
    rows = data["rows"]
    for rank in range(pp):
        by = {r["strategy"]: r for r in rows if r["rank"] == rank}
        assert by["full"]["activations"] < by["none"]["activations"]
        assert by["full"]["states"] == by["none"]["states"] > 0
    assert {r["rank"] for r in rows} == set(range(pp))
    assert all(r["fits"] for r in rows if r["strategy"].startswith("plan@"))
