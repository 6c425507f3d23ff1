"""The launcher itself: results come back per rank; hangs and failures end in
time and leave no process behind (workers, and their children in other sessions)."""

from __future__ import annotations

import os
import time

import pytest

from dist_harness import TORCHRUN, launch_ranks, run_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.system, pytest.mark.timeout(120)]


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


def test_rank_killed_by_a_signal_is_run_again_once(tmp_path):
    marker = str(tmp_path / "aborted")
    with pytest.warns(UserWarning, match="died by a signal"):
        results = launch_ranks("harness_cases:abort_once", tmp_path, marker=marker)
    assert results == [{"rank": 0}, {"rank": 1}]
    assert os.path.exists(marker)  # the first run did abort


def _torchrun_failing_once(tmp_path, how):
    """``harness_cases.end_rank1_once`` under torchrun: rank 1 ends as ``how`` says, once."""
    if TORCHRUN is None:
        pytest.skip("torchrun not found")
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "harness_cases"]
    cmd += [str(tmp_path / "marker"), how]
    return run_torchrun(cmd, tmp_path / "runs", name=f"torchrun-{how}", timeout=90)


def test_torchrun_worker_killed_by_a_signal_is_run_again_once(tmp_path):
    with pytest.warns(UserWarning, match="died by a signal; running it again"):
        rc, output = _torchrun_failing_once(tmp_path, "abort")
    assert rc == 0, output[-3000:]
    assert output.count(" done") == 2  # both ranks, and the output is the second run's


def test_torchrun_plain_failure_is_not_run_again(tmp_path, recwarn):
    rc, _ = _torchrun_failing_once(tmp_path, "exit")
    assert rc != 0
    assert not [w for w in recwarn if "running it again" in str(w.message)]
