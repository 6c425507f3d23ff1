"""The PyTorch examples run as documented: ``torchrun --nproc_per_node 2 examples/<name>.py``.

Each example checks itself (collective counts per phase, gradient agreement),
prints a report per rank, and exits non-zero if a check fails.
"""

from __future__ import annotations

import json

import pytest

from dist_harness import EXAMPLES, TORCHRUN, run_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.system, pytest.mark.timeout(240)]


@pytest.mark.parametrize("name", ["tp", "moe", "fsdp2", "dtensor_tp"])
def test_example_under_torchrun(name, tmp_path):
    if TORCHRUN is None:
        pytest.skip("torchrun not found")
    cmd = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node", "2",
        str(EXAMPLES / f"{name}.py"),
        "--json-dir", str(tmp_path),
    ]  # fmt: skip
    rc, output = run_torchrun(cmd, tmp_path / "runs", name=f"torchrun-{name}", timeout=150)
    assert rc == 0, output[-4000:]
    assert "OK" in output.splitlines(), output[-4000:]
    for rank in range(2):
        assert f"[rank {rank}]   check " in output
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["ok"], report["checks"]
        assert report["variants"]["recomp"]["counts"]["replay"] == {}
