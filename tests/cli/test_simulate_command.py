"""``recomp simulate MODEL``: the command reads its options and prints what
``recomp.plan.fit.will_it_fit`` finds (end to end on two layers of Llama-3.1-8B under
tensor and sequence parallelism, its numbers against ``job_memory`` called directly),
usage errors exit with status 2 naming the fix, and ``recomp plan --simulate`` still
runs it for one release, saying so."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")

from recomp.cli import plan as plan_cli
from recomp.cli import simulate
from recomp.plan import Budget

GiB = float(1 << 30)
ARGS = ["llama-3.1-8b", "--layers", "2", "--seq", "512", "--tp", "2", "--sp"]


def test_table_equals_the_library(tmp_path, capsys) -> None:
    out_json, out_png = tmp_path / "sim.json", tmp_path / "sim.png"
    code = simulate.main([*ARGS, "--json", str(out_json), "--png", str(out_png)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "llama-3.1-8b on H100 SXM" in printed and "plan@" in printed
    data = json.loads(out_json.read_text())
    assert os.path.getsize(out_png) > 0

    # The same numbers from the library, called directly.
    from recomp.plan.job import Parallel, job_memory, model_params
    from recomp.plan.models import SimulatedModel

    model = SimulatedModel("llama-3.1-8b", layers=2, seq=512, tp=2, sp=True)
    profile = model.simulate(hardware="H100 SXM")
    assert len(profile.layers) == 32
    params = model_params(model.meta_model())
    rows = {r["strategy"]: r for r in data["rows"]}
    assert {"none", "full", "selective", "exclude:self_attn", "exclude:mlp"} <= set(rows)
    for option in ("none", "full", "selective", "exclude:self_attn"):
        row = rows[option]
        assert row["activations_per_microbatch"] == profile.uniform_bytes(option)
        job = job_memory(
            params,
            Parallel(tp=2, sp=True),
            activations=profile,
            option=option,
            microbatches=1,
            budget=Budget("80GB", nbytes=80 * 10**9),
        )
        assert row["total"] == job.ranks[0].total
        assert row["activations"] == job.ranks[0].activations
        assert row["fits"] == job.fits
        predicted = profile.predict([option] * 32)
        assert row["replay_flops"] == predicted["replay_flops"]
    assert rows["none"]["replay_flops"] == 0 and rows["full"]["replay_flops"] > 0
    assert rows["full"]["activations_per_microbatch"] < rows["none"]["activations_per_microbatch"]
    # The plan fits and its row is the plan's own prediction.
    plan_row = next(r for s, r in rows.items() if s.startswith("plan@"))
    assert plan_row["fits"] is True
    assert plan_row["activations_per_microbatch"] == data["plan"]["predicted"]["activation_bytes"]
    # Every printed line fits a narrow terminal (and the docs page, without scrolling).
    assert max(map(len, _table_lines(printed))) <= simulate.WIDTH


def test_pipeline_plan_is_made_per_rank(tmp_path, capsys) -> None:
    """Under a pipeline, each rank's layers are planned for what that rank has left after
    its states, divided by the micro-batches its schedule holds at once: the plan fits
    every rank, the last one's with the loss's backward buffers on top of its peak."""
    out = tmp_path / "pp.json"
    argv = [*ARGS, "--seq", "2048", "--pp", "2", "--microbatches", "4",
            "--device-memory", "38GiB"]  # fmt: skip
    assert simulate.main([*argv, "--json", str(out)]) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    plan_rows = [r for r in data["rows"] if r["strategy"].startswith("plan@")]
    assert [r["rank"] for r in plan_rows] == [0, 1]
    assert all(r["fits"] and r["total"] <= 38 * (1 << 30) for r in plan_rows)
    none_rows = {r["rank"]: r for r in data["rows"] if r["strategy"] == "none"}
    # 1F1B: 2 micro-batches held on the first rank, 1 on the last, whose peak falls in
    # the loss's backward (its buffers on top of the micro-batch it holds).
    assert none_rows[0]["activations"] > none_rows[0]["activations_per_microbatch"] / 2
    assert len(data["plan"]["layers"]) == 32


def test_the_parser_reads_the_layout_and_the_memory_as_a_budget() -> None:
    args = simulate.build_parser().parse_args(
        ["llama-3.1-70b", "--tp", "8", "--sp", "--pp", "4", "--device-memory", "75GB",
         "--stage-layers", "19,20,20,21", "--replay-collectives"]
    )  # fmt: skip
    assert args.model == "llama-3.1-70b" and (args.tp, args.sp, args.pp) == (8, True, 4)
    assert args.device_memory == Budget("75GB", nbytes=75 * 10**9)
    assert args.stage_layers == "19,20,20,21" and args.replay_collectives
    assert simulate.check_args(args) == []


@pytest.mark.parametrize(
    "argv, fix",
    [
        (["llama-4"], "unknown model 'llama-4': use one of llama-3.1-8b"),
        (["llama-3.1-8b", "--sp"], "add --tp N"),
        (["llama-3.1-8b", "--zero", "3"], "add --dp N"),
        (["llama-3.1-8b", "--pp", "2", "--schedule", "Nope"], "unknown --schedule"),
        (["llama-3.1-8b", "--pp", "33"], "--pp must be at most"),
        (["llama-3.1-8b", "--device-memory", "50%"], "--device-memory is bytes per device"),
        (["llama-3.1-8b", "--device-memory", "80"], "has no unit"),
        (["llama-3.1-8b", "--pp", "2", "--stage-layers", "16,15"], "say 16,16"),
        (["llama-3.1-8b", "--budget", "80GiB"], "unknown option --budget"),
        (["--tp", "2"], "the following arguments are required: MODEL"),
        (["llama-3.1-8b", "--replay-collectives", "--keep-collectives"], "give one"),
        (["llama-3.1-8b", "--loss-parallel"], "--loss-parallel shards the vocabulary"),
        (["llama-3.1-8b", "--cp", "0"], "--cp is a positive integer"),
    ],
)
def test_usage_errors_exit_2_naming_the_fix(argv, fix, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        simulate.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("recomp simulate: ") and fix in err, err


@pytest.mark.parametrize(
    "argv, fix",
    [
        (["mixtral-8x22b", "--tp", "2"], "add --sp"),
        (["qwen3-30b-a3b", "--tp", "8", "--sp"], "--tp must divide both"),
        (["llama-3.1-8b", "--accelerator", "TPU9"], "unknown hardware"),
        (["llama-3.1-8b", "--cp", "3", "--seq", "512"], "choose a multiple of 6"),
    ],
)
def test_model_and_target_errors_exit_2_naming_the_fix(argv, fix, capsys) -> None:
    assert simulate.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("recomp simulate: ") and fix in err, err


def test_plan_simulate_still_runs_it_and_says_it_is_deprecated(tmp_path, capsys) -> None:
    """``recomp plan --simulate MODEL`` for one more release: the same report, its
    ``--budget`` read as the memory per device, and a line saying what to type now."""
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    argv = ["--layers", "2", "--seq", "512", "--tp", "2", "--sp"]
    assert plan_cli.main(["--simulate", "llama-3.1-8b", *argv, "--budget", "30GiB",
                          "--json", str(old)]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "recomp plan --simulate is deprecated" in err and "recomp simulate MODEL" in err
    assert simulate.main(["llama-3.1-8b", *argv, "--device-memory", "30GiB", "--json",
                          str(new)]) == 0  # fmt: skip
    assert json.loads(old.read_text()) == json.loads(new.read_text())
    assert json.loads(new.read_text())["budget_bytes"] == 30 * (1 << 30)
    # Its usage errors still exit 2.
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main(["--simulate", "llama-3.1-8b", "--sp"])
    assert exit_info.value.code == 2


def test_loss_and_context_parallelism_are_layouts_of_the_command(tmp_path, capsys) -> None:
    """``--loss-parallel`` and ``--cp``: the profile is simulated under the layout, and
    the rows are ``job_memory``'s for it; the layout line says so."""
    out = tmp_path / "lp.json"
    argv = [*ARGS, "--loss-parallel", "--cp", "2", "--json", str(out)]
    assert simulate.main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "cp=2" in printed and "loss_parallel" in printed
    data = json.loads(out.read_text())

    from recomp.plan.job import Parallel, job_memory
    from recomp.plan.models import SimulatedModel

    model = SimulatedModel(
        "llama-3.1-8b", layers=2, seq=512, tp=2, sp=True, cp=2, loss_parallel=True
    )
    profile = model.simulate(hardware="H100 SXM")
    job = job_memory(
        model.meta_model(), Parallel(tp=2, sp=True, cp=2, loss_parallel=True),
        activations=profile, option="full", microbatches=1,
    )  # fmt: skip
    full = next(r for r in data["rows"] if r["strategy"] == "full")
    assert full["activations"] == job.ranks[0].activations
    assert full["total"] == job.ranks[0].total


