"""The public surface a user holds, framework-free part: every error class in
``recomp.errors`` (one object wherever it is raised), ``recomp.plan`` kept small with the
solver's types in ``recomp.plan.solver``, and moved names that still work for one release
with a warning naming the new place, as the reference's "Moved names" table says."""

from __future__ import annotations

import pytest

import recomp
import recomp.errors
import recomp.plan
import recomp.plan.solver
from public_surface import (
    assert_moved,
    assert_star_import_is_quiet,
    documented_moves,
    expected_message,
    moves_of,
)
from recomp import _moved


def test_the_documented_table_is_the_one_the_packages_answer_with():
    documented = documented_moves()
    code = {f"{pkg}.{old}": new for pkg, table in _moved.MOVED.items() for old, new in table.items()}
    assert documented == code
    # Each name moves within its own package or to recomp.errors: no import goes upwards.
    for old, new in documented.items():
        package = old.rpartition(".")[0]
        assert new.startswith((package + ".", "recomp.errors.")), (old, new)


def test_the_table_parser_reads_the_rows():
    # The parse must see every package and the example of the brief's form.
    documented = documented_moves()
    assert {old.rpartition(".")[0] for old in documented} == {
        "recomp.torch", "recomp.mindspore", "recomp.plan"
    }
    assert documented["recomp.torch.SwapManager"] == "recomp.torch.hyperparallel.SwapManager"
    assert len(documented) == 39


def test_recomp_plan_is_small():
    assert len(recomp.plan.__all__) <= 20
    internals = {"Choice", "LayerOptions", "NearTie", "Option", "Solution", "evaluate",
                 "minimum_bytes", "solve", "solve_with_ties"}
    assert internals.isdisjoint(recomp.plan.__all__)
    assert internals == set(recomp.plan.solver.__all__)
    assert {"BudgetTooSmallError", "PlanFormatError"}.isdisjoint(recomp.plan.__all__)


@pytest.mark.parametrize(("name", "new"), sorted(moves_of("recomp.plan").items()))
def test_a_moved_planner_name_still_works_and_warns(name, new):
    assert_moved("recomp.plan", name, new)


def test_a_lazy_planner_name_does_not_warn(recwarn):
    pytest.importorskip("torch")  # recomp.plan.profile imports the PyTorch parts
    assert callable(recomp.plan.profile) and callable(recomp.plan.apply_plan)
    assert [w for w in recwarn if "moved to" in str(w.message)] == []


def test_an_unknown_planner_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'solv'"):
        recomp.plan.solv  # noqa: B018


def test_star_import_of_the_planner_is_quiet():
    assert_star_import_is_quiet("recomp.plan")


def test_the_warning_text_names_the_new_place():
    assert expected_message("recomp.plan", "solve", "recomp.plan.solver.solve") == (
        "recomp.plan.solve moved to recomp.plan.solver.solve; the old name goes away in the "
        "next release."
    )


# --------------------------------------------------------------------------- errors


ERROR_CLASSES = {
    name: value
    for name, value in vars(recomp.errors).items()
    if isinstance(value, type) and issubclass(value, (Exception, Warning))
}


def test_every_error_class_is_in_recomp_errors_all():
    assert set(recomp.errors.__all__) == set(ERROR_CLASSES)
    for name in ("SwapPolicyError", "SwapNotSupportedError", "PlanFormatError",
                 "BudgetTooSmallError", "ReplayStateWarning"):
        assert name in recomp.errors.__all__
        assert ERROR_CLASSES[name].__module__ == "recomp.errors"


@pytest.mark.parametrize("name", sorted(ERROR_CLASSES))
def test_recomp_reexports_every_error_as_the_same_object(name):
    assert name in recomp.__all__
    assert getattr(recomp, name) is ERROR_CLASSES[name]


def test_the_planner_raises_the_classes_of_recomp_errors():
    from recomp.plan import budget, planfile, solver

    assert solver.BudgetTooSmallError is recomp.errors.BudgetTooSmallError
    assert planfile.PlanFormatError is recomp.errors.PlanFormatError
    assert budget.format_bytes is recomp.errors.format_bytes
    layers = [solver.LayerOptions("l0", [solver.Option("full", 10), solver.Option("none", 50)])]
    with pytest.raises(recomp.errors.BudgetTooSmallError) as info:
        solver.solve(layers, 5)
    assert (info.value.budget_bytes, info.value.minimum_bytes) == (5, 10)
    with pytest.raises(recomp.errors.PlanFormatError, match="version"):
        recomp.plan.load_plan({"version": 99, "budget_bytes": 0, "layers": []})


def test_error_bases_are_kept():
    e = recomp.errors
    assert issubclass(e.SwapPolicyError, e.RecompError) and issubclass(e.SwapPolicyError, ValueError)
    assert issubclass(e.SwapNotSupportedError, e.RecompError)
    assert issubclass(e.SwapNotSupportedError, NotImplementedError)
    # Planner errors come before anything runs: ValueErrors, not RecompErrors.
    for cls in (e.BudgetTooSmallError, e.PlanFormatError):
        assert issubclass(cls, ValueError) and not issubclass(cls, e.RecompError)


def test_swap_errors_are_one_object_in_the_framework_free_core():
    from recomp import _policy

    assert _policy.SwapPolicyError is recomp.errors.SwapPolicyError
    with pytest.raises(recomp.errors.SwapPolicyError, match="not a policy"):
        _policy.as_policy(42, "policy_fn")
