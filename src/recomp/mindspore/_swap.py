"""HyperParallel's swap names on MindSpore PyNative: what MindSpore 2.10 allows.

NOTE [ Swap on MindSpore ]

MindSpore 2.10 PyNative has what a per-tensor swap needs, and recomp uses it:

* ``mindspore.saved_tensors_hooks(pack, unpack)`` works in PyNative, with any Python
  object as the packed value; an inner hook wins over an outer one (also over
  ``mindspore.recompute``'s own, in its forward and in its replay), and a hook around
  ``mindspore.recompute`` sees the inputs the recompute saves. So ``swap``,
  ``swap_wrapper``, ``async_save_on_cpu`` and a checkpoint's ``swap_inputs=True`` are
  saved-tensors hooks here as on PyTorch.
* ``Tensor.move_to("CPU", blocking=False)`` and back (``move_to(device,
  blocking=False)``) copy asynchronously; on a CPU tensor it returns a new Tensor on
  the same memory (nothing moves).

A **swap scope** is one layer's call (the layer's forward, or a ``swap`` call, or an
``async_save_on_cpu`` block with no layer around it). Its pack hook keeps each chosen
tensor (per-tensor policy: ``MUST_SWAP`` or ``MUST_SAVE``; parameters and empty
tensors stay); when the layer returns, every kept tensor that does not share memory
with the layer's output is copied to the host and recomp drops its device reference
(the device memory is freed once nothing else holds it), as one group named by
:class:`SwapManager`. In backward the first read of a group brings back, ahead, the
group paired with its layer (``set_forward_prefetch_layer``) or, with no pair set,
the group recorded before it; the last layer of a chain of pairs keeps its tensors,
and the gradient of its output brings back its pair. A tensor read before it was
brought back is copied back then.

Where nothing would move (a CPU device) the tensors stay, unless the host-copy test
mode is on (``RECOMP_OFFLOAD_HOST_COPY=1`` or :func:`host_copy`): it runs the same
bookkeeping with copies on the CPU, so that tests see bytes out and in.

Per-op policies in a checkpoint (``policy_fn``, ``MUST_SWAP`` of an op's output) go
through ``mindspore.MsDispatchMode``: NOTE [ Per-op policies on MindSpore ] in
``recomp.mindspore._selective``; a ``MUST_SWAP`` output is kept by the checkpoint's swap
scope like a saved tensor. What MindSpore 2.10 does not give recomp, and so what is
refused with an error saying so: ``group_swap`` (one copy of
many small tensors) and ``cpu_pool`` (a pinned host pool) need storage-level copies
into a shared host buffer; ``swap_tensor_wrapper`` empties a storage in place and
refills it. recomp does none of these on MindSpore. Mutations of a chosen tensor
between its save and the end of its layer are not detected (MindSpore's version
counters are read only after the queue is drained; recomp does not drain it per
saved tensor).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mindspore
from mindspore import nn, ops

from .._policy import CheckpointPolicy, SwapPolicyError, tensor_swapped
from .._pytree import flatten
from .._state import is_recomputing
from .._swap_pairs import OwnScopes, ScopeSlot, SwapHooks, SwapManagerBase, SwapWrappers
from .._wrapping import instance_required
from ..errors import RecompError, SwapNotSupportedError
from . import _compat
from ._backend import BACKEND
from ._plain import PlainFunction

__all__ = [
    "AsyncSaveOnCpu",
    "CheckpointPolicy",
    "SwapManager",
    "SwapNotSupportedError",
    "SwapPolicyError",
    "async_save_on_cpu",
    "swap",
    "swap_tensor_wrapper",
    "swap_wrapper",
]

ENV_HOST_COPY = "RECOMP_OFFLOAD_HOST_COPY"


def refuse(option: str, lacks: str, instead: str) -> SwapNotSupportedError:
    return SwapNotSupportedError(
        f"recomp.mindspore: {option} is not available on MindSpore: {lacks}. {instead}"
    )


def check_swap_options(api: str, group_swap: Any, cpu_pool: Any) -> None:
    if not isinstance(group_swap, bool):
        raise TypeError(f"group_swap must be a bool, got {group_swap!r}.")
    if group_swap:
        raise refuse(
            f"{api}(..., group_swap=True)",
            "packing many small tensors into one host buffer needs storage-level copies "
            "into a shared buffer, which recomp does not do on MindSpore",
            "Drop group_swap (each tensor is then copied on its own).",
        )
    if cpu_pool is not None:
        raise refuse(
            f"{api}(..., cpu_pool=...)",
            "recomp has no pinned host memory pool on MindSpore (Tensor.move_to allocates "
            "the host copy)",
            "Drop cpu_pool.",
        )


# --------------------------------------------------------------------------- moving


@dataclass
class SwapStats:
    """What the swap moved since the counters were made or :meth:`reset`."""

    offloaded_bytes: int = 0  # device -> host
    offloaded_tensors: int = 0
    restored_bytes: int = 0  # host -> device
    prefetched_bytes: int = 0  # brought back ahead of the read
    #: the groups brought back ahead, in order
    prefetched_groups: list[str] = field(default_factory=list)

    def reset(self) -> None:
        self.offloaded_bytes = self.offloaded_tensors = 0
        self.restored_bytes = self.prefetched_bytes = 0
        self.prefetched_groups.clear()


STATS = SwapStats()
_HOST_COPY: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "recomp_ms_host_copy", default=None
)


@contextlib.contextmanager
def host_copy(on: bool = True) -> Iterator[None]:
    """Within the block, swaps copy CPU tensors too (the test mode; see the NOTE)."""
    token = _HOST_COPY.set(on)
    try:
        yield
    finally:
        _HOST_COPY.reset(token)


def _host_copy_mode() -> bool:
    on = _HOST_COPY.get()
    return os.environ.get(ENV_HOST_COPY, "") not in ("", "0") if on is None else on


def _device_type(t: Any) -> str:
    return str(t.device).split(":", 1)[0]


def _nbytes(t: Any) -> int:
    return int(t.nbytes)


def _tensors_in(tree: Any) -> Iterator[Any]:
    leaves, _ = flatten(tree)
    return (x for x in leaves if isinstance(x, mindspore.Tensor))


def _storage_key(t: Any) -> Any:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, TypeError, AttributeError):
        return None


class _Kept:
    """A tensor a swap scope chose: the tensor until its layer returns, then its host
    copy (or still the tensor, where it stays)."""

    __slots__ = ("__weakref__", "device", "group", "host", "restored", "tensor")

    def __init__(self, tensor: Any) -> None:
        self.tensor: Any = tensor
        self.host: Any = None
        self.restored: Any = None
        self.device = _device_type(tensor)
        self.group: _Group | None = None

    def to_host(self, copy_on_cpu: bool) -> None:
        t = ops.stop_gradient(self.tensor)
        self.host = t.copy() if copy_on_cpu else t.move_to("CPU", blocking=False)
        self.tensor = None
        STATS.offloaded_bytes += _nbytes(self.host)
        STATS.offloaded_tensors += 1

    def bring_back(self, ahead: bool) -> None:
        if self.host is None or self.restored is not None:
            return
        host = self.host
        self.restored = host.copy() if self.device == "CPU" else host.move_to(self.device, blocking=False)
        STATS.restored_bytes += _nbytes(host)
        if ahead:
            STATS.prefetched_bytes += _nbytes(host)

    def get(self) -> Any:
        if self.host is None:
            if self.tensor is None:
                raise RecompError("A swapped tensor was read after its layer's call failed.")
            return self.tensor
        if self.group is not None:
            self.group.first_read()
        self.bring_back(ahead=False)
        out, self.restored = self.restored, None  # a second read (retain_graph) copies again
        return out


class _Group:
    """What one layer's call moved to the host. It lives as long as one of its tensors
    (the autograd graph holds them, and they hold the group); the swap manager holds
    groups weakly, so a freed graph's groups are never brought back."""

    __slots__ = ("__weakref__", "members", "name", "read")

    def __init__(self, name: str) -> None:
        self.name = name
        self.members: weakref.WeakSet[_Kept] = weakref.WeakSet()
        self.read = False

    def prefetch(self) -> None:
        if any(k.host is not None and k.restored is None for k in self.members):
            STATS.prefetched_groups.append(self.name)
            for kept in self.members:
                kept.bring_back(ahead=True)

    def first_read(self) -> None:
        if self.read:
            return
        self.read = True
        ahead = SwapManager().next_in_backward(self)
        if ahead is not None:
            ahead.prefetch()


