"""Worker side of test_job_memory_pipeline.py: live saved activations of a real
``torch.distributed.pipelining`` run against the peak ``recomp.plan.job`` reads from the
schedule's action list.

Each rank runs a schedule over stages of small MLP blocks (no checkpointing) under a
saved-tensors hook that counts the bytes autograd holds for backward, once per storage,
from the moment a tensor is saved until autograd releases it; the most held at once
is the measured peak. One stage's forward on one micro-batch under the same hook gives
the bytes per micro-batch and stage, which the schedule walk turns into the predicted
peak of each rank.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from recomp.plan.job import schedule_actions, walk_schedule

DIM, TOKENS, MICRO = 16, 8, 4
BLOCKS_PER_STAGE = 2
SCHEDULES = {
    "1F1B": ("single", pipelining.Schedule1F1B),
    "Interleaved1F1B": ("loop", pipelining.ScheduleInterleaved1F1B),
    "ZBVZeroBubble": ("v", pipelining.ScheduleZBVZeroBubble),
}


class Counter:
    """Bytes held by autograd's saved tensors, once per data (activations only: the
    parameters' storages are left out)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, list[int]] = {}
        self.live = 0
        self.peak = 0
        self.lock = threading.Lock()

    def pack(self, t: torch.Tensor) -> Any:
        # Keyed by where the tensor's data starts: relu's output and the next linear's
        # 2-D view of it are one entry; two micro-batch chunks of one batch are two.
        ptr = t.data_ptr()
        if t.untyped_storage().data_ptr() in self.skip or ptr == 0:
            return t
        # A detached alias: holding ``t`` itself would tie a saved output to its own
        # node in a cycle that outlives a graph freed without a backward. Bytes: the
        # saved tensor's own (a micro-batch chunk is a view of the whole batch).
        return _Held(self, t.detach(), ptr, t.numel() * t.element_size())

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def add(self, ptr: int, nbytes: int) -> None:
        with self.lock:
            entry = self.refs.setdefault(ptr, [0, nbytes])
            entry[0] += 1
            if entry[0] == 1:
                self.live += nbytes
                self.peak = max(self.peak, self.live)

    def drop(self, ptr: int) -> None:
        with self.lock:
            entry = self.refs[ptr]
            entry[0] -= 1
            if entry[0] == 0:
                self.live -= entry[1]
                del self.refs[ptr]

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    def __init__(self, counter: Counter, tensor: torch.Tensor, ptr: int, nbytes: int) -> None:
        self.counter, self.tensor, self.ptr = counter, tensor, ptr
        counter.add(ptr, nbytes)

    def __del__(self) -> None:
        self.counter.drop(self.ptr)


class Block(nn.Module):
    """x + fc2(relu(fc1(x))): saves fc1's input and relu's output (fc2's input). The
    residual add also keeps the stage's output from being a view, which the zero-bubble
    schedules detach in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.mean()  # saves no tensor: the stages' activations are all that is counted


def _stage_indices(style: str, rank: int, pp: int) -> list[int]:
    if style == "single":
        return [rank]
    if style == "loop":
        return [rank, rank + pp]
    return [rank, 2 * pp - 1 - rank]


def run(rank: int, world: int, schedules: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in schedules or list(SCHEDULES):
        style, cls = SCHEDULES[name]
        torch.manual_seed(0)
        num_stages = world if style == "single" else 2 * world
        indices = _stage_indices(style, rank, world)
        modules = {i: nn.Sequential(*[Block() for _ in range(BLOCKS_PER_STAGE)]) for i in indices}
        stages = [
            pipelining.PipelineStage(modules[i], i, num_stages, torch.device("cpu"))
            for i in indices
        ]
        schedule = cls(stages[0] if style == "single" else stages, n_microbatches=MICRO, loss_fn=_loss)
        x = torch.randn(MICRO * 2, TOKENS, DIM)
        target = torch.zeros(MICRO * 2, TOKENS, DIM)
        args = (x,) if 0 in indices else ()
        kwargs = {"target": target} if num_stages - 1 in indices else {}
        schedule.step(*args, **kwargs)  # the first step also infers shapes
        params = [p for m in modules.values() for p in m.parameters()]
        counter = Counter(params)
        for m in modules.values():
            m.zero_grad()
        with counter.hooks():
            schedule.step(*args, **kwargs)
        gc.collect()
        assert counter.live == 0, (counter.live, sorted(counter.refs.values()))
        # Bytes per micro-batch and stage: one stage forward on one micro-batch (the
        # first stage's input needs no gradient, the others' do, as in the pipeline).
        per_stage: dict[int, int] = {}
        for i, m in modules.items():
            one = Counter(params)
            inp = torch.randn(2, TOKENS, DIM, requires_grad=i != 0)
            with one.hooks():
                y = m(inp)
            per_stage[i] = one.live
            del y
        out[name] = {"measured_peak": counter.peak, "per_stage": per_stage}
    dist.barrier()
    return out


def predicted(name: str, world: int, per_stage: dict[int, int]) -> dict[int, int]:
    """Each rank's predicted peak: the schedule walk over the measured bytes per stage
    (no checkpoint: a split backward holds everything until the weight step)."""
    peaks = walk_schedule(
        schedule_actions(name, world, MICRO), {s: (b, b) for s, b in per_stage.items()}
    )
    return {r: p.peak_bytes for r, p in peaks.items()}
