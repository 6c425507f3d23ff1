"""``recomp bench --tp 2``: the built-in decoder with DTensor TP + SP on 2 gloo processes.

Runs the command once on a small size (bounded in time; the harness checks that no
rank outlives it) and asserts what the table claims: the default checkpoints replay
no collective and keep exactly the all-gathered and reduce-scattered tensors their
replay reaches (from the shapes), those with ``exclude_collectives=False`` keep
nothing, replay the collectives and need less activation memory, by the kept bytes;
the gradients equal those of the parallelised model without checkpoints; the run
leaves its temporary directory as empty as it found it.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from dist_harness import child_env

pytestmark = [pytest.mark.distributed, pytest.mark.system, pytest.mark.timeout(300)]

LAYERS, HIDDEN, HEADS, SEQ, BATCH = 2, 128, 4, 128, 2
TP = 2
FLOAT32 = 4


@pytest.fixture(scope="module")
def report(command_runner, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-tp") / "tp.json"
    tmpdir = tmp_path_factory.mktemp("bench-tp-tmpdir")
    cmd = [
        sys.executable, "-m", "recomp", "bench", "--tp", str(TP),
        "--layers", str(LAYERS), "--hidden", str(HIDDEN), "--heads", str(HEADS),
        "--seq", str(SEQ), "--batch", str(BATCH), "--json", str(out), "--quiet",
    ]  # fmt: skip
    env = child_env(TMPDIR=str(tmpdir))
    rc, output = command_runner(cmd, name="bench-tp", timeout=240, env=env)
    assert rc == 0, output[-3000:]
    assert "kept for collectives MiB" in output
    assert os.listdir(tmpdir) == [], "recomp bench --tp left temporary files"
    return {row["strategy"]: row for row in json.loads(out.read_text())["rows"]}


def _kept(strategy):
    """Per block: DTensor all-gathers the sequence before attention and the MLP and
    reduce-scatters each output; early stop drops the MLP's reduce-scatter, excluding
    attention its all-gather and reduce-scatter."""
    gathered = BATCH * SEQ * HIDDEN * FLOAT32
    scattered = BATCH * (SEQ // TP) * HIDDEN * FLOAT32
    per_block = {"full": 2 * gathered + scattered, "exclude:attn": gathered}[strategy]
    return LAYERS * per_block


def test_rows_and_gradients(report):
    assert list(report) == [
        "none",
        "full",
        "full+replay-collectives",
        "exclude:attn",
        "full+replay-collectives+exclude:attn",
    ]
    for row in report.values():
        assert row["max_grad_diff"] == 0.0, row
        assert row["loss"] == report["none"]["loss"]
        assert row["forward_collectives"] == report["none"]["forward_collectives"]


@pytest.mark.parametrize("strategy", ["none", "full", "exclude:attn"])
def test_default_rows_replay_no_collective(report, strategy):
    row = report[strategy]
    assert row["replay_collectives"] == {}
    assert row["replay_comm_bytes"] == 0
    assert row["kept_collective_bytes"] == (0 if strategy == "none" else _kept(strategy))


@pytest.mark.parametrize("strategy", ["full", "exclude:attn"])
def test_keeping_nothing_replays_collectives_and_saves_the_kept_bytes(report, strategy):
    replaying = "full+replay-collectives" + ("" if strategy == "full" else f"+{strategy}")
    kept, nothing = report[strategy], report[replaying]
    assert nothing["kept_collective_bytes"] == 0
    expected = {
        "full": {"all_gather": 2 * LAYERS, "reduce_scatter": LAYERS},
        "exclude:attn": {"all_gather": LAYERS},
    }[strategy]
    assert nothing["replay_collectives"] == expected
    # Each replayed collective's input: a sequence shard (all-gather) or the whole
    # sequence (reduce-scatter).
    shard, whole = BATCH * (SEQ // TP) * HIDDEN, BATCH * SEQ * HIDDEN
    numel = expected["all_gather"] * shard + expected.get("reduce_scatter", 0) * whole
    assert nothing["replay_comm_bytes"] == numel * FLOAT32
    # The allocator's difference is the kept bytes, up to 2% and 8 KiB per layer (as
    # tests/distributed/test_plan_sequence_parallel.py).
    difference = kept["activation_bytes"] - nothing["activation_bytes"]
    slack = 0.02 * kept["kept_collective_bytes"] + 8 * 1024 * LAYERS
    assert abs(difference - kept["kept_collective_bytes"]) <= slack, (difference, kept)
