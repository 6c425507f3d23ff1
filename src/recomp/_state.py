"""The recompute state: which checkpoint call is running here, and in which phase.

This module is a leaf: it imports nothing else of recomp. What one checkpoint
call records (the exclusion cache and its bookkeeping) belongs to the engine
(``recomp._record``); the state only carries it, as an opaque ``record``.
:class:`PhaseContext` installs a state for one phase and tells a
:class:`PhaseListener` (the engine's checkpoint call) when a phase starts or ends.

The state lives in a :mod:`contextvars` variable: threads and asyncio tasks
each see their own, and nested checkpoints restore the outer state on exit.
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Callable, Hashable
from typing import Any, Protocol, TypeVar

__all__ = ["RecomputeState", "get_recompute_state", "is_recomputing"]

T = TypeVar("T")

_call_ids = itertools.count(1)


class PhaseListener(Protocol):
    """What a checkpoint call hears from :class:`PhaseContext`."""

    def on_forward_start(self) -> None:
        """The call's forward begins (not a re-run inside an enclosing replay)."""

    def on_replay_start(self) -> None:
        """A replay of the call's forward begins (once per backward), or an enclosing
        checkpoint's replay re-runs the call."""

    def on_forward_end(self, ok: bool) -> None:
        """The call's forward returned (``ok``) or raised."""


class CallIdentity:
    """What the forward and every replay of one checkpoint call share: its id and the
    user resources stored with ``get_resource`` (a dictionary from the first one on).
    The engine's record of a call (``recomp._record.Invocation``) is one."""

    __slots__ = ("id", "resources")

    def __init__(self) -> None:
        self.id: int = next(_call_ids)
        self.resources: dict[Hashable, Any] | None = None


class RecomputeState:
    """What code running inside a recomp checkpoint can ask about its situation.

    ``is_recomputing`` is False in the original forward and True while the
    forward is replayed during backward. ``invocation_id`` is the same for the
    forward and all its replays and differs between checkpoint calls (layers,
    micro-batches).
    """

    __slots__ = ("call", "is_recomputing", "record")

    def __init__(self, record: object, call: CallIdentity, is_recomputing: bool) -> None:
        self.record = record
        self.call = call
        self.is_recomputing = is_recomputing

    @property
    def invocation_id(self) -> int:
        return self.call.id

    def get_resource(self, key: Hashable, factory: Callable[[], T]) -> T:
        """Return the per-invocation object stored under ``key``, creating it once.

        The forward and its replays get the same object; it is dropped with the
        checkpoint's autograd graph. Useful for state a module must agree on in
        both passes (a routing decision, a communication handle).
        """
        resources = self.call.resources
        if resources is None:
            resources = self.call.resources = {}
        if key not in resources:
            resources[key] = factory()
        return resources[key]

    def __repr__(self) -> str:
        phase = "replay" if self.is_recomputing else "forward"
        return f"RecomputeState(invocation_id={self.invocation_id}, phase={phase!r})"


CURRENT: contextvars.ContextVar[RecomputeState | None] = contextvars.ContextVar(
    "recomp_state", default=None
)


def get_recompute_state() -> RecomputeState | None:
    """The state of the innermost recomp checkpoint running here, or None outside one.

    Code inside a checkpoint can read whether it runs in the forward or in the replay
    (``is_recomputing``), which checkpoint call it belongs to
    (``invocation_id``, the same in a forward and its replays) and keep a resource per
    call (``get_resource(key, factory)``). The state is per thread and per context."""
    return CURRENT.get()


def is_recomputing() -> bool:
    """True while a recomp checkpoint replays its forward during backward.

    False in the forward and outside checkpoints. Use it to guard side effects that must
    happen once (appending to a list, logging, counters); the replay must still compute
    the same tensors as the forward::

        if not recomp.is_recomputing():
            self.norms.append(h.detach().norm())
    """
    state = CURRENT.get()
    return state is not None and state.is_recomputing


class PhaseContext(RecomputeState):
    """Installs the recompute state for one phase of a checkpoint call: itself.

    Re-enterable: the framework enters the same replay context once per
    backward (``retain_graph``); each entry tells the listener a replay starts and
    installs the context as the state (its fields are the same at every entry). One
    object per phase, not one more per entry: a checkpoint call's contexts live as long
    as its graph, in every layer at once (NOTE [ What a call keeps ] in
    ``recomp._engine``).
    """

    __slots__ = ("_tokens", "listener")

    def __init__(
        self, record: object, call: CallIdentity, is_recomputing: bool, listener: PhaseListener
    ) -> None:
        self.record = record
        self.call = call
        self.is_recomputing = is_recomputing
        self.listener = listener
        # One token per entry (innermost last); a tuple, empty between entries.
        self._tokens: tuple[contextvars.Token[RecomputeState | None], ...] = ()

    def __enter__(self) -> RecomputeState:
        if self.is_recomputing:
            self.listener.on_replay_start()
        else:
            self.listener.on_forward_start()
        self._tokens += (CURRENT.set(self),)
        return self

    def __exit__(self, *exc_info: object) -> bool | None:
        tokens = self._tokens
        self._tokens = tokens[:-1]
        CURRENT.reset(tokens[-1])
        if not self.is_recomputing:
            self.listener.on_forward_end(ok=exc_info[0] is None)
        return None  # suppresses nothing (a composed phase's context may)
