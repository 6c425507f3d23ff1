"""Every use of PyTorch's private API in recomp, in one place.

Each entry says why it is needed, the versions it was checked on, what happens
if PyTorch changes it (each use is guarded: recomp degrades as stated rather
than failing at import or on the first call), and what public API would
retire it. ``tests/test_compat.py`` has one test per entry that fails when
PyTorch changes underneath, and ``tools/check_private_api.py`` checks that no
other recomp module touches a private attribute of torch.

Checked on torch 2.9.1, 2.13.0 and 2.14.1 (and 2.11 on CUDA). Where recomp needs to tell
versions apart, an entry says which versions take which path and how it detects them
(by feature, not by version number).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

# --------------------------------------------------------------------------- storage identity


def storage_key(t: torch.Tensor) -> Hashable | None:
    """Identity of the storage behind ``t``, equal for every view of it.

    Why: deferring a region's input must recognise views of it (``linear`` saves
    a 2-D view of a 3-D input), and ``tensor._base`` names only the root of a
    view chain. ``untyped_storage()`` returns a new Python object per call, so its
    ``_cdata`` (the address of the C++ storage) is the stable identity.
    If it changes: falls back to the data pointer and device (ambiguous only for
    empty storages, which hold no memory to defer).
    Retired by: a public storage identity (``torch.UntypedStorage`` hash/eq by storage).
    """
    if t.layout is not torch.strided or t.is_meta:
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses have no storage
        return None
    cdata = getattr(storage, "_cdata", None)
    if cdata is not None:
        return cdata
    return ("ptr", storage.data_ptr(), t.device)


def version(t: torch.Tensor) -> int | None:
    """The in-place modification counter of ``t``.

    Why: recomp detects in-place changes of what it caches, as autograd does.
    If it changes: None, and mutation checks are skipped (no false errors).
    Retired by: a public version counter accessor.
    """
    try:
        return t._version
    except (RuntimeError, AttributeError):  # inference tensors have no version counter
        return None


# --------------------------------------------------------------------------- autograd engine


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread.

    Why: an excluded region executed during backward but not in a recomp replay
    is being replayed by a checkpoint recomp does not control (warned about).
    If it changes: False (the warning is not given; nothing else depends on it).
    Retired by: a public "current graph task" query.
    """
    query = getattr(torch._C, "_current_graph_task_id", None)
    if query is None:
        return False
    return bool(query() != -1)


def graph_task_id() -> int:
    """An id of the backward pass running on this thread (-1 outside one).

    Why: the offloader starts the next region's copy back once per backward pass.
    If it changes: -1 always, and prefetching chains once per process instead.
    Retired by: a public "current graph task" query.
    """
    query = getattr(torch._C, "_current_graph_task_id", None)
    return int(query()) if query is not None else -1


def _checkpoint_frame(pack: Any) -> Any:
    """The ``_CheckpointFrame`` a non-reentrant checkpoint's pack hook closes over, or None."""
    try:
        from torch.utils.checkpoint import _CheckpointFrame
    except ImportError:
        return None
    cells = getattr(pack, "__closure__", None)
    frame = next(
        (c.cell_contents for c in cells or () if isinstance(c.cell_contents, _CheckpointFrame)),
        None,
    )
    if frame is None or not isinstance(getattr(frame, "weak_holders", None), list):
        return None
    return frame


def checkpoint_save_counter() -> Callable[[], int] | None:
    """How many tensors the enclosing non-reentrant checkpoint has saved so far, when
    its replay stops early after the last of them; None otherwise.

    Why: with early stop a replay never reaches regions called after the last saved
    tensor, so their cached outputs can be dropped at the end of the forward.
    How: the pack hook on top of the saved-tensors hook stack is the checkpoint's;
    its closure holds the ``_CheckpointFrame``, whose ``weak_holders`` grow by one per
    saved tensor.
    If it changes: None, and every cached output is kept (more memory, same results).
    Retired by: a public early-stop position on the checkpoint.
    """
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError):
        return None
    frame = _checkpoint_frame(hooks[0]) if hooks is not None else None
    if frame is None or not getattr(frame, "early_stop", False):
        return None
    frame_ref = weakref.ref(frame)

    def saved_so_far() -> int:
        live = frame_ref()
        return -1 if live is None else len(live.weak_holders)

    return saved_so_far


# --------------------------------------------------------------------------- dispatch modes


def no_dispatch_modes() -> contextlib.AbstractContextManager[Any]:
    """Run the next operations with no dispatch mode active.

    Why: the offloader's copies are bookkeeping, not model ops: selective
    checkpointing's cache and FLOP counters must not see them.
    If it changes: the modes stay active (a FLOP counter then counts the copies).
    Retired by: a public way to suspend the mode stack.
    """
    try:
        from torch.utils import _python_dispatch

        if not torch._C._len_torch_dispatch_stack():
            return contextlib.nullcontext()
        return _python_dispatch._disable_current_modes()  # type: ignore[no-any-return]
    except (ImportError, AttributeError):
        return contextlib.nullcontext()


