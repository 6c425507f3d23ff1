"""Read heap memory from the allocator, in a child process so the figures are clean.

glibc's mallinfo2() sees the main malloc arena only, so the child runs with
MALLOC_ARENA_MAX=1 (every allocation lands there) and OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_bytes() -> int:
    """Bytes in use on the heap now (small allocations plus mmapped blocks)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def run_measured(code: str, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh interpreter; it must define ``result`` (a JSON-able dict).

    The child has ``heap_bytes`` in scope.
    """
    prelude = "from memory import heap_bytes\n"
    script = (
        prelude + textwrap.dedent(code) + "\nimport json; print('RESULT' + json.dumps(result))\n"
    )
    env = dict(os.environ, MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
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
