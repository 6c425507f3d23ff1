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

Nothing here imports a framework until ``profile`` or ``apply_plan`` is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .budget import Budget, BudgetTooSmallError, parse_budget
from .job import JobMemory, Parallel, Precision, job_memory, model_params
from .planfile import LayerPlan, Plan, PlanFormatError, load_plan, save_plan
from .planner import OptionSlot, Profile, make_plan, plan_table, profile_table
from .solver import (
    Choice,
    LayerOptions,
    NearTie,
    Option,
    Solution,
    evaluate,
    minimum_bytes,
    solve,
    solve_with_ties,
)

if TYPE_CHECKING:  # imported on first use (below); named here for type checkers and docs
    from .apply import apply_plan, compile_with_plan
    from .profiler import profile
    from .simulation import simulate

__all__ = [
    "Budget",
    "BudgetTooSmallError",
    "Choice",
    "JobMemory",
    "LayerOptions",
    "LayerPlan",
    "NearTie",
    "Option",
    "OptionSlot",
    "Parallel",
    "Plan",
    "PlanFormatError",
    "Precision",
    "Profile",
    "Solution",
    "apply_plan",
    "compile_with_plan",
    "evaluate",
    "job_memory",
    "load_plan",
    "make_plan",
    "minimum_bytes",
    "model_params",
    "parse_budget",
    "plan_table",
    "profile",
    "profile_table",
    "save_plan",
    "simulate",
    "solve",
    "solve_with_ties",
]


def __getattr__(name: str) -> Any:
    # The PyTorch parts are imported on first use.
    if name == "profile":
        from .profiler import profile

        return profile
    if name == "simulate":
        from .simulation import simulate

        return simulate
    if name == "apply_plan":
        from .apply import apply_plan

        return apply_plan
    if name == "compile_with_plan":
        from .apply import compile_with_plan

        return compile_with_plan
    raise AttributeError(f"module 'recomp.plan' has no attribute {name!r}")