def version_sharing_detach() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A ``detach`` for use inside a dispatch mode whose result shares the version counter
    of its input (as a detach above autograd does); None where that is not available.

    Why: a dispatch mode runs below autograd, where ``detach`` skips the
    ADInplaceOrView kernel and gives the alias a version counter of its own; the
    kept result of a collective must see in-place changes made to the original.
    How: re-include the ADInplaceOrView key around the detach, as PyTorch's own
    selective-checkpoint cache does.
    If it changes: None, and checkpoints do not keep collective results (the replay
    communicates again, as with ``exclude_collectives=False``).
    Retired by: a public way to make a view below autograd.
    """
    guard = getattr(torch._C, "_SetExcludeDispatchKeyGuard", None)
    key = getattr(getattr(torch._C, "DispatchKey", None), "ADInplaceOrView", None)
    if guard is None or key is None:
        return None

    def detach(t: torch.Tensor) -> torch.Tensor:
        with guard(key, False):
            return t.detach()

    return detach


def completed_work_factory() -> Callable[[list[torch.Tensor]], Any] | None:
    """A function that makes a completed c10d ``Work``, in the form the dispatcher
    takes back from a Python dispatch mode; None where that is not available.

    Why: a replay that hands back a kept collective result instead of running a
    ``c10d`` operator must return a ``Work`` the caller can ``wait()`` on.
    How: ``_create_work_from_future`` on a future that is already set, then
    ``Work.boxed()`` (the script-object form operators return).
    If it changes: None, and the forward's own ``Work`` (completed by then) is kept
    and returned again, which holds whatever that ``Work`` holds a little longer.
    Retired by: a public constructor of a completed ``Work``.
    """
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return None
        from torch._C._distributed_c10d import _create_work_from_future
    except (ImportError, AttributeError):
        return None
    if not hasattr(dist.Work, "boxed"):
        return None

    def completed(tensors: list[torch.Tensor]) -> Any:
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        future.set_result(tensors)
        return _create_work_from_future(future).boxed()

    return completed


def _sac_mode_types() -> tuple[type, ...]:
    try:
        from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode
    except ImportError:
        return ()
    return (_CachingTorchDispatchMode, _CachedTorchDispatchMode)


def hide_selective_checkpoint_modes() -> contextlib.AbstractContextManager[None]:
    """Take PyTorch's selective-checkpoint dispatch modes off the mode stack for a region.

    Why: selective checkpointing caches op outputs per op kind and call index in
    the forward and pops them in the same order in the replay; a region that runs
    in the forward but is skipped in the replay would shift that order. Other
    modes stay.
    If it changes: the modes are not found and stay in place; a selective policy
    inside a checkpoint with exclusions may then raise PyTorch's own mismatch error.
    Retired by: a public way to suspend one dispatch mode.
    """
    try:
        if not torch._C._len_torch_dispatch_stack():  # the common case, checked first
            return contextlib.nullcontext()
        from torch.utils import _python_dispatch

        stack = _python_dispatch._get_current_dispatch_mode_stack()
    except (ImportError, AttributeError):
        return contextlib.nullcontext()
    sac = _sac_mode_types()
    if not sac or not any(isinstance(m, sac) for m in stack):
        return contextlib.nullcontext()
    return _without_modes(lambda m: isinstance(m, sac), _python_dispatch)


@contextlib.contextmanager
def _without_modes(drop: Callable[[Any], bool], dispatch: Any) -> Iterator[None]:
    popped = []
    while dispatch._get_current_dispatch_mode_stack():
        popped.append(dispatch._pop_mode())
        if not any(drop(m) for m in dispatch._get_current_dispatch_mode_stack()):
            break
    kept = [m for m in reversed(popped) if not drop(m)]
    for mode in kept:
        dispatch._push_mode(mode)
    try:
        yield
    finally:
        for _ in kept:
            dispatch._pop_mode()
        for mode in reversed(popped):
            dispatch._push_mode(mode)


# --------------------------------------------------------------------------- pytrees


def pytree_node(kind: type) -> tuple[Callable[[Any], Any], Callable[[Any, Any], Any]] | None:
    """(flatten, unflatten) for a type registered as a PyTorch pytree node, else None.

    Why: PyTorch's pytree registry knows the containers of the ecosystem
    (``torch.return_types``, ``OrderedDict``, ``defaultdict``, ``deque``; transformers
    registers ``ModelOutput``; users register their own), so a region's outputs are
    rebuilt exactly as the ecosystem defines them.
    If it changes: None, and recomp's own walker handles the built-in containers,
    their subclasses and dataclasses.
    Retired by: a public pytree registry lookup (``torch.utils.pytree``).
    """
    node = _SUPPORTED_NODES.get(kind) if _SUPPORTED_NODES is not None else None
    if node is None:
        return None
    return node.flatten_fn, node.unflatten_fn


def _supported_nodes() -> dict[type, Any] | None:
    try:
        from torch.utils import _pytree
    except ImportError:
        return None
    nodes = getattr(_pytree, "SUPPORTED_NODES", None)
    return nodes if isinstance(nodes, dict) else None


_SUPPORTED_NODES = _supported_nodes()


#: A number that changes when a type is registered as a PyTorch pytree node: the
#: registry's size (a builtin, as it is read on every walk).
#: Why: recomp's walker remembers which types are leaves; a type registered after it
#: was first walked must be looked into from then on.
#: If it changes: without the registry it is always 0, and so is nothing remembered wrongly.
#: Retired by: a registry that announces registrations, or no leaf cache.
pytree_generation: Callable[[], int] = (
    _SUPPORTED_NODES.__len__ if _SUPPORTED_NODES is not None else int
)


# --------------------------------------------------------------------------- dispatch-level tools


def _dispatch_mode_base() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


#: Base class of the modes that count collectives per phase (``recomp.torch.collectives``)
#: and attribute FLOPs to phases in the benchmark.
#: Why: a dispatch mode sees every operator call, DTensor's collectives included.
#: Checked on 2.13-2.14; documented, but under a private module path.
#: Retired by: a public ``torch.utils.python_dispatch`` module.
TorchDispatchMode = _dispatch_mode_base()


def op_name(op: Any) -> str:
    """The schema name of an operator overload (``c10d::allreduce_``), else ``str(op)``.

    Why: telling collectives apart by operator name, across overloads.
    Retired by: a public ``OpOverload.name()`` covering every namespace.
    """
    schema = getattr(op, "_schema", None)
    return str(schema.name) if schema is not None else str(op)


_ARGUMENTS: dict[Any, tuple[tuple[str, bool], ...]] = {}


def op_arguments(op: Any) -> tuple[tuple[str, bool], ...]:
    """The arguments of an operator overload in schema order: (name, whether the
    operator writes into it, by its alias annotation ``Tensor(a!)``).

    Why: a kept collective result replaces what the operator writes; the schema
    says which arguments those are.
    If it changes: empty, and collectives are not kept (the replay communicates
    again, as with ``exclude_collectives=False``).
    Retired by: a public ``OpOverload`` schema accessor.
    """
    known = _ARGUMENTS.get(op)
    if known is not None:
        return known
    arguments: list[tuple[str, bool]] = []
    for argument in getattr(getattr(op, "_schema", None), "arguments", ()):
        alias = getattr(argument, "alias_info", None)
        arguments.append((str(argument.name), bool(alias is not None and alias.is_write)))
    _ARGUMENTS[op] = result = tuple(arguments)
    return result


def cpu_attention_ops() -> tuple[Any, Any] | None:
    """The CPU flash-attention forward and backward operators (for FLOP counting).

    Why: PyTorch's FLOP table lacks the CPU attention kernel, which would count as 0.
    If it changes: None, and the benchmark counts no FLOPs for CPU attention.
    Retired by: the CPU kernel in ``torch.utils.flop_counter``'s table.
    """
    aten = torch.ops.aten
    names = (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    )
    try:
        forward, backward = (getattr(aten, name) for name in names)
    except (AttributeError, RuntimeError):
        return None
    return forward, backward


# --------------------------------------------------------------------------- checkpoint debug log


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
    if hooks is None or not _is_checkpoint_pack_hook(hooks[0]):
        return None
    return hooks[0], hooks[1]


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


@contextlib.contextmanager
def replace_top_hooks(
    pack: Callable[[Any], Any], unpack: Callable[[Any], Any], original: tuple[Any, Any]
) -> Iterator[None]:
    """Swap the top saved-tensors hook pair for (pack, unpack), and put ``original`` back.

    Private: the push/pop functions behind ``saved_tensors_hooks``. Replacing
    the pair in place (rather than pushing another on top) keeps the
    checkpoint's own pack hook on top, which PyTorch and recomp look for.
    """
    torch._C._autograd._pop_saved_tensors_default_hooks()
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    try:
        yield
    finally:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        torch._C._autograd._push_saved_tensors_default_hooks(*original)


# --------------------------------------------------------------------------- kept replays
# What recomp's own unpack needs to keep a replay's tensors for later backward passes
# (``recomp.torch._kept``). The upstream code relied on is ``torch/utils/checkpoint.py``
# of 2.9.1 to 2.14.1, the same in all of them in these respects:
# ``_checkpoint_without_reentrant_generator`` enters ``_checkpoint_hook(frame)`` and then,
# directly inside it, the forward context of ``context_fn``; ``_checkpoint_hook``'s pack
# hook appends ``weakref.ref(holder)`` to ``frame.weak_holders`` in save order, and its
# unpack hook replays the forward (once per graph task) under ``_recomputation_hook``,
# whose pack hook files the n-th saved tensor of the replay under the n-th holder and
# checks only its shape, dtype and device against the forward's; ``recompute_fn`` enters
# the recompute context of ``context_fn`` directly inside that hook.


def checkpoint_holders(pack: Any) -> Callable[[], list[Any]] | None:
    """For the checkpoint whose pack hook is ``pack``: a function giving its holders
    (the objects its saved tensors are replaced by), in save order, None for dead ones.

    Why: a replay's n-th saved tensor belongs to the forward's n-th holder; recomp keeps
    it under that holder for the backward passes that have not read it yet.
    How: the frame's ``weak_holders`` list (see the note above), held weakly here.
    If it changes: None, and recomp leaves PyTorch's unpack alone: one replay per
    backward pass, as with PyTorch's checkpoint.
    Retired by: a public per-holder recompute cache in PyTorch's checkpoint.
    """
    frame = _checkpoint_frame(pack)
    if frame is None:
        return None
    frame_ref = weakref.ref(frame)

    def holders() -> list[Any]:
        live = frame_ref()
        return [] if live is None else [ref() for ref in live.weak_holders]

    return holders


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


def node_finishes_in_this_pass() -> bool:
    """Whether the autograd node running now computes, in this backward pass, every
    gradient it can give (False: a later pass over the retained graph may run it again
    for the others, as a zero-bubble pipeline's weight pass does); True outside backward.

    Why: a recomputed tensor is dropped after its unpack only where no later pass of the
    same micro-batch will ask for it again.
    How: ``torch._C._current_autograd_node`` and, for each next node,
    ``torch._C._will_engine_execute_node`` (what ``register_multi_grad_hook`` uses). A
    leaf captured by ``autograd.grad`` raises there; its gradient is computed.
    If it changes: True, and the tensor is dropped after its first unpack (a later pass
    replays, as with PyTorch's checkpoint).
    Retired by: a public "gradients this pass computes" query on a node.
    """
    current = getattr(torch._C, "_current_autograd_node", None)
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if current is None or will_execute is None:
        return True
    node = current()
    if node is None:
        return True
    for next_node, _ in node.next_functions:
        if next_node is None:
            continue
        try:
            if not will_execute(next_node):
                return False
        except RuntimeError:  # a leaf captured by autograd.grad: its gradient is computed
            continue
    return True


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


# --------------------------------------------------------------------------- torch.compile


def dynamo_bypassing_wrapper() -> Callable[..., Any] | None:
    """PyTorch's ``dynamo_bypassing_wrapper`` higher-order op, or None where it is missing.

    Why: under ``torch.compile`` an excluded region's body is traced by Dynamo as
    usual, while the wrapper this op applies runs only when AOTAutograd builds the
    joint graph: there it marks the region's nodes ``MUST_SAVE`` (see
    ``recomp.torch._compile``). That mark decides only if it comes after the
    checkpoint's own tags. It does on 2.9, where the checkpoint tags its Dynamo graph
    before AOTAutograd traces it (``TagActivationCheckpoint.tag_nodes``), and on
    2.13-2.14, where every compiled checkpoint is traced as selective checkpointing,
    whose dispatch mode tags each op as it runs: both before the region's body returns.
    Versions: the op exists, and Dynamo traces it, from 2.9 on (checked: 2.9.1,
    2.13.0, 2.14.1; 2.11 on CUDA). Detected by feature: the op is looked up once, at
    import, without importing Dynamo.
    If it changes: None; a compiled recomp checkpoint then recomputes its excluded
    regions, as a compiled PyTorch checkpoint does, and warns once
    (``ForeignCheckpointWarning``); eager mode is unaffected.
    ``tests/test_compat.py`` checks that the op exists and that its mark reaches the
    partitioner.
    Retired by: a public way to tag the nodes of a traced region.
    """
    try:
        from torch._higher_order_ops.wrap import dynamo_bypassing_wrapper as wrapper
    except ImportError:
        return None
    return wrapper  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- FLOPs per op


def op_flop_counter() -> type:
    """A ``FlopCounterMode`` subclass that also hands every counted op to its method
    ``on_op(func_packet, flops)`` as it runs (made on first use: importing
    ``torch.utils.flop_counter`` takes a while, and only the benchmark needs it).

    Why: the benchmark files each op's FLOPs under the phase it ran in (forward,
    replay, backward, inside an excluded region), which only a per-op hook can
    tell. ``FlopCounterMode``'s public results are totals per module; its one
    per-op step is the private ``_count_flops(func_packet, out, args, kwargs)``,
    which its dispatch mode calls for every op, overridden here.
    If it changes: this raises a ``RecompError`` that names it (a per-phase split
    cannot be rebuilt from totals); nothing else in recomp uses it.
    Retired by: a public per-op callback on ``FlopCounterMode``.
    """
    global _OP_FLOP_COUNTER
    if _OP_FLOP_COUNTER is not None:
        return _OP_FLOP_COUNTER
    from torch.utils.flop_counter import FlopCounterMode

    if not callable(getattr(FlopCounterMode, "_count_flops", None)):
        from ..errors import RecompError

        raise RecompError(
            "recomp's FLOP split overrides torch.utils.flop_counter.FlopCounterMode."
            f"_count_flops, which this PyTorch ({torch.__version__}) does not have."
        )

    class OpFlopCounter(FlopCounterMode):
        def on_op(self, func_packet: Any, flops: int) -> None:
            """Called once per op that has a FLOP formula, with its count."""

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            formula = self.flop_registry.get(func_packet)
            if formula is not None:
                self.on_op(func_packet, int(formula(*args, **kwargs, out_val=out)))
            return super()._count_flops(func_packet, out, args, kwargs)

    _OP_FLOP_COUNTER = OpFlopCounter
    return OpFlopCounter


_OP_FLOP_COUNTER: type | None = None


# --------------------------------------------------------------------------- transformers
# Private API of libraries built on PyTorch that recomp works with is fenced here too.


def hf_layer_keeps_cache(layer: Any) -> bool:
    """Whether a transformers ``GradientCheckpointingLayer`` may keep its KV cache
    arguments (``cache``, ``layer_past``) under a checkpoint.

    Why: a layer that only reads its cache (transformers' diffusion decoders) sets
    the class attribute ``_can_checkpoint_with_cache``; HF's own checkpointing then
    keeps the cache, and recomp follows the same rule.
    If it changes: False, and such a layer's cache is dropped under a recomp
    checkpoint with a warning, as for every other layer (an error where the cache
    holds entries): no silent change of results.
    Retired by: a public attribute of ``GradientCheckpointingLayer``.
    Checked on transformers 5.24.0.
    """
    return bool(getattr(layer, "_can_checkpoint_with_cache", False))


def hf_no_split_modules(model: Any) -> frozenset[str]:
    """The class names of a transformers model's layers: its ``_no_split_modules``.

    Why: the planner and the benchmark checkpoint a model's layers; a Hugging Face
    model whose layers are not one ``nn.ModuleList`` named ``layers`` (GPT-2's
    ``transformer.h``) names their classes there, for accelerate's device maps and
    FSDP wrapping, which match ``type(module).__name__`` as recomp then does.
    If it changes: empty, and the planner asks for ``layers=`` as for any other model
    without a ``layers`` list.
    Retired by: a public list of a model's layer classes.
    Checked on transformers 5.24.0.
    """
    names = getattr(model, "_no_split_modules", None)
    if not names or isinstance(names, str):
        return frozenset()
    try:
        return frozenset(str(n) for n in names)
    except TypeError:
        return frozenset()


def run_at_trace_time(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Make Dynamo call ``fn`` when it traces a call of it, instead of tracing into it.

    Why: the warning that exclusions are recomputed under compilation is a Python side
    effect (``warnings.warn``), which Dynamo cannot put in a graph; run when the code
    is traced, it is given once per compilation, and ``fn`` keeps it to once in all.
    Public (``torch.compiler.assume_constant_result``), but it imports Dynamo (seconds):
    applied only where needed. ``fn`` must return a constant.
    """
    return torch.compiler.assume_constant_result(fn)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- saved-tensor report

# The class of the handles in ``_raw_saved_*`` attributes of autograd nodes.
_SAVED_TENSOR_TYPE: type | None = getattr(torch._C._autograd, "SavedTensor", None)
# Per autograd node class: the names of its ``_raw_saved_*`` attributes.
_SAVED_ATTRIBUTES: dict[type, tuple[str, ...]] = {}


def saved_values_readable() -> bool:
    """Whether this PyTorch lets a saved tensor's packed value be read without unpacking it.

    Why: the memory report reads what each autograd node holds for backward without
    triggering a checkpoint's replay (which unpacking would). ``SavedTensor.data``
    returns the value a pack hook returned (or the tensor, without hooks; None once
    backward released it). PyTorch 2.14 has it; 2.9 does not (detected by feature).
    If it changes: False, and ``saved_tensors_report`` raises, naming the PyTorch needed.
    Retired by: a public reader of an autograd node's saved values.
    """
    return _SAVED_TENSOR_TYPE is not None and hasattr(_SAVED_TENSOR_TYPE, "data")


def saved_handles(node: Any) -> list[tuple[str, Any]]:
    """``(name, handle)`` for each tensor the autograd ``node`` saved (lists unrolled).

    Private: the ``_raw_saved_<name>`` attributes of generated nodes and
    ``_raw_saved_tensors`` of custom Functions are the only way to reach the
    ``SavedTensor`` handles without unpacking them.
    If it changes: no handles are found; the report then lists nothing for the node.
    """
    names = _SAVED_ATTRIBUTES.get(type(node))
    if names is None:
        names = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
        _SAVED_ATTRIBUTES[type(node)] = names
    found: list[tuple[str, Any]] = []
    for name in names:
        try:
            value = getattr(node, name)
        except (RuntimeError, AttributeError, TypeError):  # released by a backward, or odd
            continue
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if _SAVED_TENSOR_TYPE is not None and isinstance(item, _SAVED_TENSOR_TYPE):
                found.append((name[len("_raw_saved_") :], item))
    return found


def is_compiled_graph_node(node: Any) -> bool:
    """Whether the autograd ``node`` is the backward of a graph compiled by torch.compile.

    Private: AOTAutograd runs each compiled forward as an autograd Function named
    ``CompiledFunction`` (``torch._functorch._aot_autograd.runtime_wrappers``), whose node class is
    ``CompiledFunctionBackward``; its saved tensors are what the partitioner kept.
    If it changes: False; the report then lists them as saved outside checkpoints.
    """
    return type(node).__name__ == "CompiledFunctionBackward"


def packed_value(handle: Any) -> Any:
    """What the pack hook returned for ``handle`` (the tensor itself without hooks), or None
    once a backward released it. See :func:`saved_values_readable`."""
    try:
        return handle.data
    except RuntimeError:
        return None


def checkpoint_frame(handle: Any) -> Any:
    """The non-reentrant checkpoint call that packed ``handle``, or None.

    Private: a checkpoint's placeholder (``torch.utils.checkpoint._Holder``) holds
    nothing; the call it belongs to (``_CheckpointFrame``: the inputs, the replay
    function, the replay's tensors) is reachable only through the closure of the
    unpack hook registered with the handle (``SavedTensor.unpack_hook``).
    Checked on 2.14 (``unpack_hook`` or ``unpack_hook_with_error_cb``, both closing over
    ``frame``). If it changes: None; the report then finds no checkpoint inputs or
    cached outputs of that checkpoint.
    """
    holder_type = getattr(torch.utils.checkpoint, "_Holder", None)
    if holder_type is None or not isinstance(packed_value(handle), holder_type):
        return None
    unpack = getattr(handle, "unpack_hook", None)
    kept = _kept_replays_of(unpack)
    if kept is not None:  # recomp's kept replays took the unpack over: PyTorch's is under it
        unpack = kept.checkpoint_unpack
    frame = _closure_value(unpack, "frame")
    if frame is None:  # unpack_hook_with_error_cb closes over frame too, or over unpack_hook
        frame = _closure_value(_closure_value(unpack, "unpack_hook"), "frame")
    return frame


def _kept_replays_of(unpack: Any) -> Any:
    """The ``recomp.torch._kept.RecomputeHandle`` whose ``unpack`` this is, or None."""
    owner = getattr(unpack, "__self__", None)
    return owner if hasattr(owner, "checkpoint_unpack") and hasattr(owner, "kept_value") else None


def _closure_value(fn: Any, name: str) -> Any:
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None)
    if code is None or closure is None:
        return None
    for var, cell in zip(code.co_freevars, closure):
        if var == name:
            try:
                return cell.cell_contents
            except ValueError:  # an empty cell
                return None
    return None


