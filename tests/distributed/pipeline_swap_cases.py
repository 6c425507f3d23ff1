"""Worker side of test_pipeline_swap.py: ``recomp.torch.pipeline_swap`` on the
``torch.distributed.pipelining`` schedules, in the offloader's host-copy mode.

The 8-block toy decoder of pipeline_cases.py (an excluded attention ending in an
all-reduce, dropout on), with one more all-reduce in each block's MLP, outside the
excluded region, that the checkpoint keeps for its replay (``exclude_collectives``),
and a plain linear and GELU at the end of every stage (tensors saved outside
checkpoints). Each schedule runs twice from the same weights and seed: checkpointed
as it is, and with pipeline swap. The parent compares the gradients bit for bit and
reads, per (stage, micro-batch), the bytes moved each way (pipeline swap's counters
and the offloader group's own) against what the stage's forward holds for backward
(recomp's saved-tensor report, a walk of the autograd graph, of the same stage run
alone on one micro-batch, the stage's input and output left out); and which storages
were copied at all, against the stages' inputs and outputs.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

import recomp.torch as rt
from pipeline_cases import (
    BATCH_PER_MICRO,
    BLOCKS,
    DIM,
    MICRO,
    SEQ,
    Block,
    _AllReduceMean,
    _batch,
    _copy,
    _groups,
    _loss,
    _stage_indices,
)
from recomp import _report
from recomp.torch import _compat
from recomp.torch._offload import OffloadGroup
from recomp.torch.collectives import count_collectives
from recomp.torch.report import saved_tensors_report

# name -> (stage layout, schedule class, min_gap)
SCHEDULES = {
    "GPipe": ("single", pipelining.ScheduleGPipe, 4),
    # Two ranks, four micro-batches: no 1F1B gap reaches 4; with 3 some do, some not.
    "1F1B": ("single", pipelining.Schedule1F1B, 3),
    "Interleaved1F1B": ("loop", pipelining.ScheduleInterleaved1F1B, 4),
    "InterleavedZeroBubble": ("loop", pipelining.ScheduleInterleavedZeroBubble, 4),
    "ZBVZeroBubble": ("v", pipelining.ScheduleZBVZeroBubble, 4),
    "DualPipeV": ("v", pipelining.ScheduleDualPipeV, 4),
}


class CollectiveBlock(Block):
    """Block with an all-reduce on the MLP's hidden layer, outside the excluded region:
    recomputed code whose collective the checkpoint keeps (``exclude_collectives``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = x + self.attn(self.norm1(x))
        hidden = _AllReduceMean.apply(torch.relu(self.fc1(self.norm2(h))), self.attn.group)
        return h + self.fc2(self.drop(hidden))


def _stage_module(blocks: list[CollectiveBlock], tail: nn.Module) -> nn.Sequential:
    """Checkpointed copies of ``blocks`` (attention excluded, collectives kept) and a
    copy of the plain ``tail``."""
    wrapped = []
    for block in blocks:
        own = _copy(block)
        rt.checkpoint_exclude_wrapper(own.attn)
        wrapped.append(rt.checkpoint_wrapper(own, exclude_collectives=True))
    return nn.Sequential(*wrapped, _copy(tail))


class _Pipeline:
    def __init__(
        self, name: str, blocks: list[Any], tails: list[Any], pp_group: Any, pp_rank: int
    ) -> None:
        style, schedule_cls, _ = SCHEDULES[name]
        pp_size = dist.get_world_size(pp_group)
        num_stages = pp_size if style == "single" else 2 * pp_size
        per_stage = BLOCKS // num_stages
        self.indices = _stage_indices(style, pp_rank, pp_size)
        self.modules: dict[int, nn.Module] = {}
        self.stages = []
        for i in self.indices:
            module = _stage_module(blocks[i * per_stage : (i + 1) * per_stage], tails[i])
            self.modules[i] = module
            self.stages.append(
                pipelining.PipelineStage(module, i, num_stages, torch.device("cpu"), group=pp_group)
            )
        self.first = 0 in self.indices
        self.last = num_stages - 1 in self.indices
        stages = self.stages[0] if style == "single" else self.stages
        self.schedule = schedule_cls(stages, n_microbatches=MICRO, loss_fn=_loss)
        self.num_stages = num_stages

    def step(self, x: torch.Tensor, target: torch.Tensor) -> None:
        for module in self.modules.values():
            for p in module.parameters():
                p.grad = None
        torch.manual_seed(1234)
        args = (x,) if self.first else ()
        kwargs = {"target": target} if self.last else {}
        self.schedule.step(*args, **kwargs)

    def grads(self) -> dict[int, list[torch.Tensor]]:
        return {i: [p.grad.clone() for p in m.parameters()] for i, m in self.modules.items()}


def _equal(a: dict[int, list[torch.Tensor]], b: dict[int, list[torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(x, y) for i in a for x, y in zip(a[i], b[i], strict=True)
    )


def _held_for_backward(
    blocks: list[Any], tail: nn.Module, first: bool, dropout_seed: int = 0
) -> int:
    """The bytes one micro-batch's forward of this stage holds for backward, but its
    input and output, recomp's random states (host memory, not saved tensors) and the
    Python numbers autograd saves as 0-dim float64 tensors (``x / DIM**0.5``: it saves
    those without calling saved-tensors hooks, so nothing can move them; 8 bytes each):
    the saved-tensor report of the graph, nothing unpacked."""
    module = _stage_module(blocks, tail)
    x = torch.randn(BATCH_PER_MICRO, SEQ, DIM, requires_grad=not first)
    torch.manual_seed(dropout_seed)
    out = module(x)
    report = saved_tensors_report(out, module, inputs=(x, out))
    held = sum(
        row.bytes
        for row in report.rows
        if row.kind not in (_report.RNG, _report.DEFERRED)
        and not (row.kind == _report.OUTSIDE and row.shape == () and row.dtype == "float64")
    )
    del out
    return held


class _Spy:
    """Which storages pipeline swap copied to the host, told apart when copied from the
    stages' inputs and outputs (held alive in ``inputs`` and ``outputs`` from their
    forward to the end of the step, so a storage key there names that storage); and the
    groups the swap's offloader opened."""

    def __init__(self) -> None:
        self.taken = 0
        self.taken_inputs = 0
        self.taken_outputs = 0
        self.inputs: list[tuple[int, Any]] = []
        self.outputs: list[tuple[int, Any]] = []
        self.groups: list[OffloadGroup] = []
        self.original = OffloadGroup.take

        spy = self

        def take(group: OffloadGroup, source: torch.Tensor) -> Any:
            key = _compat.storage_key(source)
            spy.taken += 1
            spy.taken_inputs += key in {_compat.storage_key(t) for _, t in spy.inputs}
            spy.taken_outputs += key in {_compat.storage_key(t) for _, t in spy.outputs}
            return spy.original(group, source)

        OffloadGroup.take = take  # type: ignore[method-assign]

    def close(self) -> None:
        OffloadGroup.take = self.original  # type: ignore[method-assign]


def _stage_tensors(pipe: _Pipeline, inputs: list[Any], outputs: list[Any]) -> list[Any]:
    """Hooks that keep every stage's inputs and outputs of a step in ``inputs`` and
    ``outputs``; returns the handles to remove them."""
    handles = []
    for index, module in pipe.modules.items():
        handles.append(
            module.register_forward_pre_hook(lambda m, a, i=index: inputs.append((i, a[0])))
        )
        handles.append(
            module.register_forward_hook(lambda m, a, o, i=index: outputs.append((i, o)))
        )
    return handles


def _run_schedule(
    name: str, blocks: list[Any], tails: list[Any], x: Any, target: Any, pp_group: Any, pp_rank: int
) -> dict[str, Any]:
    _, _, min_gap = SCHEDULES[name]
    plain = _Pipeline(name, blocks, tails, pp_group, pp_rank)
    plain.step(x, target)  # the first step infers shapes
    plain.step(x, target)
    reference = plain.grads()
    del plain

    pipe = _Pipeline(name, blocks, tails, pp_group, pp_rank)
    schedule_attrs = set(vars(pipe.schedule))
    stage_attrs = [set(vars(stage)) for stage in pipe.stages]
    swap = rt.pipeline_swap(pipe.schedule, min_gap=min_gap, min_bytes=0)
    spy = _Spy()
    swap.offloader.group_opened = spy.groups.append
    try:
        pipe.step(x, target)
        spy.groups.clear()
        spy.taken = spy.taken_inputs = spy.taken_outputs = 0
        hook_handles = _stage_tensors(pipe, spy.inputs, spy.outputs)
        with count_collectives() as counts:
            pipe.step(x, target)
        for h in hook_handles:
            h.remove()
        stats = swap.last_step
        grads = pipe.grads()
        swap.offloader.synchronize()
        seen = {
            "first_inputs": sum(1 for i, _ in spy.inputs if i == 0),
            "last_outputs": sum(1 for i, _ in spy.outputs if i == pipe.num_stages - 1),
        }
        spy.inputs.clear()
        spy.outputs.clear()
        groups = {g.name: (g.offloaded_bytes, g.restored_bytes) for g in spy.groups}
        plan = swap.plan
        swap.remove()
        removed = {
            "schedule_attrs": set(vars(pipe.schedule)) == schedule_attrs,
            "stage_attrs": [set(vars(s)) == a for s, a in zip(pipe.stages, stage_attrs, strict=True)],
        }
        spy.groups.clear()
        pipe.step(x, target)
        removed["groups_opened"] = len(spy.groups)
        removed["bitwise"] = _equal(reference, pipe.grads())
    finally:
        spy.close()
    chunks = {}
    for (stage, mb), c in stats.chunks.items():
        group = groups.get(f"pipeline stage {stage} micro-batch {mb}")
        chunks[f"{stage},{mb}"] = {
            **c.as_dict(),
            "group": list(group) if group is not None else None,
            "gap": plan.chunks[(stage, mb)].gap,
        }
    num_stages = len(tails)
    per_stage = BLOCKS // num_stages
    expected = {
        str(i): _held_for_backward(blocks[i * per_stage : (i + 1) * per_stage], tails[i], i == 0)
        for i in pipe.indices
    }
    return {
        "bitwise": _equal(reference, grads),
        "chunks": chunks,
        "expected": expected,
        "unplanned_steps": stats.unplanned_steps,
        # Both all-reduces of each block ran in the forward only: excluded, and kept.
        "forward_collectives": counts.as_dict()["forward"],
        "replay_collectives": counts.total("replay"),
        "taken": spy.taken,
        "taken_inputs": spy.taken_inputs,
        "taken_outputs": spy.taken_outputs,
        **seen,
        "removed": removed,
        "min_gap": min_gap,
    }


def run(rank: int, world: int, schedules: list[str] | None = None) -> dict[str, Any]:
    os.environ["RECOMP_OFFLOAD_HOST_COPY"] = "1"
    torch.manual_seed(0)
    pp_group, tp_group, pp_rank = _groups(rank, world, 1)
    blocks = [CollectiveBlock(tp_group, dropout=0.1) for _ in range(BLOCKS)]
    x, target = _batch(1)
    out: dict[str, Any] = {"rank": rank, "schedules": {}}
    for name in schedules or list(SCHEDULES):
        style = SCHEDULES[name][0]
        num_stages = world if style == "single" else 2 * world
        torch.manual_seed(1)
        tails = [nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(num_stages)]
        out["schedules"][name] = _run_schedule(name, blocks, tails, x, target, pp_group, pp_rank)
    return out
