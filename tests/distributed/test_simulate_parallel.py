"""``simulate(world_size=2)`` on a fake process group against ``profile()`` on 2 gloo ranks
(cases in simulate_parallel_cases.py): the paper's GPT layer with DTensor tensor
parallelism, and with tensor + sequence parallelism, checkpoints keeping collective
results or not. Every byte count and FLOP count of every option must be equal (device
"cpu" in both, so that the kernels save the same tensors); only times differ.
"""

from __future__ import annotations

import functools

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.system, pytest.mark.timeout(240)]

torch = pytest.importorskip("torch")

import paper_gpt  # noqa: E402
from profile_counts import profile_counts  # noqa: E402
from recomp.plan import simulate  # noqa: E402
from recomp.plan.planner import Profile  # noqa: E402
from simulate_parallel_cases import BATCH, SEQ, SIZES  # noqa: E402

WORLD_SIZE = 2




@pytest.fixture(scope="module")
def reports(launcher):
    return launcher("simulate_parallel_cases:run")


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("parallel", ["tp", "sp"])
def test_simulated_counts_equal_each_ranks_measured_profile(reports, parallel, keep):
    simulated = simulate(
        functools.partial(paper_gpt.build, parallel=parallel, **SIZES),
        functools.partial(
            paper_gpt.inputs, seq=SEQ, batch=BATCH, hidden=SIZES["hidden"], parallel=parallel
        ),
        world_size=WORLD_SIZE,
        device="cpu",
        exclude_collectives=keep,
    )
    expected = profile_counts(simulated)
    for report in reports:
        measured = Profile.from_dict(report["profiles"][f"{parallel} keep={keep}"])
        assert profile_counts(measured) == expected, report["rank"]
    # The comparison is not vacuous: collectives were seen, and kept when asked.
    kept = [o.collective_bytes for layer in simulated.layers for o in layer.options]
    assert (max(kept) > 0) is keep
    assert any("collective" in note for note in simulated.notes)
