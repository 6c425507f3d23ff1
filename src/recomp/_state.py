"""The recompute state: which checkpoint invocation is running, and in which phase.

A recomp checkpoint creates one :class:`Invocation` per call. Its forward and
every replay of that forward (one per backward) see the same invocation, so
anything keyed on it (the exclusion cache, user resources) is shared between
the forward and its replays and is freed with the checkpoint's autograd graph.

The state lives in a :mod:`contextvars` variable: threads and asyncio tasks
each see their own, and nested checkpoints restore the outer state on exit.
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from .errors import OutputNotSavedError, ReplayMismatchError

__all__ = ["RecomputeState", "get_recompute_state", "is_recomputing"]

T = TypeVar("T")

_invocation_ids = itertools.count(1)

UNSET = object()


class Invocation:
    """Everything one checkpoint call shares between its forward and its replays.

    Held by the recompute context that the framework's checkpoint keeps in its
    frame, so it lives exactly as long as the checkpoint's autograd graph.
    """

    __slots__ = (
        "__weakref__",
        "align_rng",
        "checkpoint_input_keys",
        "child_cursor",
        "children",
        "consumed_keys",
        "entries",
        "excluded_output_keys",
        "forward_done",
        "id",
        "replay_cursor",
        "resources",
        "save_counter",
        "unsaved_outputs",
    )

    def __init__(self, *, align_rng: bool = True) -> None:
        self.id: int = next(_invocation_ids)
        # Whether the replay restores the RNG state of the forward; only then
        # does skipping a region need to fast-forward the generators.
        self.align_rng = align_rng
        self.resources: dict[Hashable, Any] = {}
        # Exclusion cache: one entry per excluded-region call, in call order.
        self.entries: list[Any] = []
        self.replay_cursor = 0
        self.forward_done = False
        # Storage identities of the checkpoint's own inputs and of the outputs
        # of excluded regions: region inputs that alias these are already held
        # elsewhere, so a region saves them as they are instead of deferring.
        self.checkpoint_input_keys: set[Hashable] = set()
        self.excluded_output_keys: set[Hashable] = set()
        # save_output=False outputs (storage -> region name) and the storages that
        # later excluded regions took as inputs: each of the former must be among the latter.
        self.unsaved_outputs: dict[Hashable, str] = {}
        self.consumed_keys: set[Hashable] = set()
        # Recomp checkpoints called inside this one's forward, in call order. The
        # replay re-runs those calls; each reuses its invocation (see next_child).
        self.children: list[Invocation] = []
        self.child_cursor = 0
        # How many tensors the framework's checkpoint has saved so far, when its
        # replay stops after the last of them (early stop); None if unknown.
        # Set by the first excluded region recorded (see _engine).
        self.save_counter: Any = UNSET

    def next_child(self) -> Invocation:
        """The invocation of the nested checkpoint that this replay is re-running."""
        if self.child_cursor >= len(self.children):
            raise ReplayMismatchError(
                f"The replay of a checkpoint called a nested recomp checkpoint that its forward "
                f"did not ({len(self.children)} nested call(s) recorded). The checkpointed "
                "function must make the same checkpoint calls in the forward and the replay."
            )
        child = self.children[self.child_cursor]
        self.child_cursor += 1
        return child

    def finish_forward(self, ok: bool = True) -> None:
        """End of the checkpoint's forward: prune, check and release the cache."""
        if not ok:
            for entry in self.entries:
                entry.release()
            return
        self.forward_done = True
        if callable(self.save_counter):
            # A replay that stops at the last saved tensor never reaches the regions
            # recorded after it: their cached outputs would only take memory.
            total = self.save_counter()
            for entry in self.entries:
                if entry.saves_after == total:
                    entry.drop_cache()
        try:
            for entry in self.entries:
                entry.check_outputs_unchanged()
        finally:
            for entry in self.entries:
                entry.release()
        for key, name in self.unsaved_outputs.items():
            if key not in self.consumed_keys:
                raise OutputNotSavedError(
                    f"The output of excluded region {name!r} was created with save_output=False "
                    "but did not go into another excluded region of the same checkpoint. Without "
                    "a cached copy the replay cannot hand it to other code. Use save_output=True "
                    "for this region."
                )


class RecomputeState:
    """What code running inside a recomp checkpoint can ask about its situation.

    ``is_recomputing`` is False in the original forward and True while the
    forward is replayed during backward. ``invocation_id`` is the same for the
    forward and all its replays and differs between checkpoint calls (layers,
    micro-batches).
    """

    __slots__ = ("_invocation", "is_recomputing")

    def __init__(self, invocation: Invocation, is_recomputing: bool) -> None:
        self._invocation = invocation
        self.is_recomputing = is_recomputing

    @property
    def invocation_id(self) -> int:
        return self._invocation.id

    def get_resource(self, key: Hashable, factory: Callable[[], T]) -> T:
        """Return the per-invocation object stored under ``key``, creating it once.

        The forward and its replays get the same object; it is dropped with the
        checkpoint's autograd graph. Useful for state a module must agree on in
        both passes (a routing decision, a communication handle).
        """
        resources = self._invocation.resources
        if key not in resources:
            resources[key] = factory()
        return resources[key]

    def __repr__(self) -> str:
        phase = "replay" if self.is_recomputing else "forward"
        return f"RecomputeState(invocation_id={self.invocation_id}, phase={phase!r})"


_current: contextvars.ContextVar[RecomputeState | None] = contextvars.ContextVar(
    "recomp_state", default=None
)


def get_recompute_state() -> RecomputeState | None:
    """The state of the innermost recomp checkpoint running here, or None outside one."""
    return _current.get()


def is_recomputing() -> bool:
    """True while a recomp checkpoint replays its forward during backward."""
    state = _current.get()
    return state is not None and state.is_recomputing


class PhaseContext:
    """Installs the recompute state for one phase of an invocation.

    Re-enterable: the framework enters the same replay context once per
    backward (``retain_graph``), and each entry starts the replay from the
    first cached region again.
    """

    def __init__(self, invocation: Invocation, is_recomputing: bool) -> None:
        self._state = RecomputeState(invocation, is_recomputing)
        self._tokens: list[contextvars.Token[RecomputeState | None]] = []

    def __enter__(self) -> RecomputeState:
        if self._state.is_recomputing:
            self._state._invocation.replay_cursor = 0
            self._state._invocation.child_cursor = 0
        self._tokens.append(_current.set(self._state))
        return self._state

    def __exit__(self, *exc_info: object) -> None:
        _current.reset(self._tokens.pop())
        if not self._state.is_recomputing:
            self._state._invocation.finish_forward(ok=exc_info[0] is None)
