"""Worker side of test_simulate_parallel.py: ``profile()`` of the paper's GPT layer
(``tests/support/paper_gpt.py``) parallelised with DTensor, tensor parallel ("tp") and
tensor + sequence parallel ("sp"), on real gloo ranks; the test compares each rank's
profile with ``simulate(world_size=2)`` on a fake process group in the pytest process.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))

import paper_gpt
from recomp.plan import profile

SIZES = {"layers": 2, "hidden": 64, "heads": 4}
SEQ, BATCH = 32, 2


def run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    profiles = {}
    for parallel in ("tp", "sp"):
        for keep in (True, False):
            torch.manual_seed(0)
            model = paper_gpt.build(mesh, parallel=parallel, **SIZES)
            x = paper_gpt.inputs(
                mesh, seq=SEQ, batch=BATCH, hidden=SIZES["hidden"], parallel=parallel
            )
            prof = profile(model, x, steps=1, clock="cpu", exclude_collectives=keep)
            profiles[f"{parallel} keep={keep}"] = prof.to_dict()
    return {"rank": rank, "profiles": profiles}
