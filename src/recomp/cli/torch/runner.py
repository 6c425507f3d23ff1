"""PyTorch measurements of one strategy, interleaved step timing of several, the plans of
``plan@B`` strategies, and the saved-tensor report of one forward (``recomp report``).

``measure_strategy``, ``time_strategies`` and ``make_plans`` run inside a child process
(see ``recomp.cli.worker``): memory readings need a process of their own, started with
``MALLOC_ARENA_MAX=1``. They are plain functions so that tests can call them in-process
too.

With ``config.compile`` set, the model (not the loss or the optimizer) runs under
``torch.compile`` with that backend, and the first (warm-up) step compiles it. FLOPs and
region calls are then not counted: dispatch modes and module hooks do not see inside a
compiled graph; nor is the CPU peak (sampled around each ATen op in eager mode).
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ...plan.modelcall import call_model, example_input, loss_function, map_tensors
from ...torch import _compat
from ..config import BenchConfig, call_factory, load_factory, row_label
from ..counters import count_delta, region_counts, saved_bytes
from ..messages import PlanResult
from ..results import Offload, Result
from ..timing import StepTimes, time_interleaved
from .measure import CpuMemory, RegionTracker, SplitFlopCounter, max_grad_diff, memory_reader
from .strategies import Prepared, layers_of, parse, prepare, prepare_plan, torch_memory_budget


def build(config: BenchConfig) -> tuple[nn.Module, Any, Callable[[Any], torch.Tensor]]:
    """Model, input and loss function for ``config`` (same weights for the same seed)."""
    device = torch.device(config.device)
    dtype = getattr(torch, config.dtype)
    torch.manual_seed(config.seed)
    model = call_factory(load_factory(config.model), config)
    if not isinstance(model, nn.Module):
        raise ValueError(f"{config.model} returned {type(model).__name__}, not an nn.Module")
    model = model.to(device=device, dtype=dtype)
    generator = torch.Generator().manual_seed(config.seed + 1)
    x = example_input(model, config.batch, config.seq, config.hidden, generator, dtype)
    return model, to_device(x, device), loss_function(model)


def to_device(x: Any, device: torch.device) -> Any:
    """``x`` with every tensor in it moved to ``device``, its containers rebuilt as they
    were (``recomp.plan.modelcall.map_tensors``)."""
    return map_tensors(lambda t: t.to(device), x)


class Trainer:
    """One strategy's model, its SGD optimizer, and a step function."""

    def __init__(self, config: BenchConfig, strategy: str) -> None:
        model, self.x, self.loss_fn = build(config)
        plan = None
        if parse(strategy).kind == "plan":
            plan = plan_for(config, strategy, model, self.x, self.loss_fn)
        self.prepared: Prepared = prepare(strategy, model, plan, compiled=bool(config.compile))
        self.model = self.prepared.model
        # What the step calls: the model, or the model compiled with the chosen backend.
        # Each compiled trainer gets a backend object of its own: Dynamo would otherwise
        # run a second trainer of the same model class on the first one's graph, compiled
        # under the first one's partitioner budget (see _compat.separate_backend).
        self.run_model: Any = (
            torch.compile(self.model, backend=_compat.separate_backend(config.compile))
            if config.compile
            else self.model
        )
        # PyTorch's partitioner budget (budget@F, or a compiled plan's), read when the
        # model compiles: the forward runs with it set.
        self.memory_budget: float | None = None
        if parse(strategy).kind == "budget":
            self.memory_budget = torch_memory_budget(strategy)
        elif plan is not None and plan.compiled is not None:
            self.memory_budget = float(plan.compiled["activation_memory_budget"])
        self.params = list(self.model.parameters())
        self.optimizer = sgd(self.params)
        self.device = torch.device(config.device)

    def forward(self) -> torch.Tensor:
        if self.memory_budget is None:
            return self.loss_fn(call_model(self.run_model, self.x))
        with _compat.activation_memory_budget(self.memory_budget):
            return self.loss_fn(call_model(self.run_model, self.x))

    def step(self) -> None:
        loss = self.forward()
        loss.backward()
        self.optimizer.step()
        # Keep the gradient buffers: readings are taken against a baseline that holds them.
        self.optimizer.zero_grad(set_to_none=False)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The benchmark's optimizer."""
    return torch.optim.SGD(params, lr=1e-4)


