"""The planner's ``full+partition-inputs`` on 2 gloo ranks (cases in
plan_partition_cases.py): the plan made from a simulated profile of 2 ranks, applied with
``apply_plan(..., partition_inputs=group)``; per partitioned layer, each rank keeps the
bytes the profile predicts (its slice of the layer's input) and gathers it once in the
replay, and the gradients are those of the model without checkpoints, bit for bit."""

from __future__ import annotations

import pytest

from plan_partition_cases import build, inputs, regions
from recomp.plan import make_plan, simulate
from recomp.plan.planfile import PARTITION_INPUTS
from recomp.torch import _compat

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.system,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        _compat.simulation_unsupported() is not None,
        reason=str(_compat.simulation_unsupported()),
    ),
]

HOST = {"name": "toy", "peak_flops": {"float32": 1e12}, "memory_bandwidth": 1e11,
        "link_bandwidth": 1e10, "host_bandwidth": 1e9}  # fmt: skip
OPTIONS = [PARTITION_INPUTS, PARTITION_INPUTS, "full", PARTITION_INPUTS]


def test_each_rank_keeps_the_predicted_slice_and_gradients_are_exact(launcher):
    prof = simulate(build, inputs, device="cpu", hardware=HOST, exclude=regions, world_size=2,
                    partition_inputs=2)  # fmt: skip
    plan = make_plan(prof, "100%")
    for layer, option in zip(plan.layers, OPTIONS, strict=True):
        layer.option = option
    predicted = [
        layer.option(PARTITION_INPUTS).gather_bytes
        for layer, option in zip(prof.layers, OPTIONS)
        if option == PARTITION_INPUTS
    ]
    whole = 96 * 64 * 4
    assert predicted == [whole // 2] * 3
    for r in launcher("plan_partition_cases:run", plan=plan.to_dict()):
        assert r["exact"]
        assert r["kept_bytes"] == predicted  # one call per partitioned layer
        assert r["released_bytes"] == [whole - n for n in predicted]
        assert r["gathers"] == [1, 1, 1]
