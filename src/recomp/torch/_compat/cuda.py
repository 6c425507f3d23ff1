"""The CUDA caching allocator: its memory history, allocation labels and OOM observer.

Consumers: ``torch/_backend.py`` (labelling an excluded region's allocations) and
``torch/_oom_report.py`` (the report on an out-of-memory error).
Tested by ``tests/torch/compat/test_cuda.py`` (on a CPU only what holds without CUDA).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


def memory_history_enabled() -> bool:
    """Whether ``torch.cuda.memory._record_memory_history`` is recording on this process.

    Why: an excluded region labels its allocations in memory snapshots only while they
    are recorded; otherwise it costs one check (CUDA not initialised: one Python call).
    Private: ``torch._C._cuda_isHistoryEnabled`` has no public wrapper.
    If it changes: False (regions are not labelled; nothing else depends on it).
    Retired by: a public query of the recording state.
    """
    if not torch.cuda.is_initialized():
        return False
    query = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    try:
        return bool(query()) if query is not None else False
    except RuntimeError:
        return False


@contextlib.contextmanager
def memory_label(label: str) -> Iterator[None]:
    """Label the CUDA allocations this thread makes inside the block, in memory snapshots.

    Private: ``torch.cuda.memory._set_memory_metadata`` (the ``user_metadata`` of each
    trace entry, shown by pytorch.org/memory_viz) and its getter, to restore an outer
    label. A ``record_function`` range of the same name marks the block for the profiler.
    If it changes: no label (the block runs as it would without).
    Retired by: a public allocation-annotation API.
    """
    memory = torch.cuda.memory
    set_label = getattr(memory, "_set_memory_metadata", None)
    get_label = getattr(memory, "_get_memory_metadata", None)
    previous = None
    if set_label is not None and get_label is not None:
        try:
            previous = get_label()
            set_label(label)
        except RuntimeError:
            previous = None
    try:
        with torch.autograd.profiler.record_function(label):
            yield
    finally:
        if previous is not None and set_label is not None:
            set_label(previous)


_OOM_OBSERVER_ATTACHED = False


def attach_cuda_oom_observer(observer: Callable[[int, int, int, int], None]) -> bool:
    """Have the CUDA caching allocator call ``observer(device, alloc, device_allocated,
    device_free)`` when an allocation fails, before it raises ``OutOfMemoryError``.

    Private: ``torch._C._cuda_attach_out_of_memory_observer`` (what
    ``torch.cuda.memory._record_memory_history`` uses for its OOM snapshots). It has no
    detach: attach one observer per process that forwards to whatever is installed.
    Returns False without CUDA or if the function is gone (then nothing is attached:
    call the report yourself when you catch ``torch.OutOfMemoryError``).
    """
    global _OOM_OBSERVER_ATTACHED
    if _OOM_OBSERVER_ATTACHED:
        return True
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None or not torch.cuda.is_available():
        return False
    attach(observer)
    _OOM_OBSERVER_ATTACHED = True
    return True
