"""MindSpore tensor parallelism on 2 workers started with msrun (examples/mindspore_tp.py).

The row-parallel all-reduce (a ``_Function``: ``ops.AllReduce`` forward,
identity backward) is an excluded region of a ``recomp.mindspore`` checkpoint,
given by hand or found by the checkpoint (``exclude_collectives``, the default).
Fails if the replay issues an all-reduce with the exclusion, or not the
expected ones with ``exclude_collectives=False``, or if a gradient differs by a
single bit from the model without checkpoints; also for a model whose
all-reduce is a plain ``ops.AllReduce`` (its own backward all-reduces again).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from dist_harness import EXAMPLES, child_env, free_port
from report_checks import (
    VARIANTS,
    assert_all_checks_pass,
    assert_parallel_model_matches_dense,
    assert_replay_all_reduces_without_exclusion,
)

pytest.importorskip("mindspore")

pytestmark = [pytest.mark.distributed, pytest.mark.system, pytest.mark.timeout(300)]

BIN = Path(sys.executable).parent
MSRUN = shutil.which("msrun", path=str(BIN)) or shutil.which("msrun")


def _worker_logs(log_dir: Path) -> str:
    out = []
    for log in sorted(log_dir.glob("*.log")):
        lines = [
            line
            for line in log.read_text(errors="replace").splitlines()
            if not line.startswith(("[WARNING]", "[INFO]"))
        ]
        out.append(f"--- {log.name} ---\n" + "\n".join(lines[-40:]))
    return "\n".join(out)


@pytest.fixture(scope="module")
def reports(command_runner, tmp_path_factory):
    if MSRUN is None:
        pytest.skip("msrun (installed with MindSpore) not found")
    tmp = tmp_path_factory.mktemp("msrun")
    log_dir, json_dir = tmp / "logs", tmp / "json"
    # msrun starts its workers with the `python` on PATH: make it this one.
    env = child_env(PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))
    cmd = [
        MSRUN,
        "--worker_num", "2",
        "--local_worker_num", "2",
        "--master_port", str(free_port()),
        "--log_dir", str(log_dir),
        "--join", "True",
        str(EXAMPLES / "mindspore_tp.py"),
        "--json-dir", str(json_dir),
    ]  # fmt: skip
    rc, output = command_runner(cmd, name="msrun", timeout=200, env=env)
    assert rc == 0, f"msrun exited with {rc}\n{output[-3000:]}\n{_worker_logs(log_dir)}"
    return [json.loads((json_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("variant", ["recomp", "recomp_full_replay"])
def test_excluded_all_reduce_is_not_replayed(reports, variant):
    layers = reports[0]["layers"]
    for r in reports:
        v = r["variants"][variant]
        assert v["counts"]["replay"] == {}, v["counts"]
        assert v["counts"]["forward"] == {"all_reduce": 2 * layers}
        # f's all-reduce of the gradient, in the backward.
        assert v["counts"]["backward"] == {"all_reduce": 2 * layers}
        assert len(v["exclusions"]) == 2 * layers
        assert all(s["runs"] == 1 for s in v["exclusions"].values()), v["exclusions"]
    for r in reports:
        skips = [s["skips"] for s in r["variants"]["recomp_full_replay"]["exclusions"].values()]
        assert skips == [1] * (2 * layers)


AUTO_EXCLUDED = ["recomp_collectives_excluded", "recomp_full_replay_collectives_excluded"]
PLAIN = ["plain_recomp", "plain_recomp_no_exclusion"]


@pytest.mark.parametrize("variant", [*AUTO_EXCLUDED, "plain_recomp"])
def test_checkpoint_excludes_the_communicating_cells(reports, variant):
    # No exclude_fn: the cell around the all-reduce is excluded by exclude_collectives.
    layers = reports[0]["layers"]
    reference = "plain_reference" if variant.startswith("plain") else "reference"
    for r in reports:
        v = r["variants"][variant]
        assert v["counts"]["replay"] == {}, v["counts"]
        ref = r["variants"][reference]["counts"]
        assert (v["counts"]["forward"], v["counts"]["backward"]) == (ref["forward"], ref["backward"])
        assert v["counts"]["forward"] == {"all_reduce": 2 * layers}
        names = [f"layers.{i}.mlp{j}.reduce" for i in range(layers) for j in (1, 2)]
        assert sorted(v["exclusions"]) == names, v["exclusions"]
        assert all(s["runs"] == 1 for s in v["exclusions"].values()), v["exclusions"]


def test_plain_all_reduce_is_replayed_with_exclude_collectives_off(reports):
    # Control for the plain model: the counter sees its all-reduces when they replay.
    layers = reports[0]["layers"]
    for r in reports:
        v = r["variants"]["plain_recomp_no_exclusion"]
        assert v["counts"]["replay"] == {"all_reduce": 2 * layers}
        assert v["exclusions"] == {}


@pytest.mark.parametrize("variant", [*VARIANTS, *AUTO_EXCLUDED, *PLAIN])
def test_gradients_bit_equal(reports, variant):
    for r in reports:
        v = r["variants"][variant]
        assert v["grads_vs_reference"] == {"same_names": True, "bitwise_equal": True}
        assert v["loss_equal"]


def test_without_exclusion_the_replay_all_reduces(reports):
    assert_replay_all_reduces_without_exclusion(reports)


def test_parallel_model_matches_dense(reports):
    assert_parallel_model_matches_dense(reports, "loss_rel_diff")


def test_all_checks_pass(reports):
    assert_all_checks_pass(reports)