def test_recomp_lists_the_command() -> None:
    from recomp.__main__ import USAGE, command_main

    assert "simulate" in USAGE and command_main("simulate") is simulate.main


def test_few_ranks_show_all_many_show_the_first_two_the_largest_and_the_last() -> None:
    ranks = list(range(16))
    totals = {r: 100 - r for r in ranks} | {7: 500}
    assert simulate.shown_ranks(ranks[:4], totals, False) == [0, 1, 2, 3]
    assert simulate.shown_ranks(ranks, totals, False) == [0, 1, 7, 15]
    assert simulate.shown_ranks(ranks, totals, True) == ranks


@pytest.mark.system
@pytest.mark.parametrize(
    "argv",
    [
        ["llama-3.1-405b", "--tp", "8", "--sp", "--seq", "8192", "--pp", "8",
         "--microbatches", "16", "--dp", "4", "--zero", "1", "--schedule", "Interleaved1F1B"],
        ["deepseek-v3", "--tp", "8", "--sp", "--seq", "4096", "--dp", "8",
         "--zero", "3", "--accelerator", "H200"],
        ["mixtral-8x22b", "--tp", "8", "--sp", "--seq", "4096", "--dp", "4",
         "--zero", "3"],
        ["qwen3-235b-a22b", "--tp", "4", "--sp", "--seq", "4096", "--dp", "2",
         "--zero", "3"],
    ],
    ids=["405b-pp8", "deepseek-v3", "mixtral-8x22b", "qwen3-235b"],
)  # fmt: skip
def test_large_models_end_to_end(argv, tmp_path, capsys) -> None:
    """The largest models at full width (two layers simulated, scaled), with pipeline,
    expert and data parallelism: a row per strategy and pipeline rank, full checkpointing
    keeping less than none on every rank, and the states divided as the layout says."""
    out = tmp_path / "t.json"
    assert simulate.main([*argv, "--json", str(out)]) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    pp = int(argv[argv.index("--pp") + 1]) if "--pp" in argv else 1
    rows = data["rows"]
    for rank in range(pp):
        by = {r["strategy"]: r for r in rows if r["rank"] == rank}
        assert by["full"]["activations"] < by["none"]["activations"]
        assert by["full"]["states"] == by["none"]["states"] > 0
    assert {r["rank"] for r in rows} == set(range(pp))
    assert all(r["fits"] for r in rows if r["strategy"].startswith("plan@"))