class SwapScope:
    """One layer's chosen tensors; see NOTE [ Swap on MindSpore ]."""

    __slots__ = ("function", "layer", "name", "pending")

    def __init__(self, name: str | None = None, *, layer: Any = None, function: Any = None) -> None:
        self.name = name
        self.layer = layer
        self.function = function
        self.pending: list[_Kept] = []

    def keep(self, tensor: Any) -> _Kept:
        kept = _Kept(tensor)
        self.pending.append(kept)
        return kept

    def finish(self, outputs: Any) -> None:
        """The layer returned ``outputs``: move what it chose to the host, as one group."""
        pending, self.pending = self.pending, []
        copy_on_cpu = _host_copy_mode()
        moving = [k for k in pending if copy_on_cpu or k.device != "CPU"]
        manager = SwapManager()
        if not moving:
            manager.prefetch_on_backward(self.layer, outputs)
            return
        group = _Group(self.name or manager.group_name(self.layer, self.function))
        manager.group_recorded(self.layer, group)
        if manager.is_last_layer(self.layer):
            # Its backward comes next: moving it out and back gains nothing. Its
            # backward's start (the gradient of its output) brings its pair back.
            manager.prefetch_on_backward(self.layer, outputs)
            return
        protected = {_storage_key(t) for t in _tensors_in(outputs)} - {None}
        for kept in moving:
            if _storage_key(kept.tensor) in protected:
                continue
            kept.to_host(copy_on_cpu)
            kept.group = group
            group.members.add(kept)

    def abort(self) -> None:
        self.pending = []


