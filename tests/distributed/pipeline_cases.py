"""Worker side of test_pipeline.py: every ``torch.distributed.pipelining`` schedule with
recomp-checkpointed blocks, and what each variant replays.

An 8-block toy decoder is split into stages (2 stages for the single-stage schedules,
4 for the others: looped or V-shaped over the ranks), 4 micro-batches. Each block's
attention is an excluded region ending in a real collective (an all-reduce over the
block's tensor-parallel group: the rank alone on 2 processes, a pair of ranks on 4).
Each variant runs the same schedule from the same weights and seed:

``none``        no checkpointing;
``recomp``      recomp's ``checkpoint_wrapper`` with the attention excluded;
``recomp_off``  the same with kept replays switched off (the engine's test switch);
``torch``       ``torch.utils.checkpoint`` around each block (non-reentrant).

The parent asserts on replays per micro-batch, region runs, collectives in replays
and gradients (bitwise against ``none``, closely against an unpipelined run).
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed import pipelining

import recomp.torch as rt
from recomp import _testing
from recomp.torch import _kept
from recomp.torch.collectives import count_collectives

DIM, SEQ, MICRO, BATCH_PER_MICRO = 16, 4, 4, 2
BLOCKS = 8
SCHEDULES = {
    "GPipe": ("single", pipelining.ScheduleGPipe),
    "1F1B": ("single", pipelining.Schedule1F1B),
    "Interleaved1F1B": ("loop", pipelining.ScheduleInterleaved1F1B),
    "LoopedBFS": ("loop", pipelining.ScheduleLoopedBFS),
    "InterleavedZeroBubble": ("loop", pipelining.ScheduleInterleavedZeroBubble),
    "ZBVZeroBubble": ("v", pipelining.ScheduleZBVZeroBubble),
    "DualPipeV": ("v", pipelining.ScheduleDualPipeV),
}
VARIANTS = ("none", "recomp", "recomp_off", "torch")


class _AllReduceMean(torch.autograd.Function):
    """The tensor-parallel all-reduce of the forward (the backward passes gradients on)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out / dist.get_world_size(group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class Attention(nn.Module):
    def __init__(self, group: Any) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.group = group
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / DIM**0.5, dim=-1)
        return _AllReduceMean.apply(self.proj(att @ v), self.group)


