"""Loss parallelism and context parallelism, simulated against real runs on 2 gloo ranks
(fit_layouts_cases.py does the work): a small Llama built by ``recomp.plan.models``,
``simulate()`` of it on a fake group of 2 against ``profile()`` on each real rank
(every count but times equal), and the bytes autograd holds for backward at the end of
one forward on each rank equal to what ``job_memory`` predicts from the simulated
profile. Context parallelism's gradients, summed over the ranks, are the whole
sequence's; loss parallelism gives the loss of the gathered logits."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.system, pytest.mark.timeout(300)]

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from fit_layouts_cases import LAYOUTS, simulated  # noqa: E402
from profile_counts import profile_counts  # noqa: E402
from recomp.plan import Parallel  # noqa: E402
from recomp.plan.job import job_memory, model_params  # noqa: E402
from recomp.plan.planner import Profile  # noqa: E402


@pytest.fixture(scope="module")
def ranks(launcher):
    return launcher("fit_layouts_cases:run", timeout=240)


@pytest.fixture(scope="module")
def simulations():
    return {name: simulated(name).simulate(hardware=None) for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_simulation_counts_what_each_real_rank_keeps(ranks, simulations, layout):
    simulation = simulations[layout]
    params = model_params(simulated(layout).meta_model())
    parallel = Parallel(**LAYOUTS[layout])
    predicted = job_memory(params, parallel, activations=simulation, option="none", microbatches=1)
    for rank in ranks:
        measured = profile_counts(Profile.from_dict(rank[layout]["profile"]))
        expected = profile_counts(simulation)
        for got, want in zip(measured.pop("layers"), expected.pop("layers"), strict=True):
            for key in want:
                assert got[key] == want[key], (rank["rank"], want["path"], key)
        assert measured == expected, rank["rank"]
        # What autograd holds, and the loss itself (an fp32 scalar) that the step holds
        # until its backward, which the profile counts among what is kept.
        assert rank[layout]["saved"] + 4 == predicted.ranks[0].saved, rank["rank"]


def test_loss_parallelism_keeps_each_ranks_vocabulary_shard(ranks, simulations):
    tokens, vocab = 2 * 32, 512
    gathered, sharded = simulations["tp"], simulations["tp+loss_parallel"]
    # The fp32 log-softmax of the vocabulary shard (half) instead of the whole.
    assert gathered.after_layers_bytes - sharded.after_layers_bytes == tokens * vocab * 4 // 2
    for rank in ranks:
        assert rank["tp"]["saved"] - rank["tp+loss_parallel"]["saved"] == tokens * vocab * 4 // 2
        assert rank["tp+loss_parallel"]["loss"] == pytest.approx(rank["tp"]["loss"], rel=1e-5)


def test_context_parallel_ranks_keep_half_and_train_as_the_whole_sequence(ranks, simulations):
    for rank in ranks:
        assert rank["cp"]["gradients_match"], rank["rank"]
    cp = simulations["cp"]
    assert cp.layout == {"tp": 1, "sp": False, "cp": 2, "loss_parallel": False}
