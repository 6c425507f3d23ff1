"""Per-op checkpoint policies, framework-free: what one checkpoint call's forward kept of
its ops' outputs, and how its replays find it again.

A policy function (``policy_fn(ctx, op, *args, **kwargs)``) decides, for each op call of
a checkpoint's forward, whether the op's output is kept (``MUST_SAVE``, ``PREFER_SAVE``,
``MUST_SWAP``: the replay is handed the kept output instead of running the op) or
recomputed. The forward records its decisions per op, in call order (:class:`OpCalls`);
each replay walks them with its own :class:`OpCursor`: the n-th call of an op in the
replay is the n-th call of that op in the forward. Ops that are not asked (ignored ops,
ops of excluded regions) are not counted on either side.

Each framework sees its ops its own way (``recomp.torch._swap.selective``: a dispatch
mode below PyTorch's selective checkpointing, for ``MUST_SWAP``;
``recomp.mindspore._selective``: ``mindspore.MsDispatchMode`` for every policy) and keeps
the leaves of an output its own way (a detached alias, a swap scope's host copy); the
matching is here.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from ._hooks import CallPart, CheckpointCallView, Stage


class SelectiveCheckpointContext:
    """What a policy function is handed first: ``is_recompute`` is False in the forward
    (where recomp asks) and True in a replay."""

    __slots__ = ("is_recompute",)

    def __init__(self, *, is_recompute: bool) -> None:
        self.is_recompute = is_recompute


def map_out(fn: Callable[[Any], Any], out: Any) -> Any:
    """``fn`` applied to an op's output: each item of a list or tuple output (not of a
    named tuple, which is one value), or the output itself."""
    if isinstance(out, (list, tuple)) and not hasattr(out, "_fields"):
        return type(out)(fn(x) for x in out)
    return fn(out)


class KeptOutput:
    """The kept output of one op call: the op's output with the framework's kept leaves
    (filled once the op has run). ``inputs``: what the framework recorded of the call's
    inputs (their layouts), compared with the replay's call before it is handed back."""

    __slots__ = ("inputs", "out")

    def __init__(self, inputs: Any = None) -> None:
        self.out: Any = None
        self.inputs = inputs

    def fill(self, out: Any, keep: Callable[[Any], Any]) -> None:
        """Keep ``out``: ``keep`` turns each leaf into what is held until the replay."""
        self.out = map_out(keep, out)

    def get(self, read: Callable[[Any], Any]) -> Any:
        """The output for the replay: ``read`` turns each kept leaf back into a value."""
        return map_out(read, self.out)


class OpCursor:
    """One replay's position in each op's list of forward calls."""

    __slots__ = ("calls", "counters")

    def __init__(self, calls: dict[Hashable, list[KeptOutput | None]]) -> None:
        self.calls = calls
        self.counters: dict[Hashable, int] = {}

    def next(self, op: Hashable) -> KeptOutput | None:
        """What the forward kept of this call of ``op`` (None: the replay runs it)."""
        index = self.counters.get(op, 0)
        self.counters[op] = index + 1
        calls = self.calls.get(op)
        return calls[index] if calls is not None and index < len(calls) else None


class OpCalls:
    """The forward's decisions, per op in call order: a :class:`KeptOutput`, or None for a
    call the replay recomputes."""

    __slots__ = ("calls", "kept")

    def __init__(self) -> None:
        self.calls: dict[Hashable, list[KeptOutput | None]] = {}
        self.kept = False  # some op's output is kept: replays need a cursor

    def add(self, op: Hashable, entry: KeptOutput | None) -> None:
        self.calls.setdefault(op, []).append(entry)
        if entry is not None:
            self.kept = True

    def cursor(self) -> OpCursor:
        return OpCursor(self.calls)


class FreshMode:
    """A re-enterable context that enters a new dispatch mode (``make()``) each time: each
    replay's cursor starts at the beginning. With ``only_if``, only where the forward
    kept some op's output (else the replay has nothing to hand back)."""

    def __init__(self, make: Callable[[], Any], only_if: OpCalls | None = None) -> None:
        self.make = make
        self.only_if = only_if
        self.entered: list[Any] = []

    def __enter__(self) -> None:
        mode = None
        if self.only_if is None or self.only_if.kept:
            mode = self.make()
            mode.__enter__()
        self.entered.append(mode)

    def __exit__(self, *exc_info: Any) -> None:
        mode = self.entered.pop()
        if mode is not None:
            mode.__exit__(*exc_info)


class SelectivePart(CallPart):
    """``policy_fn=`` of a recomp checkpoint: the framework's selective-checkpoint contexts
    (``contexts()`` makes them, once per call), before the user's ``context_fn``
    (HyperParallel's order)."""

    stage = Stage.USER

    def __init__(self, contexts: Callable[[], tuple[Any, Any]]) -> None:
        self.make = contexts

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        return self.make()
