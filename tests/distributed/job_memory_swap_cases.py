"""Worker side of test_job_memory_pipeline_swap.py: a real ``torch.distributed.pipelining``
run under ``recomp.torch.pipeline_swap`` (host-copy mode, nothing under ``min_bytes``),
measured, against what ``recomp.plan.job`` predicts for the same model.

The model is ``Net``: 8 residual blocks (a layer norm and a two-layer MLP), no
checkpoint, split into the schedule's stages. Each rank measures, in the second step:

- the bytes pipeline swap moved to the host (its counters);
- the device bytes of saved activations at each compute step's start and end (inside
  the swap steps around it): the saves of micro-batches that do not swap, held from
  their save until autograd lets go of them (a saved-tensors hook around the step, as
  in job_memory_cases.py), and of those that swap, each storage the runtime recorded
  while it is on the device (not moved, its copy to the host not yet finished, or
  brought back). Copies finish only when the schedule waits for them (the offloader's
  early polling is turned off): the worst case the job model counts;
- the host bytes in use in pipeline swap's pinned pool, whose blocks are made exact
  here (no power-of-two rounding).

The model input (the batch, whose micro-batches are views) is not an activation in the
profile and is left out here too; the loss saves nothing.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

import recomp.torch as rt
from recomp.torch import _pipeline_swap
from recomp.torch._swap.pool import PinnedMemoryPool

DIM, TOKENS, PER_MB, MICRO, BLOCKS = 16, 8, 2, 8, 8
# name -> (stage layout, schedule class name, min_gap)
SCHEDULES = {
    "GPipe": ("single", "ScheduleGPipe", 4),
    "1F1B": ("single", "Schedule1F1B", 3),
    "Interleaved1F1B": ("loop", "ScheduleInterleaved1F1B", 4),
    "InterleavedZeroBubble": ("loop", "ScheduleInterleavedZeroBubble", 4),
    "ZBVZeroBubble": ("v", "ScheduleZBVZeroBubble", 4),
    "DualPipeV": ("v", "ScheduleDualPipeV", 4),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.mean()  # saves no tensor


class _Counter:
    """Bytes held by the saved tensors autograd keeps outside pipeline swap's groups,
    once per data pointer, from their save until autograd lets go of them."""

    def __init__(self, skip: set[int]) -> None:
        self.skip = skip  # storages that are not activations (parameters, the batch)
        self.refs: dict[int, list[int]] = {}
        self.live = 0
        self.lock = threading.Lock()

    def pack(self, t: torch.Tensor) -> Any:
        ptr = t.data_ptr()
        if t.untyped_storage().data_ptr() in self.skip or ptr == 0:
            return t
        return _Held(self, t.detach(), ptr, t.untyped_storage().nbytes())

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def add(self, ptr: int, nbytes: int) -> None:
        with self.lock:
            entry = self.refs.setdefault(ptr, [0, nbytes])
            entry[0] += 1
            if entry[0] == 1:
                self.live += nbytes

    def drop(self, ptr: int) -> None:
        with self.lock:
            entry = self.refs[ptr]
            entry[0] -= 1
            if entry[0] == 0:
                self.live -= entry[1]
                del self.refs[ptr]


class _Held:
    def __init__(self, counter: _Counter, tensor: torch.Tensor, ptr: int, nbytes: int) -> None:
        self.counter, self.tensor, self.ptr = counter, tensor, ptr
        counter.add(ptr, nbytes)

    def __del__(self) -> None:
        self.counter.drop(self.ptr)


def _on_device(group: Any, skip: set[int]) -> int:
    """The bytes of a swap group's recorded storages on the device now."""
    total = 0
    for ref in group.records:
        rec = ref()
        if rec is None:
            continue
        stored = rec.stored
        if rec.alias is not None:
            if rec.alias.untyped_storage().data_ptr() in skip:
                continue
            total += rec.nbytes
        elif stored is not None and (stored.source is not None or stored.resident is not None):
            total += rec.nbytes
    return total


