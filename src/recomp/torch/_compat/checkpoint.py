"""PyTorch's non-reentrant checkpoint from the inside: the hooks it pushes on the
saved-tensors hook stack, the frame (``_CheckpointFrame``) its pack hook closes over, and
what it leaves open when its function raises; PyTorch's ``checkpoint_wrapper`` taking a
module.

Consumers: ``torch/_backend.py`` (the save counter), ``torch/_kept.py`` (the top hooks,
their holders and marks), ``torch/_debug.py`` (the debug switch, the top hooks),
``torch/_api.py`` (closing a failed checkpoint), ``torch/_foreign.py`` (a plain
checkpoint around recomp's: the top hooks, closing it, PyTorch's wrapper).
Tested by ``tests/torch/compat/test_checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from .engine import graph_task_id

# --------------------------------------------------------------------------- saved-tensors hook stack


try:
    from torch.utils.checkpoint import _CheckpointFrame
except ImportError:  # not in this PyTorch: no frame is ever found
    _CheckpointFrame = None  # type: ignore[assignment,misc]

# Per code object of a pack hook: the index of its closure cell that holds the frame
# (-1: none). Read at every checkpoint call, twice (the save counter, kept replays).
_FRAME_CELL: dict[Any, int] = {}


def _checkpoint_frame(pack: Any) -> Any:
    """The ``_CheckpointFrame`` a non-reentrant checkpoint's pack hook closes over, or None."""
    cells = getattr(pack, "__closure__", None)
    if not cells or _CheckpointFrame is None:
        return None
    code = pack.__code__
    index = _FRAME_CELL.get(code)
    if index is None:
        index = next(
            (i for i, c in enumerate(cells) if isinstance(c.cell_contents, _CheckpointFrame)), -1
        )
        _FRAME_CELL[code] = index
    if index < 0 or index >= len(cells):
        return None
    frame = cells[index].cell_contents
    if not isinstance(frame, _CheckpointFrame) or not isinstance(
        getattr(frame, "weak_holders", None), list
    ):
        return None
    return frame


def checkpoint_save_counter() -> Callable[[], int | None] | None:
    """How many tensors the enclosing non-reentrant checkpoint has saved so far, when
    its replay stops early after the last of them: a counter, which gives None where the
    hooks on top of the saved-tensors stack are not such a checkpoint's (a checkpoint
    without early stop, a replay's hooks) or once the checkpoint is gone; None where no
    hooks are on the stack.

    Why: with early stop a replay never reaches regions called after the last saved
    tensor, so their cached outputs can be dropped at the end of the forward.
    How: the pack hook on top of the saved-tensors hook stack is the checkpoint's;
    its closure holds the ``_CheckpointFrame``, whose ``weak_holders`` grow by one per
    saved tensor. Asked when every checkpoint's forward starts, read only where a region
    ran: the frame is found on the first read.
    If it changes: None, and every cached output is kept (more memory, same results).
    Retired by: a public early-stop position on the checkpoint.
    """
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError):
        return None
    if hooks is None:
        return None
    pack = hooks[0]
    found: list[Any] = []  # the frame (weakly) or None, once looked for

    def saved_so_far() -> int | None:
        if not found:
            frame = _checkpoint_frame(pack)
            early = frame is not None and getattr(frame, "early_stop", False)
            found.append(weakref.ref(frame) if early else None)
        ref = found[0]
        live = None if ref is None else ref()
        return None if live is None else len(live.weak_holders)

    return saved_so_far


def checkpoint_debug_switch() -> bool | None:
    """The value set by ``torch.utils.checkpoint.set_checkpoint_debug_enabled`` (None: unset).

    Private: PyTorch offers a setter but no getter for this global.
    """
    value = getattr(torch.utils.checkpoint, "_checkpoint_debug_enabled", None)
    return value if isinstance(value, bool) else None


