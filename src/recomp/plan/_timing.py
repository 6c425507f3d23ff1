"""The profile's times: module forward times over whole steps, per-op times over repeated
forwards, the averaging of layers that run the same ops, and what a checkpoint's own
bookkeeping costs per saved tensor and per op on this machine's CPU."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from ..torch._compat import TorchDispatchMode
from ._recording import LayerRecord, Recorder, is_wrapper_subclass, run_timed
from .policy import selective_context_fn


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock reading after it counts it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ModuleTimer:
    """Forward times of modules, per call, by pre/post hooks."""

    def __init__(self, device: torch.device, clock: Callable[[], float]) -> None:
        self.device = device
        self.clock = clock
        self.times: dict[str, list[float]] = {}
        self.started: dict[str, float] = {}
        self.handles: list[Any] = []

    def track(self, name: str, module: nn.Module) -> None:
        self.times[name] = []

        def enter(m: nn.Module, args: Any) -> None:
            sync(self.device)
            self.started[name] = self.clock()

        def leave(m: nn.Module, args: Any, out: Any) -> None:
            sync(self.device)
            self.times[name].append(self.clock() - self.started[name])

        self.handles.append(module.register_forward_pre_hook(enter))
        self.handles.append(module.register_forward_hook(leave))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class OpTimer(TorchDispatchMode):
    """Times every ATen op of a forward, in order (decomposing as ``Recorder`` does)."""

    def __init__(self, registry: Any, clock: Callable[[], float]) -> None:
        super().__init__()
        self.registry = registry
        self.clock = clock
        self.seconds: list[float] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(is_wrapper_subclass(t) for t in types):
            return NotImplemented
        out, seconds = run_timed(self, func, args, kwargs or {})
        if seconds is not None:
            self.seconds.append(seconds)
        return out


def retime_ops(
    recorder: Recorder, forward: Callable[[], Any], repeats: int, clock: Callable[[], float]
) -> None:
    """Replace each op's time by the median over the instrumented forward and ``repeats``
    more forwards (one sample per op is noisy). Kept as is if the op sequence changes."""
    ops = sorted(
        (op for record in [recorder.outside, *recorder.layers] for op in record.ops),
        key=lambda op: op.seq,
    )
    samples: list[list[float]] = [[op.seconds] for op in ops]
    for _ in range(repeats):
        timer = OpTimer(recorder.registry, clock)
        with timer:
            out = forward()
        del out
        if len(timer.seconds) != len(ops):
            return
        for column, seconds in zip(samples, timer.seconds):
            column.append(seconds)
    for op, column in zip(ops, samples):
        op.seconds = statistics.median(column)


def average_alike_layers(
    layers: list[tuple[str, nn.Module]],
    candidates: list[list[tuple[str, nn.Module]]],
    records: list[LayerRecord],
    forward_s: dict[str, float],
) -> None:
    """Layers that run the same ops (same type, same op sequence with the same FLOPs and
    regions) get the mean of their times: one noisy sample per layer would otherwise make
    the plan treat identical layers differently."""
    groups: dict[Hashable, list[int]] = {}
    for index, ((_, layer), record) in enumerate(zip(layers, records)):
        ops = tuple(
            (op.flops, -1 if op.span is None else record.spans[op.span].candidate)
            for op in record.ops
        )
        names = tuple(name for name, _ in candidates[index])
        groups.setdefault((type(layer).__name__, names, ops), []).append(index)
    for members in groups.values():
        if len(members) < 2:
            continue
        for position in range(len(records[members[0]].ops)):
            mean = statistics.fmean(records[i].ops[position].seconds for i in members)
            for i in members:
                records[i].ops[position].seconds = mean
        suffixes = ["", *(f".{name}" for name, _ in candidates[members[0]])]
        for suffix in suffixes:
            keys = [layers[i][0] + suffix for i in members]
            mean = statistics.fmean(forward_s[k] for k in keys)
            for k in keys:
                forward_s[k] = mean


# --------------------------------------------------------------------------- overheads

# clock -> (per saved tensor, per op under a selective policy) seconds, on the CPU.
_MEASURED_OVERHEADS: dict[Callable[[], float], tuple[float, float]] = {}


def checkpoint_overheads(clock: Callable[[], float]) -> tuple[float, float]:
    """The CPU seconds a checkpoint's own Python bookkeeping adds per saved tensor and a
    selective policy per op: properties of the machine, measured by the first profile
    of a process with this clock."""
    if clock not in _MEASURED_OVERHEADS:
        _MEASURED_OVERHEADS[clock] = (per_save_seconds(clock), per_policy_op_seconds(clock))
    return _MEASURED_OVERHEADS[clock]


def _tiny_chain(chain: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """``chain`` multiplications of 8 numbers by a weight (two saved tensors each), and
    the input to run them on: ops that cost next to nothing."""
    weight = torch.ones(8, requires_grad=True)

    def chain_fn(t: torch.Tensor) -> torch.Tensor:
        for _ in range(chain):
            t = t * weight
        return t

    return chain_fn, torch.ones(8, requires_grad=True)


def _seconds_per_call(
    fn: Callable[[], None], clock: Callable[[], float], repeat: int = 10
) -> float:
    start = clock()
    for _ in range(repeat):
        fn()
    return (clock() - start) / repeat


def per_save_seconds(clock: Callable[[], float], chain: int = 32) -> float:
    """CPU time a checkpoint spends per saved tensor on its own bookkeeping: the Python
    hooks that pack it in the forward, pack it again in the replay and unpack it in
    backward. Measured on a chain of tiny multiplications (two saves each), checkpointed
    against plain, so that the ops themselves cost next to nothing."""
    from recomp.torch import checkpoint

    chain_fn, x = _tiny_chain(chain)

    def forward() -> None:
        chain_fn(x).sum()

    def plain() -> None:
        chain_fn(x).sum().backward()

    def checkpointed() -> None:
        checkpoint(chain_fn, x).sum().backward()

    for fn in (forward, plain, checkpointed):
        _seconds_per_call(fn, clock, 3)
    samples = []
    for _ in range(5):
        extra = (
            _seconds_per_call(checkpointed, clock)
            - _seconds_per_call(plain, clock)
            - _seconds_per_call(forward, clock)
        )
        samples.append(extra / (2 * chain))
    return max(0.0, statistics.median(samples))


def per_policy_op_seconds(clock: Callable[[], float], chain: int = 32) -> float:
    """CPU time a selective checkpoint's policy adds per op: each op of the layer passes
    its caching dispatch mode in the forward and its cached mode in the replay (Python
    calls). Measured on a chain of tiny multiplications, checkpointed with the policy
    against without."""
    from recomp.torch import checkpoint

    chain_fn, x = _tiny_chain(chain)
    context_fn = selective_context_fn()

    def plain() -> None:
        checkpoint(chain_fn, x).sum().backward()

    def selective() -> None:
        checkpoint(chain_fn, x, context_fn=context_fn).sum().backward()

    for fn in (plain, selective):
        _seconds_per_call(fn, clock, 3)
    samples = [
        (_seconds_per_call(selective, clock) - _seconds_per_call(plain, clock)) / (2 * chain)
        for _ in range(5)
    ]
    return max(0.0, statistics.median(samples))
