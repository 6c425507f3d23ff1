"""Machine instructions per layer per step of each way of checkpointing, counted by
valgrind's cachegrind: the loop of ``host_cost.py``, one strategy per process.

CPU time moves by a few per cent between processes on a shared machine, and the Python
bytecodes ``host_cost.py`` counts weigh every bytecode alike: a C loop over a ``map`` is
a few bytecodes and may cost more than the Python loop it replaced. The instructions the
process executes are what the host pays, and they repeat to about 0.5 % between
processes (the hash seed is fixed; what is left is where memory lands: no checkpointing
counted 691,100 and 694,400 instructions per tiny layer per step in two runs of the same
code). For each strategy this runs the loop twice under cachegrind (``--cache-sim=no``),
``--short`` and ``--long`` steps after the warm-up, and reports the difference divided by
the extra steps and the layers: the count per layer per step, without the start-up
(imports, building the model), above the ``none`` strategy. A difference between two
versions of the code smaller than about 3,000 instructions per layer is not seen. Where
the sources lie counts too: compare two versions from copies at paths of the same length
(``PYTHONPATH=/tmp/old/src`` against ``PYTHONPATH=/tmp/new/src``), or the difference of
the paths moves the count by several thousand instructions per layer.

The garbage collector is off by default (a full collection, then ``gc.disable()``, after
the warm-up): its passes depend on everything the process made before, and one full pass
over every object of the process (once in a few hundred steps here) falls in the counted
steps or not and outweighs most changes. ``--collector`` leaves it on; ``host_cost.py``
counts its passes and their time over many steps.

    python benchmarks/host_instructions.py                        # none, torch, recomp
    python benchmarks/host_instructions.py --strategies none,torch,recomp-4 --layer tiny
    python benchmarks/host_instructions.py --layer llama --collector

Needs valgrind on the path; runs up to ``--jobs`` processes at once (each a few minutes:
valgrind runs the loop about 50 times slower). Run it with recomp importable
(``PYTHONPATH=src``, or the development environment).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys

LAYERS = 32  # as host_cost.LAYERS (not imported here: the parent process needs no torch)
_TOTAL = re.compile(r"I\s+refs:\s+([\d,]+)")


def _child(strategy: str, steps: int, layer: str, collector: bool) -> None:
    """Run ``steps`` steps of ``strategy`` after the warm-up (in the process valgrind
    counts)."""
    import gc

    import host_cost  # benchmarks/ is on the path: this file's folder
    import torch

    torch.set_num_threads(1)
    x = host_cost._layers(layer, 0)[2].requires_grad_()
    forward = host_cost.build(strategy, layer)
    for _ in range(5):
        host_cost.step(forward, x)
    if not collector:
        gc.collect()
        gc.disable()
    for _ in range(steps):
        host_cost.step(forward, x)


def count(strategy: str, steps: int, layer: str, collector: bool) -> int:
    """The instructions one process running ``steps`` steps of ``strategy`` executes."""
    command = [
        "valgrind",
        "--tool=cachegrind",
        "--cache-sim=no",
        "--cachegrind-out-file=/dev/null",
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        strategy,
        str(steps),
        layer,
        "1" if collector else "0",
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    run = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    found = _TOTAL.search(run.stderr)
    if run.returncode != 0 or found is None:
        raise RuntimeError(
            f"cachegrind on {strategy} ({steps} steps) failed:\n{run.stderr[-2000:]}"
        )
    return int(found.group(1).replace(",", ""))


def measure(
    strategies: list[str], layer: str, short: int, long: int, collector: bool, jobs: int
) -> dict[str, float]:
    """Instructions per layer per step of each strategy (not above ``none``)."""
    runs = [(s, n) for s in strategies for n in (short, long)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        totals = dict(
            zip(runs, pool.map(lambda r: count(r[0], r[1], layer, collector), runs), strict=True)
        )
    return {s: (totals[s, long] - totals[s, short]) / (long - short) / LAYERS for s in strategies}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        strategy, steps, layer, collector = argv[1:5]
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        _child(strategy, int(steps), layer, collector == "1")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--strategies",
        default="none,torch,recomp",
        help="comma-separated, as host_cost.py names them (none first: the base)",
    )
    parser.add_argument("--layer", default="tiny", help="as host_cost.py's --layer")
    parser.add_argument("--short", type=int, default=5, help="steps of the shorter run")
    parser.add_argument("--long", type=int, default=25, help="steps of the longer run")
    parser.add_argument("--collector", action="store_true", help="leave the collector on")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    strategies = args.strategies.split(",")
    if strategies[0] != "none":
        parser.error("--strategies: start with none, the base the others are counted above")
    if args.long <= args.short:
        parser.error("--long must be more steps than --short")
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not on the path (apt install valgrind)")
    per_layer = measure(
        strategies, args.layer, args.short, args.long, args.collector, args.jobs
    )
    base = per_layer["none"]
    above = {s: per_layer[s] - base for s in strategies if s != "none"}
    print(
        f"machine instructions per layer per step above no checkpointing ({LAYERS} "
        f"{args.layer} layers, collector {'on' if args.collector else 'off'})"
    )
    for s, n in above.items():
        ratio = f"  {n / above['torch']:.3f}x torch" if "torch" in above and s != "torch" else ""
        print(f"{s:<12} {n:12,.0f}{ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"layer": args.layer, "collector": args.collector, "per_layer": per_layer}, f
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
