"""Fake tensors and a fake process group: running a model without memory or peers.

Consumer: the planner's simulation (``recomp.plan.simulate``), which runs the user's
model at full size under ``FakeTensorMode`` (tensors with shapes, dtypes, devices and
storages but no data) and, for several ranks, under torch.distributed's fake process
group (one process plays rank 0 of ``world_size``; collectives return tensors of the
right shapes without communicating). Tested by ``tests/torch/compat/test_fake.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def fake_tensor_mode() -> Any:
    """A new ``FakeTensorMode`` that also takes real tensors created outside it (they
    become fake constants), to enter as a context manager.

    Why: the simulation builds and runs the model with no memory behind its tensors.
    ``torch._subclasses.fake_tensor`` is private (the mode is what ``torch.compile``
    and ``torch.export`` trace with); checked on 2.13.0 and 2.14.1.
    If it changes: ImportError or TypeError here, which ``simulate`` reports; nothing
    else in recomp uses it.
    Retired by: a public fake-tensor mode.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t: Any) -> bool:
    """Whether ``t`` is a fake tensor (a tensor without data)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """The default process group, for the time of the block, is a fake one of
    ``world_size`` ranks in which this process is rank 0; destroyed on leaving (errors
    included), with the DTensor random-number tracker it may have made.

    Why: DTensor and ``DeviceMesh`` need a default group; the fake one answers every
    collective with tensors of the right shape without peers.
    How: importing ``torch.testing._internal.distributed.fake_pg`` registers the
    ``"fake"`` backend (torch 2.14: not registered by ``torch.distributed`` itself);
    ``FakeStore`` is its no-op store. ``torch.distributed.tensor._random._rng_tracker``
    is DTensor's global tracker, made on the first random op on a DTensor: reset so
    that a later real job makes its own.
    If it changes: ImportError here, which ``simulate`` reports for world sizes above 1.
    Retired by: a public fake backend.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already initialised in this process; simulate() makes its "
            "own fake one: call it in a process without torch.distributed set up"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        try:
            dist.destroy_process_group()
        finally:
            reset_dtensor_random()


def reset_dtensor_random() -> None:
    """Drop DTensor's global random-number tracker (see ``fake_process_group``)."""
    try:
        from torch.distributed.tensor import _random
    except ImportError:
        return
    if getattr(_random, "_rng_tracker", None) is not None:
        _random._rng_tracker = None


def fake_tensor_type() -> type:
    """The class of fake tensors (for ``isinstance`` checks)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


def is_view_op(func: Any) -> bool:
    """Whether the ATen operator ``func`` returns a view of an input (moves no bytes).

    ``OpOverload.is_view`` reads the schema's alias annotations; where it is missing,
    False (the op is then costed as moving its inputs and outputs).
    """
    return bool(getattr(func, "is_view", False))


__all__ = [
    "fake_process_group",
    "fake_tensor_mode",
    "fake_tensor_type",
    "is_fake",
    "is_view_op",
    "reset_dtensor_random",
]
