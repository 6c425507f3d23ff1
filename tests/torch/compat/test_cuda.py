"""``recomp.torch._compat.cuda``: the CUDA caching allocator's memory history and
allocation labels. On a machine without CUDA, what must hold there: recording is off, and
a label still marks its block for the profiler and changes nothing else."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from recomp.torch import _compat  # noqa: E402

LABEL = "recomp region test"


def test_memory_history_is_off_without_cuda_and_a_label_marks_its_block_for_the_profiler():
    if torch.cuda.is_available():
        pytest.skip("checked on a GPU by the device script")
    assert _compat.memory_history_enabled() is False
    results = []
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu) as prof, _compat.memory_label(LABEL):
        results.append(torch.ones(2).sum().item())
    assert results == [2.0]  # the block ran once, as it would without the label
    assert [event.name for event in prof.events()].count(LABEL) == 1  # one range, named so
    with pytest.raises(KeyError, match="passes through"), _compat.memory_label(LABEL):
        raise KeyError("passes through")