def _stage_indices(style: str, rank: int, pp: int) -> list[int]:
    if style == "single":
        return [rank]
    if style == "loop":
        return [rank, rank + pp]
    return [rank, 2 * pp - 1 - rank]


def _measure(name: str, rank: int, world: int) -> dict[str, Any]:
    style, class_name, min_gap = SCHEDULES[name]
    num_stages = world if style == "single" else 2 * world
    per_stage = BLOCKS // num_stages
    net = make_net()
    indices = _stage_indices(style, rank, world)
    modules = {i: nn.Sequential(*net.layers[i * per_stage : (i + 1) * per_stage]) for i in indices}
    stages = [
        pipelining.PipelineStage(modules[i], i, num_stages, torch.device("cpu")) for i in indices
    ]
    cls = getattr(pipelining, class_name)
    schedule = cls(
        stages[0] if style == "single" else stages,
        n_microbatches=MICRO,
        loss_fn=lambda out, target: loss_of(out),
    )
    torch.manual_seed(1)
    x = torch.randn(MICRO * PER_MB, TOKENS, DIM)
    args = (x,) if 0 in indices else ()
    kwargs = {"target": x} if num_stages - 1 in indices else {}
    skip = {p.untyped_storage().data_ptr() for m in modules.values() for p in m.parameters()}
    skip.add(x.untyped_storage().data_ptr())

    counter = _Counter(skip)
    groups: list[weakref.ref[Any]] = []
    peak = [0]
    measuring = [False]

    def device_now() -> int:
        alive = [g for g in (ref() for ref in groups) if g is not None]
        return counter.live + sum(_on_device(g, skip) for g in alive)

    def observe(method: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            if measuring[0]:
                peak[0] = max(peak[0], device_now())
            out = method(*a, **k)
            if measuring[0]:
                peak[0] = max(peak[0], device_now())
            return out

        return run

    # Innermost: installed before pipeline swap, which wraps these.
    for stage in stages:
        for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, method, observe(getattr(stage, method)))
    original_init = _pipeline_swap._ChunkGroup.__init__

    def init(group: Any, *a: Any, **k: Any) -> None:
        original_init(group, *a, **k)
        groups.append(weakref.ref(group))

    _pipeline_swap._ChunkGroup.__init__ = init  # type: ignore[method-assign]
    swap = rt.pipeline_swap(schedule, min_gap=min_gap, min_bytes=0)
    swap.pool = PinnedMemoryPool(1 << 30, align_limit=1)  # blocks of the exact size
    swap.offloader.poll = lambda: None  # type: ignore[method-assign]
    host_peak = [0]
    acquire = swap.pool.acquire

    def acquire_counted(size: int) -> torch.Tensor:
        block = acquire(size)
        if measuring[0]:
            host_peak[0] = max(host_peak[0], swap.pool.in_use_bytes)
        return block

    swap.pool.acquire = acquire_counted  # type: ignore[method-assign]
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            schedule.step(*args, **kwargs)  # the first step also infers shapes
            groups.clear()
            measuring[0] = True
            schedule.step(*args, **kwargs)
            measuring[0] = False
    finally:
        _pipeline_swap._ChunkGroup.__init__ = original_init  # type: ignore[method-assign]
    stats = swap.last_step
    swap.remove()
    dist.barrier()
    return {
        "device_peak": peak[0],
        "host_peak": host_peak[0],
        "moved": stats.offloaded_bytes,
        "restored": stats.restored_bytes,
        "swapped_groups": sum(1 for c in stats.chunks.values() if c.swapped),
        "groups": len(stats.chunks),
        "unplanned_steps": stats.unplanned_steps,
        "pool_in_use_after": swap.pool.in_use_bytes,
        "left": counter.live,
    }


def run(rank: int, world: int, schedules: list[str] | None = None) -> dict[str, Any]:
    os.environ["RECOMP_OFFLOAD_HOST_COPY"] = "1"
    out: dict[str, Any] = {"rank": rank}
    for name in schedules or list(SCHEDULES):
        if not hasattr(pipelining, SCHEDULES[name][1]):
            continue
        out[name] = _measure(name, rank, world)
    return out
