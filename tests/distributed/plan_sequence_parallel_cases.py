"""Worker side of test_plan_sequence_parallel.py: ``recomp.plan`` on a TP + SP model.

Each rank profiles the parallelised decoder of ``sequence_parallel_cases`` twice,
with ``exclude_collectives`` True and False, then applies uniform plans (every layer
``none``, ``full`` or ``exclude:attn``) made from the first profile and measures the
activation memory of one step with the allocator (``MALLOC_ARENA_MAX=1``, set by
the test) and the collectives the replay runs.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
from _dist_common import seeded
from torch.distributed.device_mesh import init_device_mesh

from recomp.cli.memory import malloc_in_use
from recomp.plan import apply_plan, make_plan, profile
from recomp.torch.collectives import count_collectives
from sequence_parallel_cases import build

# Large enough that the activations dwarf the autograd graph's and DTensor's own objects.
SIZES = {"layers": 2, "hidden": 128, "heads": 4, "ffn": 256}
BATCH, SEQ = 2, 256
OPTIONS = ("none", "full", "exclude:attn")


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _measure(model: torch.nn.Module, x: torch.Tensor, steps: int = 3) -> dict[str, Any]:
    """Activation bytes (heap after the forward minus before, after two warm-up steps;
    the least of ``steps`` steps: now and then gloo's I/O thread holds a buffer across
    a reading) and the collectives of the last step, per phase."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    for _ in range(2):
        loss_fn(model(x)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    readings = []
    for _ in range(steps):
        gc.collect()
        dist.barrier()
        with count_collectives() as counts:
            before = malloc_in_use()
            loss = loss_fn(model(x))
            readings.append(malloc_in_use() - before)
            loss.backward()
        del loss
        optimizer.zero_grad(set_to_none=False)
    return {"activation_bytes": min(readings), "collectives": counts.as_dict()}


def run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.randn(BATCH, SEQ, SIZES["hidden"], generator=seeded(1))
    report: dict[str, Any] = {"sizes": SIZES, "batch": BATCH, "seq": SEQ, "profiles": {}}
    profiles = {}
    for keep in (True, False):
        prof = profile(build(None, mesh, **SIZES), x, loss_fn, steps=1, exclude_collectives=keep)
        profiles[keep] = prof
        report["profiles"][str(keep)] = {
            "layers": {
                layer.path: {
                    o.name: {"kept": o.kept_bytes, "collective": o.collective_bytes}
                    for o in layer.options
                    if o.name in OPTIONS
                }
                for layer in prof.layers
            },
            "predicted": {
                option: prof.predict([option] * len(prof.layers))["activation_bytes"]
                for option in OPTIONS
            },
            "notes": prof.notes,
        }
    measured: dict[str, Any] = {}
    for keep, prof in profiles.items():
        for option in OPTIONS:
            plan = make_plan(prof, "100%")
            for layer in plan.layers:
                layer.option = option
            model = apply_plan(build(None, mesh, **SIZES), plan)
            measured[f"{option} keep={keep}"] = {
                "exclude_collectives": plan.exclude_collectives,
                **_measure(model, x),
            }
    report["measured"] = measured
    return report
