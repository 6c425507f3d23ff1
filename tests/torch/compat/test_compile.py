"""``recomp.torch._compat.compile``: what a recomp checkpoint needs under ``torch.compile``.
Each test fails when PyTorch changes what recomp relies on. The compiled plans' use of
the partitioner is checked against real compiled runs in ``tests/plan/test_compiled.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from recomp.torch import _compat  # noqa: E402


def test_dynamo_bypassing_wrapper_marks_reach_the_partitioner():
    # The op exists (2.9 to 2.14), Dynamo traces it without a graph break, and the
    # MUST_SAVE marks it lets a region put on its nodes are what the partitioner reads:
    # the checkpoint's own tags came first.
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.utils.checkpoint import CheckpointPolicy

    from recomp.torch import checkpoint, checkpoint_exclude_wrapper

    assert callable(_compat.dynamo_bypassing_wrapper())
    marks = []

    def partition(joint, inputs, **kwargs):
        marks.extend(
            n.meta.get("recompute") for n in joint.graph.nodes if "recomp_region" in n.meta
        )
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        partition_fn=partition,
    )
    region = checkpoint_exclude_wrapper(lambda t: torch.sin(t) * 2, name="probe")

    def step(x):
        return checkpoint(lambda t: torch.cos(region(torch.tanh(t))), x).sum()

    torch._dynamo.reset()
    torch.compile(step, backend=backend, fullgraph=True)(
        torch.randn(3, requires_grad=True)
    ).backward()
    torch._dynamo.reset()
    assert marks and set(marks) == {CheckpointPolicy.MUST_SAVE}


def test_run_at_trace_time_runs_when_traced_not_when_run():
    calls = []

    def note() -> bool:
        calls.append(1)
        return True

    noted = _compat.run_at_trace_time(note)

    def step(x):
        noted()
        return torch.sin(x)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)  # a break would raise
    compiled(torch.randn(3))
    compiled(torch.randn(3))
    torch._dynamo.reset()
    assert calls == [1]


def test_dynamo_frame_callback_is_set_only_where_dynamo_runs_frames() -> None:
    import warnings

    seen = []

    def probe() -> None:
        seen.append(_compat.dynamo_frame_callback() is not None)

    def body(x):  # type: ignore[no-untyped-def]
        y = x + 1
        torch._dynamo.graph_break()
        probe()  # Dynamo cannot trace the question: this frame runs eagerly
        return y

    probe()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(body, backend="eager")(torch.ones(2))
    torch._dynamo.reset()
    probe()
    assert seen == [False, True, False]


def test_importing_recomp_does_not_load_dynamo() -> None:
    # Loading Dynamo takes a second or more; recomp's import leaves it to the first
    # compile or checkpoint call (PyTorch's checkpoint loads it at its first call).
    import subprocess
    import sys

    code = "import sys, torch, recomp.torch\nprint('torch._dynamo' in sys.modules)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
