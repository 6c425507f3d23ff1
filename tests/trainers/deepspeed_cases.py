"""Rank functions for ``test_deepspeed.py``, run by the distributed test harness
(tests/distributed/dist_harness.py: one process per rank, gloo on CPU); not a test module.

The model is written the way Megatron-DeepSpeed writes its transformer: each block is
checkpointed by ``deepspeed.checkpointing.checkpoint`` on a closure built by a helper
(``custom(index)``). Dropout is drawn three ways: inside the attention and the MLP from
the plain generator, and between them from DeepSpeed's RNG tracker
(``get_cuda_rng_tracker().fork()``, as tensor-parallel code draws it).

Each mode trains the same model from the same seeds; results are compared with the
run without checkpointing inside the rank (gradients and weights, exactly) and returned
as JSON for the test to assert.
"""

from __future__ import annotations

import gc
import os
import warnings
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from torch import nn

import recomp.torch.deepspeed as rtd
from recomp import _rng_trackers
from recomp.errors import IneffectiveSelectionWarning, RecompError
from recomp.torch.collectives import count_collectives

HIDDEN, ATTENTION_DIM, FFN, BLOCKS, BATCH, SEQ = 16, 24, 40, 3, 4, 6
P = 0.2
# Shapes only the attention weights have: a live tensor of one of them that is not a
# Parameter is gathered attention data that something holds.
ATTENTION_SHAPES = {(ATTENTION_DIM, HIDDEN), (HIDDEN, ATTENTION_DIM)}

CALLS = {"attention": 0, "mlp": 0}

# ZeRO-3 as in a model far larger than memory: every parameter partitioned, released
# after each use, nothing prefetched (this model is far below DeepSpeed's defaults,
# under which it would stay gathered from one step to the next).
RELEASE_AFTER_USE = {
    "stage3_param_persistence_threshold": 0,
    "stage3_max_live_parameters": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 0,
}


