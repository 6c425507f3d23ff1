"""Megatron-style tensor parallelism with recomp: the all-reduce is never replayed.

    torchrun --nproc_per_node 2 examples/tp.py

Each transformer layer has a column-parallel then row-parallel attention
(fused QKV projection split by heads, output projection split by input
features) and a column-parallel then row-parallel MLP. Two custom autograd
functions carry the communication, as in Megatron-LM:

* ``f`` (:class:`CopyToTensorParallel`) in front of each column-parallel
  linear: identity in the forward, all-reduce of the input gradient in the
  backward;
* ``g`` (:class:`ReduceFromTensorParallel`) after each row-parallel linear:
  all-reduce of the partial outputs in the forward, identity in the backward.

Every layer is a recomp checkpoint and the ``g`` all-reduce is an excluded
region, so the replay during backward recomputes the matmuls, norms and
attention but reuses the all-reduced outputs instead of communicating again.
``f`` needs no exclusion: its forward does not communicate, and a replay only
re-runs forwards, so its backward all-reduce happens once either way.

Without the exclusion, recomp's checkpoint still does not repeat the
all-reduce: it keeps the all-reduced output from the forward and the replay
reads it (it recomputes the row-parallel matmul before it). With
``exclude_collectives=False`` and no exclusion, the default replay
(``early_stop=True``) repeats the attention all-reduce of every layer but stops
before the MLP one, after which nothing is saved for backward;
``early_stop=False`` repeats both.

The script trains one step from the same weights and data without checkpoints
and with recomp, with and without the exclusion, with torch's default early
stop and with ``early_stop=False`` (which replays each layer to its end), and
without the exclusion with collectives kept.
It prints the collectives each variant issues per phase and checks the
gradients: equal bit for bit between the variants, and equal to a dense
single-process model up to float32 rounding.
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
    max_rel_diff,
    max_scaled_diff,
    named_grads,
    seeded,
)
from _tp_checks import tensor_parallel_checks
from torch import nn

from recomp.torch import apply_activation_checkpointing
from recomp.torch.collectives import count_collectives

HIDDEN = 32
HEADS = 4
FFN = 64
LAYERS = 2
BATCH, SEQ = 2, 8
# Sharded and dense float32 sums are added in different orders; 1e-5 of the
# largest magnitude is far above that rounding (~1e-7) and far below any real
# sharding mistake (O(1)).
DENSE_RTOL = 1e-5


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: identity forward; backward all-reduces the input gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: forward all-reduces the partial outputs; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class CopyToTP(nn.Module):
    def __init__(self, parallel: bool) -> None:
        super().__init__()
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return CopyToTensorParallel.apply(x) if self.parallel else x


class ReduceFromTP(nn.Module):
    """The row-parallel all-reduce: the region to keep out of the replay."""

    def __init__(self, parallel: bool) -> None:
        super().__init__()
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ReduceFromTensorParallel.apply(x) if self.parallel else x


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; the input is replicated."""

    def __init__(self, in_features: int, out_local: int, parallel: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_local, in_features))
        self.bias = nn.Parameter(torch.empty(out_local))
        self.copy = CopyToTP(parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.copy(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; partial outputs are summed by an all-reduce."""

    def __init__(self, in_local: int, out_features: int, parallel: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features))
        self.reduce = ReduceFromTP(parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(F.linear(x, self.weight)) + self.bias


class ParallelAttention(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.local_heads = HEADS // tp
        self.head_dim = HIDDEN // HEADS
        local = self.local_heads * self.head_dim
        self.qkv = ColumnParallelLinear(HIDDEN, 3 * local, tp > 1)
        self.out = RowParallelLinear(local, HIDDEN, tp > 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (
            t.reshape(b, s, self.local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


class ParallelMLP(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN // tp, tp > 1)
        self.fc2 = RowParallelLinear(FFN // tp, HIDDEN, tp > 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TPBlock(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attn = ParallelAttention(tp)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.mlp = ParallelMLP(tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TPModel(nn.Module):
    """``tp=1`` is the dense model: same code, full weights, no communication."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TPBlock(tp) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def dense_parameters(seed: int = 0) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights, identical on every rank."""
    g = seeded(seed)
    params = {}
    for name, p in TPModel(tp=1).named_parameters():
        if name.endswith("weight") and p.dim() == 2:
            params[name] = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
        elif ".ln" in name and name.endswith("weight"):
            params[name] = 1 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            params[name] = 0.1 * torch.randn(p.shape, generator=g)
    return params


def shard(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This rank's part of a dense parameter (or of its gradient)."""
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        return torch.cat([part.chunk(tp, dim=0)[rank] for part in full.chunk(3, dim=0)])
    if name.endswith(("mlp.fc1.weight", "mlp.fc1.bias")):
        return full.chunk(tp, dim=0)[rank]
    if name.endswith(("attn.out.weight", "mlp.fc2.weight")):
        return full.chunk(tp, dim=1)[rank]
    return full  # layer norms and row-parallel biases are replicated


# variant -> (exclude the row-parallel all-reduce?, checkpoint options)
VARIANTS: dict[str, tuple[bool, dict[str, Any]]] = {
    "recomp": (True, {}),
    "recomp_no_exclusion": (False, {"exclude_collectives": False}),
    # early_stop=False replays the whole layer, up to its last op.
    "recomp_full_replay": (True, {"early_stop": False}),
    "recomp_full_replay_no_exclusion": (
        False,
        {"early_stop": False, "exclude_collectives": False},
    ),
    # No region excluded: the replay reads the all-reduced outputs the forward kept.
    "recomp_collectives_kept": (False, {}),
}


def build(variant: str, rank: int, tp: int, dense: dict[str, torch.Tensor]) -> nn.Module:
    model = TPModel(tp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard(name, dense[name], rank, tp))
    if variant != "reference":
        exclude, options = VARIANTS[variant]
        apply_activation_checkpointing(
            model,
            checkpoint_fn=lambda m: isinstance(m, TPBlock),
            exclude_fn=(lambda m: isinstance(m, ReduceFromTP)) if exclude else None,
            **options,
        )
    return model


def inputs(seed: int = 1) -> torch.Tensor:
    # Tensor parallelism needs the same activations on every rank.
    return torch.randn(BATCH, SEQ, HIDDEN, generator=seeded(seed))


def train_step(model: nn.Module, x: torch.Tensor) -> tuple[Any, torch.Tensor]:
    with count_collectives() as counts:
        out = model(x)
        out.square().mean().backward()
    return counts, out.detach()


def run(rank: int, world_size: int) -> dict[str, Any]:
    assert HEADS % world_size == 0 and FFN % world_size == 0
    dense = dense_parameters()
    x = inputs()
    report: dict[str, Any] = {
        "title": "Megatron-style tensor parallel",
        "rank": rank,
        "variants": {},
    }

    outputs, grads = {}, {}
    for variant in ("reference", *VARIANTS):
        model = build(variant, rank, world_size, dense)
        counts, outputs[variant] = train_step(model, x)
        grads[variant] = named_grads(model)
        entry: dict[str, Any] = {"counts": counts.as_dict(), "exclusions": exclude_stats(model)}
        if variant != "reference":
            entry["grads_vs_reference"] = compare(grads[variant], grads["reference"])
            entry["output_equal"] = bool(torch.equal(outputs[variant], outputs["reference"]))
        report["variants"][variant] = entry

    # The tensor-parallel reference itself against the dense model on one rank.
    dense_model = build("reference", 0, 1, dense)
    _, dense_out = train_step(dense_model, x)
    dense_grads = named_grads(dense_model)
    grad_diff = max_scaled_diff(
        (grads["reference"][n], shard(n, g, rank, world_size)) for n, g in dense_grads.items()
    )
    report["dense"] = {
        "output_max_rel_diff": max_rel_diff(outputs["reference"], dense_out),
        "grad_max_rel_diff": grad_diff,
        "rtol": DENSE_RTOL,
    }

    # Two row-parallel linears per layer: the attention output projection and
    # MLP fc2. A replay with torch's default early_stop ends at the layer's last
    # saved tensor (fc2's input), before the MLP all-reduce: without the
    # exclusion it replays the attention all-reduce only, one per layer.
    # With early_stop=False it replays both.
    report["layers"] = LAYERS
    report["expected_replay_all_reduces_without_exclusion"] = {
        "recomp_no_exclusion": LAYERS,
        "recomp_full_replay_no_exclusion": 2 * LAYERS,
    }
    report["checks"] = checks = tensor_parallel_checks(
        report,
        layers=LAYERS,
        variants=VARIANTS,
        equal_key="output_equal",
        dense_key="output_max_rel_diff",
    )
    report["ok"] = all(checks.values())
    return report


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
