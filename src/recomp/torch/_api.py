"""Public PyTorch API: ``checkpoint``, the two module wrappers, and model-wide wrapping."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from .. import _engine, _wrapping
from .._wrapping import WRAPPED, RegionCounters, check_callable, default_name
from . import _compile
from ._backend import BACKEND

_PREFIX = WRAPPED + "."


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Checkpoint ``function(*args, **kwargs)`` with recomp's recompute state installed.

    Built on ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``; its
    options (``preserve_rng_state``, ``determinism_check``, ``early_stop``, ...)
    pass through. ``context_fn`` is composed with recomp's own contexts, which
    are entered first. Excluded regions called inside run once in the forward
    and are skipped when the forward is replayed during backward.
    """
    _engine.check_use_reentrant(use_reentrant, "torch")
    if _compile.is_compiling():
        return _compile.checkpoint(function, args, kwargs, context_fn)
    context = _engine.begin(
        BACKEND, args, kwargs, context_fn, align_rng=kwargs.get("preserve_rng_state", True)
    )
    return torch.utils.checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=context,
        **kwargs,
    )


class _TransparentWrapper(nn.Module):
    """A module around ``_checkpoint_wrapped_module`` that looks like it from outside.

    Unknown attributes fall through to the inner module; ``state_dict`` keys and
    ``named_parameters()`` of the wrapper carry no wrapper prefix, and
    ``load_state_dict`` accepts keys of the unwrapped model.
    """

    def __init__(self, inner: Any) -> None:
        super().__init__()
        setattr(self, WRAPPED, inner)
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = (
                super().__getattr__(WRAPPED)
                if WRAPPED in self._modules
                else self.__dict__.get(WRAPPED)
            )
            if inner is None or name == WRAPPED:
                raise
            return getattr(inner, name)

    def __getitem__(self, key: Any) -> Any:
        return getattr(self, WRAPPED)[key]

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield name.replace(_PREFIX, ""), param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, buf in super().named_buffers(prefix, recurse, remove_duplicate):
            yield name.replace(_PREFIX, ""), buf


def _strip_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    inner = prefix + _PREFIX
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        state_dict[prefix + key[len(inner) :] if key.startswith(inner) else key] = value


def _add_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    for key in [
        k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + _PREFIX)
    ]:
        state_dict[prefix + _PREFIX + key[len(prefix) :]] = state_dict.pop(key)


class CheckpointWrapper(_TransparentWrapper):
    """Runs every call of the wrapped module as a recomp :func:`checkpoint`."""

    def __init__(self, module: nn.Module, **checkpoint_kwargs: Any) -> None:
        check_callable(module, "checkpoint_wrapper", "module")
        _engine.check_use_reentrant(checkpoint_kwargs.pop("use_reentrant", None), "torch")
        super().__init__(module)
        self.checkpoint_kwargs = checkpoint_kwargs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(getattr(self, WRAPPED), *args, **self.checkpoint_kwargs, **kwargs)


class ExcludeWrapper(RegionCounters, _TransparentWrapper):
    """Keeps the wrapped module or function out of the replay of recomp checkpoints.

    Inside a recomp checkpoint, it runs once in the forward, keeps its saved
    tensors and output, and returns the cached output when the forward is
    replayed. Anywhere else it is a plain call. ``region_runs`` and
    ``region_skips`` count executions and skipped replays; ``region_saved_bytes``
    is what the last call keeps for backward.
    """

    def __init__(self, module: Any, *, save_output: bool = True, name: str | None = None) -> None:
        check_callable(module, "checkpoint_exclude_wrapper", "module")
        _engine.check_save_output(save_output)
        super().__init__(module)
        self.save_output = save_output
        self.region = _engine.ExcludedRegion(BACKEND, name or default_name(module), save_output)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if _compile.is_compiling():
            return _compile.excluded_call(self.region.name, getattr(self, WRAPPED), args, kwargs)
        return self.region.call(getattr(self, WRAPPED), args, kwargs)

    def extra_repr(self) -> str:
        return f"region={self.region.name!r}, save_output={self.save_output}"


def checkpoint_wrapper(module: nn.Module, **checkpoint_kwargs: Any) -> CheckpointWrapper:
    """Wrap ``module`` so that every call is a recomp :func:`checkpoint` (options pass through)."""
    return CheckpointWrapper(module, **checkpoint_kwargs)


def checkpoint_exclude_wrapper(
    module: Any, *, save_output: bool = True, name: str | None = None
) -> ExcludeWrapper:
    """Wrap a module or function so that recomp checkpoints never replay it.

    ``save_output=False`` does not cache the output; the replay hands a
    zero-element placeholder on. Use it only when the output goes straight into
    another excluded region (whose saved tensors already hold it): a chain of
    excluded regions then keeps one copy. Any other use raises
    :class:`recomp.errors.OutputNotSavedError` during backward.
    ``name`` appears in error messages (default: the module's class name).
    """
    return ExcludeWrapper(module, save_output=save_output, name=name)


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    checkpoint_fn: Callable[[nn.Module], bool],
    exclude_fn: Callable[[nn.Module], bool] | None = None,
    **checkpoint_kwargs: Any,
) -> nn.Module:
    """Checkpoint every sub-module for which ``checkpoint_fn`` is true, excluding inside them
    every sub-module for which ``exclude_fn`` is true. Wraps in place and returns the model
    (a new wrapper if ``model`` itself is checkpointed)::

        apply_activation_checkpointing(
            model,
            checkpoint_fn=lambda m: isinstance(m, DecoderLayer),
            exclude_fn=lambda m: isinstance(m, Attention),
        )

    Checkpoints are not nested: below a checkpointed module only exclusions are
    applied. Modules already wrapped by recomp are left as they are.
    """
    return _wrapping.apply_activation_checkpointing(
        _MODEL_OPS, model, checkpoint_fn, exclude_fn, checkpoint_kwargs
    )


_MODEL_OPS = _wrapping.ModelOps(
    module_type=nn.Module,
    checkpoint_wrapper=CheckpointWrapper,
    exclude_wrapper=ExcludeWrapper,
    children=lambda m: list(m.named_children()),
    replace_child=setattr,
)
