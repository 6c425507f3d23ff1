"""The built-in Llama-style decoder for MindSpore (PyNative), mirroring ``models.llama``.

Attention is written out (``softmax(q k^T / sqrt(d) + causal mask) v``): MindSpore's
fused attention kernels are not available on CPU.
"""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from ..config import intermediate_size


class RMSNorm(nn.Cell):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = Parameter(Tensor(np.ones(hidden, np.float32)), name="weight")

    def construct(self, x: Tensor) -> Tensor:
        scale = ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + self.eps)
        return x * scale * self.weight


class Attention(nn.Cell):
    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.head_dim = hidden // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.q_proj = nn.Dense(hidden, hidden, has_bias=False)
        self.k_proj = nn.Dense(hidden, hidden, has_bias=False)
        self.v_proj = nn.Dense(hidden, hidden, has_bias=False)
        self.o_proj = nn.Dense(hidden, hidden, has_bias=False)
        mask = np.triu(np.full((seq, seq), -1e9, np.float32), k=1)
        self.mask = Tensor(mask)

    def construct(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        shape = (b, s, self.heads, self.head_dim)
        q = self.q_proj(x).reshape(shape).swapaxes(1, 2)
        k = self.k_proj(x).reshape(shape).swapaxes(1, 2)
        v = self.v_proj(x).reshape(shape).swapaxes(1, 2)
        scores = ops.matmul(q, k.swapaxes(2, 3)) * self.scale + self.mask[:s, :s]
        out = ops.matmul(ops.softmax(scores, -1), v)
        return self.o_proj(out.swapaxes(1, 2).reshape(b, s, h))


class SwiGLU(nn.Cell):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Dense(hidden, intermediate, has_bias=False)
        self.up_proj = nn.Dense(hidden, intermediate, has_bias=False)
        self.down_proj = nn.Dense(intermediate, hidden, has_bias=False)

    def construct(self, x: Tensor) -> Tensor:
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Cell):
    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.attn = Attention(hidden, heads, seq)
        self.mlp_norm = RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, intermediate_size(hidden))

    def construct(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Cell):
    def __init__(self, layers: int, hidden: int, heads: int, seq: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.layers = nn.CellList([DecoderLayer(hidden, heads, seq) for _ in range(layers)])
        self.norm = RMSNorm(hidden)

    def construct(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def llama(layers: int = 4, hidden: int = 256, heads: int = 4, seq: int = 256) -> Decoder:
    ms.set_seed(0)
    return Decoder(layers, hidden, heads, seq)
