"""Allocator readings, without framework imports: glibc ``mallinfo2`` for CPU memory.

``mallinfo2`` reports the main malloc arena (and blocks mmapped by malloc) only. Run the
measured code in a process started with ``MALLOC_ARENA_MAX=1`` so that every thread
allocates from the main arena (``child_env`` builds that environment), and read after a
warm-up step: the first call of many kernels allocates caches that are not activations.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import lru_cache

_FIELDS = (
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


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


@lru_cache(maxsize=1)
def _mallinfo2():  # type: ignore[no-untyped-def]
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        fn = libc.mallinfo2
    except (OSError, AttributeError) as exc:
        raise RuntimeError(
            "CPU memory readings need glibc 2.33 or newer (mallinfo2); this C library has none. "
            "Run the benchmark on Linux with glibc, or on a GPU."
        ) from exc
    fn.restype = _Mallinfo2
    fn.argtypes = []
    return fn


def malloc_in_use() -> int:
    """Bytes of heap in use in the main malloc arena plus malloc's mmapped blocks."""
    info = _mallinfo2()()
    return int(info.uordblks + info.hblkhd)


def arena_is_single() -> bool:
    """Whether this process runs with one malloc arena (the readings then see all threads)."""
    return os.environ.get("MALLOC_ARENA_MAX") == "1"


def child_env(threads: int = 1) -> dict[str, str]:
    """Environment for a measuring child process: one malloc arena, ``threads`` OpenMP threads."""
    env = dict(os.environ)
    env["MALLOC_ARENA_MAX"] = "1"
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env.setdefault("GLOG_v", "3")  # MindSpore: warnings off
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env
