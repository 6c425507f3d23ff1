"""Random state kept outside the framework's generators: RNG trackers.

Tensor-parallel trainers draw dropout masks from named generator states that they keep in
a Python object of their own (Megatron-Core's ``CudaRNGStatesTracker``, DeepSpeed's
``get_cuda_rng_tracker()``), swapped into the framework's generator by ``tracker.fork()``
around each draw. A checkpoint that restores only the framework's generators replays such
a draw from the state the forward left behind: another mask, wrong gradients, and the
tracker advanced twice per step.

A tracker is anything with ``get_states()`` (a snapshot of its states) and
``set_states(states)``. recomp saves the states of every known tracker when it saves the
framework's random state, and restores them at the same moments: the replay starts from
the states the checkpoint's forward started from, the states are put back when the replay
ends, and a replay that skips an excluded region continues from the states the region left
(the region's draws are not repeated). Known trackers are those registered with
:func:`register_rng_tracker` and, without registration, Megatron-Core's and DeepSpeed's
once those packages have been imported (looked up in ``sys.modules`` at each checkpoint
call; recomp imports neither).

This module imports no framework.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ._hooks import CallPart, CheckpointCallView, Stage

__all__ = [
    "RngTracker",
    "RngTrackerRegistration",
    "TrackerStates",
    "capture_tracker_states",
    "known_trackers",
    "register_rng_tracker",
    "unregister_rng_tracker",
]


@runtime_checkable
class RngTracker(Protocol):
    """What recomp asks of an RNG tracker: an object that keeps named random states
    outside the framework's generators (Megatron-Core's and DeepSpeed's
    ``get_cuda_rng_tracker()``). Register one with :func:`register_rng_tracker`; every
    checkpoint then saves its states with the random state and restores them for the
    replay."""

    def get_states(self) -> Any:
        """A snapshot of the tracker's states, unaffected by later draws."""

    def set_states(self, states: Any) -> None:
        """Make ``states`` (from :meth:`get_states`) the tracker's states."""


# Module attributes holding a tracker object in packages that recomp recognises by
# themselves. Read, never called: their ``get_cuda_rng_tracker()`` may create one.
AUTOMATIC_TRACKERS: tuple[tuple[str, str], ...] = (
    ("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER"),
    ("deepspeed.runtime.activation_checkpointing.checkpointing", "_CUDA_RNG_STATE_TRACKER"),
)

_AUTOMATIC_MODULES = tuple(module_name for module_name, _ in AUTOMATIC_TRACKERS)


class _FunctionTracker:
    """A tracker given as a pair of functions."""

    __slots__ = ("get_states", "set_states")

    def __init__(self, get_states: Callable[[], Any], set_states: Callable[[Any], None]) -> None:
        self.get_states = get_states
        self.set_states = set_states


class RngTrackerRegistration:
    """Returned by :func:`register_rng_tracker`: :meth:`remove` it, or use it as a context
    manager to keep the tracker registered for a block."""

    __slots__ = ("__weakref__", "_ref")

    def __init__(self, ref: Callable[[], Any]) -> None:
        self._ref = ref

    def tracker(self) -> Any:
        """The registered tracker, or None once it was garbage-collected or removed."""
        return self._ref()

    def remove(self) -> None:
        """Stop saving and restoring the tracker (removing twice is harmless)."""
        _unregister(self)

    def __enter__(self) -> RngTrackerRegistration:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()


_LOCK = threading.Lock()
# Replaced, never changed in place: a checkpoint call reads it without the lock.
_REGISTERED: tuple[RngTrackerRegistration, ...] = ()


def register_rng_tracker(
    tracker: RngTracker | None = None,
    *,
    get_states: Callable[[], Any] | None = None,
    set_states: Callable[[Any], None] | None = None,
) -> RngTrackerRegistration:
    """Save and restore ``tracker``'s states with every checkpoint's random state.

    Pass an object with ``get_states()`` and ``set_states(states)``, or the two functions.
    An object is held weakly: it leaves the registry when it is garbage-collected. The
    functions are held until the returned registration is removed. ``get_states()`` must
    return a snapshot that later draws do not change; ``set_states`` receives a shallow
    copy of it (with ``torch.Generator``-like values cloned), so a tracker that adopts the
    object it is given and replaces its entries leaves recomp's saved states intact.
    Registering the same object twice returns its first registration.
    """
    global _REGISTERED
    if tracker is None:
        if get_states is None or set_states is None:
            raise TypeError(
                "register_rng_tracker needs a tracker object with get_states() and "
                "set_states(states), or both get_states= and set_states= functions."
            )
        held: Any = _FunctionTracker(get_states, set_states)
        ref: Callable[[], Any] = _Strong(held)
    else:
        if get_states is not None or set_states is not None:
            raise TypeError(
                "register_rng_tracker takes a tracker object or get_states=/set_states= "
                "functions, not both."
            )
        if not (
            callable(getattr(tracker, "get_states", None))
            and callable(getattr(tracker, "set_states", None))
        ):
            raise TypeError(
                f"{type(tracker).__name__} is not an RNG tracker: it needs get_states() and "
                "set_states(states) methods."
            )
        for registration in _REGISTERED:
            if registration.tracker() is tracker:
                return registration
        try:
            ref = weakref.ref(tracker)
        except TypeError:  # no weak references to it: held until removed
            ref = _Strong(tracker)
    registration = RngTrackerRegistration(ref)
    with _LOCK:
        _REGISTERED = (*_REGISTERED, registration)
    return registration


