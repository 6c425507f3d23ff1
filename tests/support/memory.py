"""Run measured code in a child process, with the benchmark's allocator reader.

The child gets one malloc arena (``MALLOC_ARENA_MAX=1``) so that glibc's
``mallinfo2`` sees every allocation, and has ``heap_bytes`` in scope.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from recomp.cli.memory import child_env
from recomp.cli.memory import malloc_in_use as heap_bytes

__all__ = ["heap_bytes", "run_measured"]


def run_measured(code: str, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh interpreter; it must define ``result`` (a JSON-able dict)."""
    prelude = "from memory import heap_bytes\n"
    script = (
        prelude + textwrap.dedent(code) + "\nimport json; print('RESULT' + json.dumps(result))\n"
    )
    env = child_env(threads=1)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(__file__), *filter(None, [env.get("PYTHONPATH")])]
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"measured child failed:\n{proc.stdout}\n{proc.stderr}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])
