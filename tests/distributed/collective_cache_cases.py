"""Worker side of test_collective_cache.py: collectives written by hand in recomputed code.

Each case runs a small checkpointed function on every rank, counts the
collectives per phase and compares the gradients with the same function run
without a checkpoint; the parent asserts on the report.
"""

from __future__ import annotations

import gc
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import recomp
import recomp.torch as rt
from recomp.torch._compat import TorchDispatchMode
from recomp.torch.collectives import collective_kind, count_collectives


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


def storage_alive(t: torch.Tensor, settle_s: float = 2.0) -> Callable[[], bool]:
    """Whether the storage of ``t`` is still allocated (held by anything, an alias too).

    A storage that is not kept can outlive its last Python reference for a moment: the
    process group's worker thread drops its own reference to a collective's tensors
    after the caller's wait returns. So the answer is "alive" only if the storage is
    still there ``settle_s`` later (seen on PyTorch 2.9 with both cores busy)."""
    ref = weakref.ref(t.untyped_storage())

    def alive() -> bool:
        deadline = time.monotonic() + settle_s
        while True:
            gc.collect()
            if ref() is None:
                return False
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.01)

    return alive


def kept_after_forward(**options: Any) -> dict[str, bool]:
    """Whether an all-reduced tensor that nothing the backward needs reads is held after
    the checkpoint's forward, and after its backward: with early stop no replay reaches
    it, so it is not kept; without early stop the replay reads it until the graph goes."""
    probes: list[Callable[[], bool]] = []

    def fn(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.sin(v * w)
        t = y.detach().clone()
        dist.all_reduce(t)
        probes.append(storage_alive(t))
        return y + t  # an add saves neither operand

    v = torch.randn(64).requires_grad_()
    w = torch.ones(64, requires_grad=True)
    out = rt.checkpoint(fn, v, w, **options)
    after_forward = probes[0]()
    out.sum().backward()
    del out
    return {"after_forward": after_forward, "after_backward": probes[0]()}


class _WatchAllGathers(TorchDispatchMode):
    """Probes on the output storages of the all-gathers issued while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[Callable[[], bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if collective_kind(func) == "all_gather":
            first = args[0]
            while isinstance(first, (list, tuple)):
                first = first[0]
            self.outputs.append(storage_alive(first))
        return out


def fsdp_gathers_held_after_forward(**options: Any) -> list[bool]:
    """For each all-gather that ``fully_shard`` on a module inside the checkpoint issues in
    the forward: whether its output is still held after the forward. FSDP frees it once
    the parameters are resharded; keeping it would hold the unsharded weight."""
    from torch.distributed.fsdp import fully_shard

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(64, 64, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.inner(x))

    torch.manual_seed(0)
    block = Block()
    fully_shard(block.inner)  # not the root: resharded after its forward
    fully_shard(block)
    rt.checkpoint_wrapper(block, **options)
    x = torch.randn(2, 64, requires_grad=True)
    block(x).sum().backward()  # warm-up
    watch = _WatchAllGathers()
    with watch:
        out = block(x)
    held = [alive() for alive in watch.outputs]
    out.sum().backward()
    return held


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
    cases["fsdp_gathers_held"] = fsdp_gathers_held_after_forward()
    cases["fsdp_gathers_held_not_keeping"] = fsdp_gathers_held_after_forward(
        exclude_collectives=False
    )
    cases["replays_per_call"] = replays_per_call(2 + rt_recheck_every(), quiet_calls=1)
    dist.barrier()
    return cases


def rt_recheck_every() -> int:
    from recomp.torch import _collective_cache

    return _collective_cache.RECHECK_EVERY