def unregister_rng_tracker(tracker: Any) -> None:
    """Stop saving and restoring ``tracker`` (an object given to
    :func:`register_rng_tracker`, or the registration it returned)."""
    if isinstance(tracker, RngTrackerRegistration):
        _unregister(tracker)
        return
    for registration in _REGISTERED:
        if registration.tracker() is tracker:
            _unregister(registration)


def _unregister(registration: RngTrackerRegistration) -> None:
    global _REGISTERED
    with _LOCK:
        _REGISTERED = tuple(r for r in _REGISTERED if r is not registration)
    registration._ref = _gone


def _gone() -> None:
    return None


class _Strong:
    """A strong reference with ``weakref.ref``'s call signature."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self) -> Any:
        return self.value


def known_trackers() -> list[Any]:
    """The trackers whose states a checkpoint saves now: the live registered ones, then
    those of imported packages recomp recognises, each object once."""
    found: list[Any] = []
    for registration in _REGISTERED:
        tracker = registration.tracker()
        if tracker is not None:
            found.append(tracker)
    modules = sys.modules
    for module_name, attribute in AUTOMATIC_TRACKERS:
        module = modules.get(module_name)
        if module is None:
            continue
        tracker = getattr(module, attribute, None)
        if (
            tracker is not None
            and callable(getattr(tracker, "get_states", None))
            and not any(tracker is t for t in found)
        ):
            found.append(tracker)
    return found


class TrackerStates:
    """The states of the known trackers at one moment, to set them back later."""

    __slots__ = ("saved",)

    def __init__(self, saved: list[tuple[Any, Any]]) -> None:
        self.saved = saved

    def restore(self) -> None:
        for tracker, states in self.saved:
            tracker.set_states(_snapshot(states))


def capture_tracker_states() -> TrackerStates | None:
    """The states of every known tracker now; None when there is none (the common case)."""
    # Asked at every checkpoint and region call: no tracker, usually (one C loop).
    if not _REGISTERED and not any(map(sys.modules.__contains__, _AUTOMATIC_MODULES)):
        return None
    trackers = known_trackers()
    if not trackers:
        return None
    return TrackerStates([(t, _snapshot(t.get_states())) for t in trackers])


def _snapshot(states: Any) -> Any:
    """A copy of ``states`` that the tracker may adopt and change: the container copied,
    generator objects (which draws advance in place) cloned, tensors shared (trackers
    replace them rather than change them)."""
    if isinstance(states, dict):
        return {key: _clone_generator(value) for key, value in states.items()}
    if type(states) in (list, tuple):  # a named tuple is passed on as it is
        return type(states)(_clone_generator(value) for value in states)
    return _clone_generator(states)


def _clone_generator(value: Any) -> Any:
    clone_state = getattr(value, "clone_state", None)  # torch.Generator
    return clone_state() if callable(clone_state) else value


class ReplayTrackers(CallPart):
    """The replay starts from the trackers' states at the checkpoint's forward, and puts
    back the states it found when it ends (as the framework's random state)."""

    stage = Stage.RESTORED_STATE

    def __init__(self, forward_states: TrackerStates) -> None:
        self.forward_states = forward_states
        self._saved: list[TrackerStates | None] = []

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        return None, self

    def __enter__(self) -> None:
        self._saved.append(capture_tracker_states())
        self.forward_states.restore()

    def __exit__(self, *exc_info: Any) -> None:
        found = self._saved.pop()
        if found is not None:
            found.restore()


def replay_trackers_part() -> ReplayTrackers | None:
    """The part of a checkpoint call that restores the trackers' states for its replays,
    the states captured now (when the call starts); None when no tracker is known."""
    states = capture_tracker_states()
    return None if states is None else ReplayTrackers(states)
