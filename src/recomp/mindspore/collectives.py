"""Count MindSpore collectives per training phase (PyNative).

The MindSpore counterpart of :mod:`recomp.torch.collectives`, with the same
phases:

``forward``
    the ordinary forward pass;
``replay``
    forward code that a recomp checkpoint re-runs during backward
    (:func:`recomp.is_recomputing` is true);
``backward``
    everything else that runs inside MindSpore's autodiff engine.

Example::

    from recomp.mindspore.collectives import count_collectives

    with count_collectives() as counts:
        loss, grads = value_and_grad_fn(x)
    assert counts.total("replay") == 0, counts

How it works, and what it sees: MindSpore has no dispatcher hook that every
operator passes through (PyTorch's ``TorchDispatchMode``), so while the block
runs the counter wraps MindSpore's Python entry points for collectives:

* ``__call__`` of the communication primitives in
  ``mindspore.ops.operations.comm_ops`` (``ops.AllReduce()``,
  ``ops.AllGather()``, ``ops.AlltoAll()``, ``ops.AlltoAllV()``, ...);
* the functions of ``mindspore.mint.distributed``,
  ``mindspore.ops.communication`` and ``mindspore.communication.comm_func``
  (``all_reduce``, ``all_to_all_single``, ...), wherever those modules
  expose them.

A call made inside another counted call (a function built on a primitive) is
counted once. Not seen: a collective that C++ issues without going through
Python (for example a bprop written in C++), and a function that the caller
bound with ``from ... import all_reduce`` before the block started (the
module attribute is what is wrapped). Collectives that user code issues in
its own ``_Function.forward`` / ``backward`` through the APIs above are seen.
The wrapping is removed when the block exits.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .._collectives import (
    DEFAULT_IS_REPLAYING,
    PHASES,
    CollectiveCounts,
    CollectiveEvent,
    current_phase,
)
from ._backend import BACKEND

__all__ = ["PHASES", "CollectiveCounts", "CollectiveEvent", "count_collectives"]


# Communication primitives (mindspore.ops.operations.comm_ops) -> kind.
_PRIMITIVES = {
    "AllReduce": "all_reduce",
    "AllGather": "all_gather",
    "AllGatherV": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "ReduceScatterV": "reduce_scatter",
    "AlltoAll": "all_to_all",
    "AlltoAllV": "all_to_all",
    "AlltoAllVC": "all_to_all",
    "_AllSwap": "all_to_all",
    "NeighborExchange": "all_to_all",
    "NeighborExchangeV2": "all_to_all",
    "Broadcast": "broadcast",
    "Reduce": "reduce",
    "CollectiveGather": "gather",
    "CollectiveScatter": "scatter",
    "Send": "send",
    "Receive": "recv",
    "Barrier": "barrier",
}

# Functional collectives -> kind, looked up in each of _FUNCTION_MODULES.
_FUNCTIONS = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_uneven": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_uneven": "reduce_scatter",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "all_to_all_v_c": "all_to_all",
    "all_to_all_with_output_shape": "all_to_all",
    "all_to_all_single_with_output_shape": "all_to_all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "gather_into_tensor": "gather",
    "scatter": "scatter",
    "scatter_tensor": "scatter",
    "send": "send",
    "isend": "send",
    "recv": "recv",
    "irecv": "recv",
    "batch_isend_irecv": "send_recv",
    "barrier": "barrier",
}

_FUNCTION_MODULES = (
    "mindspore.mint.distributed",
    "mindspore.mint.distributed.distributed",
    "mindspore.ops.communication",
    "mindspore.ops.function.comm_func",
    "mindspore.communication.comm_func",
)


def primitive_classes() -> dict[type, str]:
    """The communication primitive classes this MindSpore has -> their class name."""
    from mindspore.ops.operations import comm_ops

    classes = (getattr(comm_ops, name, None) for name in _PRIMITIVES)
    return {cls: cls.__name__ for cls in classes if isinstance(cls, type)}


def collective_functions() -> dict[int, str]:
    """``id`` of each functional collective (as the modules hold it now, and the
    original behind a counter's wrapping) -> its name."""
    found: dict[int, str] = {}
    for module_name in _FUNCTION_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in _FUNCTIONS:
            fn = module.__dict__.get(name)
            while callable(fn):
                found[id(fn)] = name
                fn = getattr(fn, "__wrapped__", None) if getattr(fn, "__recomp_counted__", False) else None
    return found


class _Counter:
    """The active counters (a stack: blocks may nest), the watchers of the checkpoint
    forwards (``recomp.mindspore._communicating``) and the wrapped entry points."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: list[tuple[CollectiveCounts, Callable[[], bool]]] = []
        self.watchers: list[Callable[[str], None]] = []
        self.restore: list[tuple[Any, str, Any]] = []
        self.local = threading.local()

    def count(self, kind: str, op: str) -> None:
        for watcher in list(self.watchers):
            watcher(op)
        if not self.active:
            return
        counts, is_replaying = self.active[-1]
        counts.record(current_phase(is_replaying, BACKEND.in_backward), kind, op)

    def wrap(self, fn: Callable[..., Any], kind: str, op: str) -> Callable[..., Any]:
        counter = self

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(counter.local, "depth", 0)
            if depth == 0:
                counter.count(kind, op)
            counter.local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.local.depth = depth

        counted.__recomp_counted__ = True  # type: ignore[attr-defined]
        return counted

    def install(self) -> None:
        from mindspore.ops.operations import comm_ops

        for name, kind in _PRIMITIVES.items():
            cls = getattr(comm_ops, name, None)
            if cls is None:
                continue
            original = cls.__dict__.get("__call__")
            inherited = cls.__call__
            cls.__call__ = self.wrap(inherited, kind, name)
            self.restore.append((cls, "__call__", original))
        seen: dict[int, Callable[..., Any]] = {}
        for module_name in _FUNCTION_MODULES:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            short = module_name.removeprefix("mindspore.")
            for name, kind in _FUNCTIONS.items():
                fn = module.__dict__.get(name)
                if not callable(fn) or getattr(fn, "__recomp_counted__", False):
                    continue
                wrapped = seen.get(id(fn))
                if wrapped is None:
                    wrapped = seen[id(fn)] = self.wrap(fn, kind, f"{short}.{name}")
                setattr(module, name, wrapped)
                self.restore.append((module, name, fn))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self.restore):
            if original is None:  # the class inherited it: drop our override
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, original)
        self.restore.clear()


_COUNTER = _Counter()


@contextlib.contextmanager
def watch_collectives(watcher: Callable[[str], None]) -> Iterator[None]:
    """Call ``watcher(op)`` for each collective entry point called while the block runs
    (outermost calls only, as counted). For recomp's own checks; counts are unchanged."""
    with _COUNTER.lock:
        if not _COUNTER.active and not _COUNTER.watchers:
            _COUNTER.install()
        _COUNTER.watchers.append(watcher)
    try:
        yield
    finally:
        with _COUNTER.lock:
            _COUNTER.watchers.remove(watcher)
            if not _COUNTER.active and not _COUNTER.watchers:
                _COUNTER.uninstall()


@contextlib.contextmanager
def count_collectives(
    *, is_replaying: Callable[[], bool] | None = None
) -> Iterator[CollectiveCounts]:
    """Count MindSpore collective calls per phase while the block runs.

    Yields a :class:`CollectiveCounts`. ``is_replaying`` decides what counts as
    the ``replay`` phase (default: :func:`recomp.is_recomputing`). Blocks may
    nest; the innermost one counts.
    """
    counts = CollectiveCounts()
    entry = (counts, is_replaying or DEFAULT_IS_REPLAYING)
    with _COUNTER.lock:
        if not _COUNTER.active and not _COUNTER.watchers:
            _COUNTER.install()
        _COUNTER.active.append(entry)
    try:
        yield counts
    finally:
        with _COUNTER.lock:
            _COUNTER.active.remove(entry)
            if not _COUNTER.active and not _COUNTER.watchers:
                _COUNTER.uninstall()
