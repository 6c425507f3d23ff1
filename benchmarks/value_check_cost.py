"""What ``determinism_check="values"`` costs: step time and memory, side by side with the
default check, on the built-in Llama-style decoder (every layer checkpointed, attention
excluded, as ``recomp bench``'s ``exclude:attn``).

Time: training steps (forward, backward) alternate between the two settings, so both
see the same machine load; the medians and their ratio are printed. Memory: what the
checkpoints hold between forward and backward, read with glibc's ``mallinfo2`` in a
child process (``MALLOC_ARENA_MAX=1``, after a warm-up step, as the memory tests do),
divided by the number of tensors the checkpoints saved::

    PYTHONPATH=src python benchmarks/value_check_cost.py                 # hidden 256, seq 256
    PYTHONPATH=src python benchmarks/value_check_cost.py --hidden 64 --seq 32   # a tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import recomp.torch as rt
from recomp.cli.memory import malloc_in_use
from recomp.cli.torch.models import Attention, DecoderLayer, llama


def build(args: argparse.Namespace, check: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = llama(layers=args.layers, hidden=args.hidden, heads=4)
    rt.apply_activation_checkpointing(
        model, checkpoint_fn=DecoderLayer, exclude_fn=Attention, determinism_check=check
    )
    return model


def step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()


def timing(args: argparse.Namespace) -> dict[str, float]:
    models = {check: build(args, check) for check in ("default", "values")}
    x = torch.randn(args.batch, args.seq, args.hidden)
    times: dict[str, list[float]] = {check: [] for check in models}
    for model in models.values():
        step(model, x)  # warm-up
    for _ in range(args.steps):
        for check, model in models.items():
            start = time.perf_counter()
            step(model, x)
            times[check].append(time.perf_counter() - start)
    result = {f"{check} ms": statistics.median(t) * 1e3 for check, t in times.items()}
    result["ratio"] = result["values ms"] / result["default ms"]
    return result


def held_between_forward_and_backward(args: argparse.Namespace, check: str) -> dict[str, int]:
    """Run in the child: bytes held after the forward, and the fingerprints taken."""
    from recomp.torch import _value_check

    taken = 0
    fingerprint = _value_check._fingerprint

    def counted(t: torch.Tensor) -> torch.Tensor | None:
        nonlocal taken
        taken += 1
        return fingerprint(t)

    _value_check._fingerprint = counted
    model = build(args, check)
    x = torch.randn(args.batch, args.seq, args.hidden)
    step(model, x)  # warm-up
    taken = 0
    before = malloc_in_use()
    out = model(x).pow(2).mean()
    held = malloc_in_use() - before
    fingerprints = taken
    out.backward()
    return {"held": held, "fingerprints": fingerprints}


def memory(args: argparse.Namespace) -> dict[str, float]:
    results = {}
    for check in ("default", "values"):
        env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--child", check],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        results[check] = json.loads(proc.stdout.strip().splitlines()[-1])
    count = results["values"]["fingerprints"]
    extra = results["values"]["held"] - results["default"]["held"]
    return {
        "held by default, bytes": results["default"]["held"],
        "held by values, bytes": results["values"]["held"],
        "saved tensors fingerprinted": count,
        "bytes per saved tensor": extra / count if count else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--child", choices=("default", "values"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        print(json.dumps(held_between_forward_and_backward(args, args.child)))
        return
    print(json.dumps({"time": timing(args), "memory": memory(args)}, indent=1))


if __name__ == "__main__":
    main()
