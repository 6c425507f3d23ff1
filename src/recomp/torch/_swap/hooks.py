"""Per-tensor swap: saved-tensors hooks that hand what autograd saves to the swap scope
(``async_save_on_cpu``, and through it ``swap``, ``swap_wrapper`` and a checkpoint's
``swap_inputs=True``), and ``swap_tensor_wrapper`` for tensors a layer keeps outside
autograd's saved tensors (NOTE [ Swap scopes ] in ``scope``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..._policy import tensor_swapped
from ..._swap_pairs import OwnScopes, SwapHooks, SwapWrappers
from ..._wrapping import instance_required
from .. import _compat
from .._backend import BACKEND
from .._plain import PlainFunction
from .manager import _tensors_in
from .pool import _check_swap_options
from .scope import _SCOPES, SwapScope, _read, current_scope, is_compiling


def _stays_on_device(t: torch.Tensor) -> bool:
    if isinstance(t, nn.Parameter) or isinstance(_compat.view_base(t), nn.Parameter):
        return True
    try:
        return t.untyped_storage().nbytes() == 0
    except (RuntimeError, NotImplementedError):
        return True


class AsyncSaveOnCpu(torch.autograd.graph.saved_tensors_hooks):
    """What ``async_save_on_cpu`` returns: a saved-tensors hook that chooses, tensor by
    tensor, what goes to the host (NOTE [ Swap scopes ])."""

    def __init__(
        self,
        policy_fn: Callable[[torch.Tensor], Any] | None = None,
        group_swap: bool = False,
        cpu_pool: Any = None,
    ) -> None:
        _check_swap_options(group_swap, cpu_pool)
        if policy_fn is not None and not callable(policy_fn):
            raise TypeError(f"policy_fn must be callable or None, got {policy_fn!r}.")
        self.policy_fn = policy_fn
        self.own = OwnScopes(
            _SCOPES,
            lambda: SwapScope("async_save_on_cpu", group_swap=group_swap, cpu_pool=cpu_pool),
        )
        # A function of the policy, not a bound method: the hooks object would hold
        # itself (a reference cycle per swapped call, freed only by the collector).
        super().__init__(functools.partial(_pack_to_host, policy_fn), _read)

    def __enter__(self) -> None:
        # No layer around it: the block is the scope, finished when it ends.
        self.own.enter()
        super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        self.own.exit(*exc_info)

    def pack_to_host(self, t: torch.Tensor) -> Any:
        return _pack_to_host(self.policy_fn, t)

    unpack_from_host = staticmethod(_read)


def _pack_to_host(policy_fn: Callable[[torch.Tensor], Any] | None, t: torch.Tensor) -> Any:
    if _stays_on_device(t):
        return t
    if policy_fn is not None and not tensor_swapped(policy_fn(t)):
        return t
    scope = current_scope()
    if scope is None:
        return t
    return scope.keep(t)


def async_save_on_cpu(
    policy_fn: Callable[[torch.Tensor], Any] | None = None,
    group_swap: bool = False,
    cpu_pool: Any = None,
) -> AsyncSaveOnCpu:
    """A context in which the tensors autograd saves go to the host until backward.

    ``policy_fn(tensor)`` returns ``MUST_SAVE`` (stays on the device) or ``MUST_SWAP``
    (default for every tensor). Parameters, views of parameters and tensors sharing
    storage with the layer's output stay on the device. Inside a recomp checkpoint
    call or a swap wrapper the tensors move when that layer returns; elsewhere when
    the block ends. On a machine without CUDA nothing moves (unless the
    ``RECOMP_OFFLOAD_HOST_COPY=1`` test mode is on)."""
    return AsyncSaveOnCpu(policy_fn, group_swap, cpu_pool)


def swap(
    function: Callable[..., Any],
    *args: Any,
    policy_fn: Callable[[torch.Tensor], Any] | None = None,
    group_swap: bool = False,
    cpu_pool: Any = None,
    **kwargs: Any,
) -> Any:
    """Call ``function(*args, **kwargs)`` with what autograd saves in it on the host until
    backward (nothing is recomputed). ``policy_fn(tensor)`` returns ``MUST_SAVE`` or
    ``MUST_SWAP`` (default); see :func:`async_save_on_cpu`. Refused under
    ``torch.compile``."""
    if is_compiling():
        raise ValueError("recomp.torch.swap does not run under torch.compile (eager only).")
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    with _swapped_call(policy_fn, group_swap, cpu_pool, function) as finish:
        return finish(function(*args, **kwargs))


def _swapped_call(
    policy_fn: Any, group_swap: bool, cpu_pool: Any, function: Any
) -> contextlib.AbstractContextManager[Any]:
    """One call of ``function`` as a swap scope, with the per-tensor hooks."""
    scope = SwapScope(
        group_swap=group_swap,
        cpu_pool=cpu_pool,
        layer=BACKEND.module_of(function),
        function=function,
    )
    return _SCOPES.layer_call(scope, async_save_on_cpu(policy_fn, group_swap, cpu_pool))


def _wrapped_call(
    policy_fn: Any, group_swap: bool, cpu_pool: Any, module: nn.Module
) -> contextlib.AbstractContextManager[Any] | None:
    if not torch.is_grad_enabled() or is_compiling():
        return None
    return _swapped_call(policy_fn, group_swap, cpu_pool, module)


def swap_wrapper(
    module: Any,
    policy_fn: Callable[[torch.Tensor], Any] | None = None,
    group_swap: bool = False,
    cpu_pool: Any = None,
) -> Any:
    """Make every call of ``module`` a :func:`swap` (what autograd saves in it goes to the
    host until backward). Wraps in place with forward hooks and returns the module (a
    plain function comes back as a small module around it); names are unchanged.
    Around a :func:`checkpoint_wrapper`'d module it moves the checkpoint's inputs, as
    ``swap_inputs=True`` does."""
    if policy_fn is not None and not callable(policy_fn):
        raise TypeError(f"policy_fn must be callable or None, got {policy_fn!r}.")
    _check_swap_options(group_swap, cpu_pool)
    if isinstance(module, type):
        raise instance_required(module, "swap_wrapper", "module or a function")
    if not isinstance(module, nn.Module):
        if not callable(module):
            raise TypeError(f"swap_wrapper needs a module or a function, got {module!r}.")
        module = PlainFunction(module)
    hooks = SwapHooks(functools.partial(_wrapped_call, policy_fn, group_swap, cpu_pool))
    return _WRAPPED.install(module, hooks)


def unwrap_swaps(module: Any) -> bool:
    """Remove what :func:`swap_wrapper` put on ``module`` and on the modules below it;
    whether there was any."""
    if not isinstance(module, nn.Module):
        return False
    return _WRAPPED.remove(module.modules())


_WRAPPED = SwapWrappers()


def swap_tensor_wrapper(
    target: Any, tag: str | None = None, group_swap: bool = False, cpu_pool: Any = None
) -> Any:
    """Register the tensors of ``target`` (a tensor, or a list, tuple or dict of them)
    with the current layer's swap group and return ``target`` unchanged: for tensors a
    layer keeps for its backward outside autograd's saved tensors. When the layer
    returns their storages are copied to the host and emptied in place; the start of
    the layer's backward (the gradient of its output) refills them. Parameters and
    what shares storage with the layer's output stay. Outside a recomp checkpoint,
    ``swap`` or swap wrapper call, nothing happens. ``tag`` (HyperParallel's debug tag)
    names the tensors in the offloader's trace (``recomp._testing.offload_events``:
    ``<group>/<tag>``)."""
    _check_swap_options(group_swap, cpu_pool)
    if tag is not None and not isinstance(tag, str):
        raise TypeError(f"tag must be a str or None, got {tag!r}.")
    scope = current_scope()
    if scope is None or not torch.is_grad_enabled() or is_compiling():
        return target
    for t in _tensors_in(target):
        if not _stays_on_device(t):
            scope.in_place.append((t, tag))
    return target
