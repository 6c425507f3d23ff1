"""Where things are, for tests that run files or processes: the repository, its sources,
the tests and these helpers (put on ``sys.path`` by ``tests/conftest.py``)."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
ROOT = TESTS.parent
SRC = ROOT / "src"
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BENCHMARKS = ROOT / "benchmarks"