def checkpoint_input_handles(frame: Any) -> list[Any]:
    """The saved-tensor handles of a checkpoint call's inputs.

    Private: 2.14 keeps them in ``frame.saved_args`` (``SavedTensor`` or plain values);
    2.9 saved them on a ``_NoopSaveInputs`` node (``frame.input_saver.grad_fn``).
    If it changes: empty; the report then lists no checkpoint inputs.
    """
    saved = getattr(frame, "saved_args", None)
    if isinstance(saved, list) and saved:
        return [
            a for a in saved if _SAVED_TENSOR_TYPE is not None and isinstance(a, _SAVED_TENSOR_TYPE)
        ]
    saver = getattr(frame, "input_saver", None)
    node = getattr(saver, "grad_fn", None)
    return [h for _, h in saved_handles(node)] if node is not None else []


def checkpoint_plain_arguments(frame: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of what a checkpoint call holds of its arguments as they are, not
    as saved tensors: its keyword arguments (``past_key_values``, ``position_embeddings``,
    a layer input passed by keyword) and positional arguments that are not tensors
    (tuples of tensors, cache objects). They stay alive until the replay has run.

    Private: 2.14 keeps positional arguments in ``frame.saved_args`` (tensors as
    ``SavedTensor``, anything else as it is) and the keyword arguments in the closure
    (``kwargs``) of ``frame.recompute_fn``. If it changes: empty; the report then misses
    tensors passed this way (the allocator shows more than its total).
    """
    found: list[tuple[str, Any]] = []
    saved = getattr(frame, "saved_args", None)
    if isinstance(saved, list):
        for i, value in enumerate(saved):
            if value is None or (
                _SAVED_TENSOR_TYPE is not None and isinstance(value, _SAVED_TENSOR_TYPE)
            ):
                continue
            found.append((f"argument {i}", value))
    kwargs = _closure_value(getattr(frame, "recompute_fn", None), "kwargs")
    if isinstance(kwargs, dict):
        found.extend((str(k), v) for k, v in kwargs.items() if v is not None)
    return found


def selective_checkpoint_storage(context: Any) -> list[tuple[str, Any]]:
    """``(op name, entry)`` for each op output a selective activation checkpoint keeps
    for its replay, found in the checkpoint's replay ``context`` (or in contexts composed
    into it). An entry is what the cache holds (tensors inside wrappers), or a marker.

    Private: ``create_selective_checkpoint_contexts`` returns a caching mode and a cached
    mode (``torch.utils.checkpoint._CachingTorchDispatchMode`` /
    ``_CachedTorchDispatchMode``) that share ``storage``: op key (the op, or a tuple
    starting with it) -> list or dict of entries (``_VersionWrapper``s around detached
    outputs); the replay replaces each entry it reads with a marker. These tensors are
    held outside the autograd graph, so no saved-tensor handle shows them.
    If it changes: empty; the report then misses what selective checkpoints keep.
    """
    mode_types = tuple(
        t
        for t in (
            getattr(torch.utils.checkpoint, "_CachedTorchDispatchMode", None),
            getattr(torch.utils.checkpoint, "_CachingTorchDispatchMode", None),
        )
        if isinstance(t, type)
    )
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    stack = [context]
    while stack and mode_types:
        ctx = stack.pop()
        if ctx is None or id(ctx) in seen:
            continue
        seen.add(id(ctx))
        if isinstance(ctx, mode_types):
            storage = getattr(ctx, "storage", None)
            if not isinstance(storage, dict) or id(storage) in seen:
                continue
            seen.add(id(storage))
            for key, entries in storage.items():
                op = key[0] if isinstance(key, tuple) and key else key
                name = getattr(op, "_opname", None) or getattr(op, "__name__", None) or str(op)
                if isinstance(entries, dict):
                    entries = list(entries.values())
                for entry in entries if isinstance(entries, list) else [entries]:
                    found.append((str(name), entry))
            continue
        inner = getattr(ctx, "contexts", None)  # recomp's ComposedContext
        if isinstance(inner, (list, tuple)):
            stack.extend(reversed(inner))
    return found


def checkpoint_function(frame: Any) -> tuple[Any, Any]:
    """``(function, replay context)`` of a checkpoint call: what it checkpointed (a
    module, a bound method, a function) and the context its replay enters (recomp's
    state lives there).

    Private: both are closure variables (``fn``, ``recompute_context``) of the replay
    function PyTorch builds per call (``frame.recompute_fn``).
    If it changes: ``(None, None)``; the report then names the layer by nothing.
    """
    recompute = getattr(frame, "recompute_fn", None)
    return _closure_value(recompute, "fn"), _closure_value(recompute, "recompute_context")


def checkpoint_rng_states(frame: Any) -> list[torch.Tensor]:
    """The random-generator states a checkpoint call keeps for its replay (CPU tensors).

    Private: closure variables (``fwd_cpu_state``, ``fwd_device_states``) of the replay
    function. If it changes: empty (the report leaves these few KiB out).
    """
    recompute = getattr(frame, "recompute_fn", None)
    found = []
    for name in ("fwd_cpu_state", "fwd_device_states"):
        value = _closure_value(recompute, name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                found.append(t)
    return found


def replay_tensors(frame: Any, handle: Any) -> list[torch.Tensor]:
    """The tensors a running (or interrupted) replay produced for ``handle`` and that the
    checkpoint holds until backward reads them.

    Private: ``_Holder.handles`` (graph task -> key) and ``frame.recomputed`` (graph
    task -> key -> tensor), and what recomp's kept replays hold for a later backward
    pass. If it changes: empty (the report omits replayed tensors).
    """
    holder = packed_value(handle)
    found = []
    kept = _kept_replays_of(getattr(handle, "unpack_hook", None))
    if kept is not None:  # what recomp keeps for a later backward pass
        value = kept.kept_value(holder)
        if isinstance(value, torch.Tensor):
            found.append(value)
    handles = getattr(holder, "handles", None)
    recomputed = getattr(frame, "recomputed", None)
    if not isinstance(handles, dict) or recomputed is None:
        return found
    for gid, key in handles.items():
        if key is None or gid not in recomputed:
            continue
        tensor = recomputed[gid].get(key)
        if isinstance(tensor, torch.Tensor):
            found.append(tensor)
    return found


# --------------------------------------------------------------------------- CUDA memory history


def memory_history_enabled() -> bool:
    """Whether ``torch.cuda.memory._record_memory_history`` is recording on this process.

    Why: an excluded region labels its allocations in memory snapshots only while they
    are recorded; otherwise it costs one check (CUDA not initialised: one Python call).
    Private: ``torch._C._cuda_isHistoryEnabled`` has no public wrapper.
    If it changes: False (regions are not labelled; nothing else depends on it).
    Retired by: a public query of the recording state.
    """
    if not torch.cuda.is_initialized():
        return False
    query = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    try:
        return bool(query()) if query is not None else False
    except RuntimeError:
        return False


@contextlib.contextmanager
def memory_label(label: str) -> Iterator[None]:
    """Label the CUDA allocations this thread makes inside the block, in memory snapshots.

    Private: ``torch.cuda.memory._set_memory_metadata`` (the ``user_metadata`` of each
    trace entry, shown by pytorch.org/memory_viz) and its getter, to restore an outer
    label. A ``record_function`` range of the same name marks the block for the profiler.
    If it changes: no label (the block runs as it would without).
    Retired by: a public allocation-annotation API.
    """
    memory = torch.cuda.memory
    set_label = getattr(memory, "_set_memory_metadata", None)
    get_label = getattr(memory, "_get_memory_metadata", None)
    previous = None
    if set_label is not None and get_label is not None:
        try:
            previous = get_label()
            set_label(label)
        except RuntimeError:
            previous = None
    try:
        with torch.autograd.profiler.record_function(label):
            yield
    finally:
        if previous is not None and set_label is not None:
            set_label(previous)


_OOM_OBSERVER_ATTACHED = False


def attach_cuda_oom_observer(observer: Callable[[int, int, int, int], None]) -> bool:
    """Have the CUDA caching allocator call ``observer(device, alloc, device_allocated,
    device_free)`` when an allocation fails, before it raises ``OutOfMemoryError``.

    Private: ``torch._C._cuda_attach_out_of_memory_observer`` (what
    ``torch.cuda.memory._record_memory_history`` uses for its OOM snapshots). It has no
    detach: attach one observer per process that forwards to whatever is installed.
    Returns False without CUDA or if the function is gone (then nothing is attached:
    call the report yourself when you catch ``torch.OutOfMemoryError``).
    """
    global _OOM_OBSERVER_ATTACHED
    if _OOM_OBSERVER_ATTACHED:
        return True
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None or not torch.cuda.is_available():
        return False
    attach(observer)
    _OOM_OBSERVER_ATTACHED = True
    return True


def compiled_original(module: Any) -> Any:
    """The module that ``torch.compile(module)`` wrapped, or None if ``module`` is not
    such a wrapper.

    Why: the planner profiles a model eagerly, op by op and hook by hook, and a
    compiled wrapper would show it the original's modules under ``_orig_mod.`` paths,
    which a plan cannot name; the original is what the plan applies to (and the
    compiled wrapper sees the change, since it calls the same module).
    The wrapper's class (``torch._dynamo.eval_frame.OptimizedModule``) is matched by
    name and module so that Dynamo is not imported for a model that was never compiled;
    the original is its ``_orig_mod`` attribute. Checked on 2.9.1, 2.13.0 and 2.14.1.
    If it changes: None, and a compiled model is profiled like any other module.
    Retired by: a public way to get a compiled module's original.
    """
    kind = type(module)
    if kind.__name__ != "OptimizedModule" or not kind.__module__.startswith("torch._dynamo"):
        return None
    original = getattr(module, "_orig_mod", None)
    return original if isinstance(original, torch.nn.Module) else None


def ops_named(names: tuple[str, ...]) -> tuple[Any, ...]:
    """The default overloads of the ops ``"namespace::name"`` that this PyTorch has.

    Why: the planner's selective option keeps the outputs of expensive ops, among them
    ATen's attention kernels and the functional collectives, whose names start with an
    underscore (``aten::_scaled_dot_product_flash_attention``,
    ``_c10d_functional::all_gather_into_tensor``); which of them exist depends on the
    version and the build. Looked up by name; missing ones are left out.
    If it changes: a renamed op is no longer kept, and is recomputed as a cheap op is.
    Retired by: a public list of PyTorch's compute-bound and communication ops.
    """
    found = []
    for qualified in names:
        namespace, _, name = qualified.partition("::")
        try:
            found.append(getattr(getattr(torch.ops, namespace), name).default)
        except (AttributeError, RuntimeError):
            continue
    return tuple(found)


# --------------------------------------------------------------------------- compiled plans


def compiled_backend_name(module: Any) -> str | None:
    """The name of the backend a ``torch.compile`` wrapper compiles with (``"inductor"``,
    ``"aot_eager"``, ...), or None if it cannot be read.

    Why: ``recomp.plan.profile(torch.compile(model))`` plans for the compiler the user
    chose, whose decompositions and partitioner decide what the compiled step keeps.
    The wrapper's Dynamo context holds its frame callback, which holds the backend
    wrapped for debugging, which holds the backend; registered backends carry their
    name in ``__name__``. Checked on 2.9.1 and 2.14.1.
    If it changes: None, and ``profile`` asks for ``backend=``.
    Retired by: a public accessor for a compiled module's backend.
    """
    if compiled_original(module) is None:
        return None
    backend: Any = getattr(getattr(module, "dynamo_ctx", None), "callback", None)
    for _ in range(4):
        backend = getattr(backend, "_torchdynamo_orig_backend", None)
        name = getattr(backend, "__name__", None)
        if isinstance(name, str):
            return name
    return None


#: The backends whose partitioning ``partitioning_backend`` reproduces.
PLANNABLE_BACKENDS = ("inductor", "aot_eager")


def partitioning_backend(backend: str, on_joint: Callable[..., None]) -> tuple[Any, Any]:
    """A ``torch.compile`` backend that traces like ``backend`` up to the partition of the
    joint forward-backward graph and runs the graphs without compiling them, and the
    partition function ``backend`` uses. ``on_joint(joint, joint_inputs, kwargs,
    context)`` sees each joint graph before it is partitioned (it must not change it),
    with the tracing context it is partitioned in: partitioning it again later must
    happen inside that context (``in_tracing_context``), where Inductor's joint-graph
    passes find the fake-tensor mode of the graph's constants.

    Why: the planner for compiled models asks the partitioner what it saves at several
    memory budgets. It needs the joint graph as the backend's partitioner gets it:
    Inductor decomposes ops first (``select_decomp_table``) and runs its joint-graph
    passes inside its ``partition_fn`` (``torch._inductor.compile_fx``); ``aot_eager``
    partitions with ``min_cut_rematerialization_partition`` and no decompositions.
    Generating code is not needed, so the forward and backward compilers are no-ops
    (``make_boxed_compiler``). Checked on 2.9.1 and 2.14.1.
    If it changes: an ImportError or a changed graph; ``tests/test_compat.py`` checks
    that the predicted bytes match a real compiled run.
    Retired by: a public API to query the partitioner's choice at a budget.
    """
    from functorch.compile import make_boxed_compiler
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._guards import TracingContext

    if backend not in PLANNABLE_BACKENDS:
        raise ValueError(
            f"recomp plans for the torch.compile backends {', '.join(PLANNABLE_BACKENDS)}, "
            f"not {backend!r}: compile with one of them, or pass backend="
        )
    decompositions: Any = None
    partition: Any = min_cut_rematerialization_partition
    if backend == "inductor":
        from torch._inductor.compile_fx import partition_fn
        from torch._inductor.decomposition import select_decomp_table

        decompositions = select_decomp_table()
        partition = partition_fn

    def capture(joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        on_joint(joint, joint_inputs, dict(kwargs), TracingContext.try_get())
        return partition(joint, joint_inputs, **kwargs)

    def no_codegen(graph: Any, example_inputs: Any) -> Any:
        return graph

    compiler = make_boxed_compiler(no_codegen)
    traced = aot_autograd(
        fw_compiler=compiler,
        bw_compiler=compiler,
        partition_fn=capture,
        decompositions=decompositions,
        keep_inference_input_mutations=True,
    )
    return traced, partition


def in_tracing_context(context: Any) -> contextlib.AbstractContextManager[Any]:
    """Re-enter the tracing context a joint graph was partitioned in (see
    ``partitioning_backend``; ``torch._guards.tracing``). Checked on 2.9.1 and 2.14.1.
    If it changes: an ImportError when a compiled profile partitions.
    Retired by: a public API to query the partitioner's choice at a budget."""
    from torch._guards import tracing

    return tracing(context) if context is not None else contextlib.nullcontext()


