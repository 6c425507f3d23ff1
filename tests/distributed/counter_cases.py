"""Worker side of test_collective_counter.py: every collective API, counted per phase.

Runs on each rank inside a gloo process group (see dist_harness.launch_ranks)
and returns what ``recomp.torch.collectives.count_collectives`` saw, case by
case, for the parent to assert on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import recomp.torch as rt
from recomp.torch.collectives import count_collectives


class _AllReduceInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _AllReduceInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def run(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    x = torch.arange(4.0) + rank

    # Classic c10d API, one call of each kind, all in the forward phase.
    with count_collectives() as c:
        t = x.clone()
        dist.all_reduce(t)
        out = torch.empty(4 * world)
        dist.all_gather_into_tensor(out, x)
        dist.all_gather([torch.empty(4) for _ in range(world)], x)
        rs = torch.empty(4)
        dist.reduce_scatter_tensor(rs, torch.ones(4 * world))
        a2a = torch.empty(4)
        dist.all_to_all_single(a2a, x)
        dist.broadcast(t, src=0)
        dist.barrier()
        work = dist.all_reduce(t, async_op=True)
        work.wait()
    results["c10d"] = {"counts": c.as_dict(), "ops": [e.op for e in c.events]}

    # Functional collectives (the path DTensor and compiled code take).
    with count_collectives() as c:
        funcol.all_reduce(x, "sum", dist.group.WORLD).wait()
        funcol.all_gather_tensor(x, 0, dist.group.WORLD).wait()
        funcol.reduce_scatter_tensor(torch.ones(4 * world), "sum", 0, dist.group.WORLD).wait()
        funcol.all_to_all_single(x, None, None, dist.group.WORLD).wait()
    results["functional"] = {"counts": c.as_dict(), "ops": [e.op for e in c.events]}

    # DTensor redistribution inside DTensor's own dispatch.
    mesh = init_device_mesh("cpu", (world,))
    with count_collectives() as c:
        d = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])
        d.redistribute(mesh, [Replicate()]).to_local()  # all-gather
        p = DTensor.from_local(torch.ones(2, 4), mesh, [Partial()])
        p.redistribute(mesh, [Replicate()]).to_local()  # all-reduce
        s = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])
        s.redistribute(mesh, [Shard(1)]).to_local()  # an all-gather on this version
    results["dtensor_redistribute"] = {"counts": c.as_dict(), "ops": [e.op for e in c.events]}
    with count_collectives() as c:
        # Sharding propagation inside DTensor's dispatch: a [4, 2] matrix
        # sharded by rows times a [2, 3] one sharded by rows needs the second
        # gathered first; the collective is issued by DTensor's op dispatch.
        a = DTensor.from_local(torch.ones(2, 2), mesh, [Shard(0)])
        b = DTensor.from_local(torch.ones(1, 3), mesh, [Shard(0)])
        (a @ b).to_local()
    results["dtensor_dispatch"] = {"counts": c.as_dict(), "ops": [e.op for e in c.events]}

    # Phases: forward, backward (an autograd Function's backward), replay (a
    # recomp checkpoint replaying a collective that is not excluded).
    w = torch.ones(4, requires_grad=True)
    xg = x.clone().requires_grad_()

    def body(v: torch.Tensor) -> torch.Tensor:
        return torch.tanh(_AllReduceInForward.apply(_AllReduceInBackward.apply(v) * w))

    with count_collectives() as c:
        rt.checkpoint(body, xg, exclude_collectives=False).sum().backward()
    results["phases"] = c.as_dict()
    results["phases_str"] = str(c)
    # By default the replay reads the all-reduce's result the forward kept.
    with count_collectives() as c:
        rt.checkpoint(body, xg).sum().backward()
    results["phases_kept"] = c.as_dict()

    excluded = rt.checkpoint_exclude_wrapper(_AllReduceInForward.apply)

    def body_excluded(v: torch.Tensor) -> torch.Tensor:
        return torch.tanh(excluded(_AllReduceInBackward.apply(v) * w))

    with count_collectives() as c:
        rt.checkpoint(body_excluded, xg).sum().backward()
    results["phases_excluded"] = c.as_dict()

    # Plain torch.utils.checkpoint replays too, but recomp.is_recomputing() is
    # false there: its replay counts as backward unless a predicate says so.
    replaying = []

    def body_flagged(v: torch.Tensor) -> torch.Tensor:
        replaying.append(torch._C._current_graph_task_id() != -1)
        return body(v)

    with count_collectives() as c:
        torch.utils.checkpoint.checkpoint(body_flagged, xg, use_reentrant=False).sum().backward()
    results["torch_checkpoint_default"] = c.as_dict()

    class Flag:
        on = False

    def flagged(v: torch.Tensor) -> torch.Tensor:
        Flag.on = torch._C._current_graph_task_id() != -1
        try:
            return body(v)
        finally:
            Flag.on = False

    with count_collectives(is_replaying=lambda: Flag.on) as c:
        torch.utils.checkpoint.checkpoint(flagged, xg, use_reentrant=False).sum().backward()
    results["torch_checkpoint_predicate"] = c.as_dict()

    # Nested blocks: both see the call, each once.
    with count_collectives() as outer:
        with count_collectives() as inner:
            dist.all_reduce(x.clone())
        dist.all_reduce(x.clone())
    results["nested"] = {"outer": outer.total(), "inner": inner.total()}

    # Nothing is counted outside a block.
    with count_collectives() as c:
        pass
    dist.all_reduce(x.clone())
    results["outside"] = c.total()
    dist.barrier()
    return results
