"""Worker side of test_partition_inputs.py: ``checkpoint(..., partition_inputs=group)`` on
each gloo rank, against the same block without checkpointing; what each rank kept and
which collectives ran, per phase, for the parent to assert on."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import recomp.torch as rt
from collective_cache_cases import AllReduceInForward  # a row-linear's reduction
from recomp.torch import _partition
from recomp.torch.collectives import count_collectives


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.inner = nn.Linear(width, 2 * width)
        self.outer = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.inner(self.norm(x))) * scale
        return x + AllReduceInForward.apply(self.outer(h))


def _grads(block: nn.Module, x: torch.Tensor, scale: torch.Tensor, run: Any) -> list[torch.Tensor]:
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    run(block, x, scale).pow(2).sum().backward()
    return [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]


def run(rank: int, world: int) -> dict[str, Any]:
    group = dist.group.WORLD
    results: dict[str, Any] = {}
    for name, shape in (("even", (4, 6, 8)), ("odd", (3, 5, 8))):  # 192 and 120 elements
        torch.manual_seed(0)
        block = Block(8)
        x = torch.randn(*shape)
        scale = torch.tensor(0.5)  # one element: fewer than the ranks, kept whole
        want = _grads(block, x, scale, lambda b, x, s: b(x, s))
        made: list[_partition.PartitionedInputs] = []
        real = _partition.for_call

        def counted(
            group: Any, made: list[Any] = made, real: Any = real
        ) -> _partition.PartitionedInputs:
            made.append(real(group))
            return made[-1]

        _partition.for_call = counted  # the call's hooks, to read their counters
        try:
            with count_collectives() as counts:
                got = _grads(
                    block, x, scale, lambda b, x, s: rt.checkpoint(b, x, s, partition_inputs=group)
                )
        finally:
            _partition.for_call = real
        (hooks,) = made
        results[name] = {
            "exact": all(torch.equal(a, b) for a, b in zip(want, got)),
            "counts": counts.as_dict(),
            "kept_bytes": hooks.kept_bytes,
            "released_bytes": hooks.released_bytes,
            "gathers": hooks.gathers,
            "numel": x.numel(),
        }

    # An excluded region inside: it runs once, its result is kept whole, the input split.
    torch.manual_seed(0)
    block = Block(8)
    x = torch.randn(4, 6, 8)
    scale = torch.tensor(0.5)
    want = _grads(block, x, scale, lambda b, x, s: b(x, s))
    rt.checkpoint_exclude_wrapper(block.inner)
    wrapped = rt.checkpoint_wrapper(block, partition_inputs=group)
    got = _grads(wrapped, x, scale, lambda b, x, s: b(x, s))
    results["excluded"] = {
        "exact": all(torch.equal(a, b) for a, b in zip(want, got)),
        "runs": [block.inner.region_runs, block.inner.region_skips],
    }

    # Options it cannot be combined with: refused before anything runs.
    refused = {}
    calls = []

    def counted(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t.sin()

    t = torch.randn(4, 8, requires_grad=True)
    for name, options in (
        ("swap_inputs", {"swap_inputs": True}),
        ("not_a_group", {}),
    ):
        try:
            rt.checkpoint(counted, t, partition_inputs=group if options else "tp", **options)
            refused[name] = "ran"
        except (TypeError, ValueError) as exc:
            refused[name] = f"{type(exc).__name__}: {exc}"
    results["refused"] = refused
    results["refused_calls"] = len(calls)
    return results
