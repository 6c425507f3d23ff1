"""Worker side of test_harness.py: ranks that hang or fail, and leave children behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import torch.distributed as dist


def _leave_a_grandchild(pid_file: str, rank: int) -> None:
    # In a session of its own, as launchers do with their workers: the
    # harness must find and kill it all the same.
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    with open(f"{pid_file}.{rank}", "w") as f:
        f.write(str(child.pid))


def hang(rank: int, world: int, pid_file: str) -> dict[str, Any]:
    _leave_a_grandchild(pid_file, rank)
    if rank == 1:
        time.sleep(600)
    dist.barrier()
    return {}


def crash(rank: int, world: int, pid_file: str) -> dict[str, Any]:
    _leave_a_grandchild(pid_file, rank)
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()  # rank 0 waits for a peer that is gone
    return {}


def ok(rank: int, world: int) -> dict[str, Any]:
    t = [rank]
    out = [None] * world
    dist.all_gather_object(out, t)
    return {"rank": rank, "gathered": out}


def end_rank1_once(rank: int, marker: str, how: str = "abort") -> None:
    """The first time only (``marker`` not there yet), end rank 1: ``abort`` kills it by
    SIGABRT, as gloo's I/O thread does at teardown; ``exit`` is a plain exit code 3."""
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        if how == "abort":
            os.abort()
        sys.exit(3)


def abort_once(rank: int, world: int, marker: str) -> dict[str, Any]:
    dist.barrier()
    end_rank1_once(rank, marker)
    return {"rank": rank}


if __name__ == "__main__":
    # Under torchrun (no process group): ``torchrun ... -m harness_cases MARKER HOW``.
    rank, how = int(os.environ["RANK"]), sys.argv[2]
    if rank == 0 and how == "exit":
        # Still running when rank 1 fails: torchrun then stops it with SIGTERM, so a
        # worker's negative exit code is in the failure summary, yet no rank aborted.
        time.sleep(20)
    end_rank1_once(rank, sys.argv[1], how)
    print("rank", rank, "done", flush=True)