def activation_memory_budget(budget: float) -> contextlib.AbstractContextManager[Any]:
    """``torch._functorch.config.activation_memory_budget`` set to ``budget`` inside.

    Why: a compiled plan is PyTorch's memory-budget partitioner at the budget that lands
    on the user's bytes; the partitioner reads this setting when a graph is compiled.
    The module config's ``patch`` is the documented way to set it for a scope. Checked
    on 2.9.1 and 2.14.1.
    If it changes: AttributeError at the first compiled-plan call.
    Retired by: a public per-compile memory budget.
    """
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=budget)


def fake_mode_of(values: list[Any]) -> Any:
    """The fake-tensor mode of the placeholder values of a traced graph, or None.

    Why: counting the FLOPs a backward graph recomputes runs it on its fake tensors,
    inside their mode. ``torch._guards.detect_fake_mode``. Checked on 2.9.1 and 2.14.1.
    If it changes: None, and the FLOPs are not counted.
    Retired by: a public way to re-enter a traced graph's fake mode.
    """
    try:
        from torch._guards import detect_fake_mode
    except ImportError:  # pragma: no cover - depends on the PyTorch version
        return None
    return detect_fake_mode(values)


def many_recompiles() -> contextlib.AbstractContextManager[Any]:
    """Dynamo's limit of compiled versions per code object raised inside.

    Why: each profile compiles a fresh copy of the model's ``forward`` with a backend of
    its own, which Dynamo counts against the code object's recompile limit (8): a
    process that profiles often would otherwise run its profile eagerly, unseen.
    The setting is ``recompile_limit`` (2.14) or ``cache_size_limit`` (2.9, an alias
    later). Checked on 2.9.1 and 2.14.1.
    If it changes: the limit is left as it is.
    Retired by: a way to compile a module copy without counting against the original.
    """
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            return dynamo_config.patch(name, 1 << 16)
    return contextlib.nullcontext()  # pragma: no cover - depends on the PyTorch version


