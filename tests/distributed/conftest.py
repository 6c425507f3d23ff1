"""Fixtures for the multi-process tests; the machinery is in dist_harness.py."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

# The tests and their rank processes import the case modules and the harness next to
# this file (pytest's importlib mode puts no test directory on sys.path).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_harness import launch_ranks, run_command


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "distributed: starts several processes (gloo ranks, torchrun or msrun)"
    )


@pytest.fixture(scope="session")
def launcher(tmp_path_factory: pytest.TempPathFactory):
    """``launcher("module:function", **kwargs)`` -> list of per-rank results (2 ranks)."""

    def _launch(target: str, **kwargs: Any) -> list[dict[str, Any]]:
        return launch_ranks(target, tmp_path_factory.mktemp("ranks"), **kwargs)

    return _launch


@pytest.fixture(scope="session")
def command_runner(tmp_path_factory: pytest.TempPathFactory):
    """``command_runner([...], name=..., timeout=...)`` -> (exit code, output)."""

    def _run(cmd: list[str], **kwargs: Any) -> tuple[int, str]:
        return run_command(cmd, tmp_path_factory.mktemp(kwargs.get("name", "cmd")), **kwargs)

    return _run
