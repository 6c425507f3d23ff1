"""recomp inside Megatron-Core (``recomp.torch.megatron.install``), on 2 gloo ranks.

A tiny GPTModel (2 layers, dropout 0.1 on hidden states and attention) trains one
step under Megatron's own recompute settings, with and without recomp installed, at
tensor parallel 2 (dense) and expert parallel 2 (MoE, alltoall dispatcher). Each
variant starts from the same weights, data and random state as the model without
recompute; the ranks report gradient differences, collectives per step, forward calls
of the watched modules and the runs of recomp's excluded regions
(tests/trainers/megatron_support.py, which also holds the CPU shims Megatron needs).

Fails if a gradient differs from the model without recompute, if a recomp checkpoint
runs a collective again, if an excluded module runs twice, if Megatron's own full
recompute stops replaying collectives (the comparison would be void), or if hiding
Megatron's RNG tracker from recomp leaves the gradients right (dropout would be off).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "distributed"))

import megatron_support as support  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402

import recomp.torch.megatron as recomp_megatron  # noqa: E402
from dist_harness import launch_ranks  # noqa: E402
from recomp.errors import RecompError  # noqa: E402

pytestmark = [pytest.mark.system, pytest.mark.timeout(400)]

LAYERS = support.LAYERS
TOLERANCE = 1e-6
SPLIT = "recomp_distributed_inputs"  # distribute_saved_activations=True  # float tolerance; measured: 0.0 in every variant


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Per rank: the dense (TP 2) and the MoE (EP 2) results, from one pair of processes."""
    return launch_ranks(
        "megatron_support:run_all",
        tmp_path_factory.mktemp("megatron"),
        timeout=240,
        env={"PYTHONPATH": support.trainer_path()},
    )


@pytest.fixture(scope="module")
def dense(reports):
    return [r["dense"] for r in reports]


@pytest.fixture(scope="module")
def moe(reports):
    return [r["moe"] for r in reports]


def _variants(results: dict, prefix: str = "") -> list[str]:
    return [
        k for k in results
        if k.startswith(prefix) and isinstance(results[k], dict) and k != "first_input_split"
    ]


# ------------------------------------------------------------------ gradients


def test_gradients_equal_the_model_without_recompute(dense, moe):
    controls = {"recomp_tracker_unknown", "apply_activation_checkpointing_tracker_unknown"}
    for results in (*dense, *moe):
        for name in _variants(results):
            if name in controls:
                continue
            assert "error" not in results[name], (name, results[name])
            assert results[name]["max_diff"] <= TOLERANCE, (name, results[name]["max_diff"])


def test_megatron_rng_tracker_is_what_makes_dropout_replay(dense):
    # With Megatron's tracker hidden from recomp, the replay draws other dropout masks:
    # the gradients differ, with install() and with apply_activation_checkpointing.
    for results in dense:
        assert results["recomp_tracker_unknown"]["max_diff"] > 1e-4
        assert results["apply_activation_checkpointing_tracker_unknown"]["max_diff"] > 1e-4


# ------------------------------------------------------------------ collectives


def test_recomp_runs_the_collectives_of_a_step_without_recompute(dense, moe):
    for results in (*dense, *moe):
        none = results["none"]["collectives"]
        assert none  # the counter sees the step's collectives
        for name in [*_variants(results, "recomp_"), "apply_activation_checkpointing"]:
            variant = results[name]
            if "error" in variant or name in ("recomp_communicates_again", SPLIT):
                continue
            assert variant["collectives"] == none, (name, variant["collectives"], none)
            assert variant["replay"] == {}, (name, variant["replay"])


