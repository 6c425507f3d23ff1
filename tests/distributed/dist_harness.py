"""Launching multi-process tests (used through the fixtures in conftest.py): bounded in time, no stray processes, results as files.

``launch_ranks`` starts one ``python _worker.py`` per rank (gloo over a
``file://`` rendezvous in the test's tmp dir, so no port is needed);
``run_command`` runs a launcher such as ``torchrun`` or ``msrun``
(``run_torchrun`` adds the rerun policy below for torchrun). Both

* put their processes in a new session and watch every descendant (by pid and
  start time, so a reused pid is never touched), including the ones a
  launcher moves into sessions of their own;
* stop at a deadline, kill everything they started on timeout or failure, and
  check that nothing they started is left alive;
* collect each process's output into a log file whose tail is shown on failure;
* run once more, with a warning, a run in which a rank was killed by a signal
  (gloo's I/O thread aborts now and then while a group is torn down, after the
  work is done); a second failure, or any other failure, fails the test.

Results travel as JSON files written by the ranks and are asserted in the
parent (the pytest process).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
EXAMPLES = REPO / "examples"
HERE = Path(__file__).resolve().parent
WORKER = HERE / "_worker.py"
PYTHON = sys.executable
TORCHRUN = shutil.which("torchrun", path=str(Path(PYTHON).parent)) or shutil.which("torchrun")

# Every launch is bounded by this many seconds unless a test asks otherwise.
DEFAULT_TIMEOUT = float(os.environ.get("RECOMP_DIST_TIMEOUT", "150"))


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(SRC), str(EXAMPLES), str(HERE)]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    # Two ranks share two cores: one thread each keeps them from fighting.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    # A rank that dies by a signal prints every thread's Python stack into its log.
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- process tracking


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie is dead already; its parent will reap it
        return None
    return int(fields[1]), int(fields[19])


class ProcessTree:
    """Remembers every descendant of some root processes, to kill them all later."""

    def __init__(self, roots: Iterable[int]) -> None:
        self.known: dict[int, int] = {}  # pid -> start time
        for pid in roots:
            st = _stat(pid)
            if st is not None:
                self.known[pid] = st[1]

    def scan(self) -> None:
        parents: dict[int, list[int]] = {}
        starts: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                st = _stat(int(entry))
                if st is not None:
                    parents.setdefault(st[0], []).append(int(entry))
                    starts[int(entry)] = st[1]
        stack = [p for p in self.known if starts.get(p) == self.known[p]]
        while stack:
            for child in parents.get(stack.pop(), []):
                if child not in self.known:
                    self.known[child] = starts[child]
                    stack.append(child)

    def alive(self) -> list[int]:
        out = []
        for pid, start in self.known.items():
            st = _stat(pid)
            if st is not None and st[1] == start:
                out.append(pid)
        return out

    def kill(self, grace: float = 3.0) -> None:
        """SIGTERM everything still alive (launchers forward it), then SIGKILL."""
        self.scan()
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            pids = self.alive()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and self.alive():
                time.sleep(0.05)


def _tail(path: Path, n: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "<no log>"
    return text[-n:]


# --------------------------------------------------------------------------- launchers

_Run = TypeVar("_Run")


def _rerun_once_if_killed(
    run: Callable[[Path], _Run], killed: Callable[[_Run], bool], base: Path, label: str
) -> _Run:
    """``run(base / "attempt1")``, and once more if ``killed`` says a process died by a signal.

    gloo's I/O thread now and then aborts a rank while the group is torn down, after
    all the work is done ("terminate called without an active exception"); a second
    run tells that apart from a real failure. Whatever the second run gives stands.
    """
    result = run(base / "attempt1")
    if killed(result):
        warnings.warn(f"{label}: a process died by a signal; running it again", stacklevel=3)
        result = run(base / "attempt2")
    return result


def launch_ranks(
    target: str,
    tmp_path: Path,
    *,
    world_size: int = 2,
    timeout: float = DEFAULT_TIMEOUT,
    peer_grace: float = 10.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """Run ``target`` ("module:function") on ``world_size`` ranks; return each rank's result.

    The function is called as ``function(rank, world_size, **kwargs)`` inside a
    gloo process group; modules are found on src/, examples/ and this folder.
    ``env``: variables added to the ranks' environment (``MALLOC_ARENA_MAX=1`` for
    allocator readings).
    The run fails after ``timeout`` seconds, or ``peer_grace`` seconds after a
    rank failed while another still runs (it is likely waiting for the dead one).
    A run in which a rank was killed by a signal is run once more (see
    ``_rerun_once_if_killed``); any other failure, or a second one, fails the test.
    """

    def killed(run: tuple[str | None, list[int | None], list[Path], Path]) -> bool:
        failure, codes = run[0], run[1]
        signalled = any(c is not None and c < 0 for c in codes)
        return failure is not None and "timed out" not in failure and signalled

    failure, _, logs, run_dir = _rerun_once_if_killed(
        lambda base: _launch_once(target, base, world_size, timeout, peer_grace, kwargs, env or {}),
        killed,
        tmp_path,
        target,
    )
    if failure is not None:
        details = "\n".join(
            f"--- rank {r} log (tail) ---\n{_tail(log)}" for r, log in enumerate(logs)
        )
        pytest.fail(f"{target} on {world_size} ranks: {failure}\n{details}", pytrace=False)
    results = []
    for rank in range(world_size):
        with open(run_dir / f"rank{rank}.json") as f:
            results.append(json.load(f))
    return results


def _launch_once(
    target: str,
    base: Path,
    world_size: int,
    timeout: float,
    peer_grace: float,
    kwargs: dict[str, Any],
    extra_env: dict[str, str],
) -> tuple[str | None, list[int | None], list[Path], Path]:
    """One run of ``launch_ranks``: (failure or None, exit codes, log paths, run folder)."""
    base.mkdir(parents=True, exist_ok=True)
    run_dir = base / f"ranks-{target.replace(':', '-')}"
    run_dir.mkdir()
    env = child_env(
        WORLD_SIZE=str(world_size),
        RECOMP_TEST_INIT=f"file://{run_dir / 'rendezvous'}",
        RECOMP_TEST_OUT=str(run_dir),
        **extra_env,
    )
    procs: list[subprocess.Popen[bytes]] = []
    logs = [run_dir / f"rank{r}.log" for r in range(world_size)]
    tree = ProcessTree([])
    failure = None
    codes: list[int | None] = []
    try:
        for rank in range(world_size):
            with open(logs[rank], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [PYTHON, str(WORKER), target, json.dumps(kwargs)],
                        env={**env, "RANK": str(rank)},
                        cwd=REPO,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        # Its own session: a signal to pytest's terminal does not
                        # reach it half-way; cleanup below is explicit instead.
                        start_new_session=True,
                    )
                )
            tree = ProcessTree(p.pid for p in procs)
        deadline = time.monotonic() + timeout
        first_failure_at = None
        while True:
            tree.scan()
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if first_failure_at is None and any(c not in (None, 0) for c in codes):
                first_failure_at = time.monotonic()
            now = time.monotonic()
            if now > deadline:
                failure = f"timed out after {timeout:.0f}s"
                break
            # A rank that failed leaves its peer waiting in a collective: stop it.
            if first_failure_at is not None and now - first_failure_at > peer_grace:
                failure = "a rank failed; its peer did not finish"
                break
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        if failure is None and any(c != 0 for c in codes):
            failure = f"exit codes {codes}"
    finally:
        tree.kill()
        for p in procs:
            if p.poll() is None:  # pragma: no cover - kill() above got it
                p.kill()
            p.wait()
        leftover = tree.alive()
    assert not leftover, f"processes left alive after the run: {leftover}"
    return failure, codes, logs, run_dir


def run_command(
    cmd: list[str],
    tmp_path: Path,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict[str, str] | None = None,
    name: str = "command",
) -> tuple[int, str]:
    """Run a launcher command bounded in time; return (exit code, combined output).

    On timeout everything it started is killed and the test fails with the
    output's tail.
    """
    tmp_path.mkdir(parents=True, exist_ok=True)
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            env=env or child_env(),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    tree = ProcessTree([proc.pid])
    timed_out = False
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            tree.scan()
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        tree.kill()
        if proc.poll() is None:  # pragma: no cover
            proc.kill()
        proc.wait()
        leftover = tree.alive()
    output = log_path.read_text(errors="replace")
    assert not leftover, f"processes left alive after {name}: {leftover}"
    if timed_out:
        pytest.fail(
            f"{name} timed out after {timeout:.0f}s: {' '.join(cmd)}\n{output[-4000:]}",
            pytrace=False,
        )
    return proc.returncode, output


# torchrun's failure summary names the first worker that failed ("Root Cause") and its
# exit code, negative for a signal. Only that one counts: torchrun stops the other
# workers with SIGTERM, so theirs are negative whenever any worker fails.
_TORCHRUN_SIGNAL_EXIT = re.compile(r"Root Cause .*?exitcode\s*:\s*-\d+", re.DOTALL)


def run_torchrun(cmd: list[str], tmp_path: Path, *, name: str, **kwargs: Any) -> tuple[int, str]:
    """``run_command`` for a ``torchrun`` command, with ``launch_ranks``' rerun policy."""
    return _rerun_once_if_killed(
        lambda base: run_command(cmd, base, name=name, **kwargs),
        lambda run: run[0] != 0 and _TORCHRUN_SIGNAL_EXIT.search(run[1]) is not None,
        tmp_path,
        name,
    )