_SCOPES = ScopeSlot("recomp_ms_swap_scope")
current_scope = _SCOPES.current


# --------------------------------------------------------------------------- per tensor


def _stays_on_device(t: Any) -> bool:
    return isinstance(t, mindspore.Parameter) or _nbytes(t) == 0


class AsyncSaveOnCpu:
    """What :func:`async_save_on_cpu` returns: a saved-tensors hook that chooses, tensor
    by tensor, what goes to the host (NOTE [ Swap on MindSpore ])."""

    def __init__(self, policy_fn: Callable[[Any], Any] | None = None) -> None:
        if policy_fn is not None and not callable(policy_fn):
            raise TypeError(f"policy_fn must be callable or None, got {policy_fn!r}.")
        self.policy_fn = policy_fn
        # No layer around it: the block is the scope, finished when it ends.
        self.own = OwnScopes(_SCOPES, lambda: SwapScope("async_save_on_cpu"))
        self.hooks: list[Any] = []

    def __enter__(self) -> AsyncSaveOnCpu:
        self.own.enter()
        hooks = mindspore.saved_tensors_hooks(self.pack_to_host, self.unpack_from_host)
        hooks.__enter__()
        self.hooks.append(hooks)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.hooks.pop().__exit__(*exc_info)
        self.own.exit(*exc_info)

    def pack_to_host(self, t: Any) -> Any:
        if _stays_on_device(t) or is_recomputing():
            # In a recomp checkpoint's replay an inner hook's saves are thrown away with
            # the replay's graph (the forward's were kept): nothing to move.
            return t
        if self.policy_fn is not None and not tensor_swapped(self.policy_fn(t)):
            return t
        scope = current_scope()
        return t if scope is None else scope.keep(t)

    @staticmethod
    def unpack_from_host(packed: Any) -> Any:
        return packed.get() if isinstance(packed, _Kept) else packed