def start(rank: int) -> None:
    """DeepSpeed on the harness's gloo group. Its CPU communication backend would build a
    shared-memory op first (a C++ build of minutes), used only by its inference
    all-reduce: marking the op unavailable makes it use gloo alone, as it does wherever
    the op cannot be built."""
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.ops.__compatible_ops__ = {}
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(HIDDEN, ATTENTION_DIM, bias=False)
        self.o = nn.Linear(ATTENTION_DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS["attention"] += 1
        scores = F.dropout(torch.softmax(self.q(x), dim=-1), P, self.training)
        # A matmul with a view of the weight (not F.linear): autograd saves the view,
        # which holds ZeRO-3's gathered data after the Parameter's is released.
        return scores @ self.o.weight.t()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS["mlp"] += 1
        return self.down(F.dropout(torch.tanh(self.up(x)), P, self.training))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(HIDDEN)
        self.self_attention = Attention()
        self.norm2 = nn.LayerNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.self_attention(self.norm1(x))
        with ds_checkpointing.get_cuda_rng_tracker().fork():
            h = F.dropout(h, P, self.training)
        h = x + h
        return h + self.mlp(self.norm2(h))


class Model(nn.Module):
    def __init__(self, checkpointing: bool) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        # Outside every checkpoint, so that the blocks' inputs require gradients:
        # DeepSpeed's checkpoint is reentrant, and would pass no gradient to a block
        # whose inputs require none.
        self.embed = nn.Linear(HIDDEN, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def custom(index: int) -> Any:
            def custom_forward(hidden: torch.Tensor) -> torch.Tensor:
                return self.layers[index](hidden)

            return custom_forward

        x = self.embed(x)
        for index in range(BLOCKS):
            if self.checkpointing:
                x = deepspeed.checkpointing.checkpoint(custom(index), x)
            else:
                x = custom(index)(x)
        return self.head(x)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    tracker = ds_checkpointing.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", seed + 2718)


def engine_for(model: nn.Module, stage: int) -> Any:
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": stage, **(RELEASE_AFTER_USE if stage == 3 else {})},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def gathered_alive(model: nn.Module) -> int:
    """Attention weights' gathered data alive now: Parameters whose data ZeRO-3 did not
    release and other tensors of their full shape."""
    gc.collect()
    parameters = sum(
        1 for name, p in model.named_parameters() if "self_attention" in name and p.numel() > 0
    )
    others = sum(
        1
        for obj in gc.get_objects()
        if isinstance(obj, torch.Tensor)
        and not isinstance(obj, nn.Parameter)
        and tuple(obj.shape) in ATTENTION_SHAPES
        and obj.untyped_storage().nbytes() > 0
    )
    return parameters + others


EXCLUDE = {"recomp": (Attention,), "recomp-path": ("self_attention",)}


def train(rank: int, mode: str, stage: int, steps: int) -> dict[str, Any]:
    """``steps`` steps in ``mode``; the last one is counted, its gradients and the
    weights after it returned as tensors."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    seed_everything(0)
    model = Model(checkpointing=mode != "none")
    installation = None
    saved_trackers = _rng_trackers.AUTOMATIC_TRACKERS
    if mode.startswith("recomp"):
        installation = rtd.install(exclude=EXCLUDE.get(mode, (Attention,)))
    if mode == "recomp-untracked":  # recomp not told of DeepSpeed's tracker
        _rng_trackers.AUTOMATIC_TRACKERS = ()
    try:
        engine = engine_for(model, stage)
        seed_everything(100 + rank)  # dropout masks differ per rank, and agree per mode
        data = torch.Generator().manual_seed(rank)
        result: dict[str, Any] = {}
        for step in range(steps):
            x = torch.randn(BATCH, SEQ, HIDDEN, generator=data)
            last = step == steps - 1
            CALLS.update(attention=0, mlp=0)
            with count_collectives() as counts:
                loss = engine(x).square().mean()
                alive = gathered_alive(engine.module) if last and stage == 3 else None
                engine.backward(loss)
            if last:
                result["counts"] = counts.as_dict()
                result["alive"] = alive
                result["calls"] = dict(CALLS)
                # Flattened: a kept gradient or weight must not count as gathered data.
                result["grads"] = [
                    safe_get_full_grad(p).flatten().clone() for p in engine.module.parameters()
                ]
            engine.step()
        result["weights"] = [
            safe_get_full_fp32_param(p).flatten().clone() for p in engine.module.parameters()
        ]
        return result
    finally:
        _rng_trackers.AUTOMATIC_TRACKERS = saved_trackers
        if installation is not None:
            installation.remove()


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[bool, float]:
    equal = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    diff = max((float((x - y).abs().max()) for x, y in zip(a, b)), default=0.0)
    return equal, diff


def zero_steps(rank: int, world_size: int, stage: int, modes: list[str], steps: int = 2) -> Any:
    """Each mode against the same model without checkpointing, under ZeRO ``stage``."""
    start(rank)
    reference = train(rank, "none", stage, steps)
    out: dict[str, Any] = {}
    for mode in ["none", *modes]:
        run = dict(reference) if mode == "none" else train(rank, mode, stage, steps)
        grads_equal, grads_diff = _same(run.pop("grads"), reference["grads"])
        weights_equal, weights_diff = _same(run.pop("weights"), reference["weights"])
        out[mode] = {
            **run,
            "grads_equal": grads_equal,
            "grads_diff": grads_diff,
            "weights_equal": weights_equal,
            "weights_diff": weights_diff,
        }
    return out


# --------------------------------------------------------------------------- configure()


class _ModelParallelUnit:
    """What ``deepspeed.checkpointing.configure(mpu)`` reads of an mpu: a model-parallel
    group of ``size`` ranks."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_model_parallel_rank(self) -> int:
        return int(torch.distributed.get_rank()) % self.size

    def get_model_parallel_world_size(self) -> int:
        return self.size

    def get_model_parallel_group(self) -> Any:
        return torch.distributed.group.WORLD

    def get_data_parallel_rank(self) -> int:
        return 0


def _plain_step(model: Model, rank: int) -> list[torch.Tensor]:
    """One forward and backward without an engine; the gradients."""
    seed_everything(100 + rank)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(rank))
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def configure_options(rank: int, world_size: int) -> dict[str, Any]:
    """What recomp does with each option of ``deepspeed.checkpointing.configure``."""
    start(rank)
    seed_everything(0)
    model = Model(checkpointing=False)
    model.checkpointing = False
    reference = _plain_step(model, rank)
    model.checkpointing = True
    out: dict[str, Any] = {}
    with rtd.install(exclude=(Attention,)):
        # synchronize: honoured, at the start and end of each forward and each replay.
        accelerator = ds_checkpointing.get_accelerator()
        calls = {"forward": 0, "backward": 0}
        phase = ["forward"]

        def synchronize() -> None:
            calls[phase[0]] += 1

        ds_checkpointing.configure(None, synchronize=True)
        accelerator.synchronize = synchronize  # on the instance: the class keeps its own
        try:
            seed_everything(100 + rank)
            x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(rank))
            model.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            phase[0] = "backward"
            loss.backward()
        finally:
            del accelerator.synchronize
        out["synchronize"] = calls
        out["synchronize_grads_equal"] = _same([p.grad for p in model.parameters()], reference)[0]

        # Inputs already in host memory, a model-parallel size of 1: nothing to move or
        # split, recomp runs as without these options.
        ds_checkpointing.configure(None, partition_activations=True, checkpoint_in_cpu=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grads = _plain_step(model, rank)
        out["host_grads_equal"] = _same(grads, reference)[0]
        out["host_warnings"] = [str(w.message) for w in caught]

        # Contiguous buffers and DeepSpeed's timers: no effect, one warning each.
        ds_checkpointing.configure(
            None,
            partition_activations=True,
            contiguous_checkpointing=True,
            num_checkpoints=BLOCKS,
            profile=True,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grads = _plain_step(model, rank)
            _plain_step(model, rank)
        out["ineffective_grads_equal"] = _same(grads, reference)[0]
        out["ineffective_warnings"] = [
            str(w.message) for w in caught if issubclass(w.category, IneffectiveSelectionWarning)
        ]

        # Partitioned over 2 model-parallel ranks: each checkpoint's input kept split and
        # gathered once by its replay. The ranks of a model-parallel group hold the same
        # activations: both run rank 0's step.
        from recomp.torch.collectives import count_collectives

        ds_checkpointing.configure(None)
        same_everywhere = _plain_step(model, 0)
        ds_checkpointing.configure(_ModelParallelUnit(world_size), partition_activations=True)
        with count_collectives() as counts:
            grads = _plain_step(model, 0)
        out["partitioned_grads_equal"] = _same(grads, same_everywhere)[0]
        out["partitioned_collectives"] = counts.as_dict()
        # With host checkpointing as well: refused, naming both options.
        ds_checkpointing.configure(
            _ModelParallelUnit(world_size), partition_activations=True, checkpoint_in_cpu=True
        )
        try:
            _plain_step(model, rank)
            out["partitioned_on_host"] = "ran"
        except RecompError as exc:
            out["partitioned_on_host"] = str(exc)
        ds_checkpointing.mpu = None
        ds_checkpointing.mp_size = 1
        ds_checkpointing.configure(None)
    return out


# --------------------------------------------------------------------------- pipelines


def _pipeline_module(interval: int) -> Any:
    from deepspeed.pipe import PipelineModule

    seed_everything(0)
    model = Model(checkpointing=False)
    layers = [model.embed, *model.layers, model.head]
    return PipelineModule(
        layers=layers,
        num_stages=1,
        loss_fn=lambda out, target: (out - target).square().mean(),
        activation_checkpoint_interval=interval,
        checkpointable_layers=["Block"],
    )


def _train_pipeline(module: Any, rank: int) -> dict[str, Any]:
    from deepspeed.utils import safe_get_full_fp32_param

    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    generator = torch.Generator().manual_seed(rank)
    batches = [
        (
            torch.randn(BATCH, SEQ, HIDDEN, generator=generator),
            torch.randn(BATCH, SEQ, 1, generator=generator),
        )
        for _ in range(2)
    ]
    seed_everything(100 + rank)
    CALLS.update(attention=0, mlp=0)
    engine.train_batch(iter(batches))
    return {
        "calls": dict(CALLS),
        "weights": [
            safe_get_full_fp32_param(p).flatten().clone() for p in engine.module.parameters()
        ],
    }


def pipeline(rank: int, world_size: int) -> dict[str, Any]:
    """A PipelineModule built while recomp is installed checkpoints with recomp; one
    built before keeps DeepSpeed's function."""
    start(rank)
    reference = _train_pipeline(_pipeline_module(interval=0), rank)
    before = _pipeline_module(interval=1)
    out: dict[str, Any] = {}
    with rtd.install(exclude=(Attention,)) as installation:
        during = _pipeline_module(interval=1)
        out["default_is_recomp"] = (
            during.activation_checkpoint_func is deepspeed.checkpointing.checkpoint
            and before.activation_checkpoint_func is not deepspeed.checkpointing.checkpoint
        )
        run = _train_pipeline(during, rank)
        out["recomp"] = {
            "calls": run["calls"],
            "weights_equal": _same(run["weights"], reference["weights"])[0],
        }
        run = _train_pipeline(before, rank)
        out["built_before"] = {
            "calls": run["calls"],
            "weights_equal": _same(run["weights"], reference["weights"])[0],
        }
    out["removed"] = not installation.installed
    return out


# --------------------------------------------------------------------------- all at once


def run_all(rank: int, world_size: int) -> dict[str, Any]:
    """Every case above in one launch (starting DeepSpeed costs more than a case); the
    seconds each took under ``seconds``."""
    import time

    cases = {
        "zero3": lambda: zero_steps(rank, world_size, 3, ["deepspeed", "recomp", "recomp-path"]),
        "zero2": lambda: zero_steps(
            rank, world_size, 2, ["deepspeed", "recomp", "recomp-untracked"]
        ),
        "configure": lambda: configure_options(rank, world_size),
        "pipeline": lambda: pipeline(rank, world_size),
    }
    out: dict[str, Any] = {"seconds": {}}
    for name, case in cases.items():
        began = time.perf_counter()
        out[name] = case()
        out["seconds"][name] = round(time.perf_counter() - began, 1)
    return out
