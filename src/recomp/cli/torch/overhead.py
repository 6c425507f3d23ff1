"""Cost of ``checkpoint_exclude_wrapper`` itself, on a tiny op.

Two figures, each the median over repeated trials:

* ``outside_us``: a wrapped call minus a plain call, outside any checkpoint (the
  wrapper is then a pass-through);
* ``in_checkpoint_us``: per wrapped call, a recomp-checkpointed forward and backward of
  ``calls`` wrapped tiny ops minus the same with plain tiny ops. The chain ends in a
  ``sin`` that saves its input, so the backward replays the chain: the figure includes
  recording the call in the forward and returning the cached output in the replay, and
  it is credited with the tiny op the replay no longer runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..results import WrapperOverhead


class Tiny(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.5


def _chain(ops: list[Callable[[torch.Tensor], torch.Tensor]]) -> Callable[[torch.Tensor], Any]:
    def run(x: torch.Tensor) -> torch.Tensor:
        for op in ops:
            x = op(x)
        # sin saves its input: the backward must replay the chain to rebuild it.
        return x.sin()

    return run


def _median_time(fn: Callable[[], Any], repeats: int, inner: int) -> tuple[float, float]:
    """Median wall time and median process CPU time of one ``fn()`` call."""
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(inner):
            fn()
        wall.append((time.perf_counter() - t0) / inner)
        cpu.append((time.process_time() - c0) / inner)
    return statistics.median(wall), statistics.median(cpu)


def measure_overhead(calls: int = 20, repeats: int = 15, inner: int = 20) -> WrapperOverhead:
    from recomp.torch import checkpoint, checkpoint_exclude_wrapper

    torch.set_num_threads(1)
    x = torch.randn(16, requires_grad=True)
    plain_ops: list[Callable[[torch.Tensor], torch.Tensor]] = [Tiny() for _ in range(calls)]
    wrappers = [checkpoint_exclude_wrapper(Tiny()) for _ in range(calls)]
    wrapped_ops: list[Callable[[torch.Tensor], torch.Tensor]] = list(wrappers)
    plain, wrapped = _chain(plain_ops), _chain(wrapped_ops)

    def step(fn: Callable[[torch.Tensor], Any]) -> Callable[[], None]:
        def run() -> None:
            checkpoint(fn, x).sum().backward()

        return run

    def per_call(a: Callable[[], Any], b: Callable[[], Any]) -> tuple[float, float]:
        (wa, ca), (wb, cb) = _median_time(a, repeats, inner), _median_time(b, repeats, inner)
        return (wa - wb) / calls, (ca - cb) / calls

    # Warm up both paths, then interleave the trials.
    for _ in range(3):
        step(plain)()
        step(wrapped)()
        plain(x)
        wrapped(x)
    outside, inside = [], []
    for _ in range(3):
        outside.append(per_call(lambda: wrapped(x), lambda: plain(x)))
        inside.append(per_call(step(wrapped), step(plain)))
    skips = sum(w.region_skips for w in wrappers)
    if skips == 0:
        raise RuntimeError("the overhead benchmark's checkpoint never replayed its regions")
    op_wall, _ = _median_time(lambda: plain(x), repeats, inner)
    return WrapperOverhead(
        op="x * 1.5 on a 16-element tensor",
        calls_per_checkpoint=calls,
        outside_us=statistics.median(w for w, _ in outside) * 1e6,
        in_checkpoint_us=statistics.median(w for w, _ in inside) * 1e6,
        outside_cpu_us=statistics.median(c for _, c in outside) * 1e6,
        in_checkpoint_cpu_us=statistics.median(c for _, c in inside) * 1e6,
        plain_op_us=op_wall / calls * 1e6,
    )
