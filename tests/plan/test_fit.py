"""``recomp.plan.fit``: the plan made per pipeline rank (``plan_per_rank``) fits every
rank as the whole-job count (``job_memory``) finds it, each rank planned for the room
its own states and schedule leave; and when nothing fits, ``NoPlan`` says which rank,
by how much, and the levers the layout has left (``will_it_fit``'s note)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from recomp.plan import Budget, Parallel
from recomp.plan.fit import NoPlan, plan_per_rank, will_it_fit
from recomp.plan.job import job_memory, model_params
from recomp.plan.models import SimulatedModel

GiB = 1 << 30


@pytest.fixture(scope="module")
def llama_8b():
    model = SimulatedModel("llama-3.1-8b", layers=2, seq=2048, tp=2, sp=True)
    return model.simulate(hardware="H100 SXM"), model_params(model.meta_model())


def test_each_pipeline_rank_is_planned_for_its_own_room(llama_8b) -> None:
    profile, params = llama_8b
    parallel = Parallel(tp=2, sp=True, pp=2)
    budget = Budget("38GiB", nbytes=38 * GiB)
    plan, no_plan = plan_per_rank(profile, params, parallel, budget, microbatches=4)
    assert no_plan is None and plan is not None
    job = job_memory(params, parallel, activations=profile, plan=plan, microbatches=4)
    assert all(r.total <= budget.nbytes for r in job.ranks)
    # Each rank uses the room it has (the first holds two micro-batches under 1F1B, the
    # last one, with the loss's backward on top), so their layers are planned apart.
    assert all(r.total > 0.99 * budget.nbytes for r in job.ranks)
    assert job.ranks[1].transient == profile.loss_backward_bytes
    options = [lp.option for lp in plan.layers]
    assert sorted(options[:16]) != sorted(options[16:])
    # Budgets are bytes per device: a percentage is refused.
    with pytest.raises(ValueError, match="bytes per device"):
        plan_per_rank(profile, params, parallel, "50%", microbatches=4)


def test_no_room_for_the_states_says_so(llama_8b) -> None:
    profile, params = llama_8b
    plan, no_plan = plan_per_rank(profile, params, Parallel(tp=2, sp=True), "20GiB")
    assert plan is None and isinstance(no_plan, NoPlan)
    assert no_plan.least_bytes is None and no_plan.states_bytes > 20 * GiB
    assert "parameters, gradients and optimizer states alone take" in no_plan.describe()


@pytest.mark.parametrize("collectives", ["per-layer", True])
def test_no_room_for_the_activations_names_the_least_and_the_levers(collectives) -> None:
    report = will_it_fit(
        "llama-3.1-8b", Parallel(tp=2, sp=True, dp=2, zero=1), seq=8192, batch=2,
        layers=2, device_memory="50GiB", exclude_collectives=collectives,
    )  # fmt: skip
    assert report.plan is None and report.no_plan is not None
    no_plan = report.no_plan
    job = report.jobs["full"]
    assert no_plan.least_bytes is not None
    assert no_plan.states_bytes < 50 * GiB < no_plan.states_bytes + no_plan.least_bytes
    assert no_plan.states_bytes == job.ranks[0].total - job.ranks[0].activations
    note = next(n for n in report.notes if n.startswith("no plan"))
    for lever in ("more pipeline stages (pp=2", "a higher ZeRO stage over the 2",
                  "a smaller micro-batch (1 sequence"):
        assert lever in note, note
    # Replaying the collectives is a lever only where the plan could not choose it.
    assert ("replaying the collectives" in note) is (collectives is True)
    assert not any(r.strategy.startswith("plan@") for r in report.rows)


# ------------------------------------------------------- Llama-3.1-405B, Meta's layout

# Meta's pre-training layout of Llama-3.1-405B (The Llama 3 Herd of Models, section
# 3.3.2): TP 8 with sequence parallelism, 16 pipeline stages with one layer fewer on the
# first and the last, sequence 8192, 1F1B over 32 micro-batches of one sequence, bf16.
META_405B = {
    "seq": 8192, "schedule": "1F1B", "microbatches": 32,
    "stage_layers": [7] + [8] * 14 + [7], "hardware": "H100 SXM",
}  # fmt: skip
MiB = 1 << 20


@pytest.fixture(scope="module")
def meta_405b():
    return will_it_fit("llama-3.1-405b", Parallel(tp=8, sp=True, pp=16), **META_405B)


def _rank_totals(report, strategy):
    return [r.total for r in report.rows if r.strategy == strategy]


def test_405b_in_metas_layout_gets_a_plan_on_80gb_h100s(meta_405b) -> None:
    report = meta_405b
    assert report.budget_bytes == 80 * 10**9  # the H100 SXM's memory
    assert report.plan is not None and report.no_plan is None
    plan_rows = [r for r in report.rows if r.strategy == report.plan_strategy]
    assert len(plan_rows) == 16 and all(r.fits for r in plan_rows)
    # Keeping the collectives' results everywhere (recomp's checkpoint default) fits
    # only the last ranks, which hold few micro-batches; full checkpointing with the
    # collectives replayed fits every rank.
    assert not all(t <= report.budget_bytes for t in _rank_totals(report, "full"))
    assert all(t <= report.budget_bytes for t in _rank_totals(report, "full+replay-collectives"))
    # The plan replays them where it must, not everywhere.
    options = [lp.option for lp in report.plan.layers]
    assert any("replay-collectives" in o for o in options)
    assert not all("replay-collectives" in o for o in options)


def test_405b_full_checkpointing_with_the_collectives_replayed_per_rank(meta_405b) -> None:
    """Exact: each layer keeps its input, this rank's sequence share (s h / t bf16:
    32 MiB); the rotary embedding's tables (cos and sin, s x 128 bf16: 4 MiB) are kept
    once per micro-batch; rank r of 1F1B holds 16 - r micro-batches."""
    job = meta_405b.jobs["full+replay-collectives"]
    layer_input = 8192 * 16384 * 2 // 8
    tables = 2 * 8192 * 128 * 2
    assert (layer_input, tables) == (32 * MiB, 4 * MiB)
    stages = META_405B["stage_layers"]
    for rank in job.ranks[:-1]:
        held = 16 - rank.rank
        assert rank.peak.microbatches == held
        assert rank.saved == held * (stages[rank.rank] * layer_input + tables)
    # The first rank holds no more than the second but for one micro-batch of
    # activations and the embedding's states (a vocabulary shard per TP rank).
    first, second = job.ranks[0], job.ranks[1]
    per_microbatch = stages[0] * layer_input + tables
    embedding = 128256 * 16384 // 8 * 18  # bf16-adam: 18 bytes per parameter
    assert first.total <= second.total + per_microbatch + embedding
    # The last rank holds one micro-batch and the head's: its peak falls in the
    # loss's backward (the bf16 logits and two fp32 logits-sized gradients).
    last = job.ranks[-1]
    assert last.transient == meta_405b.profile.loss_backward_bytes == 8192 * 128256 * 10


def test_405b_keeping_every_collective_gets_no_plan_and_says_what_to_change() -> None:
    report = will_it_fit(
        "llama-3.1-405b", Parallel(tp=8, sp=True, pp=16), exclude_collectives=True, **META_405B
    )
    assert report.plan is None and report.no_plan is not None
    assert report.no_plan.rank == 0 and report.no_plan.held == 16
    note = next(n for n in report.notes if n.startswith("no plan"))
    assert "no plan: pipeline rank 0 needs at least" in note
    for lever in ("replaying the collectives", "more pipeline stages (pp=32",
                  "ZeRO over data-parallel ranks", "shorter sequences than 8192"):
        assert lever in note, note
