"""How the planner's profile and ``recomp bench`` call a model, score its output and
count its FLOPs, written once for both.

* the calling protocol: ``model(**x)`` for a dict, ``model(*x)`` for a tuple, else
  ``model(x)``;
* the default loss: the mean square of the output (its first element for a tuple or list);
* the FLOP formulas given to ``torch.utils.flop_counter.FlopCounterMode`` in addition to
  PyTorch's own table: its table has the CUDA attention kernels but not the CPU one,
  which would otherwise count zero.

Importing this module imports no framework, and it sits below the framework packages:
``flop_formulas`` imports PyTorch when called and takes the attention ops from its
caller (``recomp.torch._compat.cpu_attention_ops()``).
"""

from __future__ import annotations

from typing import Any


def call_model(model: Any, x: Any) -> Any:
    """``model(**x)`` for a dict, ``model(*x)`` for a tuple, else ``model(x)``."""
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, tuple):
        return model(*x)
    return model(x)


def mean_square_loss(out: Any) -> Any:
    """The default loss: mean square of the output (its first element if a tuple)."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.float().pow(2).mean()


def _cpu_sdpa_flop(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    from torch.utils import flop_counter

    return int(flop_counter.sdpa_flop_count(query, key, value))


def _cpu_sdpa_backward_flop(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
) -> int:
    from torch.utils import flop_counter

    return int(flop_counter.sdpa_backward_flop_count(grad_out, query, key, value))


def flop_formulas(attention_ops: tuple[Any, Any] | None) -> dict[Any, Any]:
    """``custom_mapping`` for ``FlopCounterMode``: the CPU attention kernels
    ``attention_ops`` (forward, backward), with PyTorch's own attention formulas (causal
    masking is not discounted, as there). Empty where this PyTorch has no such kernels
    (``attention_ops`` None)."""
    if attention_ops is None:
        return {}
    forward, backward = attention_ops
    return {forward: _cpu_sdpa_flop, backward: _cpu_sdpa_backward_flop}
