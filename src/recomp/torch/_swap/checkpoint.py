"""The swap side of a recomp checkpoint call (:class:`CheckpointSwap`): its HyperParallel
options (``policy_fn``, ``swap_inputs``, ``group_swap``, ``cpu_pool``) checked once, the
selective-checkpoint part ``policy_fn`` adds to the call, the swap scope around the
framework's checkpoint (with ``swap_inputs``, the per-tensor hooks on the checkpoint's own
saved inputs), and the ``context_fn`` of a compiled checkpoint, where swapping is refused.
Also ``get_class_activation_wrapper``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from ..._hooks import CallPart
from ..._op_policy import SelectivePart
from .._backend import BACKEND
from .hooks import async_save_on_cpu
from .pool import _check_swap_options
from .scope import _SCOPES, SwapScope
from .selective import _selective_contexts, create_selective_checkpoint_contexts


def get_class_activation_wrapper() -> type:
    """The class every module wrapped by ``checkpoint_wrapper`` or
    ``checkpoint_exclude_wrapper`` is an instance of (``swap_wrapper`` adds hooks and
    keeps the module's class)."""
    from ..._wrapping import WrapperMixin

    return WrapperMixin


class CheckpointSwap:
    """The swap options of one recomp checkpoint call (``policy_fn``, ``swap_inputs``,
    ``group_swap``, ``cpu_pool``)."""

    __slots__ = ("cpu_pool", "group_swap", "policy_fn", "swap_inputs")

    def __init__(self, policy_fn: Any, swap_inputs: Any, group_swap: Any, cpu_pool: Any) -> None:
        if policy_fn is not None and not callable(policy_fn) and not isinstance(policy_fn, list):
            raise TypeError(f"policy_fn must be a function or a list of ops, got {policy_fn!r}.")
        if not isinstance(swap_inputs, bool):
            raise TypeError(f"swap_inputs must be a bool, got {swap_inputs!r}.")
        _check_swap_options(group_swap, cpu_pool)
        self.policy_fn = policy_fn
        self.swap_inputs = swap_inputs
        self.group_swap = group_swap
        self.cpu_pool = cpu_pool

    def compiled_context_fn(self, context_fn: Any) -> Any:
        """The ``context_fn`` for a compiled checkpoint; swapping there is refused."""
        refused = [
            name
            for name, on in (
                ("swap_inputs", self.swap_inputs),
                ("group_swap", self.group_swap),
                ("cpu_pool", self.cpu_pool is not None),
                ("context_fn with policy_fn", self.policy_fn is not None and context_fn is not None),
            )
            if on
        ]
        if refused:
            raise ValueError(
                f"recomp.torch.checkpoint under torch.compile does not support "
                f"{', '.join(refused)}: swapping runs in eager mode only."
            )
        if self.policy_fn is None:
            return context_fn
        policy_fn = self.policy_fn
        if isinstance(policy_fn, list):
            return functools.partial(create_selective_checkpoint_contexts, policy_fn)
        return functools.partial(_selective_contexts, policy_fn, False, True)

    def part(self) -> CallPart | None:
        if self.policy_fn is None:
            return None  # group_swap without a policy: no selective checkpointing
        return SelectivePart(
            functools.partial(
                create_selective_checkpoint_contexts,
                self.policy_fn,
                group_swap=self.group_swap,
                cpu_pool=self.cpu_pool,
            )
        )

    def scope(
        self, function: Any, context_fn: Any, saved_inputs: Any = None
    ) -> contextlib.AbstractContextManager[Any]:
        """Around the framework's checkpoint of ``function``: yields ``finish(outputs)``.
        ``saved_inputs``: other saved-tensors hooks for the checkpoint's own saved inputs
        (``partition_inputs``: ``recomp.torch._partition``; a user's
        ``saved_tensors_hooks`` pair), which ``swap_inputs`` cannot
        be given with."""
        if saved_inputs is not None:
            if self.swap_inputs:
                raise ValueError(
                    "checkpoint(..., partition_inputs=group) keeps the inputs split over the "
                    "group on the device; it cannot be combined with swap_inputs=True. Pass "
                    "one of them."
                )
            if self.policy_fn is None and context_fn is None:
                return _hooks_only(saved_inputs)
        if self.policy_fn is None and not self.swap_inputs and context_fn is None:
            return contextlib.nullcontext(_identity)
        scope = SwapScope(
            group_swap=self.group_swap,
            cpu_pool=self.cpu_pool,
            layer=BACKEND.modules.module_of(function),
            function=function,
        )
        hooks = saved_inputs
        if self.swap_inputs:
            hooks = async_save_on_cpu(group_swap=self.group_swap, cpu_pool=self.cpu_pool)
        return _SCOPES.layer_call(scope, hooks)


@contextlib.contextmanager
def _hooks_only(hooks: Any) -> Any:
    """A call that swaps nothing, with hooks on its saved inputs: no swap scope."""
    with hooks:
        yield _identity


def _identity(out: Any) -> Any:
    return out
