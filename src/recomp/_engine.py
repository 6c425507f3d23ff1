"""The exclusion engine, shared by every framework backend: where a checkpoint call starts.

The framework APIs (``recomp.torch._api``, ``recomp.mindspore._api``) use the
engine through this module: :func:`begin` starts one checkpoint call and builds
the ``context_fn`` that recomp hands to the framework's own checkpoint;
``ExcludedRegion`` (from ``_region``) is what each exclude wrapper holds.

Where things live, bottom up (each module imports only those above it in this list;
``docs/mechanism.md`` has the full map):

* ``errors``, ``_state``  recomp's errors; the public recompute state and its context variable;
* ``_pytree``, ``_backend``  flattening and rebuilding; the questions the engine asks a
  framework, with shared defaults (``torch/_backend.py`` and ``mindspore/_backend.py``
  answer them, each framework's ``_compat.py`` holds its private API);
* ``_hooks``     the typed interfaces of the parties that watch a region call (debug
  report, tests, memory reports) or move what it keeps (offload);
* ``_record``    what one checkpoint call records: ``Invocation`` and the pieces of a
  region call's record (``Snapshot``, ``CachedOutput``, ...);
* ``_region``    ``ExcludedRegion`` and ``RegionCall``: one excluded-region call, its
  whole life, what it keeps, defers, caches and hands back to replays. Its NOTE
  blocks state the rules the engine relies on, numbered; the code cites them;
* ``_running_stats``  BatchNorm running statistics that a replay must leave as it found them;
* ``_engine``    (here) checkpoint calls: ``begin``, ``context_fn``, nesting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ._backend import Backend
from ._hooks import OBSERVERS
from ._record import Invocation, invocation_of
from ._region import ExcludedRegion, check_flag
from ._running_stats import RestoreStatistics, replayed_statistics
from ._state import CallIdentity, PhaseContext, RecomputeState, get_recompute_state

__all__ = [
    "ComposedContext",
    "ExcludedRegion",
    "begin",
    "check_flag",
    "check_use_reentrant",
    "make_context_fn",
]


class MechanismSwitches:
    """Mechanisms the test seam (``recomp._testing``) can turn off to show that a
    guarantee depends on them. Read once per checkpoint call, by :func:`begin`
    (``kept_replays`` by the framework's checkpoint that has it)."""

    __slots__ = ("kept_replays", "replay_rewind", "rng_alignment")

    def __init__(self) -> None:
        self.rng_alignment = True
        self.replay_rewind = True
        # What a replay recomputed stays until a backward pass reads it (PyTorch:
        # ``recomp.torch._kept``), instead of one replay per backward pass.
        self.kept_replays = True


SWITCHES = MechanismSwitches()


class ComposedContext:
    """Enter several contexts in order, exit in reverse; re-enterable like ``PhaseContext``."""

    def __init__(self, *contexts: Any) -> None:
        self.contexts = contexts
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            for context in self.contexts:
                stack.enter_context(context)
            self._stacks.append(stack.pop_all())

    def __exit__(self, *exc_info: Any) -> bool:
        return bool(self._stacks.pop().__exit__(*exc_info))


class _ReplayRng:
    """For frameworks whose checkpoint does not restore the RNG fully: the replay starts
    from the random state the forward started from, and leaves it as it found it."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.forward_state = backend.get_rng_state()
        self._saved: list[Any] = []

    def __enter__(self) -> None:
        self._saved.append(self.backend.get_rng_state())
        self.backend.set_rng_state(self.forward_state)

    def __exit__(self, *exc_info: Any) -> None:
        self.backend.set_rng_state(self._saved.pop())


def make_context_fn(
    invocation: Invocation,
    user_context_fn: Callable[[], tuple[Any, Any]] | None,
    *,
    forward_replays: bool = False,
    rng_backend: Backend | None = None,
    statistics: RestoreStatistics | None = None,
) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` handed to the framework's checkpoint: recomp's state outermost.

    ``forward_replays``: this checkpoint call re-runs, inside the replay of an
    enclosing checkpoint, a call whose forward already ran (see ``begin``);
    its excluded regions must then return their cached outputs.
    ``rng_backend``: restore the RNG for the replay here (see ``_ReplayRng``).
    ``statistics``: running statistics the replay must leave as it found them.
    """

    call = invocation.call

    def context_fn() -> tuple[Any, Any]:
        forward_state = RecomputeState(invocation, call, is_recomputing=forward_replays)
        forward: list[Any] = [PhaseContext(forward_state)]
        replay: list[Any] = [PhaseContext(RecomputeState(invocation, call, is_recomputing=True))]
        if statistics is not None:
            replay.append(statistics)
        if rng_backend is not None:
            replay.append(_ReplayRng(rng_backend))
        if user_context_fn is not None:
            user_forward, user_replay = user_context_fn()
            forward.append(user_forward)
            replay.append(user_replay)
        return (
            forward[0] if len(forward) == 1 else ComposedContext(*forward),
            replay[0] if len(replay) == 1 else ComposedContext(*replay),
        )

    return context_fn


def begin(
    backend: Backend,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    user_context_fn: Callable[[], tuple[Any, Any]] | None,
    *,
    align_rng: bool,
    restore_rng: bool = False,
    function: Any = None,
) -> Callable[[], tuple[Any, Any]]:
    """Start one checkpoint call; return the ``context_fn`` for the framework's checkpoint.

    A checkpoint called inside the replay of another recomp checkpoint is a
    re-run of a call that already ran in that checkpoint's forward: it gets
    the same invocation back, so its excluded regions are not executed again.
    If ``function`` is a module (or a module's bound method), the running
    statistics of the BatchNorm-like modules its replay re-runs are restored
    after each replay (see ``_running_stats``).
    """
    parent = get_recompute_state()
    if parent is not None and parent.is_recomputing:
        invocation = invocation_of(parent).next_child()
        replaying = True
    else:
        invocation = Invocation(
            CallIdentity(),
            backend,
            align_rng=align_rng and SWITCHES.rng_alignment,
            rewind=SWITCHES.replay_rewind,
        )
        for leaf in _iter_tensors(backend, (args, kwargs)):
            key = backend.storage_key(leaf)
            if key is not None:
                invocation.checkpoint_inputs.add(key, leaf)
        for observer in OBSERVERS.get():
            observer.checkpoint_started(invocation, function)
        if parent is not None:
            invocation_of(parent).children.append(invocation)
            # The parent's replay re-runs this call in full (see above) and needs
            # every cached output then, even those this checkpoint's own replay skips.
            invocation.disable_pruning()
        replaying = False
    tensors = replayed_statistics(backend, function)
    return make_context_fn(
        invocation,
        user_context_fn,
        forward_replays=replaying,
        rng_backend=backend if restore_rng else None,
        statistics=RestoreStatistics(backend, tensors) if tensors else None,
    )


def _iter_tensors(backend: Backend, tree: Any) -> Iterator[Any]:
    leaves, _ = backend.flatten(tree)
    return (leaf for leaf in leaves if backend.is_tensor(leaf))


def check_use_reentrant(use_reentrant: Any, package: str) -> None:
    if use_reentrant:
        raise ValueError(
            "recomp checkpoints are non-reentrant: excluded regions rely on saved-tensor hooks, "
            "which a reentrant checkpoint bypasses. Drop use_reentrant=True (or pass "
            f"use_reentrant=False) when calling {package}.checkpoint."
        )
