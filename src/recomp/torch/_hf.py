"""What a recomp checkpoint does differently around a Hugging Face transformers layer.

Two things, both only for a layer (a ``transformers`` ``GradientCheckpointingLayer``)
called in training with gradients on, which is when a replay will follow:

* HF's own gradient checkpointing (``model.gradient_checkpointing_enable()``,
  ``Trainer(gradient_checkpointing=True)``) on the same layer puts a second,
  plain PyTorch checkpoint inside recomp's. That one replays the excluded
  regions, and its replay then saves other tensors than its forward did
  (PyTorch's ``CheckpointError: Recomputed values ... have different metadata``).
  recomp raises one error naming both switches instead.
* A KV cache written by recomputed code is written again by the replay, during
  backward (a cache twice as long, or a size mismatch with a prefix cache).
  As HF's checkpointing does, recomp then turns the cache off for the layer
  (``use_cache=False``, ``cache=None``) with a warning; a cache that already
  holds entries (a prefix) cannot be dropped without changing the result, so
  that is an error. Where every module that writes the cache (HF attention
  modules, which carry ``layer_idx``) is an excluded region, the write runs
  once and the cache is kept as it is.

``transformers`` is never imported here: if the caller's model is an HF model,
its module is loaded already.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any

from torch import nn

from .. import _kv_cache
from .._engine import ExcludedRegion
from .._wrapping import CHECKPOINT_KWARGS, FirstLooks
from . import _compat
from ._foreign import refuse_double_checkpoint

__all__ = ["adapt_hf_layer_call", "guard_model_cache"]

# Keyword arguments under which HF layers receive a KV cache (names differ per model).


def adapt_hf_layer_call(function: Any, kwargs: dict[str, Any]) -> None:
    """Check and adjust, in place, the keyword arguments of a checkpointed HF layer call."""
    layer = _hf_layer(function)
    if layer is None or not layer.training:
        return
    import torch

    if not torch.is_grad_enabled():
        return
    if getattr(layer, "gradient_checkpointing", False):
        refuse_double_checkpoint(
            f"{type(layer).__name__} is checkpointed twice: by recomp and by Hugging Face's "
            "activation checkpointing (model.activation_checkpointing_enable() or its older name "
            "gradient_checkpointing_enable(), which Trainer calls for "
            "TrainingArguments(activation_checkpointing=True) or gradient_checkpointing=True). "
            "HF's plain PyTorch checkpoint inside recomp's replays the excluded regions and fails "
            "in backward. recomp already checkpoints this layer: turn HF's off "
            "(model.activation_checkpointing_disable(), and leave activation_checkpointing and "
            "gradient_checkpointing False in TrainingArguments)."
        )
    _turn_off_rewritten_cache(layer, kwargs)


def _hf_layer(function: Any) -> nn.Module | None:
    """The HF ``GradientCheckpointingLayer`` that ``function`` is (or is a method of), if any."""
    modeling_layers = sys.modules.get("transformers.modeling_layers")
    layer_type = getattr(modeling_layers, "GradientCheckpointingLayer", None)
    if layer_type is None:
        return None
    # A module, a bound method of one (its forward), or a partial of an unbound forward with
    # the module first; never Module.__getattr__ (slow).
    candidate: Any
    if isinstance(function, nn.Module):
        candidate = function
    elif isinstance(function, functools.partial):
        candidate = function.args[0] if function.args else None
    else:
        candidate = getattr(function, "__self__", None)
    return candidate if isinstance(candidate, layer_type) else None


def _turn_off_rewritten_cache(layer: nn.Module, kwargs: dict[str, Any]) -> None:
    # Only a layer whose replay writes a cache again: an encoder layer (no module with a
    # layer_idx; HF passes it config.use_cache all the same) or one whose cache writers
    # are all excluded is left as it is, without a warning.
    if not _kv_cache.uses_cache(kwargs) or not _kv_cache.rewritten(
        layer, lambda m: m.children(), _is_excluded_region
    ):
        return
    # HF layers that may keep a cache through a checkpoint say so themselves.
    _kv_cache.turn_off(layer, kwargs, drop_caches=not _compat.hf_layer_keeps_cache(layer))


def _is_excluded_region(module: nn.Module) -> bool:
    return isinstance(vars(module).get("_recomp_region"), ExcludedRegion)


def guard_model_cache(model: nn.Module) -> None:
    """Turn ``use_cache`` off at the HF model itself, in training, where its checkpointed
    layers would have their cache turned off: the model then returns no cache, as with
    HF's own checkpointing, rather than the empty cache it made before its layers were
    told not to write it. Registered on each HF ``PreTrainedModel`` in ``model`` (itself
    included) that holds such layers; inert once they are unwrapped."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    model_type = getattr(modeling_utils, "PreTrainedModel", None)
    if model_type is None:
        return
    for module in model.modules():
        if not isinstance(module, model_type):
            continue
        layers = [m for m in module.modules() if _is_checkpointed_hf_layer(m)]
        if layers and not _guarded(module):
            module.register_forward_pre_hook(_CacheOffInTraining(layers), with_kwargs=True)


# HF models that already have the hook (applying recomp twice registers it once).
_GUARDED = FirstLooks()


def _guarded(module: nn.Module) -> bool:
    return not _GUARDED.first(module)


def _is_checkpointed_hf_layer(module: nn.Module) -> bool:
    return CHECKPOINT_KWARGS in vars(module) and _hf_layer(module) is not None


class _CacheOffInTraining:
    """Forward pre-hook of an HF model: ``use_cache=False`` in training with gradients on
    when a layer recomp checkpoints would otherwise have its cache turned off."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers

    def __call__(self, model: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        import torch

        if not model.training or not torch.is_grad_enabled():
            return None
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(getattr(model, "config", None), "use_cache", False)
        if not use_cache or not any(self._rewrites_cache(layer) for layer in self.layers):
            return None
        kwargs["use_cache"] = False
        warnings.warn(
            f"The KV cache is turned off (use_cache=False) for {type(model).__name__} in "
            f"training: recomp checkpoints its {type(self.layers[0]).__name__} layers, and their "
            "recomputed forward would write the cache a second time during backward. Hugging "
            "Face's own checkpointing does the same: the model returns no cache. Pass "
            "use_cache=False in training to silence this, or exclude the attention modules "
            "(exclude_fn) so that the cache is written once and kept.",
            UserWarning,
            stacklevel=3,
        )
        return args, kwargs

    @staticmethod
    def _rewrites_cache(layer: nn.Module) -> bool:
        if CHECKPOINT_KWARGS not in vars(layer) or _compat.hf_layer_keeps_cache(layer):
            return False
        return _kv_cache.rewritten(layer, lambda m: m.children(), _is_excluded_region)
