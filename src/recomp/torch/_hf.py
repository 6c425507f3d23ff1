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

from .._engine import ExcludedRegion
from ..errors import DoubleCheckpointError, RecompError

__all__ = ["adapt_hf_layer_call"]

# Keyword arguments under which HF layers receive a KV cache (names differ per model).
_CACHE_KWARGS = ("cache", "past_key_values", "layer_past")


def adapt_hf_layer_call(function: Any, kwargs: dict[str, Any]) -> None:
    """Check and adjust, in place, the keyword arguments of a checkpointed HF layer call."""
    layer = _hf_layer(function)
    if layer is None or not layer.training:
        return
    import torch

    if not torch.is_grad_enabled():
        return
    if getattr(layer, "gradient_checkpointing", False):
        raise DoubleCheckpointError(
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
    uses_cache = bool(kwargs.get("use_cache")) or any(
        kwargs.get(name) is not None for name in _CACHE_KWARGS
    )
    if not uses_cache or _cache_written_once(layer):
        return
    changed = []
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
        changed.append("use_cache=False")
    if not getattr(layer, "_can_checkpoint_with_cache", False):
        for name in _CACHE_KWARGS:
            cache = kwargs.get(name)
            if cache is None:
                continue
            if _holds_entries(cache):
                raise RecompError(
                    f"{type(layer).__name__} is checkpointed by recomp and was given a KV cache "
                    f"that already holds entries ({name}=...) in training. Its recomputed forward "
                    "would write the cache a second time during backward, and dropping the cache "
                    "would drop those entries. Exclude the modules that write the cache (the "
                    "attention, via exclude_fn) so that it is written once, or do not checkpoint "
                    "this layer."
                )
            kwargs[name] = None
            changed.append(f"{name}=None")
    if changed:
        warnings.warn(
            f"The KV cache is turned off ({', '.join(changed)}) for {type(layer).__name__}, "
            "which recomp checkpoints in training: the recomputed forward would write the cache "
            "a second time during backward. Hugging Face's own checkpointing does the same. Pass "
            "use_cache=False in training to silence this, or exclude the attention modules "
            "(exclude_fn) so that the cache is written once and kept.",
            UserWarning,
            stacklevel=4,
        )


def _holds_entries(cache: Any) -> bool:
    """Whether a cache passed to a layer already holds entries (a prefix), as far as can be told."""
    seq_length = getattr(cache, "get_seq_length", None)
    if seq_length is None:  # a legacy tuple of tensors, or an unknown cache type
        return True
    try:
        return int(seq_length()) > 0
    except Exception:  # a cache type whose length needs arguments we do not know
        return True


def _cache_written_once(layer: nn.Module) -> bool:
    """True if every module of ``layer`` that indexes the cache runs inside an excluded region.

    HF modules that read and write a KV cache address it by their ``layer_idx``;
    an excluded region is not replayed, so a cache written there is written once.
    """
    writers = excluded = 0

    def visit(module: nn.Module, in_region: bool) -> None:
        nonlocal writers, excluded
        in_region = in_region or _is_excluded_region(module)
        if module is not layer and isinstance(getattr(module, "layer_idx", None), int):
            writers += 1
            excluded += in_region
            return
        for child in module.children():
            visit(child, in_region)

    visit(layer, False)
    return writers > 0 and writers == excluded


def _is_excluded_region(module: nn.Module) -> bool:
    return isinstance(vars(module).get("_recomp_region"), ExcludedRegion)
