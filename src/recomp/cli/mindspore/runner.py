"""MindSpore (PyNative) measurements: the counterpart of ``recomp.cli.torch.runner`` for
strategies
``none``, ``full`` (``mindspore.recompute``, non-reentrant, per layer) and ``exclude:R``
(recomp.mindspore).

Memory: MindSpore takes CPU memory for tensors from its own pool (1 GiB reserved at the
first op), so ``mallinfo2`` does not see tensors come and go, and
``mindspore.runtime.memory_allocated`` is 0 on CPU. The readings come instead from the
pool's own allocation record, which MindSpore's profiler writes with
``profile_memory=True`` (``FRAMEWORK/cpu_ms_memory_record_0.txt``: time stamp, bytes
allocated). The record has a row per allocation only: a free shows in the next row. So
each point of the step is marked (:func:`mark`, under ``launch_blocking``) by its time
and a small allocation of a known size right after it, whose row is the first at or
after that time and holds everything allocated at that point (:func:`allocated_at_mark`);
a mark read from the row before it would count what was freed since that row, which
made readings move by a tensor between runs. The collector is off during the measured
step. FLOPs are not counted (MindSpore has no FLOP counter); the JSON holds ``null`` for
them.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import glob
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from ..config import BenchConfig, call_factory, load_factory
from ..counters import count_delta, region_counts, saved_bytes
from ..results import Result
from ..strategies import REGION_ALIASES, parse
from ..timing import StepTimes, time_interleaved

DEFAULT_MODEL = "recomp.cli.mindspore.models:llama"

def setup(config: BenchConfig) -> None:
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    # MindSpore's CPU kernels use 25 threads by default; match PyTorch's setting instead.
    with contextlib.suppress(RuntimeError, ValueError):
        ms.device_context.cpu.op_tuning.threads_num(max(1, config.threads))


def build(config: BenchConfig) -> tuple[nn.Cell, Tensor]:
    ms.set_seed(config.seed)
    # The PyTorch model of the configuration has no MindSpore counterpart: the built-in
    # decoder, unless a MindSpore factory is named (extra["ms_model"]).
    spec = config.model if config.model.startswith("recomp.cli.mindspore.") else DEFAULT_MODEL
    if config.extra.get("ms_model"):
        spec = config.extra["ms_model"]
    model = call_factory(load_factory(spec), config)
    if not isinstance(model, nn.Cell):
        raise ValueError(f"{spec} returned {type(model).__name__}, not a mindspore.nn.Cell")
    hidden = getattr(model, "hidden", config.hidden)
    rng = np.random.default_rng(config.seed + 1)
    x = Tensor(rng.standard_normal((config.batch, config.seq, hidden)).astype(np.float32))
    return model, x


class FullRecompute(nn.Cell):
    """``mindspore.recompute(layer, x, use_reentrant=False)``."""

    def __init__(self, inner: nn.Cell) -> None:
        super().__init__(auto_prefix=False)
        self.inner = inner

    def construct(self, *args: Any) -> Any:
        return ms.recompute(self.inner, *args, use_reentrant=False)


def _child(layer: nn.Cell, region: str) -> tuple[str, nn.Cell]:
    for name in REGION_ALIASES.get(region, (region,)):
        child = getattr(layer, name, None)
        if isinstance(child, nn.Cell):
            return name, child
    raise ValueError(f"layer {type(layer).__name__} has no child cell {region!r}")


class Prepared:
    def __init__(self, model: nn.Cell) -> None:
        self.model = model
        self.regions: dict[str, nn.Cell] = {}
        self.exclude_wrappers: dict[str, Any] = {}


def prepare(strategy: str, model: nn.Cell) -> Prepared:
    parsed = parse(strategy)
    prepared = Prepared(model)
    layers = model.layers
    if parsed.kind == "none":
        return prepared
    if parsed.kind == "full":
        for i in range(len(layers)):
            layers[i] = FullRecompute(layers[i])
        return prepared
    if parsed.kind == "exclude":
        from recomp.mindspore import apply_activation_checkpointing

        units = {id(layer) for layer in layers}
        kept: dict[int, str] = {}
        for i, layer in enumerate(layers):
            for region in parsed.regions:
                cname, child = _child(layer, region)
                kept[id(child)] = f"layers.{i}.{cname}"
                prepared.regions[f"layers.{i}.{cname}"] = child
        apply_activation_checkpointing(
            model,
            checkpoint_fn=lambda c: id(c) in units,
            exclude_fn=lambda c: id(c) in kept,
        )
        prepared.exclude_wrappers.update(prepared.regions)  # wrapped in place
        return prepared
    raise ValueError(f"MindSpore runs none, full and exclude:R[+R...]; not {parsed}")


class Trainer:
    def __init__(self, config: BenchConfig, strategy: str) -> None:
        model, self.x = build(config)
        self.prepared = prepare(strategy, model)
        self.model = self.prepared.model
        self.params = self.model.trainable_params()
        self.marks: list[int] | None = None

        def loss_fn(x: Tensor) -> Tensor:
            out = self.model(x)
            loss = (out * out).mean()
            if self.marks is not None:
                self.marks.append(mark())
            return loss

        self.grad_fn = ms.value_and_grad(loss_fn, None, weights=self.params)
        self.optimizer = nn.SGD(self.params, learning_rate=1e-4)

    def grads(self) -> tuple[float, Any]:
        loss, grads = self.grad_fn(self.x)
        return float(loss.asnumpy()), grads

    def step(self) -> None:
        loss, grads = self.grad_fn(self.x)
        self.optimizer(grads)
        loss.asnumpy()  # wait for the step to finish

    def sync(self) -> None:
        """Nothing to wait for: ``step`` returns once the step has finished."""


class _CallCounter:
    def __init__(self, cells: dict[str, nn.Cell]) -> None:
        self.calls = dict.fromkeys(cells, 0)
        self._handles = []
        for name, cell in cells.items():
            self._handles.append(cell.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(cell: Any, inputs: Any) -> None:
            self.calls[name] += 1

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@contextlib.contextmanager
def _profiled(directory: str) -> Iterator[Callable[[], list[tuple[int, int]]]]:
    """Profile memory in ``directory``; yields a function that reads the record."""
    from mindspore.profiler import ProfilerActivity, profile

    previous = os.getcwd()
    os.chdir(directory)
    try:
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.start()
        try:
            yield lambda: _read_record(directory)
        finally:
            prof.stop()
    finally:
        os.chdir(previous)


def _read_record(directory: str) -> list[tuple[int, int]]:
    paths = glob.glob(os.path.join(directory, "**", "cpu_ms_memory_record_*.txt"), recursive=True)
    rows: list[tuple[int, int]] = []
    for path in paths:
        with open(path) as f:
            next(f, None)
            for line in f:
                parts = line.strip().split(",")
                if len(parts) >= 2:
                    rows.append((int(parts[0]), int(parts[1])))
    rows.sort()
    return rows


#: The size of a mark's allocation: a multiple of the pool's 512-byte granule.
_MARK_BYTES = 512


def mark() -> int:
    """The time now, and right after it an allocation of ``_MARK_BYTES`` from MindSpore's
    pool (dropped at once), whose row in the memory record :func:`allocated_at_mark` reads.
    Needs ``mindspore.runtime.launch_blocking()``: the allocation happens before the next
    op does."""
    now = time.time_ns()
    ops.zeros((_MARK_BYTES // 4,), ms.float32)
    return now


def allocated_at_mark(rows: list[tuple[int, int]], t: int) -> int:
    """Bytes allocated at the :func:`mark` taken at ``t``: its allocation's row (the first
    at or after ``t``) less that allocation."""
    i = bisect.bisect_left(rows, (t, -1))
    if i >= len(rows):
        raise RuntimeError("MindSpore's memory record ends before a mark of the measured step")
    return rows[i][1] - _MARK_BYTES


def measure_strategy(config: BenchConfig, strategy: str) -> Result:
    setup(config)
    _, reference = Trainer(config, "none").grads()
    ref = [g.asnumpy() for g in reference]
    trainer = Trainer(config, strategy)
    first_loss, grads = trainer.grads()
    grad_diff = max(
        (float(np.abs(g.asnumpy() - r).max()) for g, r in zip(grads, ref, strict=True)),
        default=0.0,
    )
    del grads, reference
    for _ in range(max(1, config.warmup)):
        trainer.step()

    runs_before, skips_before = region_counts(trainer.prepared.exclude_wrappers)
    counter = _CallCounter(trainer.prepared.regions)
    ms.runtime.launch_blocking()
    # Garbage of earlier steps, freed by the collector in the middle of the step, would
    # move the readings: collect it first, and keep the collector off.
    gc.collect()
    gc.disable()
    try:
        with tempfile.TemporaryDirectory(prefix="recomp-mindspore-profile-") as tmp:
            with _profiled(tmp):
                trainer.marks = []
                start = mark()
                trainer.step()
                end = mark()
                forward_end = trainer.marks[0]
                trainer.marks = None
            rows = _read_record(tmp)
    finally:
        gc.enable()
    counter.remove()
    runs_after, skips_after = region_counts(trainer.prepared.exclude_wrappers)
    if not rows:
        raise RuntimeError("MindSpore's profiler wrote no memory record")
    base = allocated_at_mark(rows, start)
    # The step's rows, the marks' own left out.
    first, middle, last = (bisect.bisect_left(rows, (t, -1)) for t in (start, forward_end, end))
    in_step = [rows[i][1] for i in range(first + 1, last) if i != middle]
    # FLOPs stay None: MindSpore has no FLOP counter.
    return Result(
        framework="mindspore",
        strategy=strategy,
        device="cpu",
        memory_source="mindspore profiler memory record",
        activation_bytes=allocated_at_mark(rows, forward_end) - base,
        peak_bytes=max(in_step, default=base) - base,
        retained_after_step_bytes=allocated_at_mark(rows, end) - base,
        region_runs=count_delta(runs_after, runs_before),
        region_skips=count_delta(skips_after, skips_before),
        region_calls=dict(counter.calls),
        region_saved_bytes=saved_bytes(trainer.prepared.exclude_wrappers),
        max_grad_diff=grad_diff,
        loss=first_loss,
        num_layers=len(trainer.model.layers),
        config=config,
    )


def time_strategies(
    config: BenchConfig,
    strategies: list[str],
    progress: Callable[[int, int], None] | None = None,
) -> StepTimes:
    setup(config)
    trainers = {s: Trainer(config, s) for s in strategies}
    return time_interleaved(trainers, config.steps, config.warmup, progress)


def report_strategy(config: BenchConfig, strategy: str) -> Any:
    """One training step of the MindSpore decoder under ``strategy`` (after a warm-up
    step), recorded by ``recomp.mindspore.report.record_saved_tensors``."""
    from recomp.mindspore.report import record_saved_tensors

    setup(config)
    trainer = Trainer(config, strategy)
    trainer.step()
    layers = [f"layers.{i}" for i in range(len(trainer.model.layers))]
    with record_saved_tensors(trainer.model, inputs=trainer.x, layers=layers) as record:
        trainer.step()
    return record.report