class _SeparateBackend:
    """A ``torch.compile`` backend equal only to itself (see ``separate_backend``)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __call__(self, graph: Any, example_inputs: Any, **kwargs: Any) -> Any:
        return self._inner(graph, example_inputs, **kwargs)


def separate_backend(
    backend: str, mode: str | None = None, options: dict[str, Any] | None = None
) -> Any:
    """``backend`` (a registered name) as a backend object that Dynamo will not take for
    the backend of any other ``torch.compile`` call.

    Why: Dynamo keys its compiled code by code object and guards, and the guards hold
    the backend by equality (``torch.compile``'s backend wrappers compare their
    settings) and a module by type, not by identity. Two instances of one model class
    compiled with the same backend share the first one's graph, compiled under the
    partitioner's memory budget of that moment: a second model compiled with another
    budget (a plan, or none) would silently run the first one's choice. A backend object
    of its own gives each compile its own cache entries. Inductor is built as
    ``torch.compile`` builds it (``torch._TorchCompileInductorWrapper``, which applies
    ``mode`` and ``options``); other backends come from Dynamo's registry
    (``torch._dynamo.lookup_backend``). Checked on 2.9.1 and 2.14.1.
    If it changes: an AttributeError when compiling with a plan.
    Retired by: the memory budget as part of Dynamo's guards, or a per-compile budget.
    """
    if backend == "inductor":
        inner: Any = torch._TorchCompileInductorWrapper(mode, options, None)  # type: ignore[attr-defined]
    else:
        if mode is not None or options is not None:
            raise ValueError(f"mode= and options= are Inductor's; the backend here is {backend!r}")
        from torch._dynamo import lookup_backend

        inner = lookup_backend(backend)
    return _SeparateBackend(inner)
