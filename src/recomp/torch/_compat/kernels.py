"""Kernels and settings the simulated published models need (``recomp.plan.models``).

Consumer: ``recomp.plan.models`` only, which builds Hugging Face models at published
sizes for ``recomp.plan.simulate``. Tested by ``tests/torch/compat/test_kernels.py``.
"""

from __future__ import annotations

from typing import Any


def flash_attention_forward(
    query: Any, key: Any, value: Any, dropout_p: float, scale: float | None
) -> Any:
    """Causal attention output ``(batch, heads, seq, head_dim)`` of ATen's FlashAttention
    op, with its autograd formula (it keeps query, key, value, output and log-sum-exp).

    Why: ``scaled_dot_product_attention`` picks its kernel by asking the CUDA device;
    fake CUDA tensors without a driver get the math kernel, which keeps the scores.
    Calling the op itself gives the kernel a GPU run takes. ``aten._scaled_dot_product_
    flash_attention`` is private (underscore); checked on torch 2.14.1 (fake tensors).
    If it changes: AttributeError or a schema error on the first simulated attention.
    Retired by: a public way to choose sdpa's kernel without a device.
    """
    import torch

    op = torch.ops.aten._scaled_dot_product_flash_attention
    return op(query, key, value, dropout_p, True, False, scale=scale)[0]


def grouped_mm(x: Any, w: Any, offsets: Any) -> Any:
    """``x`` (rows sorted by group) times ``w[g]`` per group ending at ``offsets[g]``.

    Why: routed experts as one kernel per projection, whose bytes do not depend on the
    routing. ``torch.nn.functional.grouped_mm`` is public from 2.10 on; before it, the
    private ``torch._grouped_mm``. If it changes: AttributeError on the first expert block.
    Retired by: ``torch.nn.functional.grouped_mm`` on every supported torch.
    """
    import torch

    grouped = getattr(torch.nn.functional, "grouped_mm", None)
    if grouped is not None:
        return grouped(x, w, offs=offsets)
    return torch._grouped_mm(x, w, offs=offsets)


def set_hf_attention(config: Any, name: str) -> None:
    """Choose the attention function of a transformers config by its registered name.

    Why: the simulated models run attention through a function of their own
    (``AttentionInterface.register``), chosen per config. ``config._attn_implementation``
    is the setter transformers' own ``attn_implementation=`` argument goes through;
    checked on transformers 5.24. If it changes: the model falls back to its default
    attention (the math kernel on fake tensors: more bytes, as stated in the profile).
    Retired by: a public setter on the config.
    """
    config._attn_implementation = name


__all__ = ["flash_attention_forward", "grouped_mm", "set_hf_attention"]
