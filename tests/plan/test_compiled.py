"""Plans for compiled models (``recomp.plan.compiled``): ``profile(torch.compile(model))``
asks PyTorch's partitioner what it saves at each memory budget; a plan is the budget
that lands on the user's bytes, optionally with regions kept whole.

Checked here: the profile names the original's paths and the backend; plans fit their
budget and keep more as the budget grows, replaying less; the predicted bytes are the
allocator's in a compiled run (aot_eager and inductor); kept regions are never
recomputed; ``compile_with_plan`` compiles with the plan's budget and restores the
setting; the plan file round-trips; misuse gets errors naming the fix."""

from __future__ import annotations

import copy
import json

import pytest

import paths

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from memory import run_measured  # noqa: E402
from recomp.cli.torch.models import Attention, llama  # noqa: E402
from recomp.errors import BudgetTooSmallError, PlanFormatError  # noqa: E402
from recomp.plan import (  # noqa: E402
    compile_with_plan,
    load_plan,
    make_plan,
    profile,
)
from recomp.plan.compiled import MIN_BUDGET, CompiledProfile  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _sum_loss(y: torch.Tensor) -> torch.Tensor:
    # Saves nothing outside the compiled model: every byte held is the graph's.
    return y.sum()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return llama(layers=2, hidden=32, heads=2)


X = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def prof() -> CompiledProfile:
    return profile(torch.compile(_model(), backend="aot_eager"), X, _sum_loss)


@pytest.fixture(scope="module")
def kept_prof() -> CompiledProfile:
    def is_attention(m: nn.Module) -> bool:
        return isinstance(m, Attention)

    return profile(torch.compile(_model(), backend="aot_eager"), X, _sum_loss, keep=is_attention)


def test_the_profile_of_a_compiled_model_is_compiled(prof):
    assert isinstance(prof, CompiledProfile)
    assert prof.backend == "aot_eager"
    assert [p for p, _ in prof.layers] == ["layers.0", "layers.1"]  # no _orig_mod.
    assert prof.graphs == 1 and prof.notes == [] and prof.outside_bytes == 0
    # Compiled, the partitioner's default already keeps less than eager no-checkpoint
    # would, and its least is nothing but the graph's inputs.
    assert prof.least.saved_bytes == 0 < prof.default.saved_bytes


def test_plans_fit_and_trade_bytes_for_recompute(prof):
    plans = [make_plan(prof, b) for b in ("0%", "25%", "50%", "100%")]
    kept = [p.predicted["activation_bytes"] for p in plans]
    flops = [p.predicted["replay_flops"] for p in plans]
    budgets = [p.compiled["activation_memory_budget"] for p in plans]
    for plan in plans:
        assert plan.version == 3 and plan.compiled["backend"] == "aot_eager"
        assert plan.predicted["activation_bytes"] <= plan.budget_bytes
        assert [layer.option for layer in plan.layers] == ["partitioner"] * 2
    assert kept == sorted(kept) and kept[0] == 0 and kept[-1] == prof.default.saved_bytes
    assert flops == sorted(flops, reverse=True) and flops[-1] == 0 < flops[0]
    assert budgets == sorted(budgets) and budgets[0] == MIN_BUDGET and budgets[-1] == 1.0
    # The bytes of each plan are the partitioner's at that budget, exactly.
    assert prof.outcome(budgets[1]).saved_bytes == kept[1]
    # Per layer, the saved bytes add up to at most the plan's (the final norm aside).
    assert 0 <= kept[2] - sum(layer.kept_bytes for layer in plans[2].layers) <= 4 * 2 * 16 * 32
    assert all(layer.kept_bytes > 0 for layer in plans[3].layers)


def test_a_byte_budget_below_the_least_is_refused_with_the_minimum(kept_prof):
    least = kept_prof.least.saved_bytes
    with pytest.raises(BudgetTooSmallError, match="compiled") as info:
        make_plan(kept_prof, f"{least - 1}B")
    assert info.value.minimum_bytes == least
    assert make_plan(kept_prof, f"{least}B").predicted["activation_bytes"] == least


