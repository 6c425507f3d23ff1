"""The dispatcher below autograd: the Python dispatch-mode stack, operators' schemas and
names, and FLOPs per operator.

Consumers: ``torch/_offload.py``, ``torch/_kept.py`` and ``torch/_collective_cache.py``
(running without modes, detaching below autograd, completed ``Work``, operator
arguments), ``torch/_backend.py`` (hiding selective checkpointing's modes),
``torch/collectives.py`` and ``torch/_debug.py`` (``TorchDispatchMode``, operator names),
the planner (``ops_named``, ``cpu_attention_ops``) and the benchmark (``op_flop_counter``).
Tested by ``tests/torch/compat/test_dispatch.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

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


#: recomp's own modes that take part in selective checkpointing (the swap taps of
#: ``recomp.torch._swap.selective``): hidden in excluded regions with PyTorch's.
_OWN_SAC_MODES: list[type] = []


def register_selective_mode_type(mode_type: type) -> None:
    """Hide ``mode_type`` in excluded regions along with PyTorch's selective-checkpoint
    modes (see :func:`hide_selective_checkpoint_modes`)."""
    if mode_type not in _OWN_SAC_MODES:
        _OWN_SAC_MODES.append(mode_type)


def _sac_mode_types() -> tuple[type, ...]:
    try:
        from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode
    except ImportError:
        return tuple(_OWN_SAC_MODES)
    return (_CachingTorchDispatchMode, _CachedTorchDispatchMode, *_OWN_SAC_MODES)


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


# --------------------------------------------------------------------------- operators


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
        from ...errors import RecompError

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