def test_megatron_full_recompute_runs_the_layers_collectives_again(dense, moe):
    for results in dense:
        # Per layer the row-parallel all-reduces of attention and MLP run again:
        # 13 all-reduces a step without recompute, 17 with Megatron's full recompute.
        assert results["none"]["collectives"] == {"all_reduce": 13}
        assert results["megatron_full"]["collectives"] == {"all_reduce": 13 + 2 * LAYERS}
    for results in moe:
        none = results["none"]["collectives"]
        assert none == {"all_gather": 2, "all_reduce": 3, "all_to_all": 12}
        for name in ("megatron_full", "megatron_moe"):
            # Per MoE layer: the token and probability dispatch and the combine
            # all-to-alls, and the all-gather of the tokens per expert.
            assert results[name]["collectives"] == {
                "all_gather": 2 + LAYERS, "all_reduce": 3, "all_to_all": 12 + 3 * LAYERS
            }, name


def test_exclude_collectives_false_communicates_again(dense):
    for results in dense:
        variant = results["recomp_communicates_again"]
        assert variant["replay"] == {"all_reduce": 2 * LAYERS}
        assert variant["collectives"] == results["megatron_full"]["collectives"]


def test_what_recomp_keeps_for_the_replay(dense, moe):
    # Per layer, the all-reduced outputs of the attention's and the MLP's row-parallel
    # linears (sequence x batch x hidden, float32), between forward and backward.
    per_result = support.SEQ * support.BATCH * support.HIDDEN * 4
    for results in dense:
        assert results["recomp_full"]["kept_bytes"] == 2 * LAYERS * per_result
        # The excluded attention caches its output as a region; only the MLP's is kept.
        assert results["recomp_exclude_path"]["kept_bytes"] == LAYERS * per_result
        assert results["recomp_communicates_again"]["kept_bytes"] == 0
        assert results["megatron_full"]["kept_bytes"] == 0
    for results in moe:
        assert results["recomp_moe"]["kept_bytes"] > 0  # the all-to-alls' and all-gather's


def test_no_state_of_a_replay_is_left_on_megatron_layers(dense, moe):
    # TransformerLayer keeps its pre-MLP norm manager (holding the hidden states) between
    # its halves and clears it at the end: a replay that stopped early would leave it set,
    # with the replay's graph behind it, until the layer's next forward.
    for results in (*dense, *moe):
        for name in _variants(results):
            if "state_left" in results[name]:
                assert results[name]["state_left"] == 0, name


# ------------------------------------------------------------------ exclusions


def _layers(suffix: str) -> list[str]:
    return [f"decoder.layers.{i}.{suffix}" for i in range(LAYERS)]


@pytest.mark.parametrize("name", ["recomp_exclude_class", "recomp_exclude_path"])
def test_excluded_attention_runs_once_per_step(dense, name):
    for results in dense:
        variant = results[name]
        assert variant["regions"] == {path: [1, 1] for path in _layers("self_attention")}
        assert [variant["calls"][p] for p in _layers("self_attention")] == [1] * LAYERS
        # Megatron's full recompute and recomp's without the exclusion run it twice.
        for other in ("megatron_full", "recomp_full"):
            assert [results[other]["calls"][p] for p in _layers("self_attention")] == [2] * LAYERS


@pytest.mark.parametrize(
    "name",
    ["recomp_full_exclude_class", "recomp_moe_exclude_class", "recomp_full_exclude_path",
     "recomp_moe_exclude_path", "apply_activation_checkpointing"],
)
def test_excluded_router_runs_once_per_step(moe, name):
    # TopKRouter derives from Router(ABC, MegatronModule): an ABC-first class.
    for results in moe:
        variant = results[name]
        assert variant["regions"] == {path: [1, 1] for path in _layers("mlp.router")}
        assert [variant["calls"][p] for p in _layers("mlp.router")] == [1] * LAYERS
        for other in ("megatron_full", "megatron_moe", "recomp_moe"):
            assert [results[other]["calls"][p] for p in _layers("mlp.router")] == [2] * LAYERS


# ------------------------------------------------------------------ Megatron's settings


def test_recompute_method_block_checkpoints_the_first_layers_only(dense):
    for results in dense:
        calls = results["recomp_block"]["calls"]
        assert [calls[p] for p in _layers("self_attention")] == [2, 1]