class Block(nn.Module):
    def __init__(self, group: Any, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = Attention(group)
        self.norm2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(dropout)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = x + self.attn(self.norm1(x))
        return h + self.fc2(self.drop(torch.relu(self.fc1(self.norm2(h)))))


class TorchCheckpointed(nn.Module):
    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _copy(module: nn.Module) -> Any:
    """A deep copy that shares the process groups (which cannot be copied)."""
    groups = {id(m.group): m.group for m in module.modules() if isinstance(m, Attention)}
    return copy.deepcopy(module, memo=dict(groups))


def _stage_indices(style: str, pp_rank: int, pp_size: int) -> list[int]:
    if style == "single":
        return [pp_rank]
    if style == "loop":
        return [pp_rank, pp_rank + pp_size]
    return [pp_rank, 2 * pp_size - 1 - pp_rank]


def _wrap(block: Block, variant: str) -> nn.Module:
    if variant == "torch":
        return TorchCheckpointed(block)
    if variant in ("recomp", "recomp_off"):
        rt.checkpoint_exclude_wrapper(block.attn)
        return rt.checkpoint_wrapper(block)
    return block


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(MICRO * BATCH_PER_MICRO, SEQ, DIM, generator=g)
    return x, torch.randn(x.shape, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


class _Pipeline:
    """One schedule's stages on this rank, built from copies of ``blocks``."""

    def __init__(
        self, name: str, variant: str, blocks: list[Block], pp_group: Any, pp_rank: int
    ) -> None:
        style, schedule_cls = SCHEDULES[name]
        pp_size = dist.get_world_size(pp_group)
        num_stages = pp_size if style == "single" else 2 * pp_size
        per_stage = BLOCKS // num_stages
        self.indices = _stage_indices(style, pp_rank, pp_size)
        self.blocks: dict[int, list[Block]] = {}
        self.stages = []
        for i in self.indices:
            own = [_copy(b) for b in blocks[i * per_stage : (i + 1) * per_stage]]
            self.blocks[i] = own
            module = nn.Sequential(*[_wrap(b, variant) for b in own])
            self.stages.append(
                pipelining.PipelineStage(
                    module,
                    i,
                    num_stages,
                    torch.device("cpu"),
                    group=pp_group,
                )
            )
        self.first = 0 in self.indices
        self.last = num_stages - 1 in self.indices
        stages = self.stages[0] if style == "single" else self.stages
        self.schedule = schedule_cls(stages, n_microbatches=MICRO, loss_fn=_loss)
        self.variant = variant
        self.first_stage_of = {i: i == 0 for i in self.indices}

    def step(self, x: torch.Tensor, target: torch.Tensor) -> None:
        args = (x,) if self.first else ()
        kwargs = {"target": target} if self.last else {}
        if self.variant == "recomp_off":
            with _testing.without_kept_replays():
                self.schedule.step(*args, **kwargs)
        else:
            self.schedule.step(*args, **kwargs)

    def zero_grad(self) -> None:
        for own in self.blocks.values():
            for b in own:
                for p in b.parameters():
                    p.grad = None

    def counters(self) -> dict[str, Any]:
        replays = {
            str(i): [(b.calls - MICRO) / MICRO for b in own] for i, own in self.blocks.items()
        }
        runs = {str(i): [b.attn.runs for b in own] for i, own in self.blocks.items()}
        return {"replays": replays, "attn_runs": runs}

    def reset_counters(self) -> None:
        for own in self.blocks.values():
            for b in own:
                b.calls = 0
                b.attn.runs = 0

    def grads(self) -> dict[str, list[torch.Tensor]]:
        return {
            str(i): [p.grad.clone() for b in own for p in b.parameters()]
            for i, own in self.blocks.items()
        }


def _groups(rank: int, world: int, tp: int) -> tuple[Any, Any, int]:
    """(pipeline group, tensor-parallel group, rank in the pipeline) for a pp x tp grid."""
    pp = world // tp
    pp_group = tp_group = None
    for t in range(tp):
        ranks = [p * tp + t for p in range(pp)]
        g = dist.new_group(ranks)
        if rank in ranks:
            pp_group = g
    for p in range(pp):
        ranks = [p * tp + t for t in range(tp)]
        g = dist.new_group(ranks)
        if rank in ranks:
            tp_group = g
    return pp_group, tp_group, rank // tp


def _reference_grads(blocks: list[Block], x: torch.Tensor, target: torch.Tensor) -> list[Any]:
    """Every block's parameter gradients from one unpipelined step (mean of the
    micro-batch losses, as the schedules scale them)."""
    model = _copy(nn.Sequential(*blocks))
    total = sum(
        _loss(model(xm), tm)
        for xm, tm in zip(x.chunk(MICRO), target.chunk(MICRO), strict=True)
    )
    (total / MICRO).backward()
    return [[p.grad for p in b.parameters()] for b in model]


SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Schedules run with the controls too (PyTorch's checkpoint; recomp with kept replays off).
CONTROLS = ("GPipe", "ZBVZeroBubble", "DualPipeV")


def _measured_step(pipe: _Pipeline, x: torch.Tensor, target: torch.Tensor) -> dict[str, Any]:
    """One step after a first one (the first also infers shapes, which runs the stages)."""
    torch.manual_seed(1234)
    pipe.step(x, target)
    pipe.zero_grad()
    pipe.reset_counters()
    torch.manual_seed(1234)
    with count_collectives() as counts:
        pipe.step(x, target)
    return {**pipe.counters(), "replay_collectives": counts.total("replay")}


def run(
    rank: int,
    world: int,
    tp: int = 1,
    schedules: list[str] | None = None,
    steps: int = 100,
    steady: str = "recomp",
    controls: tuple[str, ...] = CONTROLS,
    dropout: bool = True,
) -> dict[str, Any]:
    torch.manual_seed(0)
    pp_group, tp_group, pp_rank = _groups(rank, world, tp)
    names = list(SCHEDULES) if schedules is None else schedules
    plain = [Block(tp_group, dropout=0.0) for _ in range(BLOCKS)]
    x, target = _batch(1)
    reference = _reference_grads(plain, x, target)
    out: dict[str, Any] = {"rank": rank, "schedules": {}}
    for name in names:
        variants = tuple(v for v in VARIANTS if v in ("none", "recomp") or name in controls)
        if name not in SPLIT_BACKWARD:  # switching kept replays off changes nothing there
            variants = tuple(v for v in variants if v != "recomp_off")
        grads: dict[str, Any] = {}
        result: dict[str, Any] = {}
        for variant in variants:
            pipe = _Pipeline(name, variant, plain, pp_group, pp_rank)
            result[variant] = _measured_step(pipe, x, target)
            grads[variant] = pipe.grads()
            del pipe
        result["bitwise_equal_to_none"] = {
            v: all(
                torch.equal(a, b)
                for i in grads["none"]
                for a, b in zip(grads["none"][i], grads[v][i], strict=True)
            )
            for v in variants
        }
        per_stage = BLOCKS // (len(grads["none"]) * dist.get_world_size(pp_group))
        result["max_diff_to_unpipelined"] = max(
            float((a - b).abs().max())
            for i, gs in grads["recomp"].items()
            for a, b in zip(
                gs,
                [g for blk in reference[int(i) * per_stage : (int(i) + 1) * per_stage] for g in blk],
                strict=True,
            )
        )
        out["schedules"][name] = result
    if dropout:
        out["dropout"] = _dropout_masks_match(plain, x, target, pp_group, pp_rank)
    out["steady_state"] = _steady_state(plain, x, target, pp_group, pp_rank, steps, steady)
    return out


def _dropout_masks_match(
    plain: list[Block], x: Any, target: Any, pp_group: Any, pp_rank: int
) -> bool:
    """With dropout on, ZBV with recomp gives the gradients of ZBV without checkpointing."""
    blocks = [_copy(b) for b in plain]
    for b in blocks:
        b.drop.p = 0.2
    grads = []
    for variant in ("none", "recomp"):
        pipe = _Pipeline("ZBVZeroBubble", variant, blocks, pp_group, pp_rank)
        _measured_step(pipe, x, target)
        grads.append(pipe.grads())
    return all(
        torch.equal(a, b)
        for i in grads[0]
        for a, b in zip(grads[0][i], grads[1][i], strict=True)
    )


def _live(kind: type) -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, kind))


def _census(group: Any) -> dict[str, int]:
    dist.barrier(group=group)  # no send or receive of the step still in flight
    gc.collect()
    return {
        "tensors": _live(torch.Tensor),
        "handles": _live(_kept.RecomputeHandle),
        "objects": len(gc.get_objects()),
    }


def _steady_state(
    plain: list[Block], x: Any, target: Any, pp_group: Any, pp_rank: int, steps: int,
    variant: str = "recomp",
) -> dict[str, Any]:
    """Many ZBV steps with recomp: live tensors, handles and objects stay where they were
    after the first steps, and every step replays once per micro-batch."""
    pipe = _Pipeline("ZBVZeroBubble", variant, plain, pp_group, pp_rank)
    replays: set[float] = set()
    runs: set[int] = set()

    def one_step() -> None:
        pipe.zero_grad()
        pipe.reset_counters()
        pipe.step(x, target)
        counters = pipe.counters()
        replays.update(r for per_stage in counters["replays"].values() for r in per_stage)
        runs.update(r for per_stage in counters["attn_runs"].values() for r in per_stage)

    one_step()  # infers shapes
    replays.clear()
    runs.clear()
    for _ in range(2):
        one_step()
    baseline = _census(pp_group)
    for _ in range(steps):
        one_step()
    return {
        "baseline": baseline,
        "after": _census(pp_group),
        "replays_seen": sorted(replays),
        "attn_runs_seen": sorted(runs),
        "sessions": _kept.session_count(),
    }

