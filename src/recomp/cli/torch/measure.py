"""PyTorch measuring tools: memory readers, a peak tracker, and FLOPs split by phase.

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` (exact counts of matmuls,
convolutions and attention; element-wise ops count zero). ``SplitFlopCounter`` files
each counted op under one bucket:

* ``forward``: ops of the model's forward call (and the loss);
* ``replay``: ops run during ``backward()`` with grad mode on. Backward formulas run
  with grad mode off (no ``create_graph``), while a non-reentrant checkpoint replays
  its forward under ``torch.enable_grad()``; so this is exactly the recomputed work,
  whatever library runs the checkpoint. ``replay_recomp`` counts the subset during which
  ``recomp.is_recomputing()`` was true, a cross-check for recomp's own checkpoints;
* ``backward``: the gradient computation itself.

Inside ``forward``, ``excluded`` counts the ops that ran inside a kept region (an
excluded module, or the region that SAC and torch-remat keep), and ``layers`` the ops
inside the checkpoint units.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ...plan.modelcall import flop_formulas
from ...torch._compat import TorchDispatchMode, cpu_attention_ops, op_flop_counter
from ..memory import malloc_in_use

# --------------------------------------------------------------------------- memory


class CpuMemory:
    """Reads glibc's heap in use; the peak is sampled around every ATen op (``PeakMode``)."""

    source = "mallinfo2"

    def __init__(self) -> None:
        self._peak = 0

    def read(self) -> int:
        return malloc_in_use()

    def sync(self) -> None:
        pass

    def reset_peak(self) -> None:
        self._peak = self.read()

    def sample(self) -> None:
        now = malloc_in_use()
        if now > self._peak:
            self._peak = now

    def peak(self) -> int:
        self.sample()
        return self._peak

    def peak_context(self) -> contextlib.AbstractContextManager[Any]:
        return PeakMode(self)


class CudaMemory:
    """``torch.cuda.memory_allocated`` and the allocator's own peak."""

    source = "torch.cuda.memory_allocated"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def peak_context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


def memory_reader(device: torch.device) -> CpuMemory | CudaMemory:
    return CudaMemory(device) if device.type == "cuda" else CpuMemory()


class PeakMode(TorchDispatchMode):
    """Samples the heap before and after every ATen op. Temporaries that an op allocates
    and frees internally are not seen; everything that crosses an op boundary is."""

    def __init__(self, memory: CpuMemory) -> None:
        super().__init__()
        self.memory = memory

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.memory.sample()
        out = func(*args, **(kwargs or {}))
        self.memory.sample()
        return out


# --------------------------------------------------------------------------- regions


class RegionTracker:
    """Counts calls of chosen modules and knows whether code runs inside one of them.

    Module hooks fire only when a module really executes: a region that a checkpoint
    skips in its replay is not counted again.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.calls: dict[str, int] = {}
        self._handles: list[Any] = []

    def track(self, modules: dict[str, nn.Module]) -> None:
        for name, module in modules.items():
            self.calls.setdefault(name, 0)
            self._handles.append(module.register_forward_pre_hook(self._enter_hook(name)))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))

    def _enter_hook(self, name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: Any) -> None:
            self.calls[name] += 1
            self.depth += 1

        return hook

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1

    def reset(self) -> None:
        self.depth = 0
        for name in self.calls:
            self.calls[name] = 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


# --------------------------------------------------------------------------- FLOPs


# PyTorch's table lacks the CPU attention kernels (see ``recomp.plan.modelcall``).
CPU_ATTENTION_FORMULAS = flop_formulas(cpu_attention_ops())

BUCKETS = ("forward", "excluded", "layers", "replay", "replay_recomp", "backward", "other")


class SplitFlopCounter(op_flop_counter()):  # type: ignore[misc]
    """``FlopCounterMode`` that also files each count under a phase (see module docstring).

    Set ``phase`` to ``"forward"``, ``"backward"`` or ``"other"`` around the parts of a
    step; attach ``regions`` and ``layers`` trackers for the ``excluded`` and ``layers``
    buckets.
    """

    def __init__(
        self, regions: RegionTracker | None = None, layers: RegionTracker | None = None
    ) -> None:
        super().__init__(display=False, custom_mapping=dict(CPU_ATTENTION_FORMULAS))
        self.phase = "other"
        self.regions = regions
        self.layers = layers
        self.split = dict.fromkeys(BUCKETS, 0)
        self.ops: dict[str, dict[str, int]] = {b: {} for b in BUCKETS}

    def on_op(self, func_packet: Any, flops: int) -> None:
        for bucket in self.buckets():
            self.split[bucket] += flops
            per_op = self.ops[bucket]
            per_op[str(func_packet)] = per_op.get(str(func_packet), 0) + flops

    def buckets(self) -> Iterator[str]:
        if self.phase == "forward":
            yield "forward"
            if self.regions is not None and self.regions.depth > 0:
                yield "excluded"
            if self.layers is not None and self.layers.depth > 0:
                yield "layers"
        elif self.phase == "backward":
            if torch.is_grad_enabled():
                yield "replay"
                if _recomp_is_recomputing():
                    yield "replay_recomp"
            else:
                yield "backward"
        else:
            yield "other"

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous


def _recomp_is_recomputing() -> bool:
    import recomp

    return recomp.is_recomputing()


# --------------------------------------------------------------------------- gradients


def max_grad_diff(
    params: Iterable[nn.Parameter], reference: Iterable[torch.Tensor | None]
) -> float:
    """Largest absolute difference between the gradients of ``params`` and ``reference``."""
    worst = 0.0
    for p, ref in zip(params, reference, strict=True):
        if p.grad is None and ref is None:
            continue
        if p.grad is None or ref is None:
            return float("inf")
        worst = max(worst, (p.grad.detach().float() - ref.float()).abs().max().item())
    return worst
