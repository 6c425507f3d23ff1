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
from typing import Any

from torch import nn

from .. import _kv_cache
from .._engine import ExcludedRegion
from ..errors import DoubleCheckpointError
from . import _compat

__all__ = ["adapt_hf_layer_call"]

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
        error = DoubleCheckpointError(
            f"{type(layer).__name__} is checkpointed twice: by recomp and by Hugging Face's "
            "activation checkpointing (model.activation_checkpointing_enable() or its older name "
            "gradient_checkpointing_enable(), which Trainer calls for "
            "TrainingArguments(activation_checkpointing=True) or gradient_checkpointing=True). "
            "HF's plain PyTorch checkpoint inside recomp's replays the excluded regions and fails "
            "in backward. recomp already checkpoints this layer: turn HF's off "
            "(model.activation_checkpointing_disable(), and leave activation_checkpointing and "
            "gradient_checkpointing False in TrainingArguments)."
        )
        _compat.close_enclosing_checkpoint(error)  # HF's checkpoint, left open by PyTorch 2.9
        raise error
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
    if not _kv_cache.uses_cache(kwargs) or _kv_cache.written_once(
        layer, lambda m: m.children(), _is_excluded_region
    ):
        return
    # HF layers that may keep a cache through a checkpoint say so themselves.
    _kv_cache.turn_off(
        layer, kwargs, drop_caches=not getattr(layer, "_can_checkpoint_with_cache", False)
    )


def _is_excluded_region(module: nn.Module) -> bool:
    return isinstance(vars(module).get("_recomp_region"), ExcludedRegion)
