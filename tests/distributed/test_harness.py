"""The launcher itself: results come back per rank; hangs and failures end in
time and leave no process behind (workers, and their children in other sessions)."""

from __future__ import annotations

import os
import time

import pytest
from dist_harness import launch_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _grandchildren(pid_file) -> list[int]:
    return [
        int(open(f"{pid_file}.{r}").read()) for r in range(2) if os.path.exists(f"{pid_file}.{r}")
    ]


def test_results_per_rank(tmp_path):
    results = launch_ranks("harness_cases:ok", tmp_path)
    assert results == [{"rank": r, "gathered": [[0], [1]]} for r in range(2)]


@pytest.mark.parametrize("case", ["hang", "crash"])
def test_failures_are_bounded_and_cleaned_up(tmp_path, case):
    pid_file = str(tmp_path / "grandchild")
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        launch_ranks(f"harness_cases:{case}", tmp_path, timeout=15, peer_grace=2, pid_file=pid_file)
    assert time.monotonic() - start < 60
    message = str(failure.value)
    if case == "hang":
        assert "timed out after 15s" in message
    else:
        assert "rank 1 fails on purpose" in message
    children = _grandchildren(pid_file)
    assert children  # the ranks got as far as starting one (normally both)
    assert not [pid for pid in children if _alive(pid)]
