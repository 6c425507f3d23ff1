"""Worker side of test_plan_partition.py: a plan with ``full+partition-inputs`` layers
applied by ``apply_plan(..., partition_inputs=group)`` on each gloo rank, against the
same model without checkpoints; what each partitioned checkpoint call kept, for the
parent to compare with the simulated profile's prediction."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recomp.plan import apply_plan
from recomp.torch import _partition

WIDTH, TOKENS = 64, 96  # the layers' input: 96 x 64 float32, 24 KiB


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build(mesh: object = None) -> Model:
    torch.manual_seed(0)
    return Model()


def inputs(mesh: object = None) -> torch.Tensor:
    torch.manual_seed(1)  # the same on every rank: what tensor parallelism replicates
    return torch.randn(TOKENS, WIDTH, requires_grad=True)


def regions(m: nn.Module) -> bool:
    return isinstance(m, nn.Sequential)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    x = inputs()
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]  # type: ignore[union-attr]


def run(rank: int, world: int, plan: dict[str, Any]) -> dict[str, Any]:
    want = _grads(build())
    made: list[_partition.PartitionedInputs] = []
    real = _partition.for_call

    def counted(group: Any) -> _partition.PartitionedInputs:
        made.append(real(group))
        return made[-1]

    _partition.for_call = counted  # each call's hooks, to read their counters
    try:
        model = build()
        apply_plan(model, plan, partition_inputs=dist.group.WORLD)
        got = _grads(model)
    finally:
        _partition.for_call = real
    return {
        "exact": all(torch.equal(a, b) for a, b in zip(want, got)),
        "kept_bytes": [h.kept_bytes for h in made],
        "released_bytes": [h.released_bytes for h in made],
        "gathers": [h.gathers for h in made],
    }
