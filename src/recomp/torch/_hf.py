"""What a recomp checkpoint does differently around a Hugging Face transformers layer,
and recomp as the checkpoint function of HF's own checkpointing.

Two things a recomp checkpoint does, both only for a layer (a ``transformers``
``GradientCheckpointingLayer``) called in training with gradients on, which is when a
replay will follow:

* HF's own gradient checkpointing (``model.gradient_checkpointing_enable()``,
  ``Trainer(gradient_checkpointing=True)``) on a layer that recomp's wrapper also
  checkpoints puts a second, plain PyTorch checkpoint around or inside recomp's. That
  one replays the excluded regions, and its replay then saves other tensors than its
  forward did (PyTorch's ``CheckpointError: Recomputed values ... have different
  metadata``). recomp raises one error naming both switches and the fix instead. The
  call HF's switch itself makes (recomp's checkpoint as HF's checkpoint function, which
  HF hands the layer's own forward, below the switch) is a single checkpoint and passes.
* A KV cache written by recomputed code is written again by the replay, during
  backward (a cache twice as long, or a size mismatch with a prefix cache).
  As HF's checkpointing does, recomp then turns the cache off for the layer
  (``use_cache=False``, ``cache=None``) with a warning; a cache that already
  holds entries (a prefix) cannot be dropped without changing the result, so
  that is an error. Where every module that writes the cache (HF attention
  modules, which carry ``layer_idx``) is an excluded region, the write runs
  once and the cache is kept as it is.

``HFCheckpointing`` (``hf_activation_checkpointing``) makes recomp's checkpoint the
function HF's switch calls: a forward pre-hook on each layer swaps it in for PyTorch's
whenever HF put PyTorch's there (``Trainer``, TRL and PEFT turn the switch on again),
with the same keyword arguments.

``transformers`` is never imported here: if the caller's model is an HF model,
its module is loaded already.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from .. import _kv_cache
from .._engine import ExcludedRegion
from .._wrapping import CHECKPOINT_KWARGS, FirstLooks
from ..errors import RecompError
from . import _compat
from ._foreign import refuse_double_checkpoint

__all__ = [
    "HFCheckpointFunction",
    "HFCheckpointing",
    "adapt_hf_layer_call",
    "guard_model_cache",
    "hf_layers",
    "hf_switch_modules",
    "recomp_hf_layers",
    "undo_hf_checkpointing",
]


#: The module of HF's ``GradientCheckpointingLayer``: until it is imported, no function is
#: an HF layer call (checked first at every checkpoint call).
LAYERS_MODULE = "transformers.modeling_layers"


def adapt_hf_layer_call(function: Any, kwargs: dict[str, Any]) -> None:
    """Check and adjust, in place, the keyword arguments of a checkpointed HF layer call."""
    layer = _hf_layer(function)
    if layer is None or not layer.training:
        return
    import torch

    if not torch.is_grad_enabled():
        return
    # HF's switch on the layer means a second checkpoint unless this call is the one HF's
    # switch makes (recomp as HF's checkpoint function): that one runs the layer's own
    # forward, below the switch.
    if getattr(layer, "gradient_checkpointing", False) and not _compat.is_hf_checkpoint_call(
        layer, function
    ):
        refuse_double_checkpoint(_double_checkpoint_message(layer))
    _turn_off_rewritten_cache(layer, kwargs)


def _double_checkpoint_message(layer: nn.Module) -> str:
    name = type(layer).__name__
    fix = (
        "Checkpoint it once. Either let recomp be HF's checkpoint function, so that HF's "
        "switch (and Trainer's and TRL's defaults) can stay on: recomp.torch.unwrap(model), "
        "then recomp.torch.hf_activation_checkpointing(model, exclude_fn=...) in place of "
        "apply_activation_checkpointing / checkpoint_wrapper; or turn HF's off "
        "(model.activation_checkpointing_disable(), and leave activation_checkpointing and "
        "gradient_checkpointing False in TrainingArguments, SFTConfig and the other TRL configs)."
    )
    if _is_recomp_function(_compat.hf_checkpoint_function(layer)):
        return (
            f"{name} is checkpointed twice: by recomp (checkpoint_wrapper, "
            "apply_activation_checkpointing or checkpoint of the layer) and by Hugging Face's "
            "activation checkpointing, whose checkpoint function is recomp's too "
            "(hf_activation_checkpointing, or recomp's checkpoint given to HF). " + fix
        )
    return (
        f"{name} is checkpointed twice: by recomp (checkpoint_wrapper, "
        "apply_activation_checkpointing or checkpoint of the layer) and by Hugging Face's "
        "activation checkpointing with PyTorch's checkpoint (model.activation_checkpointing_enable() "
        "or its older name gradient_checkpointing_enable(), which Trainer calls for "
        "TrainingArguments(activation_checkpointing=True) or gradient_checkpointing=True, and "
        "TRL's trainers by default). HF's plain PyTorch checkpoint around or inside recomp's replays the "
        "excluded regions and fails in backward. " + fix
    )


def _is_recomp_function(function: Any) -> bool:
    while isinstance(function, functools.partial):
        function = function.func
    if isinstance(function, HFCheckpointFunction):
        return True
    return str(getattr(function, "__module__", "")).startswith("recomp.")


def _hf_layer(function: Any) -> nn.Module | None:
    """The HF ``GradientCheckpointingLayer`` that ``function`` is (or is a method of), if any."""
    modeling_layers = sys.modules.get(LAYERS_MODULE)
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


# --------------------------------------------------------------------------- recomp as HF's
# checkpoint function (hf_activation_checkpointing)

#: Where a layer keeps what hf_activation_checkpointing installed on it (its HFCheckpointing).
HF_CHECKPOINTING = "_recomp_hf_checkpointing"


def hf_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformers ``GradientCheckpointingLayer`` modules in ``model``, with their paths."""
    modeling_layers = sys.modules.get(LAYERS_MODULE)
    layer_type = getattr(modeling_layers, "GradientCheckpointingLayer", None)
    if layer_type is None:
        return []
    return [(path, m) for path, m in model.named_modules() if isinstance(m, layer_type)]


