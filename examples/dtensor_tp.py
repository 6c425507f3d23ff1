"""DTensor tensor parallelism (``parallelize_module``) with recomp exclusions.

    torchrun --nproc_per_node 2 examples/dtensor_tp.py

Each layer's attention projections and MLP are split with PyTorch's own
tensor-parallel styles: ``ColwiseParallel`` for q, k, v and fc1,
``RowwiseParallel`` for the output projection and fc2. A ``RowwiseParallel``
linear produces partial sums, and its output hook turns them into a
replicated tensor with an all-reduce. Excluding those two linears keeps the
all-reduce and the small matmul before it out of the replay; without the
exclusion the replay recomputes the matmul and reads the all-reduced output
that the checkpoint kept (unless ``exclude_collectives=False``).

Order: ``parallelize_module`` first, then recomp. recomp wraps in place and
changes no path, so the plan names the same sub-modules (``"attn.o"``) either
way; the output hook ``parallelize_module`` registers on a linear runs inside
that linear's excluded region::

    for layer in model.layers:
        parallelize_module(layer, mesh, PLAN)
    apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, Block),
        exclude_fn=lambda m: isinstance(m, OutProj),    # the RowwiseParallel linears
    )

The script trains one step in several variants from the same weights and
data, prints the collectives per phase, and checks that the local gradient
shards are equal bit for bit with and without recomp and that the parallel
model matches the dense one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from recomp.torch import apply_activation_checkpointing
from recomp.torch.collectives import count_collectives

HIDDEN = 32
HEADS = 4
FFN = 64
LAYERS = 2
BATCH, SEQ = 2, 8
DENSE_RTOL = 1e-5  # sharded vs dense float32 sums; rounding is ~1e-7


class OutProj(nn.Linear):
    """A linear whose input features are split: the ``RowwiseParallel`` ones."""


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(HIDDEN, HIDDEN)
        self.k = nn.Linear(HIDDEN, HIDDEN)
        self.v = nn.Linear(HIDDEN, HIDDEN)
        self.o = OutProj(HIDDEN, HIDDEN)
        self.head_dim = HIDDEN // HEADS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Colwise outputs are local shards: this rank's heads only.
        q, k, v = (
            proj(x).reshape(b, s, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = OutProj(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


PLAN = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.o": RowwiseParallel(),
    "mlp.fc1": ColwiseParallel(),
    "mlp.fc2": RowwiseParallel(),
}

# variant -> (exclude the RowwiseParallel linears?, checkpoint options)
VARIANTS: dict[str, tuple[bool, dict[str, Any]]] = {
    "recomp": (True, {}),
    "recomp_no_exclusion": (False, {"exclude_collectives": False}),
    "recomp_full_replay": (True, {"early_stop": False}),
    "recomp_full_replay_no_exclusion": (
        False,
        {"early_stop": False, "exclude_collectives": False},
    ),
    # No region excluded: the replay reads the all-reduced outputs the forward kept.
    "recomp_collectives_kept": (False, {}),
}


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


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor (an all-gather), or the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def build(variant: str, init: dict[str, torch.Tensor], mesh: Any) -> nn.Module:
    model = Model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init[name])
    if variant == "dense":
        return model
    for layer in model.layers:
        parallelize_module(layer, mesh, PLAN)
    if variant != "reference":
        exclude, options = VARIANTS[variant]
        apply_activation_checkpointing(
            model,
            checkpoint_fn=lambda m: isinstance(m, Block),
            exclude_fn=(lambda m: isinstance(m, OutProj)) if exclude else None,
            **options,
        )
    return model


def run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    init = initial_parameters()
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=seeded(1))  # replicated input
    report: dict[str, Any] = {"title": "DTensor tensor parallel", "rank": rank, "variants": {}}
    outputs, grads = {}, {}
    full_reference_grads: dict[str, torch.Tensor] = {}
    for variant in ("reference", *VARIANTS):
        model = build(variant, init, mesh)
        with count_collectives() as counts:
            out = model(x)
            out.square().mean().backward()
        outputs[variant], grads[variant] = out.detach(), named_grads(model)
        entry: dict[str, Any] = {"counts": counts.as_dict(), "exclusions": exclude_stats(model)}
        if variant == "reference":
            full_reference_grads = {n: full(p.grad) for n, p in model.named_parameters()}
        else:
            entry["grads_vs_reference"] = compare(grads[variant], grads["reference"])
            entry["output_equal"] = bool(torch.equal(outputs[variant], outputs["reference"]))
        report["variants"][variant] = entry

    dense = build("dense", init, mesh)
    dense_out = dense(x)
    dense_out.square().mean().backward()
    report["dense"] = {
        "output_max_rel_diff": max_rel_diff(outputs["reference"], dense_out.detach()),
        "grad_max_rel_diff": max_scaled_diff(
            (full_reference_grads[n], p.grad) for n, p in dense.named_parameters()
        ),
        "rtol": DENSE_RTOL,
    }

    report["layers"] = LAYERS
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
