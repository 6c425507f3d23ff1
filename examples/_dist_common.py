"""Helpers shared by the distributed examples (and reused by tests/distributed).

Every example module defines ``run(rank, world_size, **options) -> dict`` that
does its work inside an initialised default process group and returns a
JSON-serialisable report, and calls :func:`main` under ``if __name__ ==
"__main__"`` so that ``torchrun --nproc_per_node 2 examples/<name>.py`` works.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def named_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by parameter name, local shards for DTensors."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            raise AssertionError(f"parameter {name} got no gradient")
        out[name] = local(p.grad).detach().clone()
    return out


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Compare two name -> tensor dicts: bit-for-bit equality and the largest difference."""
    if set(got) != set(want):
        return {
            "same_names": False,
            "bitwise_equal": False,
            "max_abs_diff": float("inf"),
            "missing": sorted(set(want) - set(got)),
            "unexpected": sorted(set(got) - set(want)),
        }
    max_diff = 0.0
    equal = True
    for name, w in want.items():
        g = got[name]
        if g.shape != w.shape or g.dtype != w.dtype:
            return {
                "same_names": True,
                "bitwise_equal": False,
                "max_abs_diff": float("inf"),
                "mismatch": f"{name}: {tuple(g.shape)}/{g.dtype} vs {tuple(w.shape)}/{w.dtype}",
            }
        equal = equal and torch.equal(g, w)
        if g.numel():
            max_diff = max(max_diff, (g.double() - w.double()).abs().max().item())
    return {"same_names": True, "bitwise_equal": equal, "max_abs_diff": max_diff, "n": len(want)}


def max_rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| relative to the largest |want| (a scale-free closeness measure)."""
    scale = want.double().abs().max().item() or 1.0
    return (got.double() - want.double()).abs().max().item() / scale


def max_scaled_diff(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Largest |got - want| over many tensors, relative to the largest |want| among them all.

    One scale for the whole model: a gradient that is zero in exact arithmetic
    (the key bias of attention) is rounding noise, which a per-tensor relative
    measure would blow up.
    """
    pairs = list(pairs)
    scale = max(w.double().abs().max().item() for _, w in pairs) or 1.0
    return max((g.double() - w.double()).abs().max().item() for g, w in pairs) / scale


def exclude_stats(model: nn.Module) -> dict[str, dict[str, int]]:
    """``region_runs`` / ``region_skips`` of every recomp exclusion wrapper in ``model``."""
    stats = {}
    for name, m in model.named_modules():
        if hasattr(m, "region_runs") and hasattr(m, "region_skips"):
            stats[name] = {"runs": int(m.region_runs), "skips": int(m.region_skips)}
    return stats


def sum_exclude_stats(
    stats: dict[str, dict[str, int]], names: Iterable[str] | None = None
) -> dict[str, int]:
    keys = list(stats) if names is None else list(names)
    return {
        "runs": sum(stats[k]["runs"] for k in keys),
        "skips": sum(stats[k]["skips"] for k in keys),
    }


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def format_counts(counts: dict[str, dict[str, int]]) -> str:
    parts = []
    for phase in ("forward", "replay", "backward"):
        c = counts.get(phase, {})
        parts.append(f"{phase}: " + (" ".join(f"{k}={v}" for k, v in sorted(c.items())) or "-"))
    return " | ".join(parts)


def print_report(report: dict[str, Any], rank: int) -> None:
    """Print the variants' collective counts and gradient agreement (human-readable)."""
    print(f"[rank {rank}] {report.get('title', '')}", flush=True)
    for variant, v in report.get("variants", {}).items():
        line = f"[rank {rank}]   {variant:<32} {format_counts(v['counts'])}"
        if "grads_vs_reference" in v:
            g = v["grads_vs_reference"]
            line += f" | grads vs reference: bitwise_equal={g['bitwise_equal']} max_abs_diff={g['max_abs_diff']:.3g}"
        print(line, flush=True)
    for key, value in report.get("checks", {}).items():
        print(f"[rank {rank}]   check {key}: {value}", flush=True)


def main(run: Callable[..., dict[str, Any]], description: str) -> None:
    """Entry point for ``torchrun``: init gloo from the environment, run, report.

    ``--json-dir DIR`` also writes each rank's report to ``DIR/rank<r>.json``.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json-dir", default=None, help="write each rank's report here")
    opts = parser.parse_args()
    if "RANK" not in os.environ:
        sys.exit("run this with torchrun, e.g. `torchrun --nproc_per_node 2 " + sys.argv[0] + "`")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        report = run(rank, world)
        for r in range(world):
            if r == rank:
                print_report(report, rank)
            dist.barrier()
        if opts.json_dir:
            os.makedirs(opts.json_dir, exist_ok=True)
            path = os.path.join(opts.json_dir, f"rank{rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(report, f)
            os.replace(path + ".tmp", path)
        ok = report.get("ok")
        if rank == 0 and ok is not None:
            print("OK" if ok else "FAILED", flush=True)
        dist.barrier()  # both ranks done communicating before the group goes (see tests)
        if ok is False:
            sys.exit(1)
    finally:
        dist.destroy_process_group()