def test_kept_regions_stay_saved_at_every_budget(prof, kept_prof):
    plan = make_plan(kept_prof, "0%")
    assert [layer.option for layer in plan.layers] == ["partitioner+exclude:attn"] * 2
    # At its least the partitioner still saves the attention's values (MUST_SAVE), and
    # recomputes fewer FLOPs than without them: the attention's matmuls are not redone.
    assert kept_prof.least.saved_bytes > 0
    assert plan.predicted["replay_flops"] < make_plan(prof, "0%").predicted["replay_flops"]
    # With nothing marked the two profiles agree at the default.
    assert kept_prof.default.saved_bytes == prof.default.saved_bytes


@pytest.mark.parametrize("which", ["prof", "kept_prof"])
def test_compiled_plans_train_like_the_model(which, request):
    """At the least budget (most recompute), with and without kept regions: gradients
    those of the eager model (bit for bit on 2.14, where aot_eager runs the same ATen
    ops in the same order; within rounding on 2.9, which reorders a norm's reduction)."""
    plan = make_plan(request.getfixturevalue(which), "0%")
    model = _model()
    compile_with_plan(model, plan)(X).sum().backward()
    reference = _model()
    reference(X).sum().backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_compile_with_plan_sets_the_budget_only_while_it_runs(prof):
    import torch._functorch.config as functorch_config

    plan = make_plan(prof, "25%")
    seen = []
    model = _model()
    compiled = compile_with_plan(model, plan)
    compiled.register_forward_pre_hook(
        lambda m, a: seen.append(functorch_config.activation_memory_budget)
    )
    before = functorch_config.activation_memory_budget
    compiled(X).sum().backward()
    assert seen == [plan.compiled["activation_memory_budget"]]
    assert functorch_config.activation_memory_budget == before
    with pytest.raises(ValueError, match="pass the module"):
        compile_with_plan(torch.compile(_model()), plan)
    eager = load_plan(plan.to_dict())
    eager.compiled = None
    for layer in eager.layers:
        layer.option = "full"
    with pytest.raises(ValueError, match="made for an eager model"):
        compile_with_plan(_model(), eager)


def test_the_plan_file_round_trips_and_guards_its_options(prof, tmp_path):
    from recomp.plan import save_plan

    plan = make_plan(prof, "50%")
    save_plan(plan, tmp_path / "plan.json")
    again = load_plan(tmp_path / "plan.json")
    assert again.to_dict() == plan.to_dict() and again.compiled == plan.compiled
    data = json.loads((tmp_path / "plan.json").read_text())
    no_section = {k: v for k, v in data.items() if k != "compiled"}
    with pytest.raises(PlanFormatError, match="'compiled' section"):
        load_plan(no_section)
    with pytest.raises(PlanFormatError, match="compiled model"):
        load_plan({**no_section, "version": 2})
    wrong = copy.deepcopy(data)
    wrong["layers"][0]["option"] = "full"
    with pytest.raises(PlanFormatError, match="partitioner"):
        load_plan(wrong)


def test_misuse_names_the_fix():
    model = _model()
    with pytest.raises(ValueError, match="keep= for regions"):
        profile(torch.compile(model), X, _sum_loss, exclude=lambda m: False)
    with pytest.raises(ValueError, match="compiled models"):
        profile(model, X, _sum_loss, keep=lambda m: False)
    with pytest.raises(ValueError, match="keep= matched no sub-module"):
        profile(torch.compile(model), X, _sum_loss, keep=lambda m: False)
    with pytest.raises(ValueError, match="inductor, aot_eager"):
        profile(torch.compile(model, backend="eager"), X, _sum_loss)


def test_the_loss_outside_the_model_is_counted():
    squared = profile(torch.compile(_model(), backend="aot_eager"), X, lambda y: y.pow(2).mean())
    assert squared.outside_bytes == 2 * 16 * 32 * 4  # pow saves the model's output
    plan = make_plan(squared, "100%")
    assert plan.predicted["activation_bytes"] == squared.default.saved_bytes + 4096


