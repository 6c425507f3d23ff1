"""Per-op checkpoint policies, framework-free: what one checkpoint call's forward kept of
its ops' outputs, and how its replays find it again.

A policy function (``policy_fn(ctx, op, *args, **kwargs)``) decides, for each op call of
a checkpoint's forward, whether the op's output is kept (``MUST_SAVE``, ``PREFER_SAVE``,
``MUST_SWAP``: the replay is handed the kept output instead of running the op) or
recomputed. The forward records its decisions per op, in call order (:class:`OpCalls`);
each replay walks them with its own :class:`OpCursor`: the n-th call of an op in the
replay is the n-th call of that op in the forward. Ops that are not asked (ignored ops,
ops of excluded regions) are not counted on either side.

Each kept output is also an entry of the invocation's log of kept op outputs
(``recomp._record.EntryLog``, kind :data:`LOG_KIND`), recorded once its op has run
(:meth:`OpCalls.fill`): so the invocation prunes it with its other logs at the end of the
forward, with the save counter it asked once (rule 8 of NOTE [ How an excluded region is
kept out of the replay ]: no replay reaches an op run after the checkpoint's last saved
tensor, so what it kept is let go).

Each framework sees its ops its own way (``recomp.torch._swap.selective``: a dispatch
mode below PyTorch's selective checkpointing, for ``MUST_SWAP``;
``recomp.mindspore._selective``: ``mindspore.MsDispatchMode`` for every policy) and keeps
the leaves of an output its own way (a detached alias, a swap scope's host copy); the
matching and the record are here.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from ._hooks import CallPart, CheckpointCallView, Stage
from ._record import EntryLog, Invocation, invocation_of
from ._state import get_recompute_state

#: The kind of the invocation's log that holds the op outputs its forward kept. A re-run
#: of the call by an enclosing replay keeps op outputs of its own: it does not read it.
LOG_KIND = "kept op outputs"


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
    (filled once the op has run, :meth:`OpCalls.fill`). ``inputs``: what the framework
    recorded of the call's inputs (their layouts), compared with the replay's call before
    it is handed back. An entry of the invocation's log of kept op outputs."""

    __slots__ = ("drop", "inputs", "out", "saves_after")

    def __init__(self, inputs: Any = None) -> None:
        self.out: Any = None
        self.inputs = inputs
        self.drop: Callable[[Any], Any] | None = None
        self.saves_after: int | None = None  # set by the invocation that records it

    def get(self, read: Callable[[Any], Any]) -> Any:
        """The output for the replay: ``read`` turns each kept leaf back into a value."""
        return map_out(read, self.out)

    def drop_cache(self) -> None:
        """No replay reaches the op (rule 8): ``drop`` lets go of each kept leaf."""
        drop, self.drop = self.drop, None
        if drop is not None:
            self.out = map_out(drop, self.out)

    def release(self) -> None:
        """Nothing is held for the forward alone."""


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
    call the replay recomputes; and where the kept outputs are recorded."""

    __slots__ = ("calls", "kept", "owner")

    def __init__(self) -> None:
        self.calls: dict[Hashable, list[KeptOutput | None]] = {}
        self.kept = False  # some op's output is kept: replays need a cursor
        # The invocation whose forward these decisions belong to, and its log.
        self.owner: tuple[Invocation, EntryLog[KeptOutput]] | None = None

    def forward_started(self) -> None:
        """The forward of the checkpoint call these decisions belong to begins here (its
        recompute state is installed): the outputs it keeps go into that call's log.
        Outside a recomp checkpoint's forward (in a call that an enclosing replay re-runs,
        under PyTorch's own checkpoint) nothing is recorded, and nothing is let go."""
        state = get_recompute_state()
        if state is None or state.is_recomputing:
            self.owner = None
            return
        invocation = invocation_of(state)
        self.owner = (invocation, invocation.log(LOG_KIND, rerun_reads=False))

    def add(self, op: Hashable, entry: KeptOutput | None) -> None:
        self.calls.setdefault(op, []).append(entry)
        if entry is not None:
            self.kept = True

    def fill(
        self,
        entry: KeptOutput,
        out: Any,
        keep: Callable[[Any], Any],
        drop: Callable[[Any], Any] | None = None,
    ) -> None:
        """The op of ``entry`` returned ``out``, and autograd has not yet saved what the op
        saves: ``keep`` turns each leaf into what is held until the replay; the entry is
        recorded with the number of tensors the checkpoint has saved so far, and if no
        replay reaches the op, the invocation lets go of each kept leaf with ``drop``
        (without one, the leaves stay held) (rule 8)."""
        entry.out = map_out(keep, out)
        entry.drop = drop
        owner = self.owner
        if owner is not None:
            invocation, log = owner
            invocation.record(log, entry)

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
