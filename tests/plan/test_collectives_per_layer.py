"""Keep or replay the results of collectives, a choice the plan makes per layer: under
tensor and sequence parallelism a profile made with ``exclude_collectives="per-layer"``
(the default) offers each checkpoint both ways, the one that replays the collectives
keeping exactly their results less and replaying exactly their time over the link of
the cost model's hardware more; the plan then replays where the link is fast and keeps
where it is slow and memory allows."""

from __future__ import annotations

import collections
import dataclasses

import pytest

pytest.importorskip("transformers")

from recomp.plan import make_plan
from recomp.plan.cost import ACCELERATORS
from recomp.plan.models import SimulatedModel
from recomp.plan.planfile import replay_collectives_option, replays_collectives

SEQ, HIDDEN, TP = 1024, 4096, 2
H100 = ACCELERATORS["H100 SXM"]
SLOW = dataclasses.replace(H100, name="a slow link", link_bandwidth=5e9)


@pytest.fixture(scope="module")
def profiles():
    model = SimulatedModel("llama-3.1-8b", layers=3, seq=SEQ, tp=TP, sp=True)
    return {hw.name: model.simulate(hardware=hw, swap=False) for hw in (H100, SLOW)}


@pytest.mark.parametrize("hardware", [H100, SLOW], ids=["nvlink", "slow"])
def test_the_replaying_option_keeps_the_results_less_and_replays_their_link_time(
    profiles, hardware
) -> None:
    profile = profiles[hardware.name]
    layer = profile.layers[1]
    gathered = SEQ * HIDDEN * 2  # the sequence all-gathered before attention and the MLP
    for option in ("full", "exclude:self_attn", "exclude:mlp"):
        kept, replayed = layer.option(option), layer.option(replay_collectives_option(option))
        assert replayed.collective_bytes == 0 < kept.collective_bytes
        assert replayed.kept_bytes == kept.kept_bytes - kept.collective_bytes
        assert replayed.replay_flops == kept.replay_flops
    # The full checkpoint's replay reaches the two all-gathers (2 x s x h bf16 gathered)
    # and the attention's reduce-scatter (its s x h input), whose results it keeps
    # otherwise: 2 sbh + 2 sbh / t. Each sends (t - 1) / t of its tensor over the link.
    full, replayed = layer.option("full"), layer.option("full+replay-collectives")
    assert full.collective_bytes == 2 * gathered + gathered // TP
    link_s = 3 * (TP - 1) / TP * gathered / hardware.link_bandwidth
    assert replayed.replay_s - full.replay_s == pytest.approx(link_s, rel=1e-9)


def test_the_plan_replays_where_the_link_is_fast_and_keeps_where_it_is_slow(profiles) -> None:
    fast, slow = profiles[H100.name], profiles[SLOW.name]
    # The same bytes on either hardware: only the price of a replayed collective differs.
    assert fast.uniform_bytes("full") == slow.uniform_bytes("full")
    budget = f"{fast.uniform_bytes('full')}B"
    on_fast, on_slow = make_plan(fast, budget), make_plan(slow, budget)
    replaying = [sum(replays_collectives(lp.option) for lp in p.layers) for p in (on_fast, on_slow)]
    assert replaying[0] > replaying[1]
    # Chosen per layer: between the two uniform plans, the slow link's plan mixes layers
    # that keep the results with layers that replay the collectives.
    low, high = slow.uniform_bytes("full+replay-collectives"), slow.uniform_bytes("full")
    mixed = make_plan(slow, f"{(low + high) // 2}B")
    kinds = collections.Counter(replays_collectives(lp.option) for lp in mixed.layers)
    assert kinds[True] and kinds[False], kinds
    assert any(slow.layers[i].option(lp.option).collective_bytes for i, lp in enumerate(mixed.layers))
    assert mixed.predicted["activation_bytes"] <= (low + high) // 2
