"""Child processes of ``recomp bench`` and ``recomp plan``: each job is one task of
``recomp.bench.worker`` (profile and plan, measure, or time), run in a process of its own
with one malloc arena, while a progress bar on stderr follows their ``PROGRESS`` lines."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from .memory import child_env

# --------------------------------------------------------------------------- progress


class Progress:
    """A plain-text progress bar on stderr (redrawn in place on a terminal)."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total = max(1, total)
        self.done = 0.0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()
        self.label = ""
        self._last_line = ""

    def update(self, done: float | None = None, label: str | None = None) -> None:
        if done is not None:
            self.done = min(done, self.total)
        if label is not None:
            self.label = label
        if not self.enabled:
            return
        frac = self.done / self.total
        width = 30
        fill = round(frac * width)
        elapsed = time.monotonic() - self.start
        text = (
            f"[{'#' * fill}{'.' * (width - fill)}] {frac * 100:5.1f}%  "
            f"{elapsed:5.0f}s  {self.label}"
        )
        if self.tty:
            sys.stderr.write("\r" + text[:110].ljust(110))
            sys.stderr.flush()
        elif self.label != self._last_line:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
            self._last_line = self.label

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


# --------------------------------------------------------------------------- child runs


class Job:
    def __init__(self, name: str, task: dict[str, Any], units: int) -> None:
        self.name = name
        self.task = task
        self.units = units
        self.done_units = 0.0
        self.result: dict[str, Any] | None = None
        self.error: str | None = None


def run_jobs(jobs: list[Job], parallel: int, progress: Progress, offset: list[float]) -> None:
    """Run ``jobs`` as worker processes, ``parallel`` at a time, feeding the progress bar."""
    events: queue.Queue[tuple[Job, str]] = queue.Queue()
    pending = list(jobs)
    running: list[tuple[Job, subprocess.Popen[str], str]] = []
    tmp = tempfile.mkdtemp(prefix="recomp-bench-")

    def reader(job: Job, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            events.put((job, line))
        events.put((job, "\0EOF"))

    def total_done() -> float:
        return offset[0] + sum(j.done_units for j in jobs)

    finished = 0
    while pending or running:
        while pending and len(running) < max(1, parallel):
            job = pending.pop(0)
            task_path = os.path.join(tmp, f"{id(job)}-task.json")
            result_path = os.path.join(tmp, f"{id(job)}-result.json")
            with open(task_path, "w") as f:
                json.dump(job.task, f)
            err_path = result_path + ".err"
            err = open(err_path, "w")  # noqa: SIM115 - closed when the job ends
            proc = subprocess.Popen(
                [sys.executable, "-m", "recomp.bench.worker", task_path, result_path],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=child_env(job.task["config"]["threads"]),
            )
            err.close()
            running.append((job, proc, result_path))
            threading.Thread(target=reader, args=(job, proc), daemon=True).start()
            progress.update(total_done(), job.name)
        job, line = events.get()
        if line.startswith("PROGRESS"):
            _, done, total = line.split()
            job.done_units = job.units * int(done) / max(1, int(total))
            progress.update(total_done(), f"{job.name} {done}/{total}")
        elif line == "\0EOF":
            entry = next(e for e in running if e[0] is job)
            running.remove(entry)
            _, proc, result_path = entry
            code = proc.wait()
            job.done_units = job.units
            finished += 1
            if code == 0 and os.path.exists(result_path):
                with open(result_path) as f:
                    job.result = json.load(f)
            else:
                with open(result_path + ".err") as f:
                    tail = f.read().strip().splitlines()
                job.error = (tail[-1] if tail else f"exit code {code}")[:300]
            progress.update(total_done(), f"{job.name} done")
    offset[0] += sum(j.units for j in jobs)
