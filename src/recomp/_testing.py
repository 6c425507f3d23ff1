"""The one internal seam recomp's own tests use to watch or disable a mechanism.

Tests otherwise go through the public API. What is here lets a test show that
a mechanism is what makes a guarantee hold (turn it off, see the guarantee
fail) and see what the engine keeps, without patching private functions.
Watching goes through the same interface as every other observer of a region
call (``recomp._hooks.RegionObserver``). Not part of the public API.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from . import _region, _state
from ._engine import SWITCHES
from ._hooks import RegionCallView, RegionObserver, observing
from ._record import Invocation, invocation_of
from ._region import RegionCall
from ._state import RecomputeState


class _CallbackObserver(RegionObserver):
    def __init__(
        self,
        kept: Callable[[Any, Any], None] | None,
        deferred: Callable[[bool], None] | None,
        boundary: Callable[[list[Any], list[Any]], None] | None,
    ) -> None:
        self.kept = kept
        self.deferred = deferred
        self.boundary = boundary

    def tensor_kept(self, call: RegionCallView, original: Any, kept: Any) -> None:
        if self.kept is not None:
            self.kept(original, kept)

    def tensor_deferred(self, call: RegionCallView, original: Any, is_view: bool) -> None:
        if self.deferred is not None:
            self.deferred(is_view)

    def boundary_applied(self, call: RegionCallView, saved: list[Any], outputs: list[Any]) -> None:
        if self.boundary is not None:
            self.boundary(saved, outputs)


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
    with observing(_CallbackObserver(kept, deferred, boundary)):
        yield


@contextlib.contextmanager
def without_rng_alignment() -> Iterator[None]:
    """Checkpoint calls started here do not restore the random state after a skipped
    region in their replay."""
    SWITCHES.rng_alignment = False
    try:
        yield
    finally:
        SWITCHES.rng_alignment = True


@contextlib.contextmanager
def without_own_replay() -> Iterator[None]:
    """Checkpoint calls started here are replayed by the framework's checkpoint itself
    (PyTorch's unpack hook), not by recomp's replay of it."""
    SWITCHES.own_replay = False
    try:
        yield
    finally:
        SWITCHES.own_replay = True


@contextlib.contextmanager
def without_replay_rewind() -> Iterator[None]:
    """Replays of checkpoint calls started here continue from where the last replay stopped."""
    SWITCHES.replay_rewind = False
    try:
        yield
    finally:
        SWITCHES.replay_rewind = True


@contextlib.contextmanager
def without_kept_replays() -> Iterator[None]:
    """Checkpoint calls started here replay once per backward pass that needs them
    (PyTorch's rule) instead of keeping what a replay recomputed for later passes."""
    SWITCHES.kept_replays = False
    try:
        yield
    finally:
        SWITCHES.kept_replays = True


@contextlib.contextmanager
def offload_events(offloader: Any) -> Iterator[list[tuple[str, str]]]:
    """Collect what ``offloader`` (a ``recomp.torch.Offloader``) does in backward, as
    (event, region name): "copy back" (started ahead of the read), "copy back on
    read" and "read"."""
    events: list[tuple[str, str]] = []
    previous = offloader.trace
    offloader.trace = lambda event, name: events.append((event, name))
    try:
        yield events
    finally:
        offloader.trace = previous


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
    saved = _region.ACTIVE_REGION, _state.CURRENT
    _region.ACTIVE_REGION = _ProcessGlobal(None)  # type: ignore[assignment]
    _state.CURRENT = _ProcessGlobal(None)  # type: ignore[assignment]
    try:
        yield
    finally:
        _region.ACTIVE_REGION, _state.CURRENT = saved


def uses_context_variables() -> bool:
    variables = (_region.ACTIVE_REGION, _state.CURRENT)
    return all(type(v).__name__ == "ContextVar" for v in variables)


def record_of(state: RecomputeState) -> Invocation:
    """The engine's record of the checkpoint call ``state`` belongs to."""
    return invocation_of(state)


def region_calls(record: Invocation) -> list[RegionCall]:
    """The region calls the record holds, in call order."""
    return [entry for entry in record.regions if isinstance(entry, RegionCall)]


def cached_values(record: Invocation) -> list[Any]:
    """The tensors the record's last region call cached as outputs."""
    entry = region_calls(record)[-1]
    return [c.snapshot.value for c in entry.outputs if c.snapshot is not None]


def active_region_name() -> str | None:
    """The excluded region whose forward runs in this context, if any."""
    region = _region.active_region()
    return None if region is None else region.name
