"""Built-in PyTorch models for ``recomp bench``.

``llama``: a Llama-style decoder stack (RMSNorm, multi-head attention through
``scaled_dot_product_attention``, SwiGLU MLP, pre-norm residual blocks). The input
is a batch of hidden states, the loss the mean square of the output: the
benchmark measures the layer stack, not an embedding or a vocabulary head.

``norm_matmul_silu``: the deferred-input scenario (target 2b in ``benchmarks/targets.py``).
Each layer is ``silu(norm(x) @ W)`` with the matmul as its own sub-module, so that a
strategy can exclude it (``exclude-proj``).

A user model (``--model module:factory``) follows the same protocol:

* the factory takes any of the keyword arguments ``layers``, ``hidden``, ``seq``,
  ``batch``, ``heads`` (only those it declares are passed) and returns an ``nn.Module``;
* the module has ``layers``, an iterable of sub-modules: the checkpoint units (or one
  ``nn.ModuleList`` named ``layers`` below it, or, on a Hugging Face model, the modules of
  the classes its ``_no_split_modules`` names: ``recomp.plan.profiler.find_layers``);
* strategy ``exclude-NAME`` excludes the child ``NAME`` of every layer (``attn`` also
  finds ``self_attn`` / ``attention``, ``mlp`` also finds ``feed_forward`` / ``ffn``);
* ``model.example_input(batch, seq, generator)`` returns the input, if defined; a
  Hugging Face ``PreTrainedModel`` gets token ids (``input_ids``, ``labels=input_ids``,
  ``use_cache=False``); otherwise a float tensor ``(batch, seq, hidden)`` is used;
* ``model.loss(output)`` returns the loss, if defined; a Hugging Face model's is its own
  (``output.loss``); otherwise the mean of the squared output.

(``recomp.plan.modelcall.example_input`` and ``loss_function``; ``config.MODEL_PROTOCOL`` is
the same in the commands' ``--help``.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import intermediate_size


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * scale * self.weight


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Heads from the projections' width: under tensor parallelism each rank holds some.
        shape = (b, s, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.mlp_norm = RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """A stack of Llama decoder layers with a final RMSNorm."""

    def __init__(self, layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.layers = nn.ModuleList(
            DecoderLayer(hidden, heads, intermediate_size(hidden)) for _ in range(layers)
        )
        self.norm = RMSNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def llama(layers: int = 4, hidden: int = 256, heads: int = 4) -> Decoder:
    """The built-in model (``--model recomp.cli.torch.models:llama``, the default)."""
    return Decoder(layers, hidden, heads)


class Projection(nn.Module):
    """A bare matmul as a module, so that it can be excluded."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, hidden) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class NormMatmulSilu(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.proj = Projection(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.proj(self.norm(x)))


class NormMatmulSiluStack(nn.Module):
    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.layers = nn.ModuleList(NormMatmulSilu(hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def norm_matmul_silu(layers: int = 4, hidden: int = 256) -> NormMatmulSiluStack:
    """Scenario model: per layer RMSNorm, a matmul (child ``proj``), SiLU."""
    return NormMatmulSiluStack(layers, hidden)


def hf_llama(layers: int = 4, hidden: int = 256, heads: int = 4) -> nn.Module:
    """A Hugging Face ``LlamaForCausalLM`` built from a config (``--model
    recomp.cli.torch.models:hf_llama``; needs transformers): vocabulary 1000, MLP width the
    built-in model's, half as many key-value heads as heads, no weights downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate_size(hidden),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        vocab_size=1000,
    )
    return LlamaForCausalLM(config)