def hf_switch_modules(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], Any]:
    """The modules of ``model`` whose checkpoint function HF's switch sets, with their
    paths, and the diffusers model whose switch that is (None for transformers): a
    transformers model's layers (each checkpoints its own forward), else the modules of a
    diffusers model, or of one that ``model`` holds (a PEFT ``PeftModel`` around it), that
    checkpoint sub-modules they hand the function (its blocks' resnets and transformer
    blocks); empty for any other model."""
    layers = hf_layers(model)
    if layers:
        return layers, None
    diffusers = _compat.diffusers_model(model)
    if diffusers is None:
        return [], None
    blocks = _compat.diffusers_checkpointing_modules(model, diffusers)
    return blocks, diffusers if blocks else None


class HFCheckpointFunction:
    """What an HF layer finds as its checkpoint function under ``hf_activation_checkpointing``:
    recomp's ``checkpoint`` with the options given to recomp and the keyword arguments HF
    was given (``activation_checkpointing_kwargs``), HF's on a key both name."""

    def __init__(self, owner: HFCheckpointing, replaced: Any, hf_kwargs: dict[str, Any]) -> None:
        self.owner = owner
        self.replaced = replaced  # what HF had put there; unwrap gives it back
        self.hf_kwargs = hf_kwargs
        self.kwargs = {**owner.checkpoint_kwargs, **hf_kwargs}

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        return self.owner.checkpoint(function, *args, **self.kwargs, **kwargs)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"recomp.torch.checkpoint({shown})" if shown else "recomp.torch.checkpoint"


