"""Python calls per excluded-region call: recomp's own cost of keeping a call out of the replay.

A recomp-checkpointed forward and backward of ``CALLS`` tiny wrapped ops (``x * 1.5``
in a ``checkpoint_exclude_wrapper``) is counted against the same chain of plain ops;
the difference, divided by ``CALLS``, is what one region call costs in Python function
calls: recording it in the forward and handing its cached output to the replay, less
the tiny op the replay no longer runs. The checkpoint's own cost is in both and drops
out. Unlike a time, the count is the same on every run of the same versions, so a
change that adds work to the path of every region call shows at once::

    python benchmarks/region_call_cost.py          # Python calls (sys.setprofile "call")
    python benchmarks/region_call_cost.py --builtins   # calls into builtins counted too

Run it with recomp importable (``PYTHONPATH=src``, or the development environment).
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from recomp.torch import checkpoint, checkpoint_exclude_wrapper

CALLS = 20


class Tiny(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.5


def _chain(ops: list[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        for op in ops:
            x = op(x)
        return x.sin()  # saves its input: the backward replays the chain

    return run


def count_calls(step: Callable[[], Any], events: frozenset[str]) -> int:
    """How many profiler events of ``events`` one ``step()`` makes, on every thread."""
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event in events:
            count += 1

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return count


def per_region_call(builtins: bool = False) -> float:
    events = frozenset({"call", "c_call"} if builtins else {"call"})
    x = torch.randn(16, requires_grad=True)
    plain = _chain([Tiny() for _ in range(CALLS)])
    wrapped = _chain([checkpoint_exclude_wrapper(Tiny()) for _ in range(CALLS)])

    def step(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        return lambda: checkpoint(fn, x).sum().backward()

    for _ in range(3):  # first calls fill caches (pytree leaf types, class lookups)
        step(plain)()
        step(wrapped)()
    with_regions = min(count_calls(step(wrapped), events) for _ in range(3))
    without = min(count_calls(step(plain), events) for _ in range(3))
    return (with_regions - without) / CALLS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--builtins", action="store_true", help="count calls into builtins too")
    args = parser.parse_args(argv)
    figure = per_region_call(args.builtins)
    kind = "Python and builtin" if args.builtins else "Python"
    print(f"{figure:.2f} {kind} calls per excluded-region call (torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
