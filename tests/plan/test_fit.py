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
    assert sorted(set(options[:16])) != sorted(set(options[16:]))
    # Budgets are bytes per device: a percentage is refused.
    with pytest.raises(ValueError, match="bytes per device"):
        plan_per_rank(profile, params, parallel, "50%", microbatches=4)


def test_no_room_for_the_states_says_so(llama_8b) -> None:
    profile, params = llama_8b
    plan, no_plan = plan_per_rank(profile, params, Parallel(tp=2, sp=True), "20GiB")
    assert plan is None and isinstance(no_plan, NoPlan)
    assert no_plan.least_bytes is None and no_plan.states_bytes > 20 * GiB
    assert "parameters, gradients and optimizer states alone take" in no_plan.describe()


def test_no_room_for_the_activations_names_the_least_and_the_levers() -> None:
    report = will_it_fit(
        "llama-3.1-8b", Parallel(tp=2, sp=True, dp=2, zero=1), seq=8192, batch=2,
        layers=2, device_memory="50GiB",
    )  # fmt: skip
    assert report.plan is None and report.no_plan is not None
    no_plan = report.no_plan
    job = report.jobs["full"]  # the least-keeping uniform option is no smaller
    assert no_plan.least_bytes is not None
    assert no_plan.states_bytes < 50 * GiB < no_plan.states_bytes + no_plan.least_bytes
    assert no_plan.states_bytes == job.ranks[0].total - job.ranks[0].activations
    note = next(n for n in report.notes if n.startswith("no plan"))
    for lever in ("replaying the collectives", "more pipeline stages (pp=2",
                  "a higher ZeRO stage", "a smaller micro-batch (1 sequence"):
        assert lever in note, note
    assert not any(r.strategy.startswith("plan@") for r in report.rows)