def test_offload_options_show_their_host_memory(tmp_path, capsys) -> None:
    """Where the accelerator has a host link the offload options are rows of their own,
    with the host memory they take beside the device's; --host-bandwidth 0 takes the link
    away, a slower one makes their copies show in the overhead."""
    out = tmp_path / "sim.json"
    argv = ["llama-3.1-8b", "--layers", "2", "--seq", "4096", "--pp", "2", "--microbatches", "4"]
    assert simulate.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("strategy"))
    assert header.split() == ["strategy", "pp", "act", "states", "total", "host", "TFLOP",
                              "overhead", "fits"]  # fmt: skip
    assert max(map(len, _table_lines(printed))) <= simulate.WIDTH
    rows = {(r["strategy"], r["rank"]): r for r in json.loads(out.read_text())["rows"]}
    for option in ("offload", "exclude-offload:self_attn", "swap", "full+swap-inputs"):
        # 1F1B on 2 ranks: the first holds 2 micro-batches at once, the last 1.
        assert rows[(option, 0)]["host"] == 2 * rows[(option, 1)]["host"] > 0
    assert rows[("full", 0)]["host"] == 0 and rows[("none", 0)]["host"] == 0
    assert "host: the host memory" in " ".join(printed.split())

    assert simulate.main([*argv, "--host-bandwidth", "0", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "host" not in next(ln for ln in printed.splitlines() if ln.startswith("strategy"))
    assert {r["strategy"] for r in json.loads(out.read_text())["rows"]}.isdisjoint(
        {"offload", "exclude-offload:self_attn", "swap"}
    )
    assert simulate.main([*argv, "--host-bandwidth", "8", "--json", str(out)]) == 0
    capsys.readouterr()
    slow = {(r["strategy"], r["rank"]): r for r in json.loads(out.read_text())["rows"]}
    assert slow[("offload", 0)]["overhead"] > rows[("offload", 0)]["overhead"]
    assert slow[("offload", 0)]["host"] == rows[("offload", 0)]["host"]


def test_a_job_that_fits_only_with_offload_names_it(capsys) -> None:
    """Llama-3.1-8B at 32k tokens, FSDP over 8: with no host link no plan fits 78 GiB
    (83.07 GiB at least); the note names offloading among the levers, since with a PCIe 5
    host link a plan fits, which the command with that link then prints."""
    argv = ["llama-3.1-8b", "--layers", "2", "--seq", "32768", "--dp", "8", "--zero", "3",
            "--device-memory", "78GiB"]  # fmt: skip
    assert simulate.main([*argv, "--host-bandwidth", "0"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "no plan: each rank needs at least 83.07 GiB of the 78.00 GiB" in printed
    assert "offloading activations to the host: with a host link of 64 GB/s each way" in printed
    assert simulate.main(argv) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "no plan" not in printed and "plan@78GiB" in printed
    assert "offload" in printed.split("note: plan@78GiB: layers")[1].split("note:")[0]


@pytest.mark.parametrize("value", ["-1", "fast", "inf"])
def test_host_bandwidth_is_a_number(value, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        simulate.main(["llama-3.1-8b", "--host-bandwidth", value])
    assert exit_info.value.code == 2
    assert "--host-bandwidth is GB/s each way" in capsys.readouterr().err


# Meta's layout of Llama-3.1-405B (TP 8 + SP, 16 stages, 1F1B over 32 micro-batches)
# at 64k tokens with loss parallelism: no plan fits 80 GB H100s without pipeline swap.
SWAP_ARGS = [
    "llama-3.1-405b", "--tp", "8", "--sp", "--loss-parallel", "--seq", "65536", "--pp", "16",
    "--microbatches", "32", "--stage-layers", "7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7",
]  # fmt: skip


def test_pipeline_swap_prints_the_job_model_s_figures_and_is_a_lever(tmp_path, capsys) -> None:
    """Without --pipeline-swap no plan fits the first rank (88.7 GiB at least) and the
    note names pipeline swap among the levers; with it a plan fits, and every row's
    device activations, total and host memory, printed and in the JSON, are
    ``job_memory``'s with ``PipelineSwap()`` for the same profile."""
    assert simulate.main(SWAP_ARGS) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "no plan: pipeline rank 0 needs at least 88.7" in printed
    assert "pipeline swap (recomp.torch.pipeline_swap; --pipeline-swap): with the" in printed
    assert "a plan fits, 28.00 GiB of host memory per device at most" in printed

    out = tmp_path / "swap.json"
    assert simulate.main([*SWAP_ARGS, "--pipeline-swap", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "schedule 1F1B, pipeline swap" in " ".join(printed.split())
    assert "no plan" not in printed
    data = json.loads(out.read_text())

    from recomp.plan import load_plan
    from recomp.plan.job import Parallel, PipelineSwap, job_memory, model_params
    from recomp.plan.models import SimulatedModel

    model = SimulatedModel("llama-3.1-405b", seq=65536, tp=8, sp=True, loss_parallel=True)
    profile = model.simulate(hardware="H100 SXM")
    params = model_params(model.meta_model())
    common = {
        "activations": profile,
        "schedule": "1F1B",
        "microbatches": 32,
        "stage_layers": [7, *[8] * 14, 7],
        "pipeline_swap": PipelineSwap(),
        "budget": Budget("74.51GiB", nbytes=data["budget_bytes"]),
    }
    layout = Parallel(tp=8, sp=True, pp=16, loss_parallel=True)
    rows: dict[str, list] = {}
    for row in data["rows"]:
        rows.setdefault(row["strategy"], []).append(row)
    plan_name = next(s for s in rows if s.startswith("plan@"))
    jobs = {s: job_memory(params, layout, option=s, **common) for s in ("none", "full+replay-collectives")}
    jobs[plan_name] = job_memory(params, layout, plan=load_plan(data["plan"]), **common)
    lines = {tuple(line.split()[:2]): line.split() for line in printed.splitlines()}
    for strategy, job in jobs.items():
        for row, rank in zip(rows[strategy], job.ranks, strict=True):
            assert (row["activations"], row["total"], row["host"]) == (
                rank.activations, rank.total, rank.host,
            ), (strategy, rank.rank)  # fmt: skip
            shown = lines.get((strategy, str(rank.rank)))
            if shown is not None:  # act, states, total, host as printed, GiB
                assert shown[2:6] == [
                    f"{v / GiB:.2f}"
                    for v in (rank.activations, rank.total - rank.activations, rank.total, rank.host)
                ]
    # The plan records what each option keeps (the swap is the count's to take off).
    plan = load_plan(data["plan"])
    for layer_plan, layer in zip(plan.layers, profile.layers, strict=True):
        assert layer_plan.kept_bytes >= layer.option(layer_plan.option).kept_bytes
    plan_rows = rows[plan_name]
    assert all(r["fits"] for r in plan_rows)
    assert max(r["host"] for r in plan_rows) > 0
    # The first rank: 1F1B holds 16 micro-batches there; with swap 3 of them whole.
    assert jobs[plan_name].ranks[0].swap_groups == (32, 32)
    without = job_memory(
        params, layout, option="full+replay-collectives", **{**common, "pipeline_swap": None}
    )
    assert jobs["full+replay-collectives"].ranks[0].activations < without.ranks[0].activations


def test_pipeline_swap_options_are_checked(capsys) -> None:
    for argv, fix in (
        (["llama-3.1-8b", "--pipeline-swap"], "--pipeline-swap swaps inside a pipeline schedule"),
        (["llama-3.1-8b", "--pp", "2", "--swap-min-gap", "5"], "add --pipeline-swap"),
        (["llama-3.1-8b", "--pp", "2", "--pipeline-swap", "--swap-min-gap", "2"], "at least 3"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            simulate.main(argv)
        assert exit_info.value.code == 2
        assert fix in capsys.readouterr().err


def _table_lines(printed: str) -> list[str]:
    """What the command printed but its "wrote PATH" lines, which are as long as the path
    given (longer in pytest-xdist's temporary directories)."""
    return [line for line in printed.splitlines() if not line.startswith("wrote ")]
