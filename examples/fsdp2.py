"""FSDP2 (``fully_shard``) with recomp checkpoints and an excluded attention.

    torchrun --nproc_per_node 2 examples/fsdp2.py

Wrapping order: first recomp, then FSDP2, from the inside out::

    apply_activation_checkpointing(                      # 1. checkpoint + exclusions
        model,
        checkpoint_fn=lambda m: isinstance(m, Block),
        exclude_fn=lambda m: isinstance(m, Attention),
    )
    for layer in model.layers:                           # 2. shard each (wrapped) layer
        fully_shard(layer)
    fully_shard(model)                                   # 3. then the root

Both wrap each layer in place by giving it a subclass of its own class
(FSDP2's ``FSDPBlock`` over recomp's, which keeps the name ``Block``). recomp's checkpoint covers the layer's ``forward``
only, so FSDP2's hooks on the layer stay outside it: its all-gather runs in the
forward and, before the layer's backward, in its pre-backward hook, so the
replay finds the parameters already unsharded and issues no collective. The
gradients are reduce-scattered once, after the layer's backward.

The excluded attention keeps its saved tensors and output (they are not
recomputed); the rest of each layer is. The script trains one step of the
FSDP2 model with and without recomp from the same weights and per-rank data
and checks that the sharded gradients are equal bit for bit, that the replay
issues no collective, and that FSDP2 itself matches one process training on
the whole batch. It also runs the other order (``fully_shard`` first, then
recomp), which keeps FSDP2's hooks outside the checkpoint in the same way.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist_common import (
    compare,
    exclude_stats,
    main,
    max_scaled_diff,
    named_grads,
    seeded,
)
from torch import nn
from torch.distributed.fsdp import fully_shard

from recomp.torch import apply_activation_checkpointing
from recomp.torch.collectives import count_collectives

HIDDEN = 32
HEADS = 4
FFN = 64
LAYERS = 2
BATCH, SEQ = 2, 8  # per rank
# FSDP2 averages gradients across ranks in another order than one process
# summing the whole batch; 1e-5 relative is far above float32 rounding.
SINGLE_PROCESS_RTOL = 1e-5


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, HIDDEN))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(HIDDEN, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()  # the loss


def initial_parameters(seed: int = 0) -> dict[str, torch.Tensor]:
    g = seeded(seed)
    params = {}
    for name, p in Model().named_parameters():
        if p.dim() == 2:
            params[name] = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
        elif ".ln" in name and name.endswith("weight"):
            params[name] = 1 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            params[name] = 0.1 * torch.randn(p.shape, generator=g)
    return params


def checkpoint_layers(model: nn.Module) -> None:
    apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, Block),
        exclude_fn=lambda m: isinstance(m, Attention),
    )


def build(variant: str, init: dict[str, torch.Tensor]) -> nn.Module:
    model = Model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init[name])
    if variant == "single_process":
        return model
    if variant == "recomp":  # the documented order: recomp first, then FSDP2
        checkpoint_layers(model)
        for layer in model.layers:
            fully_shard(layer)
    elif variant == "recomp_after_fsdp":  # the other order, for comparison
        for layer in model.layers:
            fully_shard(layer)
        checkpoint_layers(model)
    elif variant == "reference":  # FSDP2 without recomp
        for layer in model.layers:
            fully_shard(layer)
    else:
        raise ValueError(variant)
    fully_shard(model)
    return model


def batch(rank: int) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, HIDDEN, generator=seeded(100 + rank))


def run(rank: int, world_size: int) -> dict[str, Any]:
    init = initial_parameters()
    x = batch(rank)
    report: dict[str, Any] = {"title": "FSDP2 + recomp", "rank": rank, "variants": {}}
    grads, full_grads = {}, {}
    for variant in ("reference", "recomp", "recomp_after_fsdp"):
        model = build(variant, init)
        with count_collectives() as counts:
            model(x).backward()
        grads[variant] = named_grads(model)  # this rank's shards
        full_grads[variant] = {
            n: p.grad.full_tensor() for n, p in model.named_parameters()
        }  # all-gathers, outside the count
        entry: dict[str, Any] = {
            "counts": counts.as_dict(),
            "exclusions": exclude_stats(model),
            "wrapping": [type(m).__name__ for m in model.layers],
            "bases": [[b.__name__ for b in type(m).__bases__] for m in model.layers],
        }
        if variant != "reference":
            entry["grads_vs_reference"] = compare(grads[variant], grads["reference"])
        report["variants"][variant] = entry

    # FSDP2 itself against one process training on the whole batch (the mean
    # of the per-rank losses, which is what FSDP2's averaged gradients give).
    single = build("single_process", init)
    torch.stack([single(batch(r)) for r in range(world_size)]).mean().backward()
    ref_full = full_grads["reference"]
    report["single_process"] = {
        "grad_max_rel_diff": max_scaled_diff(
            (ref_full[n], p.grad) for n, p in single.named_parameters()
        ),
        "rtol": SINGLE_PROCESS_RTOL,
    }

    v = report["variants"]
    report["layers"] = LAYERS
    report["checks"] = checks = {
        "replay issues no collective (recomp, then fully_shard)": v["recomp"]["counts"]["replay"]
        == {},
        "forward/backward collectives unchanged by recomp": all(
            v[k]["counts"]["forward"] == v["reference"]["counts"]["forward"]
            and v[k]["counts"]["backward"] == v["reference"]["counts"]["backward"]
            for k in ("recomp", "recomp_after_fsdp")
        ),
        "excluded attention ran once and was skipped once per layer": all(
            s == {"runs": 1, "skips": 1} for s in v["recomp"]["exclusions"].values()
        )
        and len(v["recomp"]["exclusions"]) == LAYERS,
        "sharded gradients bit-for-bit equal to FSDP2 without recomp": all(
            v[k]["grads_vs_reference"]["bitwise_equal"] for k in ("recomp", "recomp_after_fsdp")
        ),
        "FSDP2 matches a single process on the whole batch": report["single_process"][
            "grad_max_rel_diff"
        ]
        < SINGLE_PROCESS_RTOL,
    }
    report["ok"] = all(checks.values())
    dist.barrier()
    return report


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
