"""The exclusion engine, shared by every framework backend: where a checkpoint call starts.

The framework APIs (``recomp.torch._api``, ``recomp.mindspore._api``) use the
engine through this module: :func:`begin` starts one checkpoint call
(:class:`CheckpointCall`) from the framework's parts, whose ``context_fn`` recomp
hands to the framework's own checkpoint (NOTE [ The parts of a checkpoint call ]);
``ExcludedRegion`` (from ``_region``) is what each exclude wrapper holds.

Where things live, bottom up (each module imports only those above it in this list;
``docs/mechanism.md`` has the full map):

* ``errors``, ``_state``  recomp's errors; the public recompute state and its context variable;
* ``_pytree``, ``_backend``  flattening and rebuilding; the questions the engine asks a
  framework, with shared defaults (``torch/_backend.py`` and ``mindspore/_backend.py``
  answer them, ``torch/_compat/`` and ``mindspore/_compat.py`` hold their private API);
* ``_hooks``     the typed interfaces of the parties that take part in a checkpoint
  call (``CallPart``), watch a region call (debug report, tests, memory reports) or
  move what it keeps (offload);
* ``_rng_trackers``  RNG states kept outside the framework's generators (Megatron-Core's
  and DeepSpeed's trackers, the user's), saved and restored with the checkpoint's RNG;
* ``_record``    what one checkpoint call records: ``Invocation`` and the pieces of a
  region call's record (``Snapshot``, ``CachedOutput``, ...);
* ``_region``    ``ExcludedRegion`` and ``RegionCall``: one excluded-region call, its
  whole life, what it keeps, defers, caches and hands back to replays. Its NOTE
  blocks state the rules the engine relies on, numbered; the code cites them;
* ``_module_state``  the state of the replayed modules outside the autograd graph
  (parameters swapped by ``functional_call``, buffers updated in place): what each
  replay must see as the forward did, and whose updates happen once;
* ``_engine``    (here) checkpoint calls: ``begin``, the order of their parts, nesting.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from typing import Any

from ._backend import Backend
from ._hooks import OBSERVERS, CallPart, CheckpointCallView, Placer, Stage
from ._module_state import ModuleState
from ._record import Invocation, invocation_of, weak_or_nothing
from ._region import ExcludedRegion, check_flag
from ._rng_trackers import replay_trackers_part
from ._state import PhaseContext, get_recompute_state
from .errors import ParameterChangedError, changed_argument

__all__ = [
    "CallPart",
    "CheckpointCall",
    "ComposedContext",
    "ExcludedRegion",
    "ReplayRng",
    "Stage",
    "UserContext",
    "begin",
    "check_flag",
    "check_use_reentrant",
]


class MechanismSwitches:
    """Mechanisms the test seam (``recomp._testing``) can turn off to show that a
    guarantee depends on them. Read once per checkpoint call, by :func:`begin`
    (``kept_replays`` by the framework's checkpoint that has it)."""

    __slots__ = ("kept_replays", "own_replay", "replay_rewind", "rng_alignment")

    def __init__(self) -> None:
        self.rng_alignment = True
        self.replay_rewind = True
        # What a replay recomputed stays until a backward pass reads it (PyTorch:
        # ``recomp.torch._kept``), instead of one replay per backward pass.
        self.kept_replays = True
        # The framework's checkpoint's replay run by recomp where it can, with what the
        # framework's own would leave (PyTorch: NOTE [ Replaying PyTorch's checkpoint ]).
        self.own_replay = True


SWITCHES = MechanismSwitches()


class ComposedContext:
    """Enter several contexts in order, exit in reverse; re-enterable like ``PhaseContext``.

    ``call`` is the checkpoint call the contexts belong to (memory reports find the
    invocation through it)."""

    __slots__ = ("call", "contexts")

    def __init__(self, call: CheckpointCall | None, *contexts: Any) -> None:
        self.call = call
        self.contexts = contexts

    # Entered once per forward and replay of every checkpoint call: no ExitStack, and
    # nothing kept per entry. ``__exit__`` runs only after an ``__enter__`` that entered
    # every context (a ``with`` statement, an ExitStack); an ``__enter__`` that fails
    # leaves what it entered itself. So an entry inside another (a replay re-entered)
    # needs no record of its own: each context keeps what its entries need.

    def __enter__(self) -> None:
        entered = 0
        try:
            for context in self.contexts:
                context.__enter__()
                entered += 1
        except BaseException:
            # Leave the contexts entered so far, innermost first, with the error.
            self._leave(entered, sys.exc_info(), None)
            raise

    def __exit__(self, *exc_info: Any) -> bool:
        """Exit the contexts, innermost first, as nested ``with`` blocks would: one that
        suppresses the error hides it from those outside; an error one raises is what
        those outside see. True if the error given was suppressed."""
        contexts = self.contexts
        index = len(contexts)
        if exc_info[0] is not None:
            return self._leave(index, exc_info, None)
        # No error (every forward and replay that runs through): the plain loop, until
        # a context raises.
        try:
            while index:
                index -= 1
                contexts[index].__exit__(None, None, None)
        except BaseException as exc:
            self._leave(index, (type(exc), exc, exc.__traceback__), exc)
        return False

    def _leave(self, index: int, exc_info: Any, pending: BaseException | None) -> bool:
        """Exit the first ``index`` contexts, innermost first, with the error ``exc_info``,
        which ``pending`` raised in one inside them (None: the error given to ``__exit__``)."""
        contexts = self.contexts
        received = pending is None
        while index:
            index -= 1
            try:
                if contexts[index].__exit__(*exc_info):
                    exc_info = (None, None, None)
                    pending = None
            except BaseException as exc:
                if exc is not exc_info[1] and exc.__context__ is None and exc_info[1] is not None:
                    exc.__context__ = exc_info[1]
                exc_info = (type(exc), exc, exc.__traceback__)
                pending = exc
        if pending is not None:
            raise pending
        return received and exc_info[0] is None


class _PhaseAndPart(PhaseContext):
    """A phase's context and one part's context, entered as nested ``with`` blocks would
    be, the part's inside the phase's (``inner``) or outside it: a plain call's forward
    (the kept-replay handle, then the phase) and replay (the phase, then the module
    state). Behaves as a :class:`ComposedContext` of the two, with no object of its own
    per phase (NOTE [ What a call keeps ]); the recompute state it installs is itself."""

    __slots__ = ("inner", "other")

    def __init__(
        self,
        record: object,
        call: Any,
        is_recomputing: bool,
        listener: Any,
        other: Any,
        inner: bool,
    ) -> None:
        # PhaseContext's fields, set here (no second frame: one is made per call and phase).
        self.record = record
        self.call = call
        self.is_recomputing = is_recomputing
        self.listener = listener
        self._tokens = ()
        self.other = other
        self.inner = inner

    @property
    def contexts(self) -> tuple[Any, ...]:
        """The part's context (what a walk of a call's contexts reads, as of a
        :class:`ComposedContext`)."""
        return (self.other,)

    def __enter__(self) -> Any:
        other = self.other
        if self.inner:
            PhaseContext.__enter__(self)
            try:
                other.__enter__()
            except BaseException:
                PhaseContext.__exit__(self, *sys.exc_info())
                raise
        else:
            other.__enter__()
            try:
                PhaseContext.__enter__(self)
            except BaseException:
                type(other).__exit__(other, *sys.exc_info())
                raise
        return self

    def __exit__(self, *exc_info: Any) -> bool:
        other = self.other
        if exc_info[0] is None:
            # No error (every forward and replay that runs through): both left in turn,
            # as ``_exit_pair`` would with no error given (a phase suppresses nothing).
            # Measured: with the helper for every exit, and PhaseContext.__init__ called
            # above, a call cost 11,800 more instructions (docs/benchmarks.md).
            if self.inner:
                try:
                    other.__exit__(None, None, None)
                except BaseException as exc:
                    PhaseContext.__exit__(self, type(exc), exc, exc.__traceback__)
                    raise
                PhaseContext.__exit__(self, None, None, None)
            else:
                try:
                    PhaseContext.__exit__(self, None, None, None)
                except BaseException as exc:
                    if other.__exit__(type(exc), exc, exc.__traceback__):
                        return False  # suppressed: the block ends without an error
                    raise
                other.__exit__(None, None, None)
            return False
        if self.inner:
            return _exit_pair(PhaseContext.__exit__, self, type(other).__exit__, other, exc_info)
        return _exit_pair(type(other).__exit__, other, PhaseContext.__exit__, self, exc_info)


def _exit_pair(first_exit: Any, first: Any, second_exit: Any, second: Any, exc_info: Any) -> bool:
    """Leave ``second`` (inside) then ``first`` (outside), each by its class's
    ``__exit__``, as two nested ``with`` blocks would: an error either raises is what the
    other and the outside see, unless one outside it suppresses it. True if the error
    given (``exc_info``) was suppressed."""
    error = exc_info[1]
    try:
        suppressed = second_exit(second, *exc_info)
    except BaseException as exc:
        # What the second raised is what the first and the outside see, unless the
        # first suppresses it (and with it the error given, if any).
        if exc is not error and exc.__context__ is None and error is not None:
            exc.__context__ = error
        if first_exit(first, type(exc), exc, exc.__traceback__):
            return error is not None
        raise
    if error is None:
        first_exit(first, None, None, None)
        return False
    # An error (a replay that stops early ends this way): suppressed by the second, the
    # first sees none.
    if suppressed:
        first_exit(first, None, None, None)
        return True
    return bool(first_exit(first, *exc_info))


def _phase(
    invocation: Invocation, recomputing: bool, call: CheckpointCall, others: list[Any], at: int
) -> Any:
    """One phase's context: the recompute state's (``recomputing``: a replay's, or a
    forward that an enclosing replay re-runs) with the parts' contexts ``others`` around
    and inside it (the state's at index ``at``)."""
    if not others:
        return PhaseContext(invocation, invocation, recomputing, call)
    if len(others) == 1:
        return _PhaseAndPart(invocation, invocation, recomputing, call, others[0], at == 0)
    others.insert(at, PhaseContext(invocation, invocation, recomputing, call))
    return ComposedContext(call, *others)


# NOTE [ The parts of a checkpoint call ]
#
# recomp hands the framework's checkpoint one ``context_fn``, composed here from the
# call's parts (``recomp._hooks.CallPart``), in the order of ``recomp._hooks.Stage``,
# outermost first. Each stage is where it is for a reason:
#
#   KEPT_REPLAYS     PyTorch's kept-replay handle (``recomp.torch._kept``) takes over the
#                    checkpoint's unpack hook: it must sit directly inside the
#                    checkpoint's saved-tensor hooks, before anything else pushes hooks.
#   RECOMPUTE_STATE  the recompute state (``get_recompute_state``) and the phase events:
#                    the forward starts (the save counter is asked for here, directly
#                    under the checkpoint's hook), a replay starts (every log rewinds),
#                    the forward ends (every log is pruned and checked). Everything
#                    inside sees which call and phase it is in.
#   VALUE_CHECK      PyTorch, ``determinism_check="values"`` / ``debug=True``: its pack
#                    hook fingerprints each saved tensor on top of the checkpoint's own,
#                    so it sits inside the two stages above, which read the checkpoint's
#                    frame from that hook (``recomp.torch._value_check``).
#   RESTORED_STATE   state outside the tensors that a replay must leave as it found it
#                    or start from where the forward started: the replayed modules'
#                    parameters and buffers (``_module_state``), then the random
#                    state where the framework's checkpoint does not restore it
#                    (``ReplayRng``), then the states of RNG trackers kept outside
#                    the framework (``_rng_trackers``).
#   DEBUG_LOG        ``debug=True``: routes region events to the op log and reports
#                    replay errors with it; outside the user's contexts, so that an
#                    error they raise is reported too.
#   USER             the user's ``context_fn`` (selective checkpointing, ...).
#   OP_RECORDER      ``debug=True``: the op recorder, inside the user's contexts so that
#                    it sees every op the checkpointed code calls.
#   COLLECTIVES      the collective record (``recomp.torch._collective_cache``): its
#                    dispatch modes come last so that they see each operator first; a
#                    selective-checkpointing mode below them sees the forward's
#                    collectives and none of the replay's, as for excluded regions.
#   FIRST_FORWARD_WATCH  MindSpore: the watch of a checkpointed Cell's first forward
#                    for collectives in recomputed code, innermost in the forward.
#   REPLAY_ERRORS    MindSpore: explains an early stop inside an op, innermost in the
#                    replay, where the exception arrives first.
#
# Adding a part is one ``CallPart`` subclass with its ``stage``, and one line where the
# framework's checkpoint builds its list of parts.


# NOTE [ What a call keeps ]
#
# Everything a checkpoint call makes and holds until its backward (its replay context,
# the invocation, the parts that act in the replay) lives through the rest of the forward,
# in every layer at once. Each pass of CPython's cyclic collector walks the young objects
# alive then and moves the survivors to an older generation; once enough survivors were
# moved, a full pass walks every object of the process (``benchmarks/host_cost.py``
# counts the passes and their time). So a call keeps as few objects as it can:
#
#   * containers are made on first use: the invocation's logs, registries and children,
#     a kept-replay handle's dictionaries and running passes, a call identity's
#     resources; until then each is a shared empty one, never written, or None;
#   * stacks of re-entry (a replay entered once per backward) are tuples, empty between
#     entries, and lists of parts that hear an event are tuples, most often empty;
#   * what only the forward needs is let go when it has served: the parts that hear the
#     forward's end once it ended (the parts themselves stay with the call, as long as
#     its graph: some are found through weak references while it lives, the collective
#     record by ``recomp.torch.collectives.kept_collective_bytes``);
#   * one object plays two roles where it can: the invocation is the call's identity;
#     each phase's context is the recompute state it installs.
#
# None of it may close a reference cycle: the call's objects must go with its graph, by
# reference counting (tests/torch/test_reference_cycles.py counts what a step leaves).
#
# The tiny layer of ``benchmarks/host_cost.py`` kept 89 objects per layer through the
# forward (PyTorch's checkpoint: 60), then 71, and now keeps 69; after the first of those
# rounds the collector ran a quarter less often (young passes per 100 steps: 367, then
# 275). Twelve more objects kept per call (lists, or instances of a class) did not change
# that count later, nor did the last two fewer, but they make each pass longer; and each
# instance of a class costs about 1,900 machine instructions to make, where a Python call
# costs about 400 (docs/benchmarks.md, the eleventh round).


class CheckpointCall:
    """One call of the framework's checkpoint: the invocation it records into and its
    parts, and the ``context_fn`` composed from them (NOTE [ The parts of a checkpoint
    call ]).

    ``rerun``: an enclosing recomp checkpoint's replay re-runs a call whose forward
    already ran; the invocation is that forward's, and excluded regions return their
    cached outputs. ``nested``: the call runs inside another recomp checkpoint.
    It hears the phase events (``_state.PhaseListener``) and hands them to the
    invocation, then to the parts.
    """

    __slots__ = ("ending", "function", "invocation", "nested", "parts", "replaying", "rerun")

    def __init__(
        self,
        invocation: Invocation,
        parts: list[CallPart],
        *,
        rerun: bool,
        nested: bool,
        function: Any = None,
    ) -> None:
        self.invocation = invocation
        self.rerun = rerun
        self.nested = nested
        # What the framework's checkpoint is to call: the checkpointed function, or an
        # ``ArgumentsAtCall`` around it (NOTE [ Arguments a replay sees ]).
        self.function = function
        parts.append(_RECOMPUTE_STATE)
        parts.sort(key=_STAGE)  # stable: parts of one stage keep their order
        self.parts = parts  # held as long as the call: a part lives with its graph
        # The parts that hear each phase event: those whose class overrides the method
        # (``CallPart.hears_replay``, ``hears_end``); the others' would do nothing.
        # Tuples, most often empty ones (NOTE [ What a call keeps ]).
        self.replaying: tuple[CallPart, ...] = ()
        self.ending: tuple[CallPart, ...] = ()
        for part in parts:
            if part.hears_replay:
                self.replaying += (part,)
            if part.hears_end:
                self.ending += (part,)

    def context_fn(self) -> tuple[Any, Any]:
        forward: list[Any] = []
        replay: list[Any] = []
        at_forward = at_replay = 0
        for part in self.parts:
            if part is _RECOMPUTE_STATE:
                # Where the phases' own contexts go among the others (made by ``_phase``).
                at_forward, at_replay = len(forward), len(replay)
                continue
            f, r = part.contexts(self)
            if f is not None:
                forward.append(f)
            if r is not None:
                replay.append(r)
        # (The replay's context is not the call itself: its recompute state holds the
        # call, which would then hold it back, a cycle the collector must free.)
        invocation = self.invocation
        return (
            _phase(invocation, self.rerun, self, forward, at_forward),
            _phase(invocation, True, self, replay, at_replay),
        )

    # -- PhaseListener ---------------------------------------------------------------

    def on_forward_start(self) -> None:
        self.invocation.on_forward_start()

    def on_replay_start(self) -> None:
        self.invocation.on_replay_start()
        for part in self.replaying:
            part.replay_started()

    def on_forward_end(self, ok: bool) -> None:
        try:
            self.invocation.on_forward_end(ok)
        except BaseException:
            ok = False
            raise
        finally:
            ending, self.ending = self.ending, ()  # heard once: let go
            for part in ending:
                part.forward_ended(ok)


_STAGE = operator.attrgetter("stage")


class _RecomputeStatePart(CallPart):
    """Where the recompute state of each phase sits among the parts (its stage); its
    contexts, which tell the call when phases start and end, are made by the call around
    the other parts' (``CheckpointCall.context_fn``: one object per phase where it can).
    Holds nothing: one serves every call."""

    stage = Stage.RECOMPUTE_STATE


_RECOMPUTE_STATE = _RecomputeStatePart()


class UserContext(CallPart):
    """The ``context_fn`` the user gave the checkpoint."""

    stage = Stage.USER

    def __init__(self, context_fn: Callable[[], tuple[Any, Any]]) -> None:
        self.context_fn = context_fn

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        forward, replay = self.context_fn()
        return forward, replay


class ReplayRng(CallPart):
    """For frameworks whose checkpoint does not restore the RNG fully: the replay starts
    from the random state the forward started from, and leaves it as it found it."""

    stage = Stage.RESTORED_STATE

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.forward_state: Any = None
        self._saved: list[Any] = []

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        self.forward_state = self.backend.get_rng_state()
        return None, self

    def __enter__(self) -> None:
        self._saved.append(self.backend.get_rng_state())
        self.backend.set_rng_state(self.forward_state)

    def __exit__(self, *exc_info: Any) -> None:
        self.backend.set_rng_state(self._saved.pop())


def begin(
    backend: Backend,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    user_context_fn: Callable[[], tuple[Any, Any]] | None,
    parts: list[CallPart] | None = None,
    *,
    align_rng: bool,
    restore_rng: bool = False,
    function: Any = None,
    placer: Placer | None = None,
) -> CheckpointCall:
    """Start one checkpoint call; hand ``call.context_fn`` to the framework's checkpoint.

    A checkpoint called inside the replay of another recomp checkpoint is a
    re-run of a call that already ran in that checkpoint's forward: it gets
    the same invocation back, so its excluded regions are not executed again.
    ``parts`` are the framework's parts of the call, a list the call takes and adds to
    (made per call by the framework's checkpoint: no copy); the engine adds the recompute
    state, the user's ``context_fn``, the state of the modules the replay re-runs (if
    ``function`` is a module or a module's bound method, see ``_module_state``),
    with ``restore_rng`` the replay's RNG, and with ``align_rng`` the states of the RNG
    trackers (``_rng_trackers``). ``placer``: where the excluded regions called inside keep
    their tensors when they name no place of their own (a nested call without one takes
    the enclosing call's).
    """
    parent = get_recompute_state()
    root = backend.modules.module_of(function)
    # One tensor alone (the common call): no walk of the arguments, no container to copy.
    one_tensor = not kwargs and len(args) == 1 and isinstance(args[0], backend.tensor_class)
    if parent is not None and parent.is_recomputing:
        invocation = invocation_of(parent).next_child()
        rerun = True
    else:
        invocation = Invocation(
            backend,
            align_rng=align_rng and SWITCHES.rng_alignment,
            rewind=SWITCHES.replay_rewind,
        )
        invocation.root = weak_or_nothing(root)
        if placer is None and parent is not None:
            placer = invocation_of(parent).placer
        invocation.placer = placer
        invocation.set_checkpoint_inputs(args if one_tensor else _input_tensors(backend, args, kwargs))
        for observer in OBSERVERS.get():
            observer.checkpoint_started(invocation, function)
        if parent is not None:
            invocation_of(parent).add_child(invocation)
        rerun = False
    all_parts = [] if parts is None else parts
    if user_context_fn is not None:
        all_parts.append(UserContext(user_context_fn))
    module_state = None if root is None else ModuleState.of(backend, root)
    if module_state is not None:
        all_parts.append(module_state)
    if restore_rng:
        all_parts.append(ReplayRng(backend))
    if align_rng:
        trackers = replay_trackers_part()  # RNG trackers: restored by recomp everywhere
        if trackers is not None:
            all_parts.append(trackers)
    return CheckpointCall(
        invocation,
        all_parts,
        rerun=rerun,
        nested=parent is not None,
        # What the framework's checkpoint calls (NOTE [ Arguments a replay sees ]).
        function=function if one_tensor else ArgumentsAtCall.around(backend, function, args, kwargs),
    )


# NOTE [ Arguments a replay sees ]
# A checkpoint keeps its arguments for the replay, and the framework's checkpoint keeps a
# list or dict among them as the object itself. What the caller does to that object after
# the call then reaches the replay: a list of earlier hidden states that the caller
# appends to after each layer (a layer reading ``history[-1]``) makes the replay compute
# with a later layer's output, and the gradients are wrong without an error wherever the
# shapes agree (PyTorch's checkpoint too). And what the forward writes into such an
# argument (an auxiliary loss appended to a list it was given) the replay writes a second
# time, during backward. So where an argument is, or a tuple holds, a list or a dict, each
# replay gets copies of those containers as they were when the call started, holding the
# same tensors and other objects (copied down through lists, dicts and tuples; any other
# object is handed over as it is, as before).
#
# The tensors themselves can change too. PyTorch's checkpoint saves its positional tensor
# arguments for the replay as autograd saves a tensor, so a write to one of them between
# the forward and the replay is refused, as it would be without checkpointing. A tensor
# given as a keyword argument, or held in a list, dict or tuple, it keeps as a plain
# reference: written in place before the replay (a buffer reused for the next
# micro-batch), it would be read with its new values, without an error. Where version
# counters show every write (``Modules.state_versions_track_writes``, PyTorch), their
# versions are noted when the forward returns and compared when each replay starts, and a
# replay that finds one changed raises ``ParameterChangedError`` naming the argument, as a
# changed parameter does (NOTE [ State changed before backward ] in ``_module_state``).
#
# Both are the work of an ``ArgumentsAtCall``, which the framework's checkpoint calls in
# place of the function: its first call (the forward) runs the function with the arguments
# themselves. Only a call whose arguments hold a list or a dict, or (PyTorch) a tensor by
# keyword or in a tuple gets one; a call of one tensor alone does not look.


class ArgumentsAtCall:
    """The function a checkpoint's framework calls where its arguments hold lists, dicts
    or tensors it does not save itself (NOTE [ Arguments a replay sees ]): its first call
    (the forward) runs ``function`` with the arguments it is given; each later call (a
    replay) checks those tensors and runs it with copies of the containers as they were when
    the checkpoint call started."""

    __slots__ = (
        "backend",
        "call_args",
        "call_kwargs",
        "copied_args",
        "copied_kwargs",
        "function",
        "ran",
        "versions",
        "watched",
    )

    def __init__(
        self, backend: Backend, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self.backend = backend
        self.function = function
        # The call's own argument tuple and keyword dictionary (the framework's checkpoint
        # holds them too), for naming a changed tensor.
        self.call_args, self.call_kwargs = args, kwargs
        # The tensors whose versions each replay compares (where versions show writes): all
        # but positional tensors, which the framework's checkpoint keeps itself.
        watched: list[Any] = []
        # Copies of the arguments that hold a list or a dict, as they are now.
        self.copied_args: list[Any] | None = None
        for i, value in enumerate(args):
            if _unsaved(backend, value, watched):
                if self.copied_args is None:
                    self.copied_args = [None] * len(args)
                self.copied_args[i] = _copy_containers(value)
        self.copied_kwargs = {
            name: _copy_containers(value)
            for name, value in kwargs.items()
            if _walk(value, backend.tensor_class, watched)
        }
        self.watched = watched if backend.modules.state_versions_track_writes else []
        self.versions: list[int | None] | None = None
        self.ran = False

    @classmethod
    def around(
        cls, backend: Backend, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``function`` itself where the arguments hold no list or dict and (where versions
        show writes) no tensor the framework leaves unsaved, else one around it."""
        call = cls(backend, function, args, kwargs)
        return call if call.watched or call.copied_args or call.copied_kwargs else function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.ran:
            self.ran = True
            out = self.function(*args, **kwargs)
            if self.watched:
                self.versions = self.backend.versions(self.watched)
            return out
        if self.versions is not None and self.backend.versions(self.watched) != self.versions:
            raise self._changed()
        copied = self.copied_args
        if copied is not None:
            args = tuple(
                given if kept is None else _copy_containers(kept)
                for given, kept in zip(args, copied)
            ) + args[len(copied) :]
        for name, kept in self.copied_kwargs.items():
            kwargs[name] = _copy_containers(kept)
        return self.function(*args, **kwargs)

    def _changed(self) -> ParameterChangedError:
        """The error naming the watched tensors whose versions changed (walked again, with
        their places, in the order of ``__init__``)."""
        named: list[Any] = []
        copied = self.copied_args or [None] * len(self.call_args)
        for i, (value, kept) in enumerate(zip(self.call_args, copied)):
            _unsaved(self.backend, value if kept is None else kept, named, f"argument {i}")
        for name, value in self.call_kwargs.items():
            _walk(self.copied_kwargs.get(name, value), self.backend.tensor_class, named, name)
        assert self.versions is not None
        version = self.backend.version
        changed = [path for (path, t), v in zip(named, self.versions) if version(t) != v]
        return changed_argument(changed, _called(self.function))


def _unsaved(backend: Backend, value: Any, found: list[Any], path: str | None = None) -> bool:
    """:func:`_walk` of a positional argument, except a tensor: the framework's checkpoint
    keeps that one itself."""
    if isinstance(value, backend.tensor_class):
        return False
    return _walk(value, backend.tensor_class, found, path)


def _walk(value: Any, tensor: Any, found: list[Any], path: str | None = None) -> bool:
    """Add to ``found`` the tensors in ``value`` (itself, or through lists, dicts and
    tuples), in order, each with where it is where a ``path`` is given (``("mask",
    t)``, ``("argument 0[2]", t)``); whether ``value`` holds a list or a dict."""
    kind = type(value)
    if kind is list or kind is tuple:
        holds = kind is list
        for i, item in enumerate(value):
            holds |= _walk(item, tensor, found, None if path is None else f"{path}[{i}]")
        return holds
    if kind is dict:
        for key, item in value.items():
            _walk(item, tensor, found, None if path is None else f"{path}[{key!r}]")
        return True
    if isinstance(value, tensor):
        found.append(value if path is None else (path, value))
    return False


def _called(function: Any) -> str:
    """How an error names what a checkpoint runs: a module's class, else the function's
    name."""
    owner = getattr(function, "__self__", function)
    name = getattr(function, "__qualname__", None)
    return type(owner).__name__ if name is None or owner is not function else name


def _copy_containers(value: Any) -> Any:
    """``value`` with its lists, dicts and tuples copied, down to what they hold."""
    kind = type(value)
    if kind is list:
        return [_copy_containers(v) for v in value]
    if kind is dict:
        return {k: _copy_containers(v) for k, v in value.items()}
    if kind is tuple:
        return tuple(_copy_containers(v) for v in value)
    return value


def _input_tensors(backend: Backend, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The tensors among a checkpoint call's arguments, in the order of a flatten."""
    # Arguments that are tensors, tuples of tensors (HF's position embeddings), None or
    # plain scalars (the common call) are read without a walk; anything else is walked.
    tensor = backend.tensor_class
    found: list[Any] = []
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if isinstance(value, tensor):
            found.append(value)
        elif kind is tuple and all(isinstance(item, tensor) for item in value):
            found += value
        elif value is not None and kind not in _SCALARS:
            leaves, _ = backend.flatten((args, kwargs))
            return [leaf for leaf in leaves if backend.is_tensor(leaf)]
    return found


_SCALARS = frozenset({bool, int, float, str})


def check_use_reentrant(use_reentrant: Any, package: str) -> None:
    if use_reentrant:
        raise ValueError(
            "recomp checkpoints are non-reentrant: excluded regions rely on saved-tensor hooks, "
            "which a reentrant checkpoint bypasses. Drop use_reentrant=True (or pass "
            f"use_reentrant=False) when calling {package}.checkpoint."
        )