def top_checkpoint_hooks() -> tuple[Callable[[Any], Any], Callable[[Any], Any]] | None:
    """The (pack, unpack) pair of the innermost non-reentrant checkpoint, if it is on top.

    Private: the saved-tensors hook stack has no public reader, and the marker
    ``_checkpoint_internal`` is how PyTorch's checkpoint tags its own hooks.
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return None
    pack = hooks[0]
    # 2.14's mark, read here first (asked at every checkpoint call), then the older test.
    if not getattr(pack, "_checkpoint_internal", False) and not _is_checkpoint_pack_hook(pack):
        return None
    return pack, hooks[1]


# Per version: PyTorch 2.14 marks the checkpoint's hooks (``pack_hook._checkpoint_internal
# = True``, set by ``_checkpoint_internal_hook``); 2.9 to 2.13 do not, and their pack hook
# is a function defined in ``_checkpoint_hook.__init__`` of ``torch.utils.checkpoint``.
# Detected by feature: the marker where it is set, else where the hook was defined
# (2.14's hooks have the marker, so its own classes never reach the second test).
# Retired by: the marker in every supported PyTorch (requiring 2.14).
_CHECKPOINT_HOOK_QUALNAMES = ("_checkpoint_hook.__init__.", "_recomputation_hook.__init__.")


def _is_checkpoint_pack_hook(pack: Any) -> bool:
    if getattr(pack, "_checkpoint_internal", False):
        return True
    return getattr(pack, "__module__", None) == "torch.utils.checkpoint" and str(
        getattr(pack, "__qualname__", "")
    ).startswith(_CHECKPOINT_HOOK_QUALNAMES)


class replace_top_hooks:
    """Swap the top saved-tensors hook pair for (pack, unpack), and put ``original`` back.

    Private: the push/pop functions behind ``saved_tensors_hooks``. Replacing
    the pair in place (rather than pushing another on top) keeps the
    checkpoint's own pack hook on top, which PyTorch and recomp look for.
    Entered around every forward and replay of a checkpoint: a class, not a generator.
    """

    __slots__ = ("original", "pack", "unpack")

    def __init__(
        self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any], original: tuple[Any, Any]
    ) -> None:
        self.pack = pack
        self.unpack = unpack
        self.original = original

    def __enter__(self) -> None:
        set_top_hooks(self.pack, self.unpack)

    def __exit__(self, *exc_info: Any) -> None:
        set_top_hooks(*self.original)


def set_top_hooks(pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> None:
    """Put (pack, unpack) in place of the top saved-tensors hook pair (as
    :class:`replace_top_hooks` does, for a caller that keeps the original pair itself)."""
    torch._C._autograd._pop_saved_tensors_default_hooks()
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


# --------------------------------------------------------------------------- kept replays
# What recomp's own unpack needs to keep a replay's tensors for later backward passes
# (``recomp.torch._kept``). The upstream code relied on is ``torch/utils/checkpoint.py``
# of 2.9.1 to 2.14.1, the same in all of them in these respects:
# ``_checkpoint_without_reentrant_generator`` enters ``_checkpoint_hook(frame)`` and then,
# directly inside it, the forward context of ``context_fn``; ``_checkpoint_hook``'s pack
# hook appends ``weakref.ref(holder)`` to ``frame.weak_holders`` in save order, and its
# unpack hook replays the forward once per graph task ``gid`` under
# ``_recomputation_hook``, whose pack hook files the n-th saved tensor of the replay as
# ``frame.recomputed[gid][holder.handles[gid]]`` for the n-th holder (a weak-keyed
# dictionary: the ``_Handle`` key lives as long as the holder's entry for ``gid``); the
# unpack returns that tensor and sets ``holder.handles[gid] = None``, which drops it.


class ReplayStore:
    """PyTorch's record of one checkpoint call's replays, as recomp's kept replays read
    it: the holders (what the forward's saved tensors were replaced by, in save order)
    and, per backward pass, the tensors that pass's replay recomputed and no unpack has
    taken yet. Holds the checkpoint frame weakly.

    Why: a zero-bubble pipeline runs several backward passes over one micro-batch's
    graph; PyTorch replays once per pass. What one pass's replay recomputed and did not
    read is what a later pass needs: recomp takes it over when the pass ends instead of
    replaying again, and in the common single pass touches nothing.
    How: the frame's ``weak_holders``, ``recomputed`` and each holder's ``handles``
    (see the note above).
    If it changes: :func:`replay_store` returns None and recomp leaves PyTorch's unpack
    alone (one replay per backward pass, as with PyTorch's checkpoint); a store whose
    frame no longer has these fields gives no holders and no leftovers.
    Retired by: a public per-holder recompute cache in PyTorch's checkpoint.
    """

    __slots__ = ("_frame_ref",)

    def __init__(self, frame: Any) -> None:
        self._frame_ref = weakref.ref(frame)

    def holders(self) -> list[Any]:
        """The holders in save order, None for those already freed."""
        frame = self._frame_ref()
        return [] if frame is None else [ref() for ref in frame.weak_holders]

    def take_leftovers(self, task: int | None, running: Any = ()) -> list[tuple[Any, Any]]:
        """``(holder, tensor)`` for what the replay of pass ``task`` (None: of every pass
        but those in ``running``) recomputed and no unpack took, removed from the frame:
        the caller holds them from now on."""
        frame = self._frame_ref()
        if frame is None:
            return []
        recomputed = frame.recomputed
        if task is not None:
            tasks = [task] if recomputed.get(task) else []
        else:
            tasks = [t for t, by_key in recomputed.items() if by_key and t not in running]
        found: list[tuple[Any, Any]] = []
        for t in tasks:
            by_key = recomputed.pop(t)
            for ref in frame.weak_holders:
                holder = ref()
                key = None if holder is None else holder.handles.get(t)
                if key is None:
                    continue
                value = by_key.get(key)
                holder.handles[t] = None  # the pass has ended: no unpack reads it there
                if value is not None:
                    found.append((holder, value))
        return found


def replay_store(pack: Any) -> ReplayStore | None:
    """The :class:`ReplayStore` of the checkpoint whose pack hook is ``pack``, or None
    (not a non-reentrant checkpoint's hook, or a PyTorch whose frame differs)."""
    frame = _checkpoint_frame(pack)
    if frame is None or not isinstance(getattr(frame, "recomputed", None), dict):
        return None
    return ReplayStore(frame)


# Per code object of a checkpoint pack hook (one per PyTorch version): whether the frames
# its hooks close over are what a ReplayStore reads.
_STORE_READABLE: dict[Any, bool] = {}


def replay_store_readable(pack: Any) -> bool:
    """Whether :func:`replay_store` gives a store for the checkpoint whose pack hook is
    ``pack``, decided once per definition of PyTorch's hook (the frame's class and
    fields do not change between calls): asked at every checkpoint call, where the store
    itself is needed only by a backward that keeps the graph."""
    code = getattr(pack, "__code__", None)
    readable = _STORE_READABLE.get(code)
    if readable is None:
        readable = replay_store(pack) is not None
        if code is not None:
            _STORE_READABLE[code] = readable
    return readable


def take_checkpoint_unpack(
    unpack: Callable[[Any], Any],
) -> tuple[Callable[[Any], Any], Callable[[Any], Any]] | None:
    """Where the hooks on top of the saved-tensors stack are those of a non-reentrant
    checkpoint (:func:`top_checkpoint_hooks`) whose replay store is readable
    (:func:`replay_store_readable`): put ``unpack`` in place of its unpack hook (its pack
    hook stays on top) and return the checkpoint's (pack, unpack); None elsewhere, with
    nothing changed. Why and if it changes: as those two functions and :func:`set_top_hooks`."""
    hooks = top_checkpoint_hooks()
    if hooks is None or not replay_store_readable(hooks[0]):
        return None
    set_top_hooks(hooks[0], unpack)
    return hooks


# --------------------------------------------------------------------------- recomp's replay

# NOTE [ Replaying PyTorch's checkpoint ]
#
# PyTorch's non-reentrant checkpoint replays its forward from the unpack hook of its
# saved tensors, the first time a backward pass (graph task) reads one of them: it pushes
# a second pair of hooks (``_recomputation_hook``) whose pack hook files the n-th tensor
# the replay saves under the n-th placeholder (``_Holder``) of the forward, runs the
# forward's function again (``frame.recompute_fn``: the RNG, autocast and ``context_fn``
# of the forward restored), then compares the number and metadata of what was saved.
# PyTorch 2.13 and 2.14 make a Dynamo-disabled copy of that pack hook for every replay and run
# every saved tensor through Dynamo's wrapper; with the comparison, this is about a third
# of what a checkpoint costs the host (``docs/benchmarks.md``, the thirteenth round).
#
# :func:`replay_unpack` gives recomp's checkpoints (through the kept-replay handle,
# which already stands in for PyTorch's unpack) an unpack that runs the same replay
# itself and leaves the frame as PyTorch's would: ``is_recomputed``, ``recomp_counter``,
# ``recomputed`` and each holder's ``handles`` per pass, so that every reader of the
# frame (kept replays, the memory report, PyTorch's own unpack) finds what it expects.
# The same function replays (``frame.recompute_fn`` through PyTorch's
# ``_run_fn_with_dynamo_disabled``), under gradients, with the same early stop
# (PyTorch's ``_StopRecomputationError``) and the same pass ids. The replay's pack hook
# carries PyTorch 2.14's marks (``_checkpoint_internal``, ``_user_hooks``), and holds
# the frame only while the replay runs. Every error is PyTorch's own: a replay that saved
# another number of tensors or other metadata is handed to the frame's
# ``check_recomputed_tensors_match``, a second unpack of a tensor to PyTorch's unpack;
# only a replay that saves more tensors than the forward stops with recomp's message,
# from inside the replay as PyTorch's does. With PyTorch's debug mode (its unpack wraps
# an error callback), another determinism check than the shape/dtype/device one, or a
# frame without these fields, PyTorch's unpack stays.
#
# Dynamo: the replay runs inside ``_run_fn_with_dynamo_disabled``, as PyTorch's. A module
# compiled on its own (``nn.Module.compile()``) turns Dynamo's callback back on for its
# frames, and an op it runs eagerly at a graph break calls the replay's pack hook with
# the callback on. PyTorch 2.13 and 2.14 wrap their hook in ``torch._dynamo.disable`` at
# every replay (2.9 does not); recomp's hook calls no Python function on its common path
# and its code is marked skipped once (``_skip_in_dynamo``), which costs nothing per call.
# Retired by: a cheaper replay in PyTorch's checkpoint.

_tuc: Any = torch.utils.checkpoint
_Handle = getattr(_tuc, "_Handle", None)
_StopRecomputation = getattr(_tuc, "_StopRecomputationError", None)
_RUN_DISABLED = getattr(_tuc, "_run_fn_with_dynamo_disabled", None)
_DEFAULT_META = getattr(_tuc, "_default_meta_extractor", None)
_NO_META = getattr(_tuc, "_allowed_determinism_checks_to_fns", {}).get("none")
_USER_HOOKS = getattr(_tuc, "_current_user_saved_tensors_hooks", None)
_EXEC_GROUP = getattr(torch._C, "_get_graph_exec_group", None)
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_set_grad = torch._C._set_grad_enabled
_FRAME_FIELDS = (
    "recompute_fn",
    "weak_holders",
    "recomputed",
    "recomp_counter",
    "is_recomputed",
    "early_stop",
    "forward_completed",
    "ignore_saved_mismatch",
    "x_metadatas",
    "metadata_fn",
    "unpack_error_cb",
    "check_recomputed_tensors_match",
)
# Per code object of a checkpoint's unpack hook: whether it is PyTorch's own (not a
# debug wrapper, not another stand-in) and its frame has every field the replay uses.
_REPLAYABLE: dict[Any, bool] = {}


def _replayable(unpack: Any, frame: Any) -> bool:
    code = getattr(unpack, "__code__", None)
    known = _REPLAYABLE.get(code)
    if known is None:
        known = (
            code is not None
            and None not in (_Handle, _StopRecomputation, _RUN_DISABLED, _DEFAULT_META)
            and hasattr(torch._C, "_current_graph_task_id")  # else graph_task_id gives -1
            and getattr(unpack, "__module__", None) == "torch.utils.checkpoint"
            and unpack.__qualname__ == "_checkpoint_hook.__init__.<locals>.unpack_hook"
            and "frame" in code.co_freevars
            and all(hasattr(frame, name) for name in _FRAME_FIELDS)
            and (hasattr(frame, "get_inputs") or hasattr(frame, "input_saver"))
            and getattr(frame.recomputed, "default_factory", None) is weakref.WeakKeyDictionary
            and hasattr(weakref.WeakKeyDictionary(), "_remove")
            # What the replay compares where the frame's check is PyTorch's default one.
            and set(_DEFAULT_META(torch.empty(0))) == {"shape", "dtype", "device"}  # type: ignore[misc]
        )
        _REPLAYABLE[code] = known
    return known


def replay_frame(pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> Any:
    """The frame of the checkpoint whose hooks are (``pack``, ``unpack``) where
    :func:`replay_unpack` can read its tensors (NOTE [ Replaying PyTorch's checkpoint ]);
    None where PyTorch's ``unpack`` must."""
    frame = _checkpoint_frame(pack)
    if (
        frame is None
        or not _replayable(unpack, frame)
        or frame.unpack_error_cb is not None
        or frame.metadata_fn not in (_DEFAULT_META, _NO_META)
    ):
        return None
    return frame


def replay_unpack(frame: Any, unpack: Callable[[Any], Any], holder: Any) -> Any:
    """What PyTorch's unpack hook ``unpack`` of ``frame``'s checkpoint gives for
    ``holder``, the replay run by recomp (NOTE [ Replaying PyTorch's checkpoint ])."""
    gid: Any = None if _EXEC_GROUP is None else _EXEC_GROUP()
    if gid is None:
        gid = graph_task_id()
        if gid == -1:  # outside backward: a pass of its own, as PyTorch's
            gid = uuid.uuid4().int
    if not frame.is_recomputed[gid]:
        _replay(frame, gid)
    handles = holder.handles
    handle = handles.get(gid)
    value = None if handle is None else frame.recomputed[gid].get(handle)
    if value is None:  # read twice, or never filed: PyTorch's unpack says which
        return unpack(holder)
    handles[gid] = None
    return value


def _replay(frame: Any, gid: Any) -> None:
    """Run ``frame``'s replay for pass ``gid`` as PyTorch's unpack hook would."""
    if hasattr(frame, "get_inputs"):
        args = frame.get_inputs()
    else:  # older frames (2.9): the inputs were saved by an autograd node
        saver = frame.input_saver.grad_fn
        args = saver.get_args(saver.saved_tensors)
    holders = frame.weak_holders
    recomputed = frame.recomputed[gid]
    table, remove = recomputed.data, recomputed._remove
    metadata = frame.x_metadatas if frame.metadata_fn is _DEFAULT_META else None
    early = frame.early_stop
    count = frame.recomp_counter[gid]
    differs = False
    handle_type = _Handle

    def pack(x: torch.Tensor) -> torch.Tensor:
        nonlocal count, differs
        if x.requires_grad:
            x = x.detach()
        index = count
        count = index + 1
        if index >= len(holders):
            if early:
                raise AssertionError("recomp: an early-stopping replay ran past its last tensor")
            if not frame.forward_completed:  # a backward inside the forward
                frame.ignore_saved_mismatch = True
                return x
            raise _tuc.CheckpointError(
                "torch.utils.checkpoint: trying to save more tensors during recomputation "
                f"than during the original forward pass (this replay saved more than "
                f"{len(holders)}): the checkpointed function does other work when it is "
                "replayed. Pass debug=True to the checkpoint to see the operations of both."
            )
        holder = holders[index]()
        if holder is not None:
            handles = holder.handles
            if handles.get(gid) is not None:
                raise AssertionError("recomp: a replay filed a tensor twice in one pass")
            handle = handles[gid] = handle_type()  # type: ignore[misc]  # checked by _replayable
            # ``recomputed[handle] = x``, without the Python frame of the dictionary's
            # method (see the note on Dynamo above).
            table[_weak(handle, remove)] = x
            if metadata is not None:
                saved = metadata[index]
                if (
                    saved["shape"] != x.shape
                    or saved["dtype"] != x.dtype
                    or saved["device"] != x.device
                ):
                    differs = True
        if early and count == len(holders):
            raise _StopRecomputation  # type: ignore[misc]
        return x

    # Marked as PyTorch marks its replay's pack hook (2.14; recomp's contexts of the
    # replay, as :func:`top_checkpoint_hooks`, read the mark on every version).
    pack._checkpoint_internal = True  # type: ignore[attr-defined]
    if not _PACK_SKIPPED and "torch._dynamo" in sys.modules:
        _skip_in_dynamo(pack)
    if _USER_HOOKS is not None:
        pack._user_hooks = _USER_HOOKS()  # type: ignore[attr-defined]
    owner = frame
    grad = torch.is_grad_enabled()
    _push_hooks(pack, _identity)
    try:
        _set_grad(True)
        _RUN_DISABLED(owner.recompute_fn, *args)  # type: ignore[misc]
    except _StopRecomputation:  # type: ignore[misc]
        pass
    finally:
        _set_grad(grad)
        _pop_hooks()
        if _USER_HOOKS is not None:
            del pack._user_hooks  # type: ignore[attr-defined]
        owner.recomp_counter[gid] = count
        # The replay's graph may hold its pack hook: the hook lets go of the frame.
        frame = holders = table = remove = metadata = None
    owner.is_recomputed[gid] = True
    if not owner.ignore_saved_mismatch and (differs or count != len(owner.weak_holders)):
        owner.check_recomputed_tensors_match(gid)  # raises PyTorch's error


def _identity(x: Any) -> Any:
    return x


_weak = weakref.ref
# Whether the code of the replay's pack hook is marked for Dynamo to leave alone.
_PACK_SKIPPED: list[bool] = []


def _skip_in_dynamo(pack: Callable[[Any], Any]) -> None:
    """Have Dynamo never compile the replay's pack hook (every closure of its code).

    Why: PyTorch's replay runs under ``_run_fn_with_dynamo_disabled``, but a module
    compiled on its own (``nn.Module.compile()``) runs its frames with Dynamo's callback
    on, and an op it runs eagerly there (at a graph break) calls the pack hook with the
    callback on: Dynamo would compile the hook, guard on what it changes and compile it
    again at each call (PyTorch 2.13 and 2.14 disable their replay's hook for this). The
    hook calls no Python function of its own on its common path, so skipping its frame
    suffices, and costs nothing per call.
    How: ``torch._dynamo.decorators.skip`` marks the code object (2.9 to 2.14); asked
    at a replay once Dynamo is loaded (before, no callback can be on).
    If it changes: nothing is marked, and Dynamo traces the hook where such a module
    calls it (its guards then decide).
    Retired by: a public way to keep a function out of Dynamo at no cost per call.
    """
    decorators = sys.modules.get("torch._dynamo.decorators")
    skip = getattr(decorators, "skip", None)
    if callable(skip):
        with contextlib.suppress(TypeError, AttributeError, RuntimeError):  # a Dynamo that refuses
            skip(pack)
    _PACK_SKIPPED.append(True)


def mark_as_checkpoint_hook(hook: Callable[[Any], Any], like: Callable[[Any], Any]) -> None:
    """Give ``hook``, which stands in for the checkpoint pack hook ``like`` on top of the
    hook stack, the marks PyTorch 2.14 reads there.

    Why: 2.14 finds the user's saved-tensors hooks below its checkpoint's own by skipping
    pack hooks marked ``_checkpoint_internal`` and following their ``_user_hooks``
    (a checkpoint nested in a replay, selective checkpointing); unmarked, recomp's
    stand-in would be taken for a user hook. Before 2.14 nothing reads the marks.
    If it changes: the marks are set and ignored.
    """
    hook._checkpoint_internal = True  # type: ignore[attr-defined]
    hook._user_hooks = getattr(like, "_user_hooks", None)  # type: ignore[attr-defined]


def is_early_stop(exc: BaseException | None) -> bool:
    """Whether ``exc`` is how PyTorch's replay stops early (after the last tensor the
    backward needs), passing through the recompute context of ``context_fn``.

    Why: the value check compares what a replay saved when the replay ends; an early
    stop ends it normally.
    How: the exception's class name, ``_StopRecomputationError`` (2.9 to 2.14), raised
    by the replay's pack hook and caught by its unpack hook.
    If it changes: False, and a replay that stops early skips the comparison deferred
    to its end (accelerators; on CPU each saved tensor is compared as it is saved).
    Retired by: a public early-stop signal.
    """
    return type(exc).__name__ == "_StopRecomputationError"


# --------------------------------------------------------------------------- failed checkpoint forward


_CHECKPOINT_FILE = os.path.abspath(torch.utils.checkpoint.__file__)


def finish_failed_checkpoint(exc: BaseException) -> None:
    """Close what a non-reentrant checkpoint left open when its function raised ``exc``.

    Why: PyTorch 2.9 runs the checkpoint's setup as a generator
    (``_checkpoint_without_reentrant_generator``) and, when the checkpointed function
    raises, leaves it suspended: its saved-tensors hooks stay pushed and the forward
    context of ``context_fn`` (recomp's and the user's) stays entered until the
    generator is collected, which the traceback delays. The next forward on the thread
    then saves its tensors into the dead checkpoint, and its backward fails ("A
    different number of tensors was saved"). PyTorch 2.13 and later throw the
    exception into the generator themselves (``torch.utils.checkpoint.checkpoint``:
    ``gen.throw(e)``), which closes both.
    Detected by feature: the frame of ``torch.utils.checkpoint.checkpoint`` in the
    traceback still holds its generator suspended (2.9); where PyTorch closed it
    (2.13, 2.14) or the frame is not found, nothing is done. Here the exception is
    thrown into it, as later PyTorch does.
    If it changes: nothing is found and nothing is done (the behaviour of 2.9 remains).
    Retired by: requiring a PyTorch that closes the generator itself (2.13 does).
    """
    tb = exc.__traceback__
    while tb is not None:
        if _close_checkpoint_frame(tb.tb_frame, exc):
            return
        tb = tb.tb_next


def close_enclosing_checkpoint(exc: BaseException) -> None:
    """Before raising ``exc`` inside a plain PyTorch checkpoint (HF's), close that checkpoint.

    Why: as for :func:`finish_failed_checkpoint`, on PyTorch 2.9 the error would leave
    the enclosing checkpoint, which recomp does not call, open. Only for errors raised
    before recomp's own checkpoint opens anything (nothing of it is above that one).
    Detected by feature, as there: the innermost ``torch.utils.checkpoint.checkpoint``
    frame on the stack holds its generator suspended; nothing is done otherwise
    (on 2.13 and 2.14 PyTorch closes it when the error passes).
    """
    frame = sys._getframe(1)
    while frame is not None:
        if _close_checkpoint_frame(frame, exc):
            return
        frame = frame.f_back  # type: ignore[assignment]


def _close_checkpoint_frame(frame: Any, exc: BaseException) -> bool:
    """Throw ``exc`` into the suspended generator of a ``checkpoint`` frame; False if
    ``frame`` is not PyTorch's checkpoint."""
    code = frame.f_code
    if code.co_name != "checkpoint" or os.path.abspath(code.co_filename) != _CHECKPOINT_FILE:
        return False
    gen = frame.f_locals.get("gen")
    if inspect.isgenerator(gen) and gen.gi_frame is not None and not gen.gi_running:
        try:
            gen.throw(exc)
        except StopIteration:
            pass  # a context swallowed it: the caller raises it all the same
        except BaseException as raised:
            if raised is not exc:
                raise
    return True


# --------------------------------------------------------------------------- PyTorch's checkpoint_wrapper


def guard_checkpoint_wrapper(check: Callable[[Any, Any, bool], Any]) -> bool:
    """Have PyTorch's checkpoint wrapper call ``check(module, checkpoint_fn, reentrant)``
    before it takes ``module`` (``checkpoint_fn`` None for PyTorch's own checkpoint, its
    default; ``reentrant`` whether its ``checkpoint_impl`` asks for the reentrant one); an
    error ``check`` raises leaves nothing wrapped, a function it returns becomes the
    wrapper's ``checkpoint_fn`` (called with the wrapper's keyword arguments, as
    PyTorch calls a ``checkpoint_fn`` it is given). True if installed (once per process;
    later calls change nothing).

    Why: trainers checkpoint through this wrapper (Lightning's
    ``FSDPStrategy(activation_checkpointing_policy=...)``, Accelerate's FSDP
    ``activation_checkpointing``, ``checkpoint_wrapper``/``apply_activation_checkpointing``
    of ``torch.distributed.algorithms._checkpoint``). Around modules recomp wrapped, its
    plain checkpoint replays recomp's excluded regions and it inserts its attribute into
    the name of every parameter below it, so recomp refuses it before it takes the
    module. The wrapper's constructor is the only place that sees both the module and the
    function: a global module registration hook would see every module any model
    registers (each slice of a ``ModuleList``, in every model's forward) and changes the
    hook count that compiled graphs guard on.
    How: the class's ``__init__`` is replaced by one that binds its arguments to the
    original's signature (``mod``, ``checkpoint_impl``, ``checkpoint_fn``), calls
    ``check``, then the original, with ``checkpoint_fn`` replaced where ``check`` says.
    If it changes (the class moves, other parameter names): nothing is installed (False),
    and recomp finds the plain checkpoint at the first training forward instead
    (``DoubleCheckpointError`` from a recomp checkpoint or excluded region inside it).
    Retired by: a public checkpoint wrapper class, or an option of PyTorch's that lets a
    module refuse being checkpointed.
    Checked on PyTorch 2.9.1, 2.13.0 and 2.14.1.
    """
    try:
        from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as wrappers
    except ImportError:  # a build without torch.distributed
        return False
    cls = getattr(wrappers, "CheckpointWrapper", None)
    original = getattr(cls, "__init__", None) if isinstance(cls, type) else None
    if original is None:
        return False
    if getattr(original, "_recomp_guard", None) is not None:
        return True
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        return False
    if not {"mod", "checkpoint_fn"} <= set(signature.parameters):
        return False

    reentrant_impl = getattr(getattr(wrappers, "CheckpointImpl", None), "REENTRANT", None)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        impl = bound.arguments.get("checkpoint_impl")
        reentrant = impl is not None and impl == reentrant_impl
        replacement = check(bound.arguments["mod"], bound.arguments.get("checkpoint_fn"), reentrant)
        if replacement is not None:
            bound.arguments["checkpoint_fn"] = replacement
            original(*bound.args, **bound.kwargs)
            return
        original(self, *args, **kwargs)

    __init__._recomp_guard = check  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]
    return True
