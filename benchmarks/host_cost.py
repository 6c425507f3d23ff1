"""Host cost per layer of each way of checkpointing, measured side by side in one process.

On a GPU the kernels of a small layer take microseconds, and what the host spends per
checkpoint and per excluded region decides the step. This runs ``LAYERS`` tiny layers
(Linear, GELU, Linear; batch 4, width 64: kernels cost little on the CPU too) under each
strategy, the strategies interleaved step by step so that a machine that slows down
slows all of them, and reports per layer per step, above no checkpointing:

* the median process CPU time (``time.process_time``: another job on the machine does
  not count, its own threads do: run with one thread, the default here);
* Python function calls (``sys.setprofile``) and Python bytecodes executed
  (``sys.settrace`` opcode events): counts that are the same on every run, where CPU time
  moves by a few per cent between processes. The bytecodes are the finer measure of
  what a change removed (in this loop one of recomp's costs about 40 ns);
* the cyclic garbage collector's passes, each strategy run alone for ``--collector-steps``
  steps after a full collection: young-generation and full passes per 100 steps, and the
  CPU time all its passes took per layer per step (``gc.callbacks``). Every object a
  checkpoint keeps until its backward lives through the rest of the forward; the more
  of them, the more often the collector runs, and the more often the survivors of its
  passes bring on a full pass over every object of the process. The median step
  leaves the full passes out (one step in many takes one); they count in a long run.

Strategies: ``torch`` (``torch.utils.checkpoint``, non-reentrant), ``recomp``
(``checkpoint_wrapper``, nothing excluded), ``recomp-R`` (R excluded regions per layer:
the layer's linears and then R-2 more small ones), ``sac`` (PyTorch's selective
checkpointing saving the first linear's output), ``remat-R`` (torch-remat with R
regions, where installed: it needs PyTorch 2.14). The ratios the project's targets are
judged on: ``recomp / torch``, ``recomp-R / remat-R`` and the cost of one more region,
``(X-Rmax - X-Rmin) / (Rmax - Rmin)`` per layer for each of the two. The spread printed
with each time is the interquartile range of the per-step CPU times, divided like the
median (per layer); the figures of ``none`` are subtracted from the medians only.
Target 3b of ``benchmarks/targets.py`` (``recomp bench``'s wrapper overhead on a tiny op,
per region call) measures another loop and is not judged here.

``--layer`` puts other layers under ``none``, ``torch`` and ``recomp``: ``lora`` (the
tiny layer with its linears frozen and a trainable low-rank adapter beside each, as
PEFT's LoRA leaves a model: state that does not train), ``llama`` (HF Llama's decoder
layer at hidden size 64: projections without bias, RMSNorm, rotary embeddings passed as
a keyword, on 2 sequences of 8 tokens) and ``conv`` (ResNet's basic block at 8 channels on
8x8 images: BatchNorms in training mode, whose running statistics each forward updates)::

    python benchmarks/host_cost.py                       # R in 1, 4, 16; 200 steps
    python benchmarks/host_cost.py --regions 1,4 --steps 300 --json out/host_cost.json
    python benchmarks/host_cost.py --layer llama --steps 100

Run it with recomp importable (``PYTHONPATH=src``, or the development environment).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)
from torch.utils.checkpoint import (
    checkpoint as torch_checkpoint,
)

import recomp.torch as rt

LAYERS = 32
BATCH = 4
WIDTH = 64


class Small(nn.Module):
    """What an extra excluded region holds: a tiny scale (one elementwise op)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0001


class Layer(nn.Module):
    def __init__(self, extra: int = 0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)
        self.extra = nn.ModuleList(Small() for _ in range(extra))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        for small in self.extra:
            h = small(h)
        return x + self.fc2(h)


class Adapted(nn.Module):
    """The tiny layer as parameter-efficient fine-tuning leaves it: fc1 and fc2 frozen,
    a trainable rank-4 adapter beside each (PEFT's LoRA)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.fc2 = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.down1 = nn.Linear(WIDTH, 4, bias=False)
        self.up1 = nn.Linear(4, WIDTH, bias=False)
        self.down2 = nn.Linear(WIDTH, 4, bias=False)
        self.up2 = nn.Linear(4, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x) + self.up1(self.down1(x)))
        return x + self.fc2(h) + self.up2(self.down2(h))


class Basic(nn.Module):
    """ResNet's basic block at 8 channels: two 3x3 convolutions, each followed by a
    BatchNorm in training mode (running statistics the forward updates), and the residual."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