def plan_clock(config: BenchConfig) -> str:
    """Process CPU time for one-thread CPU runs (steady on a shared machine), else wall time."""
    return str(
        config.extra.get("plan_clock")
        or ("cpu" if config.device == "cpu" and config.threads == 1 else "wall")
    )


def plan_for(
    config: BenchConfig,
    strategy: str,
    model: nn.Module,
    x: Any,
    loss_fn: Callable[[Any], torch.Tensor],
) -> Any:
    """The plan of strategy ``plan@B``: made once by the parent (``config.extra["plans"]``)
    so that every process runs the same plan, or else made here."""
    from recomp.plan import load_plan, make_plan

    given = config.extra.get("plans", {}).get(strategy)
    if given is not None:
        return load_plan(given)
    return make_plan(_profile(config, model, x, loss_fn), parse(strategy).value)


def _profile(
    config: BenchConfig, model: nn.Module, x: Any, loss_fn: Callable[[Any], torch.Tensor]
) -> Any:
    """The planner's profile: eager, or compiled with the configured backend."""
    from recomp.plan import profile

    if config.compile:
        keep_names = set(config.extra.get("keep") or ())
        keep = None
        if keep_names:
            children = {
                id(child)
                for _, layer in layers_of(model)
                for name, child in layer.named_children()
                if name in keep_names
            }
            if not children:
                raise ValueError(f"--keep {','.join(sorted(keep_names))}: no layer has such a child")

            def keep(module: nn.Module) -> bool:
                return id(module) in children

        compiled: Any = torch.compile(model, backend=config.compile)  # an OptimizedModule
        return profile(compiled, x, loss_fn, keep=keep)
    return profile(model, x, loss_fn, clock=plan_clock(config), optimizer=sgd)


def make_plans(config: BenchConfig, strategies: list[str]) -> PlanResult:
    """Profile the model once and make the plan of each ``plan@B`` strategy (a budget no
    plan meets gives an error instead)."""
    from recomp.plan import make_plan

    torch.set_num_threads(max(1, config.threads))
    model, x, loss_fn = build(config)
    prof = _profile(config, model, x, loss_fn)
    made = PlanResult(plans={}, profile=prof.to_dict(), clock=plan_clock(config))
    for strategy in strategies:
        try:
            made.plans[strategy] = make_plan(prof, parse(strategy).value).to_dict()
        except ValueError as exc:
            made.errors[strategy] = f"{type(exc).__name__}: {exc}"
    return made


def reference_grads(config: BenchConfig) -> list[torch.Tensor | None]:
    """Gradients of the first step without checkpointing."""
    trainer = Trainer(config, "none")
    loss = trainer.forward()
    loss.backward()
    return [None if p.grad is None else p.grad.detach().clone() for p in trainer.params]


def measure_strategy(config: BenchConfig, strategy: str) -> Result:
    """Memory, FLOPs, region runs and gradient difference of ``strategy`` (one process)."""
    torch.set_num_threads(max(1, config.threads))
    reference = reference_grads(replace(config, compile=None))  # eager, no checkpoint
    trainer = Trainer(config, strategy)
    memory = memory_reader(trainer.device)

    # Step 1 (warm-up) gives the gradients to compare; it also allocates kernel caches.
    loss = trainer.forward()
    first_loss = float(loss.item())
    loss.backward()
    grad_diff = max_grad_diff(trainer.params, reference)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=False)
    del loss
    for _ in range(max(0, config.warmup - 1)):
        trainer.step()

    # Activation memory: heap in use after the forward (and loss) minus before it.
    runs_before, skips_before = region_counts(trainer.prepared.exclude_wrappers)
    offloader = trainer.prepared.offloader
    if offloader is not None:
        offloader.timing = trainer.device.type == "cuda"  # copy time, this step only
        offloader.synchronize()
        offload_before = offloader.stats.snapshot()
    # PyTorch 2.9 leaves garbage in reference cycles after the first step (about 1.4 MB
    # for the tiny model, even without checkpointing); collected in the middle of the
    # measured forward, it would be subtracted from the activations.
    gc.collect()
    trainer.sync()
    before = memory.read()
    loss = trainer.forward()
    after_forward = memory.read()
    loss.backward()
    del loss
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=False)
    after_step = memory.read()
    runs_after, skips_after = region_counts(trainer.prepared.exclude_wrappers)
    offload: Offload | None = None
    if offloader is not None:
        offloader.synchronize()
        offloader.timing = False
        moved = offloader.stats - offload_before
        offload = Offload(
            host_bytes=moved.offloaded_bytes,
            restored_bytes=moved.restored_bytes,
            prefetched_bytes=moved.prefetched_bytes,
            copy_s=moved.copy_seconds,
        )

    compiled = bool(config.compile)
    # Peak of a whole step, above the same baseline.
    peak: int | None = None
    if not (compiled and isinstance(memory, CpuMemory)):
        base = memory.read()
        memory.reset_peak()
        with memory.peak_context():
            trainer.step()
        peak = memory.peak() - base

    result = Result(
        framework=row_label("torch", config.to_dict()),
        strategy=strategy,
        device=str(trainer.device),
        memory_source=memory.source,
        activation_bytes=after_forward - before,
        peak_bytes=peak,
        retained_after_step_bytes=after_step - before,
        offload=offload,
        max_grad_diff=grad_diff,
        loss=first_loss,
        num_layers=len(trainer.prepared.units),
        config=config,
    )
    if not compiled:
        _count_flops_and_calls(result, trainer)
        result.region_runs = count_delta(runs_after, runs_before)
        result.region_skips = count_delta(skips_after, skips_before)
    return result