def async_save_on_cpu(
    policy_fn: Callable[[Any], Any] | None = None, group_swap: bool = False, cpu_pool: Any = None
) -> AsyncSaveOnCpu:
    """A context in which the tensors MindSpore's autograd saves go to the host until
    backward. ``policy_fn(tensor)`` returns ``MUST_SAVE`` (stays) or ``MUST_SWAP``
    (default). Parameters and tensors sharing memory with the layer's output stay.
    Inside a checkpoint or swap wrapper call the tensors move when that layer
    returns; elsewhere when the block ends. On a CPU device nothing moves (unless
    the host-copy test mode is on). ``group_swap``/``cpu_pool`` are refused on
    MindSpore (see NOTE [ Swap on MindSpore ])."""
    check_swap_options("async_save_on_cpu", group_swap, cpu_pool)
    return AsyncSaveOnCpu(policy_fn)


def layer_scope(
    function: Any, policy_fn: Any = None, *, hooks: bool = True
) -> contextlib.AbstractContextManager[Any]:
    """A swap scope around one call of ``function``; yields ``finish(outputs)``. With
    ``hooks``, what autograd saves inside goes through ``policy_fn`` (else only what
    an inner :func:`async_save_on_cpu` or a per-op ``MUST_SWAP`` chooses)."""
    scope = SwapScope(layer=BACKEND.module_of(function), function=function)
    return _SCOPES.layer_call(scope, AsyncSaveOnCpu(policy_fn) if hooks else None)


def swap(
    function: Callable[..., Any],
    *args: Any,
    policy_fn: Callable[[Any], Any] | None = None,
    group_swap: bool = False,
    cpu_pool: Any = None,
    **kwargs: Any,
) -> Any:
    """Call ``function(*args, **kwargs)`` with what autograd saves in it on the host until
    backward (nothing is recomputed). ``policy_fn(tensor)`` returns ``MUST_SAVE`` or
    ``MUST_SWAP`` (default); see :func:`async_save_on_cpu`."""
    check_swap_options("swap", group_swap, cpu_pool)
    with layer_scope(function, policy_fn) as finish:
        return finish(function(*args, **kwargs))


_WRAPPED = SwapWrappers()


def swap_wrapper(
    module: Any,
    policy_fn: Callable[[Any], Any] | None = None,
    group_swap: bool = False,
    cpu_pool: Any = None,
) -> Any:
    """Make every call of ``module`` a :func:`swap` (what autograd saves in it goes to the
    host until backward). Puts a forward pre-hook and a forward hook on the Cell and
    returns it (a plain function comes back as a small Cell around it); names are
    unchanged. Around a ``checkpoint_wrapper``'d Cell it moves the checkpoint's inputs,
    as ``swap_inputs=True`` does."""
    if policy_fn is not None and not callable(policy_fn):
        raise TypeError(f"policy_fn must be callable or None, got {policy_fn!r}.")
    check_swap_options("swap_wrapper", group_swap, cpu_pool)
    if not _compat.forward_hooks_run():
        raise RecompError(
            "recomp.mindspore.swap_wrapper puts forward hooks on the Cell, but a library "
            "replaced MindSpore's Cell._run_forward_hook (mindnlp 0.3.1 does), so Cells "
            "with forward hooks fail. Call recomp.mindspore.swap(cell, *args) in the "
            "model's code instead."
        )
    if isinstance(module, type):
        raise instance_required(module, "swap_wrapper", "Cell or a function")
    if not isinstance(module, nn.Cell):
        if not callable(module):
            raise TypeError(f"swap_wrapper needs a Cell or a function, got {module!r}.")
        module = PlainFunction(module)
    return _WRAPPED.install(module, SwapHooks(lambda cell: layer_scope(cell, policy_fn)))


