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
    op, with its autograd formula (it keeps query, key, value, output and log-sum-exp);
    on CPU tensors its CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``),
    which keeps the same.

    Why: ``scaled_dot_product_attention`` picks its kernel by asking the CUDA device;
    fake CUDA tensors without a driver get the math kernel, which keeps the scores.
    Calling the op itself gives the kernel a GPU run takes. ``aten._scaled_dot_product_
    flash_attention`` is private (underscore); checked on torch 2.14.1 (fake tensors).
    If it changes: AttributeError or a schema error on the first simulated attention.
    Retired by: a public way to choose sdpa's kernel without a device.
    """
    import torch

    if query.device.type == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return op(query, key, value, dropout_p, True, scale=scale)[0]
    op = torch.ops.aten._scaled_dot_product_flash_attention
    return op(query, key, value, dropout_p, True, False, scale=scale)[0]


def flash_attention_with_lse(query: Any, key: Any, value: Any, scale: float | None) -> Any:
    """``(output, logsumexp, state)`` of causal attention of ``query`` against the keys
    and values ending where it ends (``key`` at least as long as ``query``: the causal
    mask aligned to their last positions, as a context-parallel rank's queries see the
    keys up to them), by the FlashAttention kernel of the tensors' device; ``state``
    is what :func:`flash_attention_backward` needs besides the tensors.

    Why: context-parallel attention keeps what the kernel keeps (query, key, value,
    output, log-sum-exp) and runs the kernel's backward itself. On CUDA,
    ``aten._scaled_dot_product_flash_attention`` (its causal mask aligned to the last
    key, as FlashAttention 2 does; ``scaled_dot_product_attention`` refuses a causal
    mask on unequal lengths), on the CPU ``aten._scaled_dot_product_flash_attention_for_cpu``
    with that mask given (its own causal mask is aligned to the first key). Both take
    grouped key-value heads as they are. Both private (underscore); checked on torch 2.14.1.
    If it changes: a schema error on the first context-parallel attention.
    Retired by: a public attention op that returns the log-sum-exp and takes its
    backward.
    """
    import torch

    if query.device.type == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        mask = _last_aligned_causal_mask(query.shape[-2], key.shape[-2], query.dtype, query.device)
        out, lse = op(query, key, value, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse, ()
    op = torch.ops.aten._scaled_dot_product_flash_attention
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = op(
        query, key, value, 0.0, True, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def flash_attention_backward(
    grad: Any, query: Any, key: Any, value: Any, out: Any, lse: Any, state: Any,
    scale: float | None,
) -> tuple[Any, Any, Any]:
    """The gradients of query, key and value of :func:`flash_attention_with_lse`, by the
    kernel's own backward (it reads the output and the log-sum-exp it kept). Private
    ops as there; checked on torch 2.14.1."""
    import torch

    if query.device.type == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        mask = _last_aligned_causal_mask(query.shape[-2], key.shape[-2], query.dtype, query.device)
        return op(grad, query, key, value, out, lse, 0.0, False, attn_mask=mask, scale=scale)
    op = torch.ops.aten._scaled_dot_product_flash_attention_backward
    cum_q, cum_k, max_q, max_k, seed, offset = state
    dq, dk, dv = op(
        grad, query, key, value, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset,
        scale=scale,
    )
    return dq, dk, dv


def _last_aligned_causal_mask(queries: int, keys: int, dtype: Any, device: Any) -> Any:
    """An additive mask: query i sees the keys up to ``i + keys - queries``."""
    import torch

    i = torch.arange(queries, device=device).unsqueeze(1)
    j = torch.arange(keys, device=device).unsqueeze(0)
    mask = torch.zeros(queries, keys, dtype=dtype, device=device)
    return mask.masked_fill(j > i + (keys - queries), float("-inf"))


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


def loss_parallel() -> Any:
    """``torch.distributed.tensor.parallel.loss_parallel()``, or nothing where it is on
    already: a context that leaves it on when it was.

    Why: a simulated model with loss parallelism computes its loss inside the context;
    a real run must also run the backward inside it, around the whole step. The context
    is not re-entrant: leaving an inner one turns the ops off for the outer one (the
    step's backward then fails on mixed tensors and DTensors). Whether it is on is read
    from ``DTensor._op_dispatcher._custom_op_handlers`` (private), where the context
    puts its handlers (``torch.distributed.tensor.parallel.loss.customized_loss_ops``);
    checked on torch 2.14.1.
    If it changes: AttributeError or KeyError, and the context is entered (as before:
    fine unless an outer one is open).
    Retired by: a re-entrant ``loss_parallel``.
    """
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel as context

    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel.loss import customized_loss_ops

        handlers = DTensor._op_dispatcher._custom_op_handlers
        if all(handlers.get(op) is handler for op, handler in customized_loss_ops.items()):
            return contextlib.nullcontext()
    except (AttributeError, ImportError):
        pass
    return context()


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


__all__ = [
    "flash_attention_backward",
    "flash_attention_forward",
    "flash_attention_with_lse",
    "grouped_mm",
    "loss_parallel",
    "set_hf_attention",
]
