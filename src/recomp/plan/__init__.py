"""The planner: the fastest checkpointing plan that fits a memory budget.

A library, which the ``recomp plan`` command (``recomp.cli.plan``) is built on. Profile
a model on its own inputs, choose per layer no checkpoint, full checkpoint or a
checkpoint with some regions excluded, so that the predicted step time is least while
the predicted activation memory fits the budget, and apply the choice::

    from recomp.plan import profile, make_plan, apply_plan, save_plan

    prof = profile(model, batch, loss_fn)          # on a copy; the model is not changed
    plan = make_plan(prof, "50%")                  # or "6GiB"
    save_plan(plan, "plan.json")
    apply_plan(model, plan)                        # recomp.torch wrappers, in place

Nothing here imports a framework until ``profile`` or ``apply_plan`` is used. The exact
solver on options of your own is ``recomp.plan.solver``; the planner's errors
(``BudgetTooSmallError``, ``PlanFormatError``) are in ``recomp.errors``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._moved import moved_names
from .budget import Budget, parse_budget
from .job import JobMemory, Parallel, Precision, job_memory, model_params
from .planfile import LayerPlan, Plan, load_plan, save_plan
from .planner import OptionSlot, Profile, make_plan, plan_table, profile_table

if TYPE_CHECKING:  # imported on first use (below); named here for type checkers and docs
    from .apply import apply_plan, compile_with_plan
    from .profiler import profile
    from .simulation import simulate

__all__ = [
    "Budget",
    "JobMemory",
    "LayerPlan",
    "OptionSlot",
    "Parallel",
    "Plan",
    "Precision",
    "Profile",
    "apply_plan",
    "compile_with_plan",
    "job_memory",
    "load_plan",
    "make_plan",
    "model_params",
    "parse_budget",
    "plan_table",
    "profile",
    "profile_table",
    "save_plan",
    "simulate",
]


# The PyTorch parts are imported on first use; names that moved (to .solver and
# recomp.errors) warn for one release (NOTE [ Moved names ] in recomp._moved).
__getattr__ = moved_names(
    __name__,
    lazy={
        "apply_plan": "recomp.plan.apply",
        "compile_with_plan": "recomp.plan.apply",
        "profile": "recomp.plan.profiler",
        "simulate": "recomp.plan.simulation",
    },
)