@pytest.mark.parametrize(
    ("backend", "budgets"),
    # Inductor compiles C++ for every graph (about 30 s each here): one budget.
    [
        ("aot_eager", ["0%", "40%", "100%"]),
        pytest.param("inductor", ["40%"], marks=pytest.mark.inductor),
    ],
)
@pytest.mark.system  # compiles and measures in child processes
def test_predicted_bytes_are_the_allocators(backend, budgets):
    """The plan run compiled by the benchmark in a child process (one malloc arena):
    the activation memory read from the allocator is the prediction, plus at most 2 %
    and 8 KiB (the compiled function's autograd node, the loss's, the allocator's
    rounding; 7 to 18 KiB of 0.03 to 1.1 MiB here)."""
    code = f"""
from recomp.cli.config import BenchConfig
from recomp.cli.torch.runner import make_plans, measure_strategy
cfg = BenchConfig(layers=2, hidden=64, heads=2, seq=64, batch=2, compile={backend!r})
names = {[f"plan@{b}" for b in budgets]!r}
made = make_plans(cfg, names)
cfg.extra["plans"] = made.plans
result = {{"made": made.to_dict(), "measured": {{s: measure_strategy(cfg, s).to_dict() for s in names}}}}
"""
    got = run_measured(code, timeout=600)
    for name, measured in got["measured"].items():
        plan = load_plan(got["made"]["plans"][name])
        predicted = plan.predicted["activation_bytes"]
        extra = measured["activation_bytes"] - predicted
        assert 0 <= extra <= 0.02 * predicted + 8 * 1024, (name, extra, predicted)
        assert measured["max_grad_diff"] <= 1e-5


@pytest.mark.system  # the whole recomp plan command
def test_cli_plans_for_a_compiled_model(tmp_path):
    import os
    import subprocess
    import sys

    from recomp.cli.memory import child_env

    env = child_env(1)
    src = str(paths.SRC)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    tiny = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "2"]

    def recomp(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "recomp", "plan", *tiny, "--quiet", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
        )

    path = tmp_path / "plan.json"
    done = recomp(
        "--compile",
        "aot_eager",
        "--keep",
        "attn",
        "--budget",
        "50%",
        "--no-measure",
        "--json",
        str(path),
    )
    assert done.returncode == 0, done.stderr
    plan = load_plan(path)
    assert plan.compiled["backend"] == "aot_eager" and plan.budget == "50%"
    assert [layer.option for layer in plan.layers] == ["partitioner+exclude:attn"] * 2
    assert (
        "activation_memory_budget = " in done.stdout and "partitioner+exclude:attn" in done.stdout
    )
    refused = recomp("--keep", "attn", "--budget", "50%", "--no-measure")
    assert refused.returncode == 2 and "--keep is for compiled plans" in refused.stderr


@pytest.mark.system  # compiles an HF model at several budgets
def test_a_hugging_face_model_called_with_keywords():
    """HF causal LMs are called with keyword arguments (Dynamo then names the modules from
    ``L['args'][0]``): the layers are found, their bytes attributed, the loss is the
    model's own, and attention can be kept whole. Profiled for Inductor, whose joint-graph
    passes rewrite the loss's one-hot scatter (they must run in the graph's fake mode when
    the graph is partitioned again), then run with aot_eager (no C++ build)."""
    from hf_models import tiny_llama

    model = tiny_llama(layers=2, hidden=64, heads=4)
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}

    def is_attention(m: nn.Module) -> bool:
        return type(m).__name__ == "LlamaAttention"

    prof = profile(torch.compile(model), batch, keep=is_attention)
    plan = make_plan(prof, "50%")
    assert prof.backend == "inductor"
    assert [layer.path for layer in plan.layers] == ["model.layers.0", "model.layers.1"]
    assert [layer.option for layer in plan.layers] == ["partitioner+exclude:self_attn"] * 2
    assert all(layer.kept_bytes > 0 for layer in plan.layers)
    assert sum(layer.kept_bytes for layer in plan.layers) <= plan.predicted["activation_bytes"]
    planned = tiny_llama(layers=2, hidden=64, heads=4)
    compile_with_plan(planned, plan, backend="aot_eager")(**batch).loss.backward()
    model(**batch).loss.backward()
    for (name, a), b in zip(model.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
