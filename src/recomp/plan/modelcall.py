"""How the planner's profile and ``recomp bench`` call a model, score its output and
count its FLOPs, written once for both (the benchmark imports it from here).

* the calling protocol: ``model(**x)`` for a dict, ``model(*x)`` for a tuple, else
  ``model(x)``;
* the default loss: the mean square of the output (its first element for a tuple or list);
* the FLOP formulas given to ``torch.utils.flop_counter.FlopCounterMode`` in addition to
  PyTorch's own table: its table has the CUDA attention kernels but not the CPU one,
  which would otherwise count zero.

Importing this module imports no framework: ``cpu_flop_formulas`` imports PyTorch when
called.
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


def cpu_flop_formulas() -> dict[Any, Any]:
    """``custom_mapping`` for ``FlopCounterMode``: the CPU attention kernels, forward and
    backward, with PyTorch's own attention formulas (causal masking is not discounted,
    as there). Empty where this PyTorch has no such kernels."""
    from ..torch._compat import cpu_attention_ops

    ops = cpu_attention_ops()
    if ops is None:
        return {}
    return {ops[0]: _cpu_sdpa_flop, ops[1]: _cpu_sdpa_backward_flop}
