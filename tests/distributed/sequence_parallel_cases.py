"""Worker side of test_sequence_parallel.py: DTensor tensor + sequence parallelism.

The plan is torchtitan's for a decoder: ``SequenceParallel`` norms, a
``PrepareModuleInput`` that all-gathers the sequence before attention and
before the MLP, ``ColwiseParallel`` q/k/v/fc1 and ``RowwiseParallel`` o/fc2
whose outputs are reduce-scattered back to sequence shards. Every collective
is issued by DTensor inside the checkpointed block; none is written by hand.

Each variant trains one step from the same weights and data; the report holds
the collectives per phase, the excluded regions' runs and the local gradient
shards compared bit for bit with the parallelized model without checkpoints.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from _dist_common import compare, named_grads, seeded
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import recomp
from recomp.torch import apply_activation_checkpointing
from recomp.torch.collectives import count_collectives

HIDDEN, HEADS, FFN, LAYERS = 16, 4, 32, 2
BATCH, SEQ = 2, 8


class Attention(nn.Module):
    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int = HIDDEN, ffn: int = FFN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn, bias=False)
        self.fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS, ffn: int = FFN) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    def __init__(
        self, layers: int = LAYERS, hidden: int = HIDDEN, heads: int = HEADS, ffn: int = FFN
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


BLOCK_PLAN = {
    "attn_norm": SequenceParallel(),
    "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.o": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    "mlp_norm": SequenceParallel(),
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "mlp.fc1": ColwiseParallel(),
    "mlp.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
}
MODEL_PLAN = {
    # The replicated input becomes sequence shards (a local split, no communication).
    "layers.0": PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False
    ),
    "norm": SequenceParallel(),
    "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
}

# variant -> options of apply_activation_checkpointing (None: no checkpoint)
VARIANTS: dict[str, dict[str, Any] | None] = {
    "reference": None,
    "recomp": {},
    "recomp_attention_excluded": {"exclude_fn": Attention},
    "recomp_full_replay": {"early_stop": False},
    "recomp_keep_nothing": {"exclude_collectives": False},
    "recomp_attention_excluded_keep_nothing": {"exclude_fn": Attention, "exclude_collectives": False},
}


def build(options: dict[str, Any] | None, mesh: Any, **sizes: int) -> nn.Module:
    """The parallelized model (``sizes``: ``layers``, ``hidden``, ``heads``, ``ffn`` of
    ``Model``), checkpointed with ``options`` unless None."""
    torch.manual_seed(0)
    model = Model(**sizes)
    with torch.no_grad():
        g = seeded(0)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    for layer in model.layers:
        parallelize_module(layer, mesh, BLOCK_PLAN)
    parallelize_module(model, mesh, MODEL_PLAN)
    if options is not None:
        apply_activation_checkpointing(model, checkpoint_fn=Block, **options)
    return model


def run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=seeded(1))
    report: dict[str, Any] = {"layers": LAYERS, "variants": {}}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for variant, options in VARIANTS.items():
        model = build(options, mesh)
        # Collectives seen while recomp.is_recomputing() is true, whatever the counter says.
        replaying: list[str] = []
        with count_collectives() as counts:
            out = model(x)
            out.square().mean().backward()
        replaying = [e.op for e in counts.events if e.phase == "replay"]
        grads[variant] = named_grads(model)
        entry: dict[str, Any] = {
            "counts": counts.as_dict(),
            "replay_ops": replaying,
            "loss": float(out.square().mean()),
        }
        if variant != "reference":
            entry["grads_vs_reference"] = compare(grads[variant], grads["reference"])
        entry["attention_runs"] = [
            getattr(layer.attn, "region_runs", None) for layer in model.layers
        ]
        report["variants"][variant] = entry
    report["is_recomputing_outside"] = recomp.is_recomputing()
    return report
