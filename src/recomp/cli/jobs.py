"""Child processes of ``recomp bench`` and ``recomp plan``: each job is one :class:`Task`
run by ``recomp.cli.worker`` in a process of its own, with one malloc arena, while a
progress bar on stderr follows the :class:`ProgressMessage` lines it prints.

Nothing outlives :func:`run_jobs`: its files (tasks, results, the children's stderr, and
the children's own temporary files: their ``TMPDIR`` points into it) are in one
temporary directory, removed when it returns or raises; a child still running then
(Ctrl-C, an error in the parent) is terminated with its process group first.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import TypeVar

from .memory import child_env
from .messages import (
    MessageError,
    ProgressMessage,
    Task,
    TaskResult,
    result_from_json,
)

R = TypeVar("R", bound=TaskResult)

# How long a terminated child gets to clean up before it is killed.
TERMINATE_GRACE_S = 5.0

# --------------------------------------------------------------------------- progress


class Progress:
    """A plain-text progress bar on stderr (redrawn in place on a terminal), in units of
    work: ``finished`` counts the units of the batches of jobs run to the end."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total = max(1, total)
        self.finished = 0.0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()
        self._last_label = ""

    def show(self, done: float, label: str) -> None:
        if not self.enabled:
            return
        frac = min(done, self.total) / self.total
        width = 30
        fill = round(frac * width)
        elapsed = time.monotonic() - self.start
        text = f"[{'#' * fill}{'.' * (width - fill)}] {frac * 100:5.1f}%  {elapsed:5.0f}s  {label}"
        if self.tty:
            sys.stderr.write("\r" + text[:110].ljust(110))
            sys.stderr.flush()
        elif label != self._last_label:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
            self._last_label = label

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.enabled = False


# --------------------------------------------------------------------------- jobs


class Job:
    """One task for a child process and what came of it: ``result`` if the child wrote
    one, else ``error`` (the last line the child wrote to stderr, or its exit code)."""

    def __init__(self, name: str, task: Task, units: int) -> None:
        self.name = name
        self.task = task
        self.units = units
        self.done_units = 0.0
        self.result: TaskResult | None = None
        self.error: str | None = None

    def outcome(self, kind: type[R]) -> R | None:
        """The result, of the type the task's kind returns; None if the child failed."""
        if self.result is None:
            return None
        if not isinstance(self.result, kind):
            raise MessageError(f"{self.name}: expected a {kind.__name__}, got {self.result}")
        return self.result


def child_environment(threads: int, scratch: str) -> dict[str, str]:
    """The environment of a measuring child (``child_env``) with its temporary files in
    ``scratch``, which the parent removes. That includes PyTorch's compile cache
    (``torchinductor_USER`` in the temporary directory), shared by the children of one
    run; set ``TORCHINDUCTOR_CACHE_DIR`` to keep it between runs."""
    env = child_env(threads)
    env["TMPDIR"] = scratch
    return env


class _Child:
    """A running job: its process, in a process group of its own, and its files."""

    def __init__(self, job: Job, workdir: str, events: queue.Queue[tuple[Job, str | None]]):
        self.job = job
        stem = os.path.join(workdir, f"job{id(job)}")
        self.result_path = stem + "-result.json"
        self.stderr_path = stem + "-stderr.txt"
        scratch = stem + "-tmp"
        os.mkdir(scratch)
        task_path = stem + "-task.json"
        with open(task_path, "w") as f:
            f.write(job.task.to_json())
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "recomp.cli.worker", task_path, self.result_path],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=child_environment(job.task.config.threads, scratch),
                start_new_session=True,
            )
        self.reader = threading.Thread(target=self._read, args=(events,), daemon=True)
        self.reader.start()

    def _read(self, events: queue.Queue[tuple[Job, str | None]]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            events.put((self.job, line))
        events.put((self.job, None))

    def finish(self) -> None:
        """After the child closed its stdout: its result, or why there is none."""
        code = self.proc.wait()
        self.reader.join()
        job = self.job
        job.done_units = job.units
        if code == 0 and os.path.exists(self.result_path):
            with open(self.result_path) as f:
                text = f.read()
            try:
                job.result = result_from_json(job.task.kind, text)
            except MessageError as exc:
                job.error = f"{type(exc).__name__}: {exc}"
            return
        with open(self.stderr_path, errors="replace") as f:
            tail = f.read().strip().splitlines()
        job.error = (tail[-1] if tail else f"exit code {code}")[:300]

    def stop(self) -> None:
        """Terminate the child and whatever it started, kill them if they linger."""
        for sig, wait in ((signal.SIGTERM, TERMINATE_GRACE_S), (signal.SIGKILL, None)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        # The group may outlive its leader (a compile worker): end it too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.reader.join(TERMINATE_GRACE_S)


def run_jobs(jobs: list[Job], parallel: int, progress: Progress) -> None:
    """Run ``jobs`` as worker processes, ``parallel`` at a time, feeding the progress
    bar; each job ends with its ``result`` or its ``error``. On an exception here
    (KeyboardInterrupt included) the children still running are terminated and every
    file of the run is removed before it propagates."""
    events: queue.Queue[tuple[Job, str | None]] = queue.Queue()
    pending = list(jobs)
    running: dict[int, _Child] = {}

    def show(label: str) -> None:
        progress.show(progress.finished + sum(j.done_units for j in jobs), label)

    with tempfile.TemporaryDirectory(prefix="recomp-") as workdir:
        try:
            while pending or running:
                while pending and len(running) < max(1, parallel):
                    job = pending.pop(0)
                    running[id(job)] = _Child(job, workdir, events)
                    show(job.name)
                job, line = events.get()
                if line is None:
                    running.pop(id(job)).finish()
                    show(f"{job.name} done")
                    continue
                message = ProgressMessage.from_line(line)
                if message is not None:
                    job.done_units = job.units * message.fraction
                    show(f"{job.name} {message.done}/{message.total}")
        finally:
            for child in running.values():
                child.stop()
    progress.finished += sum(j.units for j in jobs)