def _count_flops_and_calls(result: Result, trainer: Trainer) -> None:
    """Fill in the FLOPs of one more step split by phase, the calls of each region in it
    and the bytes each region keeps after it (eager models only)."""
    regions = RegionTracker()
    regions.track(trainer.prepared.regions)
    layers = RegionTracker()
    layers.track(trainer.prepared.units)
    counter = SplitFlopCounter(regions, layers)
    with counter:
        with counter.in_phase("forward"):
            loss = trainer.forward()
        with counter.in_phase("backward"):
            loss.backward()
        del loss
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=False)
    regions.remove()
    layers.remove()
    split = counter.split

    result.forward_flops = split["forward"]
    result.replay_flops = split["replay"]
    result.replay_flops_recomp_state = split["replay_recomp"]
    result.backward_flops = split["backward"]
    result.excluded_flops = split["excluded"]
    result.layer_forward_flops = split["layers"]
    result.total_flops = int(counter.get_total_flops())
    result.flops_by_op = {k: v for k, v in counter.ops.items() if v}
    result.region_calls = dict(regions.calls)
    result.region_saved_bytes = saved_bytes(trainer.prepared.exclude_wrappers)


def time_strategies(
    config: BenchConfig,
    strategies: list[str],
    progress: Callable[[int, int], None] | None = None,
) -> StepTimes:
    """Step times of all ``strategies`` in one process, interleaved: round ``r`` times one
    step of each strategy in turn, so that drifts of the machine hit them alike."""
    torch.set_num_threads(max(1, config.threads))
    # Same seed, same weights: every trainer starts from the same model.
    trainers = {s: Trainer(config, s) for s in strategies}
    return time_interleaved(trainers, config.steps, config.warmup, progress)


def report_strategy(config: BenchConfig, strategy: str) -> Any:
    """One forward of ``config``'s model under ``strategy`` (a benchmark strategy or a plan
    file), its report taken before backward; the backward then runs, as in training."""
    from recomp.plan import load_plan
    from recomp.torch.report import label_layers, saved_tensors_report

    model, x, loss_fn = build(config)
    if strategy.endswith(".json"):
        if not os.path.exists(strategy):
            raise FileNotFoundError(f"plan file {strategy!r} not found")
        prepared = prepare_plan(model, load_plan(strategy), os.path.basename(strategy))
    elif parse(strategy).kind == "plan":  # plan@BUDGET: profiled and planned here
        prepared = prepare(strategy, model, plan_for(config, strategy, model, x, loss_fn))
    else:
        prepared = prepare(strategy, model)
    model = prepared.model
    model.train()
    # Layers without a checkpoint are named through hooks; checkpointed ones by their checkpoint.
    with warnings.catch_warnings(), label_layers(model, [path for path, _ in layers_of(model)]):
        # label_layers' hook only names layers; what selective checkpoints keep is found
        # without it, so PyTorch's notice about such hooks around them does not apply.
        warnings.filterwarnings(
            "ignore", message="A saved_tensors_hooks context", category=FutureWarning
        )
        loss = loss_fn(call_model(model, x))
    report = saved_tensors_report(loss, model=model, inputs=x)
    loss.backward()
    return report
