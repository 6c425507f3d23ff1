"""Count ``torch.distributed`` collectives per training phase.

:func:`count_collectives` is a context manager that records every collective
communication call issued while it is active and attributes it to one of
three phases:

``forward``
    the ordinary forward pass;
``replay``
    the forward code that a recomp checkpoint re-runs during backward
    (:func:`recomp.is_recomputing` is true);
``backward``
    everything else that runs inside an autograd backward pass (gradient
    all-reduces of tensor-parallel layers, FSDP reduce-scatters, the backward
    of an all-to-all, ...).

A collective that shows up in ``replay`` is communication paid twice, and a
source of deadlocks when ranks replay differently. recomp's checkpoints keep
the results of the collectives in recomputed code and their replays read them
(see ``recomp.torch.checkpoint``), so the replay shows none unless a checkpoint
runs with ``exclude_collectives=False``, a kept result was changed in place, or
the checkpoint is not recomp's; then the cure is an excluded region
(``recomp.torch.checkpoint_exclude_wrapper``).

Example::

    import torch.distributed as dist
    from recomp.torch.collectives import count_collectives

    with count_collectives() as counts:
        loss = model(batch).sum()
        loss.backward()          # backward must run inside the block too
    print(counts)                # forward: all_reduce=4 | replay: - | backward: all_reduce=4
    assert counts.total("replay") == 0
    assert counts.forward["all_reduce"] == 4

How it works: the counter is a :class:`~torch.utils._python_dispatch.TorchDispatchMode`.
In PyTorch 2.x every collective reaches the dispatcher as an operator, whichever
API issued it: ``torch.distributed.all_reduce`` and the other classic calls and
``ProcessGroup`` methods become ``c10d.*`` ops (``c10d.allreduce_``,
``c10d._allgather_base_``, ``c10d.alltoall_base_``, ...), and functional
collectives -- the path DTensor redistribution takes -- become
``_c10d_functional.*`` ops.  The mode counts each of those once, on plain
tensors; for an operation on a tensor subclass such as ``DTensor`` it lets the
subclass run first, so the collectives it issues on local shards are counted
too.  ``wait_tensor`` and other bookkeeping operators are not collectives and
are not counted.

Importing this module needs neither an initialised process group nor a
distributed build of PyTorch; counting needs a build with ``torch.distributed``.
Dispatch modes are thread local: the forward and the ``backward()`` call must
both run inside the ``with`` block, on the thread that entered it (the autograd
engine carries the mode to its own worker threads).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._collectives import (
    DEFAULT_IS_REPLAYING,
    PHASES,
    CollectiveCounts,
    CollectiveEvent,
    current_phase,
)
from . import _compat
from ._backend import BACKEND
from ._compat import TorchDispatchMode

__all__ = [
    "PHASES",
    "CollectiveCounts",
    "CollectiveEvent",
    "collective_kind",
    "count_collectives",
    "kept_collective_bytes",
]

# Operator namespaces that hold collectives: the classic process-group ops and
# the functional collectives (native, legacy Python and autograd variants).
_NAMESPACES = frozenset(
    {"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"}
)

# Operator name (without overload) -> kind.  Names not listed (wait_tensor,
# _wrap_tensor_autograd, monitored_barrier bookkeeping, ...) are not counted.
_KINDS: dict[str, str] = {}
for _kind, _names in {
    "all_reduce": (
        "allreduce_",
        "allreduce_coalesced_",
        "all_reduce",
        "all_reduce_",
        "all_reduce_coalesced",
        "all_reduce_coalesced_",
    ),
    "all_gather": (
        "allgather_",
        "_allgather_base_",
        "allgather_coalesced_",
        "allgather_into_tensor_coalesced_",
        "all_gather_into_tensor",
        "all_gather_into_tensor_out",
        "all_gather_into_tensor_coalesced",
    ),
    "reduce_scatter": (
        "reduce_scatter_",
        "_reduce_scatter_base_",
        "reduce_scatter_tensor_coalesced_",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
    ),
    "all_to_all": ("alltoall_", "alltoall_base_", "all_to_all_single"),
    "broadcast": ("broadcast_", "broadcast"),
    "reduce": ("reduce_",),
    "gather": ("gather_",),
    "scatter": ("scatter_",),
    "send": ("send",),
    "recv": ("recv_", "recv_any_source_"),
    "barrier": ("barrier",),
}.items():
    for _name in _names:
        _KINDS[_name] = _kind
del _kind, _names, _name


def collective_kind(op: Any) -> str | None:
    """Return the kind of collective ``op`` is (``"all_reduce"``, ``"all_to_all"``, ...).

    ``op`` is an operator overload such as ``torch.ops.c10d.allreduce_.default``;
    the answer is ``None`` for anything that is not a collective.
    """
    namespace = getattr(op, "namespace", None)
    if namespace not in _NAMESPACES:
        return None
    name = _compat.op_name(op).split("::", 1)[-1]
    return _KINDS.get(name)


def _is_wrapper_subclass(t: type) -> bool:
    # DTensor and friends: tensor subclasses that wrap local tensors.  FakeTensor
    # is a subclass but not a wrapper; deferring to it would break its own mode.
    return t is not torch.Tensor and hasattr(t, "__tensor_flatten__")


def _numel(args: Any, kwargs: dict[str, Any]) -> int:
    n = 0
    stack = [args, kwargs]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            n += x.numel()
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return n


class _CollectiveCounterMode(TorchDispatchMode):
    def __init__(self, counts: CollectiveCounts, is_replaying: Callable[[], bool]) -> None:
        super().__init__()
        self.counts = counts
        self.is_replaying = is_replaying

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if any(_is_wrapper_subclass(t) for t in types):
            # Let DTensor (or another wrapper subclass) handle the op with this
            # mode still active: the collectives it issues on its local tensors
            # come back through here as plain-tensor ops and are counted then.
            return NotImplemented
        kind = collective_kind(func)
        if kind is not None:
            self.counts.record(
                current_phase(self.is_replaying, BACKEND.in_backward),
                kind,
                str(func),
                _numel(args, kwargs),
            )
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_collectives(
    *, is_replaying: Callable[[], bool] | None = None
) -> Iterator[CollectiveCounts]:
    """Count collective calls per phase while the block runs.

    Yields a :class:`CollectiveCounts` that fills in as collectives are issued.
    ``is_replaying`` decides what counts as the ``replay`` phase; it defaults to
    :func:`recomp.is_recomputing`.  Pass another predicate to attribute the
    replay of a different checkpoint implementation.

    Example::

        with count_collectives() as counts:
            model(x).sum().backward()
        assert counts.total("replay") == 0, counts
    """
    counts = CollectiveCounts()
    mode = _CollectiveCounterMode(counts, is_replaying or DEFAULT_IS_REPLAYING)
    with mode:
        yield counts


# The collective records of recomp checkpoints (``_collective_cache``) whose forward
# kept results, for as long as their checkpoint's graph holds them.
KEEPING_RECORDS: weakref.WeakSet[Any] = weakref.WeakSet()


def kept_collective_bytes() -> int:
    """Bytes that recomp checkpoints hold now for the results of collectives in their
    recomputed code (the replay reads them instead of communicating), each storage once.

    Read it between a forward and its backward: a checkpoint holds them from its forward
    until its graph is freed. Zero without a process group, and for checkpoints made
    with ``exclude_collectives=False``."""
    storages: dict[Any, int] = {}
    for record in list(KEEPING_RECORDS):
        for t in record.kept_tensors():
            key = _compat.storage_key(t)
            if key is not None:
                storages[key] = int(t.untyped_storage().nbytes())
    return sum(storages.values())