def test_checkpoint_without_output_works_as_before(dense):
    # Selective "layernorm" frees the norms' outputs and recomputes them through
    # Megatron's CheckpointWithoutOutput, which install() leaves alone.
    for results in dense:
        for name in ("megatron_layernorm", "recomp_layernorm"):
            variant = results[name]
            assert [variant["calls"][p] for p in _layers("input_layernorm")] == [2] * LAYERS
            assert variant["collectives"] == results["none"]["collectives"]


def test_distribute_saved_activations_splits_the_first_input_over_tensor_parallel(dense):
    for results in dense:
        variant = results[SPLIT]
        assert "error" not in variant, variant
        assert variant["max_diff"] <= TOLERANCE
        # The step's collectives, and one all-gather per checkpoint (its hidden states,
        # gathered by its replay); none runs again in the replay.
        none = dict(results["none"]["collectives"])
        assert variant["collectives"] == {**none, "all_gather": none.get("all_gather", 0) + LAYERS}
        assert variant["replay"] == {}


def test_distribute_saved_activations_in_megatrons_own_terms(dense):
    # What Megatron's own checkpoint does with it: the first input's data is this
    # rank's 1-D half until the backward gathers it back; results and gradients exact.
    for results in dense:
        split = results["first_input_split"]
        assert split["output_exact"] and split["first_grad_exact"] and split["second_grad_exact"]
        assert split["data_after_forward"] == [8]
        assert split["data_after_backward"] == [4, 4]
        assert split["second_data"] == [4, 4]


# ------------------------------------------------------------------ the installation


def test_install_replaces_megatron_checkpoint_and_remove_restores_it():
    from megatron.core.tensor_parallel import random as megatron_random

    original = tensor_parallel.checkpoint
    keeps = tensor_parallel.CheckpointWithoutOutput
    with recomp_megatron.install() as installation:
        assert installation.installed
        assert tensor_parallel.checkpoint is not original
        assert megatron_random.checkpoint is tensor_parallel.checkpoint
        assert tensor_parallel.CheckpointWithoutOutput is keeps
    assert not installation.installed
    assert tensor_parallel.checkpoint is original
    assert megatron_random.checkpoint is original
    installation.remove()  # a second remove does nothing
    assert tensor_parallel.checkpoint is original


def test_second_install_is_refused_until_remove():

    installation = recomp_megatron.install()
    try:
        installed = tensor_parallel.checkpoint
        with pytest.raises(RecompError, match="install\\(\\) is in effect already"):
            recomp_megatron.install(exclude="router")
        assert tensor_parallel.checkpoint is installed
    finally:
        installation.remove()
    recomp_megatron.install().remove()


def test_copies_imported_by_name_are_replaced_and_restored(monkeypatch):

    original = tensor_parallel.checkpoint
    user_code = types.ModuleType("user_training_code")
    user_code.tp_checkpoint = original  # from megatron.core.tensor_parallel import checkpoint
    monkeypatch.setitem(sys.modules, user_code.__name__, user_code)
    with recomp_megatron.install():
        assert user_code.tp_checkpoint is tensor_parallel.checkpoint
        assert user_code.tp_checkpoint is not original
    assert user_code.tp_checkpoint is original


def test_transformer_engine_checkpoint_is_left_alone():
    from megatron.core.extensions import transformer_engine

    te_checkpoint = transformer_engine.te_checkpoint
    with recomp_megatron.install():
        assert transformer_engine.te_checkpoint is te_checkpoint


def test_arguments_are_checked_before_anything_changes():

    original = tensor_parallel.checkpoint
    with pytest.raises(TypeError, match="exclude must be a module class, a module path"):
        recomp_megatron.install(exclude=[3])
    with pytest.raises(ValueError, match="exclude_collectives"):
        recomp_megatron.install(exclude_collectives="yes")
    assert tensor_parallel.checkpoint is original
