"""``recomp.torch._compat.kernels``: the kernels and the setting the simulated published
models need. Each test fails when PyTorch or transformers changes what recomp relies on."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from recomp.torch import _compat  # noqa: E402


def test_flash_attention_op_keeps_no_scores_on_fake_cuda():
    """On fake CUDA tensors the op runs, its output has the query's shape, and what
    autograd keeps is O(seq), not the seq x seq scores."""
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    with _compat.fake_tensor_mode(), torch.device("cuda"):
        q = torch.randn(1, 4, 1024, 64, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 4, 1024, 64, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _compat.flash_attention_forward(q, k, k, 0.0, None)
    assert tuple(out.shape) == (1, 4, 1024, 64)
    assert saved and max(saved) <= 4 * 1024 * 64


def test_grouped_mm_groups_rows_by_offsets():
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    w = torch.randn(2, 8, 8, dtype=torch.bfloat16)
    offsets = torch.tensor([2, 6], dtype=torch.int32)
    got = _compat.grouped_mm(x, w, offsets)
    want = torch.cat([x[:2] @ w[0], x[2:] @ w[1]])
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_hf_config_attention_setting():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=2)
    _compat.set_hf_attention(config, "eager")
    assert config._attn_implementation == "eager"


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_flash_attention_with_lse_aligns_the_causal_mask_to_the_last_key_on_cpu(heads, kv_heads):
    """Queries of the last positions against every key up to them, by the CPU kernel:
    the output and gradients of attention with the causal mask aligned to the last key
    (what ``scaled_dot_product_attention`` computes with that mask given)."""
    torch.manual_seed(0)
    q = torch.randn(1, heads, 4, 8, requires_grad=True)
    k = torch.randn(1, kv_heads, 12, 8, requires_grad=True)
    v = torch.randn(1, kv_heads, 12, 8, requires_grad=True)
    out, lse, state = _compat.flash_attention_with_lse(q, k, v, None)
    allowed = torch.arange(12)[None, :] <= torch.arange(4)[:, None] + 8
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, enable_gqa=heads != kv_heads
    )
    torch.testing.assert_close(out, want)
    assert lse.shape == (1, heads, 4)
    grad = torch.randn_like(out)
    dq, dk, dv = _compat.flash_attention_backward(grad, q, k, v, out, lse, state, None)
    want.backward(grad)
    for got, expected in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, expected)


def test_flash_attention_with_lse_on_fake_cuda_keeps_its_state_for_the_backward():
    with _compat.fake_tensor_mode(), torch.device("cuda"):
        q = torch.randn(1, 4, 512, 64, dtype=torch.bfloat16)
        k = torch.randn(1, 2, 1024, 64, dtype=torch.bfloat16)
        out, lse, state = _compat.flash_attention_with_lse(q, k, k, None)
    assert tuple(out.shape) == (1, 4, 512, 64) and tuple(lse.shape) == (1, 4, 512)
    assert len(state) == 6  # sequence offsets, lengths and the random state of the kernel
