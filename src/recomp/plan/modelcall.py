"""How the planner's profile and ``recomp bench`` call a model, walk its inputs, score
its output and count its FLOPs, written once for both.

* the calling protocol: ``model(**x)`` for a dict, ``model(*x)`` for a tuple, else
  ``model(x)``;
* the walk of an input or output: the torch backend's pytree (``recomp._pytree``, with
  PyTorch's registry), so that a named tuple, an ``OrderedDict`` or a registered type is
  rebuilt as itself (``map_tensors``, ``tensors_of``, ``fresh_inputs``);
* the input of a model built by a factory (``example_input``): the model's own
  ``example_input(batch, seq, generator)``; token ids for a Hugging Face model; else a
  float tensor ``(batch, seq, hidden)``;
* the loss (``loss_function``): the model's own ``loss(output)``; else ``default_loss``,
  the loss the output carries (a Hugging Face model computes it from ``labels``) or the
  mean square of the output;
* the FLOP formulas given to ``torch.utils.flop_counter.FlopCounterMode`` in addition to
  PyTorch's own table: its table has the CUDA attention kernels but not the CPU one,
  which would otherwise count zero.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import flop_counter

from ..torch._backend import BACKEND


def call_model(model: Any, x: Any) -> Any:
    """``model(**x)`` for a dict, ``model(*x)`` for a tuple, else ``model(x)``."""
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, tuple):
        return model(*x)
    return model(x)


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The tensors in ``tree`` (an input, an output, a module's arguments), in the order
    of the backend's pytree walk."""
    leaves, _ = BACKEND.flatten(tree)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` rebuilt with ``fn(t)`` in place of each tensor ``t``. Containers come back
    as their own type (a named tuple, an ``OrderedDict``, a dataclass, whatever PyTorch's
    pytree registry knows); what the walk does not look into passes through as it is."""
    leaves, spec = BACKEND.flatten(tree)
    return BACKEND.unflatten(
        [fn(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec
    )


def fresh_inputs(inputs: Any) -> Any:
    """Copies of the input tensors (``requires_grad`` as it was), in containers of the
    same types: the profile's backward then leaves the caller's tensors alone."""
    return map_tensors(lambda t: t.detach().clone().requires_grad_(t.requires_grad), inputs)


def is_hugging_face(model: Any) -> bool:
    """Whether ``model`` is a Hugging Face transformers ``PreTrainedModel`` (by its class,
    without importing transformers)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(model).__mro__
    )


def example_input(
    model: Any, batch: int, seq: int, hidden: int, generator: Any, dtype: Any = None
) -> Any:
    """The input a benchmark or a plan feeds ``model`` (on the CPU):

    * ``model.example_input(batch, seq, generator)``, if the model defines it;
    * a Hugging Face ``PreTrainedModel``: keyword arguments ``input_ids`` (``torch.long``,
      shape ``(batch, seq)``, uniform in ``[0, vocab_size)`` of its text config),
      ``labels=input_ids`` (the model computes its own loss) and ``use_cache=False``
      (training keeps no KV cache) where its ``forward`` takes it;
    * otherwise a float tensor ``(batch, seq, hidden)`` (``model.hidden`` if set), of
      ``dtype``.
    """
    own = getattr(model, "example_input", None)
    if callable(own):
        return own(batch, seq, generator)
    if is_hugging_face(model):
        config = model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = getattr(text, "vocab_size", None)
        if not isinstance(vocab, int) or vocab < 1:
            raise ValueError(
                f"{type(model).__name__}: its config has no vocab_size; define "
                "example_input(batch, seq, generator) on the model to give its input"
            )
        ids = torch.randint(0, vocab, (batch, seq), generator=generator, dtype=torch.long)
        inputs: dict[str, Any] = {"input_ids": ids, "labels": ids}
        params = inspect.signature(model.forward).parameters
        if "use_cache" in params:
            inputs["use_cache"] = False
        return inputs
    hidden = getattr(model, "hidden", hidden)
    return torch.randn(batch, seq, hidden, generator=generator, dtype=dtype)


def default_loss(out: Any) -> Any:
    """The loss of a model's output when no loss function is given.

    * an output that carries a loss (a Hugging Face ``ModelOutput``, any object with a
      ``loss`` attribute, any mapping with a ``"loss"`` key): that loss, which a Hugging
      Face model computes when it is called with ``labels``; an error if it is missing
      or None;
    * a tuple or list: the mean square of its first element;
    * a tensor: its mean square.
    """
    if isinstance(out, Mapping) or hasattr(out, "loss"):
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if loss is None:
            raise ValueError(
                f"the model returned a {type(out).__name__} without a loss, and no loss_fn was "
                "given: call the model with labels (a Hugging Face model then computes its "
                "loss, e.g. inputs={'input_ids': ids, 'labels': ids} with a head that takes "
                "them, such as *ForCausalLM), pass loss_fn= (a function of the model's output "
                "returning a scalar tensor) or define loss(output) on the model"
            )
        return loss
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"the model returned a {type(out).__name__}, of which no loss can be taken: pass "
            "loss_fn= (a function of the model's output returning a scalar tensor) or define "
            "loss(output) on the model"
        )
    return out.float().pow(2).mean()


def loss_function(model: Any) -> Any:
    """The loss a benchmark or a plan uses for ``model``: ``model.loss(output)`` if the
    model defines it, else ``default_loss`` (the output's own loss, or its mean square)."""
    own = getattr(model, "loss", None)
    if callable(own):
        return own
    return default_loss


def _cpu_sdpa_flop(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    key, value = _as_query_heads(query, key), _as_query_heads(query, value)
    return int(flop_counter.sdpa_flop_count(query, key, value))


def _cpu_sdpa_backward_flop(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
) -> int:
    key, value = _as_query_heads(query, key), _as_query_heads(query, value)
    return int(flop_counter.sdpa_backward_flop_count(grad_out, query, key, value))


def _as_query_heads(query: Any, shape: Any) -> Any:
    """A key or value shape with the query's head count (grouped-query attention).

    The kernel broadcasts key/value heads to the query's; PyTorch 2.14's formulas count
    that way, 2.9's reject fewer key/value heads. Broadcasting the shape first gives
    2.14's count on every version.
    """
    if len(query) == 4 and len(shape) == 4 and shape[1] != query[1]:
        return (shape[0], query[1], shape[2], shape[3])
    return shape


def flop_formulas(attention_ops: tuple[Any, Any] | None) -> dict[Any, Any]:
    """``custom_mapping`` for ``FlopCounterMode``: the CPU attention kernels
    ``attention_ops`` (forward, backward), with PyTorch's own attention formulas (causal
    masking is not discounted, as there). Empty where this PyTorch has no such kernels
    (``attention_ops`` None)."""
    if attention_ops is None:
        return {}
    forward, backward = attention_ops
    return {forward: _cpu_sdpa_flop, backward: _cpu_sdpa_backward_flop}
