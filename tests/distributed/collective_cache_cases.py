"""Worker side of test_collective_cache.py: collectives written by hand in recomputed code.

Each case runs a small checkpointed function on every rank, counts the
collectives per phase and compares the gradients with the same function run
without a checkpoint; the parent asserts on the report.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import recomp
import recomp.torch as rt
from recomp.bench.memory import malloc_in_use
from recomp.torch.collectives import count_collectives


class AllReduceInForward(torch.autograd.Function):
    """Megatron's ``g``: sums the partial outputs of the ranks, identity in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def plain(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(AllReduceInForward.apply(v * w)) * w


def asynchronous(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    t = (v * 2).detach()
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    return torch.sin(t * w)


def functional(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gathered = funcol.all_gather_tensor(v.detach(), 0, dist.group.WORLD).wait()
    summed = funcol.all_reduce(torch.cos(v).detach(), "sum", dist.group.WORLD)
    return torch.sin(gathered * w.repeat(dist.get_world_size())).sum() + (summed * w).square().sum()


def mutated(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    t = (v * w).detach()
    dist.all_reduce(t)
    t.div_(dist.get_world_size())  # changes the collective's result in place
    return torch.sin(t * w)


def excluded_and_not(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    inside = EXCLUDED(v * w)  # an excluded region with its own all-reduce
    return torch.tanh(AllReduceInForward.apply(torch.sin(inside))) * w


EXCLUDED = rt.checkpoint_exclude_wrapper(AllReduceInForward.apply, name="excluded_all_reduce")


def nested(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    inner = rt.checkpoint(plain, v, w)
    return plain(inner, w)


def diverging(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Issues another collective in the replay than in the forward: a program error.
    t = (v * w).detach()
    if recomp.is_recomputing():
        dist.broadcast(t, src=0)
    else:
        dist.all_reduce(t)
    return torch.sin(t * w)


def step(
    fn: Callable[..., torch.Tensor], checkpointed: bool, backwards: int = 1, **options: Any
) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    v = torch.randn(6, generator=g).requires_grad_()
    w = torch.linspace(0.5, 1.5, 6).requires_grad_()
    with count_collectives() as counts, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = rt.checkpoint(fn, v, w, **options) if checkpointed else fn(v, w)
        loss = out.sum()
        for i in range(backwards):
            loss.backward(retain_graph=i + 1 < backwards)
    return {
        "counts": counts.as_dict(),
        "grads": [None if t.grad is None else t.grad.tolist() for t in (v, w)],
        "warnings": sorted(
            {w.category.__name__ for w in caught if w.category.__module__.startswith("recomp")}
        ),
    }


def kept_after_forward(**options: Any) -> float:
    """Bytes held after the checkpoint's forward beyond its output, in units of the
    all-reduced tensor, which nothing the backward needs reads: with early stop no
    replay reaches it, so it is not kept; without early stop the replay reads it."""
    n = 1 << 21  # 8 MiB of float32: allocated outside the heap's small-block arena

    def fn(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.sin(v * w)
        t = y.detach().clone()
        dist.all_reduce(t)
        return y + t  # an add saves neither operand

    v = torch.randn(n).requires_grad_()
    w = torch.ones(n, requires_grad=True)
    rt.checkpoint(fn, v, w, **options).sum().backward()  # warm-up
    readings = []
    for _ in range(3):  # the median of three: the heap reading is of the whole process
        before = malloc_in_use()
        out = rt.checkpoint(fn, v, w, **options)
        readings.append((malloc_in_use() - before - out.untyped_storage().nbytes()) / (4 * n))
        out.sum().backward()
        del out
    return sorted(readings)[1]


def replays_per_call(calls: int, quiet_calls: int) -> list[int]:
    """Collectives replayed by each call of one checkpointed function that communicates
    only from call ``quiet_calls`` on: a function whose recorded forward issued none runs
    its next calls without the record (no cost per operator), then is recorded again."""
    communicate = [False]

    def fn(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return plain(v, w) if communicate[0] else torch.tanh(v * w) * w

    out = []
    for i in range(calls):
        communicate[0] = i >= quiet_calls
        v, w = torch.randn(6, requires_grad=True), torch.ones(6, requires_grad=True)
        with count_collectives() as counts:
            rt.checkpoint(fn, v, w).sum().backward()
        out.append(counts.total("replay"))
    return out


def forward_growth_with_inner_fully_shard(**options: Any) -> float:
    """Heap growth over a checkpointed forward whose block holds a ``fully_shard`` module,
    in units of that module's unsharded weight. FSDP gathers the weight inside the
    checkpoint; keeping that all-gather's result would hold the unsharded weight."""
    from torch.distributed.fsdp import fully_shard

    size = 1024

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(size, size, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.inner(x))

    torch.manual_seed(0)
    block = Block()
    fully_shard(block.inner)  # not the root: resharded after its forward
    fully_shard(block)
    rt.checkpoint_wrapper(block, **options)
    x = torch.randn(2, size, requires_grad=True)
    block(x).sum().backward()  # warm-up
    readings = []
    for _ in range(3):
        before = malloc_in_use()
        out = block(x)
        readings.append((malloc_in_use() - before) / (4 * size * size))
        out.sum().backward()
        del out
    return sorted(readings)[1]


def run(rank: int, world: int) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for name, fn in {
        "plain": plain,
        "asynchronous": asynchronous,
        "functional": functional,
        "mutated": mutated,
        "excluded_and_not": excluded_and_not,
        "nested": nested,
    }.items():
        cases[name] = {
            "reference": step(fn, checkpointed=False),
            "recomp": step(fn, checkpointed=True),
            "recomp_keep_nothing": step(fn, checkpointed=True, exclude_collectives=False),
        }
    cases["retain_graph"] = {
        "reference": step(plain, checkpointed=False, backwards=2),
        "recomp": step(plain, checkpointed=True, backwards=2),
        "recomp_keep_nothing": step(
            plain, checkpointed=True, backwards=2, exclude_collectives=False
        ),
    }
    cases["excluded_runs"] = EXCLUDED.region_runs
    try:
        step(diverging, checkpointed=True)
        cases["diverging"] = None
    except recomp.ReplayMismatchError as exc:
        cases["diverging"] = str(exc)
    cases["kept_with_early_stop"] = kept_after_forward()
    cases["kept_without_early_stop"] = kept_after_forward(early_stop=False)
    cases["kept_without_early_stop_not_keeping"] = kept_after_forward(
        early_stop=False, exclude_collectives=False
    )
    cases["fsdp_inner_growth"] = forward_growth_with_inner_fully_shard()
    cases["fsdp_inner_growth_not_keeping"] = forward_growth_with_inner_fully_shard(
        exclude_collectives=False
    )
    cases["replays_per_call"] = replays_per_call(2 + rt_recheck_every(), quiet_calls=1)
    dist.barrier()
    return cases


def rt_recheck_every() -> int:
    from recomp.torch import _collective_cache

    return _collective_cache.RECHECK_EVERY