#: Layers other than the tiny one (``--layer``): no excluded regions, no torch-remat.
LAYER_KINDS = ("tiny", "lora", "llama", "conv")


def _layers(kind: str, count: int) -> tuple[list[nn.Module], Callable[..., Any], torch.Tensor]:
    """``count`` layers of ``kind``, how one is called on the hidden state, and an input."""
    torch.manual_seed(0)
    if kind == "lora":
        return [Adapted() for _ in range(count)], _call, torch.randn(BATCH, WIDTH)
    if kind == "conv":
        return [Basic() for _ in range(count)], _call, torch.randn(2, 8, 8, 8)
    if kind != "llama":
        return [Layer() for _ in range(count)], _call, torch.randn(BATCH, WIDTH)
    # HF Llama's decoder layer at hidden size WIDTH (no bias, RMSNorm, rotary
    # embeddings given by the caller), on a batch of 2 sequences of 8 tokens.
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as llama

    config = LlamaConfig(
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=count,
        attn_implementation="sdpa",
    )
    x = torch.randn(2, 8, WIDTH)
    rotary = llama.LlamaRotaryEmbedding(config)
    embeddings = rotary(x, torch.arange(8)[None])

    def call(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        out = layer(h, position_embeddings=embeddings)
        return out[0] if isinstance(out, tuple) else out

    return [llama.LlamaDecoderLayer(config, i) for i in range(count)], call, x


def _call(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return layer(h)


def _regions(layer: Layer, count: int) -> list[nn.Module]:
    """The ``count`` modules of ``layer`` that are excluded (fc1, fc2, then the smalls)."""
    return [layer.fc1, layer.fc2, *layer.extra][:count]


def build(strategy: str, layer: str = "tiny") -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward of ``LAYERS`` layers of kind ``layer`` under ``strategy``."""
    name, _, count = strategy.partition("-")
    regions = int(count) if count else 0
    if layer != "tiny":
        if regions or name not in ("none", "torch", "recomp"):
            raise SystemExit(f"--layer {layer} runs none, torch and recomp only, not {strategy!r}")
        return _build_other(name, layer)
    torch.manual_seed(0)
    layers = [Layer(extra=max(regions - 2, 0)) for _ in range(LAYERS)]
    if name == "none":
        calls = layers
    elif name == "torch":
        calls = [lambda x, m=m: torch_checkpoint(m, x, use_reentrant=False) for m in layers]
    elif name == "sac":
        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            return (
                CheckpointPolicy.MUST_SAVE
                if op is torch.ops.aten.addmm.default
                else CheckpointPolicy.PREFER_RECOMPUTE
            )

        def context() -> Any:
            return create_selective_checkpoint_contexts(policy)

        calls = [
            lambda x, m=m: torch_checkpoint(m, x, use_reentrant=False, context_fn=context)
            for m in layers
        ]
    elif name == "recomp":
        for layer in layers:
            for i, module in enumerate(_regions(layer, regions)):
                _replace(layer, module, rt.checkpoint_exclude_wrapper(module, name=f"r{i}"))
        calls = [rt.checkpoint_wrapper(m) for m in layers]
    elif name == "remat":
        import torch_remat

        for layer in layers:
            for i, module in enumerate(_regions(layer, regions)):
                _replace(layer, module, _RematRegion(torch_remat.region(module, f"r{i}", recompute=False)))
        calls = [torch_remat.checkpoint(region_name=f"layer{i}")(m) for i, m in enumerate(layers)]
    else:
        raise SystemExit(f"unknown strategy {strategy!r}")

    def forward(x: torch.Tensor) -> torch.Tensor:
        for call in calls:
            x = call(x)
        return x

    return forward


def _build_other(name: str, kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    layers, call, _ = _layers(kind, LAYERS)
    if name == "torch":
        def run(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
            return torch_checkpoint(call, layer, h, use_reentrant=False)  # type: ignore[no-any-return]
    else:
        if name == "recomp":
            layers = [rt.checkpoint_wrapper(m) for m in layers]
        run = call

    def forward(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = run(layer, x)
        return x

    return forward


class _RematRegion(nn.Module):
    """A torch-remat region inside a module (a region is not a Module itself)."""

    def __init__(self, region: Callable[..., Any]) -> None:
        super().__init__()
        self.__dict__["region"] = region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch_remat

        # The output is read by bare ops (GELU, the residual add): torch-remat needs to
        # be told to keep it, as recomp caches a region's output by itself.
        out = self.region(x)
        torch_remat.recompute_needs_tensor(out)
        return out


def _replace(layer: Layer, old: nn.Module, new: nn.Module) -> None:
    for name, child in layer.named_children():
        if child is old:
            setattr(layer, name, new)
            return
    for i, child in enumerate(layer.extra):
        if child is old:
            layer.extra[i] = new
            return
    raise AssertionError("module not found")


def step(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    forward(x).sum().backward()


def count_events(run: Callable[[], Any], event: str) -> int:
    """How many ``event`` events one ``run()`` raises: ``"call"``, Python function calls
    (``sys.setprofile``), or ``"opcode"``, Python bytecodes executed (``sys.settrace``
    with opcode events turned on in every frame). Threads started meanwhile count too."""
    count = 0
    opcodes = event == "opcode"

    def tracer(frame: Any, kind: str, arg: Any) -> Any:
        nonlocal count
        if kind == event:
            count += 1
        if opcodes and kind == "call":
            frame.f_trace_opcodes = True
        return tracer

    # This thread's tracer last in and first out: only ``run()`` is counted.
    install = (threading.settrace, sys.settrace) if opcodes else (threading.setprofile, sys.setprofile)
    for set_tracer in install:
        set_tracer(tracer)
    try:
        run()
    finally:
        for set_tracer in reversed(install):
            set_tracer(None)
    return count


def collector_passes(
    forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, steps: int
) -> dict[str, float]:
    """The cyclic collector's passes while ``steps`` steps of ``forward`` run alone, from
    a full collection: young-generation and full passes per 100 steps, and the CPU
    microseconds all passes took per step."""
    passes = [0, 0, 0]
    spent = started = 0.0

    def watch(phase: str, info: dict[str, int]) -> None:
        nonlocal spent, started
        if phase == "start":
            passes[info["generation"]] += 1
            started = time.process_time()
        else:
            spent += time.process_time() - started

    gc.collect()
    gc.callbacks.append(watch)
    try:
        for _ in range(steps):
            step(forward, x)
    finally:
        gc.callbacks.remove(watch)
    return {
        "young_per_100_steps": passes[0] * 100 / steps,
        "full_per_100_steps": passes[2] * 100 / steps,
        "collector_us_per_step": spent / steps * 1e6,
    }


def measure(
    strategies: list[str], steps: int, layer: str = "tiny", collector_steps: int = 0
) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    x = _layers(layer, 0)[2].requires_grad_()
    forwards = {s: build(s, layer) for s in strategies}
    for _ in range(5):  # warm-up: caches, lazy initialisation
        for forward in forwards.values():
            step(forward, x)
    times: dict[str, list[float]] = {s: [] for s in strategies}
    for _ in range(steps):
        for s, forward in forwards.items():
            start = time.process_time()
            step(forward, x)
            times[s].append(time.process_time() - start)
    calls = {s: count_events(lambda f=f: step(f, x), "call") for s, f in forwards.items()}
    codes = {s: count_events(lambda f=f: step(f, x), "opcode") for s, f in forwards.items()}
    collector = {
        s: collector_passes(f, x, collector_steps) for s, f in forwards.items() if collector_steps
    }
    base_time = statistics.median(times["none"])
    base_calls = calls["none"]
    result = {}
    for s in strategies:
        median = statistics.median(times[s])
        result[s] = {
            "us_per_layer": (median - base_time) / LAYERS * 1e6,
            "calls_per_layer": (calls[s] - base_calls) / LAYERS,
            "bytecodes_per_layer": (codes[s] - codes["none"]) / LAYERS,
            "step_ms": median * 1e3,
            "spread_us_per_layer": _iqr(times[s]) / LAYERS * 1e6,
        }
        if collector:
            passes = collector[s]
            result[s]["gc_young_per_100_steps"] = passes["young_per_100_steps"]
            result[s]["gc_full_per_100_steps"] = passes["full_per_100_steps"]
            result[s]["gc_us_per_layer"] = (
                passes["collector_us_per_step"] - collector["none"]["collector_us_per_step"]
            ) / LAYERS
    return result


def _iqr(values: list[float]) -> float:
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q3 - q1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regions", default="1,4,16", help="regions per layer, comma-separated")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument(
        "--collector-steps",
        type=int,
        default=100,
        help="steps each strategy runs alone to count the garbage collector's passes (0: none)",
    )
    parser.add_argument(
        "--layer",
        choices=LAYER_KINDS,
        default="tiny",
        help="tiny: Linear, GELU, Linear (every strategy); lora: the same with frozen linears "
        "and trainable rank-4 adapters; llama: HF Llama's decoder layer at hidden size 64 "
        "(needs transformers); conv: ResNet's basic block (8 channels, BatchNorm in training "
        "mode). All but tiny: none, torch and recomp only",
    )
    args = parser.parse_args(argv)
    tiny = args.layer == "tiny"
    counts = [int(c) for c in args.regions.split(",")] if tiny else []
    remat = tiny and importlib.util.find_spec("torch_remat") is not None
    strategies = ["none", "torch", "recomp"] + (["sac"] if tiny else [])
    for c in counts:
        strategies.append(f"recomp-{c}")
        if remat:
            strategies.append(f"remat-{c}")
    result = measure(strategies, args.steps, args.layer, args.collector_steps)
    print(
        f"per layer per step above no checkpointing ({LAYERS} {args.layer} layers, "
        f"torch {torch.__version__})"
    )
    collector = args.collector_steps > 0
    print(
        f"{'strategy':<12} {'CPU us':>9} {'spread':>8} {'py calls':>9} {'bytecodes':>10}"
        + (f" {'gc us':>7} {'gc young/100':>12} {'gc full/100':>11}" if collector else "")
    )
    for s, r in result.items():
        if s != "none":
            print(
                f"{s:<12} {r['us_per_layer']:9.1f} {r['spread_us_per_layer']:8.1f} "
                f"{r['calls_per_layer']:9.1f} {r['bytecodes_per_layer']:10.1f}"
                + (
                    f" {r['gc_us_per_layer']:7.1f} {r['gc_young_per_100_steps']:12.0f} "
                    f"{r['gc_full_per_100_steps']:11.2f}"
                    if collector
                    else ""
                )
            )
    ratios = {"recomp/torch": result["recomp"]["us_per_layer"] / result["torch"]["us_per_layer"]}
    for c in counts:
        if remat:
            ratios[f"recomp-{c}/remat-{c}"] = (
                result[f"recomp-{c}"]["us_per_layer"] / result[f"remat-{c}"]["us_per_layer"]
            )
    per_region = {}
    if len(counts) > 1:
        low, high = min(counts), max(counts)
        for name in ("recomp", "remat") if remat else ("recomp",):
            a, b = result[f"{name}-{low}"], result[f"{name}-{high}"]
            per_region[name] = {
                "us": (b["us_per_layer"] - a["us_per_layer"]) / (high - low),
                "calls": (b["calls_per_layer"] - a["calls_per_layer"]) / (high - low),
            }
        if remat:
            ratios["per-region recomp/remat"] = per_region["recomp"]["us"] / per_region["remat"]["us"]
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    for name, r in per_region.items():
        print(f"one more region ({name}): {r['us']:.1f} CPU us, {r['calls']:.1f} py calls per layer")
    if args.json:
        with open(args.json, "w") as f:
            figures = {"per_layer": result, "ratios": ratios, "per_region": per_region}
            json.dump({**figures, "layer": args.layer, "torch": torch.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