class HFCheckpointing:
    """One ``hf_activation_checkpointing`` call: its options, and the forward pre-hook on
    each of its layers that puts recomp's checkpoint where HF's switch looks for its
    function, whoever turned the switch on (``Trainer``, TRL, PEFT, the user) and with
    whatever PyTorch-checkpoint arguments."""

    def __init__(self, checkpoint: Callable[..., Any], checkpoint_kwargs: dict[str, Any]) -> None:
        self.checkpoint = checkpoint
        self.checkpoint_kwargs = checkpoint_kwargs
        self.last: HFCheckpointFunction | None = None  # shared by the layers HF gave one function

    def install(self, layer: nn.Module) -> None:
        """Take over ``layer`` (again, with these options, if an earlier call did)."""
        earlier = vars(layer).get(HF_CHECKPOINTING)
        if earlier is not None:
            earlier.handle.remove()
        handle = layer.register_forward_pre_hook(self.before_call)
        layer.__dict__[HF_CHECKPOINTING] = _Installed(self, handle)
        self.adopt(layer)

    def before_call(self, layer: nn.Module, args: Any) -> None:
        if getattr(layer, "gradient_checkpointing", False):
            self.adopt(layer)

    def adopt(self, layer: nn.Module) -> None:
        """Replace the checkpoint function HF gave ``layer``, if it is not this call's."""
        current = _compat.hf_checkpoint_function(layer)
        if isinstance(current, HFCheckpointFunction) and current.owner is self:
            return
        if current is None and not getattr(layer, "gradient_checkpointing", False):
            return  # HF's switch was never turned on: nothing to replace yet
        if self.last is None or self.last.replaced is not current:
            self.last = self.function_for(layer, current)
        _compat.set_hf_checkpoint_function(layer, self.last)

    def function_for(self, layer: nn.Module, current: Any) -> HFCheckpointFunction:
        if isinstance(current, HFCheckpointFunction):  # an earlier call's, on this layer
            return HFCheckpointFunction(self, current.replaced, current.hf_kwargs)
        import torch.utils.checkpoint

        base, keywords = current, {}
        if isinstance(current, functools.partial) and not current.args:
            base, keywords = current.func, dict(current.keywords)
        if _compat.is_hf_offload_checkpoint(base):
            # HF's offload=True: the checkpoint's inputs in host memory until the replay
            keywords["swap_inputs"] = True
        elif not (
            base is torch.utils.checkpoint.checkpoint
            or base is self.checkpoint
            or _compat.is_diffusers_default_checkpoint(base)  # PyTorch's, non-reentrant
        ):
            raise RecompError(_foreign_function_message(layer, current))
        if keywords.pop("use_reentrant", None):
            warnings.warn(
                f"Hugging Face's activation checkpointing of {type(layer).__name__} was asked "
                "for use_reentrant=True (in activation_checkpointing_kwargs or "
                "gradient_checkpointing_kwargs; TRL's trainers set it for PEFT under DeepSpeed "
                "ZeRO-3). hf_activation_checkpointing made recomp HF's checkpoint function, and "
                "recomp's checkpoint is non-reentrant only (excluded regions rely on saved-tensor "
                "hooks, which a reentrant checkpoint bypasses): the layers are checkpointed "
                "non-reentrantly. To silence this, leave use_reentrant unset or pass "
                "use_reentrant=False in those keyword arguments.",
                UserWarning,
                stacklevel=2,
            )
        return HFCheckpointFunction(self, current, keywords)


class _Installed:
    """What a layer keeps of the hf_activation_checkpointing call that took it over."""

    def __init__(self, owner: HFCheckpointing, handle: Any) -> None:
        self.owner = owner
        self.handle = handle


def _foreign_function_message(layer: nn.Module, current: Any) -> str:
    return (
        f"hf_activation_checkpointing made recomp the checkpoint function of "
        f"{type(layer).__name__}, but Hugging Face's activation checkpointing was then given "
        f"another one ({current!r}). recomp takes the place of PyTorch's "
        "torch.utils.checkpoint.checkpoint, with its keyword arguments, and of its own; any "
        "other would replay the excluded regions (HF's offload=True is read as recomp's "
        "swap_inputs=True). To use that other function, call recomp.torch.unwrap(model) "
        "first."
    )


def recomp_hf_layers(module: nn.Module) -> list[nn.Module]:
    """The modules below ``module`` (itself included) that hf_activation_checkpointing took over."""
    return [m for m in module.modules() if HF_CHECKPOINTING in vars(m)]


def undo_hf_checkpointing(layers: list[nn.Module]) -> None:
    """Give each layer back the checkpoint function HF had given it before recomp replaced
    it (HF's checkpointing stays as HF's switch says) and remove recomp's hook."""
    for layer in layers:
        installed = layer.__dict__.pop(HF_CHECKPOINTING)
        installed.handle.remove()
        current = _compat.hf_checkpoint_function(layer)
        if isinstance(current, HFCheckpointFunction):
            _compat.set_hf_checkpoint_function(layer, current.replaced)
