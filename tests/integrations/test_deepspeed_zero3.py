"""DeepSpeed ZeRO-3 on CPU (one process, gloo): an excluded region keeps no gathered copy
of the parameters it used once the forward is over, and the gradients are those of the
same model under ZeRO-3 without recomp. Skipped where DeepSpeed is not installed; the
first run builds DeepSpeed's shared-memory communication op (several minutes), later
runs take under a minute. The case runs in ``deepspeed_zero3_case.py``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

import paths

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed"
    ),
]


def test_excluded_region_frees_gathered_parameters_under_zero3(tmp_path):
    python_path = os.pathsep.join([str(paths.SRC), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, PYTHONPATH=python_path, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    case = paths.TESTS / "integrations" / "deepspeed_zero3_case.py"
    proc = subprocess.run(
        [sys.executable, str(case)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "plain: 0 alive" in proc.stdout, proc.stdout
    assert "excluded: 0 alive" in proc.stdout, proc.stdout
    assert "gradients equal: True" in proc.stdout, proc.stdout