def unwrap_swaps(module: Any) -> bool:
    """Remove what :func:`swap_wrapper` put on ``module`` and the Cells below it."""
    if not isinstance(module, nn.Cell):
        return False
    return _WRAPPED.remove(sub for _, sub in module.cells_and_names())


def swap_tensor_wrapper(
    target: Any, tag: str | None = None, group_swap: bool = False, cpu_pool: Any = None
) -> Any:
    """HyperParallel's registration of tensors a layer keeps outside autograd's saved
    tensors. Outside a swap scope it returns ``target`` unchanged, as there; inside one
    it is refused on MindSpore (see NOTE [ Swap on MindSpore ]), the error naming the
    tensors by ``tag`` (HyperParallel's debug tag)."""
    check_swap_options("swap_tensor_wrapper", group_swap, cpu_pool)
    if tag is not None and not isinstance(tag, str):
        raise TypeError(f"tag must be a str or None, got {tag!r}.")
    if current_scope() is None or not any(True for _ in _tensors_in(target)):
        return target
    raise refuse(
        f"swap_tensor_wrapper({'' if tag is None else f'tag={tag!r}'}) inside a swapped layer",
        "it empties the tensors' storages in place once copied and refills them at the "
        "layer's backward, and recomp does not resize MindSpore storages in place",
        "Let autograd save the tensor (it is then swapped with the layer's other saved "
        "tensors), or keep it on the device.",
    )


# --------------------------------------------------------------------------- manager


class SwapManager(SwapManagerBase):
    """The process's swap manager on MindSpore (every ``SwapManager()`` is the same
    object): layer pairs (:meth:`set_forward_prefetch_layer`) and group names, as in
    ``recomp.torch``. With no pair for a layer, the group recorded before its group is
    brought back ahead."""

    layer_type = nn.Cell
    layer_kind = "Cells"
    order: list[weakref.ref[_Group]]

    def _started(self) -> None:
        self.order = []

    def grad_outputs(self, outputs: Any) -> Iterator[Any]:
        return (t for t in _tensors_in(outputs) if _compat.requires_grad(t))

    def group_recorded(self, layer: Any | None, group: Any) -> None:
        super().group_recorded(layer, group)
        self.order = [r for r in self.order if r() is not None]
        self.order.append(weakref.ref(group))

    def next_in_backward(self, group: _Group) -> _Group | None:
        """The group to bring back when ``group`` is first read."""
        if self.pairs:
            return self.paired(group)  # type: ignore[no-any-return]
        groups = [g for g in (r() for r in self.order) if g is not None]
        if group in groups:
            at = groups.index(group)
            return groups[at - 1] if at > 0 else None
        return None


def checkpoint_swap(api: str, options: dict[str, Any]) -> tuple[Any, bool]:
    """Take HyperParallel's swap options of a checkpoint call out of ``options``: the
    per-op ``policy_fn`` (or None) and whether the checkpoint's inputs go to the host
    (``swap_inputs=True``). What MindSpore cannot do raises."""
    policy_fn = options.pop("policy_fn", None)
    swap_inputs = options.pop("swap_inputs", False)
    check_swap_options(api, options.pop("group_swap", False), options.pop("cpu_pool", None))
    if not isinstance(swap_inputs, bool):
        raise TypeError(f"swap_inputs must be a bool, got {swap_inputs!r}.")
    if policy_fn is not None and not callable(policy_fn) and not isinstance(policy_fn, list):
        raise TypeError(f"policy_fn must be a function or a list of op names, got {policy_fn!r}.")
    return policy_fn, swap_inputs
