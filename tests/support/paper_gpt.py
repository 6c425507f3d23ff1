"""The GPT layer of Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (MLSys 2023), written as its section 4 counts it, with the tensor
and sequence parallel plans of DTensor.

Layout ``(s, b, h)`` as Megatron's. Attention: LayerNorm, Q/K/V projections, QKᵀ,
softmax, dropout, times V, output projection, dropout; MLP: LayerNorm, ``h -> ffn``, GeLU,
``ffn -> h``, dropout; residual adds. The core attention (QKᵀ to times V) is a module of
its own (``attn.core``), so that a plan can recompute it alone.

``build(mesh, parallel=...)`` returns the model; with a mesh, parallelised:
``"tp"`` (column-parallel Q/K/V and fc1, row-parallel output projection and fc2, whose
outputs are all-reduced), ``"sp"`` (the same, with the LayerNorms and dropouts on
sequence shards: the input of the attention and of the MLP is all-gathered along the
sequence, the row-parallel outputs reduce-scattered back). Under sequence parallelism
each layer takes and returns this rank's sequence shard as a plain tensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DROPOUT = 0.1


class CoreAttention(nn.Module):
    """softmax(QKᵀ/√d) with dropout, times V."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        probs = F.dropout(torch.softmax(scores, dim=-1), DROPOUT, self.training)
        return torch.matmul(probs, v)


class Projection(nn.Module):
    """A linear layer followed by dropout (the output projections)."""

    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(fan_in, fan_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.linear(x), DROPOUT, self.training)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.core = CoreAttention()
        self.proj = Projection(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (s, b, a*d) -> (b, a, s, d)
            return t.view(s, b, -1, self.head_dim).permute(1, 2, 0, 3)

        out = self.core(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        return self.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = Projection(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(hidden, heads, ffn or 4 * hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def parallelize(model: GPT, mesh: Any, parallel: str) -> GPT:
    """Tensor (``"tp"``) or tensor and sequence (``"sp"``) parallelism on ``mesh``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    out = Shard(0) if parallel == "sp" else Replicate()
    plan: dict[str, Any] = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj.linear": RowwiseParallel(output_layouts=out),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2.linear": RowwiseParallel(output_layouts=out),
    }
    if parallel == "sp":
        gather = PrepareModuleInput(
            input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        plan["attn"] = gather
        plan["mlp"] = gather
    elif parallel != "tp":
        raise ValueError(f"parallel is 'tp' or 'sp', got {parallel!r}")
    for layer in model.layers:
        # src_data_rank=None: no broadcast of the initial weights (under a fake process
        # group with fake tensors there is nothing to broadcast).
        parallelize_module(layer, mesh, plan, src_data_rank=None)
    return model


def build(
    mesh: Any = None,
    *,
    layers: int = 1,
    hidden: int = 64,
    heads: int = 4,
    ffn: int | None = None,
    parallel: str = "tp",
) -> GPT:
    model = GPT(layers, hidden, heads, ffn)
    return model if mesh is None else parallelize(model, mesh, parallel)


def inputs(mesh: Any = None, *, seq: int = 32, batch: int = 2, hidden: int = 64,
           parallel: str = "tp", generator: torch.Generator | None = None) -> torch.Tensor:  # fmt: skip
    """This rank's input: the whole ``(s, b, h)`` tensor, or its sequence shard under
    sequence parallelism (rank ``mesh.get_local_rank()`` of ``mesh.size()``)."""
    if mesh is not None and parallel == "sp":
        seq //= mesh.size()
    return torch.randn(seq, batch, hidden, generator=generator, requires_grad=True)
