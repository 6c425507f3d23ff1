"""The one internal seam recomp's own tests use to watch or disable a mechanism.

Tests otherwise go through the public API. What is here lets a test show that
a mechanism is what makes a guarantee hold (turn it off, see the guarantee
fail) and see what the engine keeps, without patching private functions.
Not part of the public API.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from . import _engine, _state
from ._record import Invocation
from ._state import RecomputeState


@contextlib.contextmanager
def observe(
    *,
    kept: Callable[[Any, Any], None] | None = None,
    deferred: Callable[[bool], None] | None = None,
    boundary: Callable[[list[Any], list[Any]], None] | None = None,
) -> Iterator[None]:
    """Call ``kept(original, kept_value)`` for each non-parameter tensor a region keeps
    for real, ``deferred(is_view)`` for each saved tensor deferred to the replay, and
    ``boundary(saved_inputs, outputs)`` each time a forward applies the boundary."""
    observers = _engine.OBSERVERS
    previous = observers.kept, observers.deferred, observers.boundary
    observers.kept, observers.deferred, observers.boundary = kept, deferred, boundary
    try:
        yield
    finally:
        observers.kept, observers.deferred, observers.boundary = previous


@contextlib.contextmanager
def without_rng_alignment() -> Iterator[None]:
    """Regions recorded here do not restore the random state after them in the replay."""
    _engine.OBSERVERS.rng_alignment = False
    try:
        yield
    finally:
        _engine.OBSERVERS.rng_alignment = True


@contextlib.contextmanager
def without_replay_rewind() -> Iterator[None]:
    """Replays entered here continue from where the last replay stopped."""
    _engine.OBSERVERS.rewind = False
    try:
        yield
    finally:
        _engine.OBSERVERS.rewind = True


class _ProcessGlobal:
    """A stand-in for a ContextVar shared by every thread (the design the real one avoids)."""

    def __init__(self, default: Any) -> None:
        self.value = default

    def get(self) -> Any:
        return self.value

    def set(self, value: Any) -> Any:
        old, self.value = self.value, value
        return old

    def reset(self, token: Any) -> None:
        self.value = token


@contextlib.contextmanager
def process_global_state() -> Iterator[None]:
    """Replace recomp's per-context variables by process-wide ones."""
    saved = _engine.ACTIVE_REGION, _state.CURRENT
    _engine.ACTIVE_REGION = _ProcessGlobal(None)  # type: ignore[assignment]
    _state.CURRENT = _ProcessGlobal(None)  # type: ignore[assignment]
    try:
        yield
    finally:
        _engine.ACTIVE_REGION, _state.CURRENT = saved


def uses_context_variables() -> bool:
    return all(type(v).__name__ == "ContextVar" for v in (_engine.ACTIVE_REGION, _state.CURRENT))


def record_of(state: RecomputeState) -> Invocation:
    """The engine's record of the checkpoint call ``state`` belongs to."""
    record = state.record
    assert isinstance(record, Invocation)
    return record


def cached_values(record: Invocation) -> list[Any]:
    """The tensors the record's last region call cached as outputs."""
    entry = record.entries[-1]
    return [c.snapshot.value for c in entry.outputs if c.snapshot is not None]


def active_region_name() -> str | None:
    """The excluded region whose forward runs in this context, if any."""
    region = _engine.ACTIVE_REGION.get()
    return None if region is None else region.name
