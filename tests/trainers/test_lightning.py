"""recomp as Lightning's activation checkpointing (Lightning 2.6): applied in
``LightningModule.configure_model``, before Lightning's FSDP wraps the model
(``FSDPStrategy``) or before ``fully_shard`` there (``ModelParallelStrategy``).

Against the same run without checkpointing, dropout on: the losses, the gradients the
optimizer applies at every step and the weights after the last one are equal bit for bit
(each rank's shard on 2 ranks: the same ops run in the same order, and the replay gets the
forward's random state), and the parameter names are the same. Each block's attention
runs once per step and is skipped in the replay; PyTorch's own checkpointing, the control,
runs it twice.

PyTorch's ``checkpoint_wrapper`` (which ``FSDPStrategy(activation_checkpointing_policy=...)``
applies) around a module recomp checkpoints is refused when it is applied, naming the
option to turn off, before any step and with no name changed; a plain checkpoint around
recomp's that is already in place is refused at the first training forward, leaving
nothing open. The runs after a refused one are right.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "distributed"))

import lightning_cases as lc  # noqa: E402
import torch  # noqa: E402

from dist_harness import EXAMPLES, SRC, launch_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(300)

STEPS, LAYERS = lc.STEPS, lc.LAYERS


def recomp_in_configure_model(module: lc.LitNet) -> None:
    lc.recomp_blocks(module.net)


def torch_in_configure_model(module: lc.LitNet) -> None:
    lc.torch_blocks(module.net)


@pytest.fixture(scope="module")
def reference() -> lc.LitNet:
    model, error = lc.fit(None)
    assert error is None and len(model.losses) == STEPS
    return model


def assert_same_training(reference: lc.LitNet, model: lc.LitNet) -> None:
    assert model.losses == reference.losses
    assert len(model.grads) == STEPS
    for expected, actual in zip(reference.grads, model.grads):
        assert lc.max_diff(expected, actual) == 0.0
    assert lc.max_diff(reference.weights(), model.weights()) == 0.0


def no_saved_tensor_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


# --------------------------------------------------------------------------- one process


def test_recomp_in_configure_model_trains_as_without_checkpointing(reference):
    model, error = lc.fit(recomp_in_configure_model)
    assert error is None
    assert_same_training(reference, model)
    assert [n for n, _ in model.named_parameters()] == [
        n for n, _ in reference.named_parameters()
    ]
    # Each attention ran once per step, and each replay skipped it.
    assert reference.attention_calls == [STEPS] * LAYERS
    assert model.attention_calls == [STEPS] * LAYERS
    assert model.regions() == [[STEPS, STEPS]] * LAYERS
    # configure_model may run again (another stage): recomp leaves wrapped modules alone.
    names = [n for n, _ in model.named_parameters()]
    model.configure_model()
    assert [n for n, _ in model.named_parameters()] == names
    assert model.regions() == [[STEPS, STEPS]] * LAYERS


def test_controls(reference):
    """Dropout changes the losses (so equal runs drew the same masks), and PyTorch's own
    checkpointing replays the attention: the counter sees replays."""
    torch_ac, error = lc.fit(torch_in_configure_model)
    assert error is None
    assert_same_training(reference, torch_ac)
    assert torch_ac.attention_calls == [2 * STEPS] * LAYERS
    assert all(lc.TORCH_PREFIX in n for n, _ in torch_ac.named_parameters() if ".blocks." in n)

    def other_masks(module: lc.LitNet) -> None:
        torch.manual_seed(1)  # configure_model runs after the seed: other dropout masks

    reseeded, _ = lc.fit(other_masks)
    assert reseeded.losses[0] != reference.losses[0]


def test_checkpoint_wrapper_around_recomp_is_refused_when_applied(reference):
    def both(module: lc.LitNet) -> None:
        lc.recomp_blocks(module.net)
        lc.torch_blocks(module.net)

    model, error = lc.fit(both)
    assert error is not None
    assert "PyTorch's checkpoint_wrapper is wrapping Block, which recomp checkpoints" in error
    assert "activation_checkpointing_policy" in error
    assert not any(lc.TORCH_PREFIX in n for n, _ in model.named_parameters())
    assert model.attention_calls == [0] * LAYERS  # refused before the first step
    # Nothing left behind: a run after it trains as without checkpointing.
    again, error = lc.fit(recomp_in_configure_model)
    assert error is None
    assert_same_training(reference, again)


def test_plain_checkpoint_around_recomp_is_refused_at_the_first_step(reference):
    """PyTorch's wrapper in place before recomp wraps the block inside it: the hook that
    refuses the wrapper never sees it, the first training forward does."""

    def torch_then_recomp(module: lc.LitNet) -> None:
        lc.torch_blocks(module.net)
        lc.recomp_blocks(module.net)

    model, error = lc.fit(torch_then_recomp)
    assert error is not None
    assert "inside a plain PyTorch checkpoint" in error
    assert "activation_checkpointing_policy" in error
    assert model.losses == [] and model.attention_calls == [0] * LAYERS
    assert no_saved_tensor_hooks()
    again, error = lc.fit(recomp_in_configure_model)
    assert error is None
    assert_same_training(reference, again)


# --------------------------------------------------------------------------- 2 ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    """Both strategies on 2 gloo ranks, in one launch (each rank imports Lightning once)."""
    path = [str(SRC), str(EXAMPLES), str(HERE.parent / "distributed"), str(HERE)]
    path += [str(HERE.parent / "support"), os.environ.get("PYTHONPATH", "")]
    return launch_ranks(
        "lightning_cases:run_strategies",
        tmp_path_factory.mktemp("lightning"),
        timeout=240,
        env={"PYTHONPATH": os.pathsep.join(p for p in path if p)},
    )


STRATEGIES = ["fsdp", "model_parallel"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_recomp_trains_as_without_checkpointing_on_2_ranks(ranks, strategy):
    for rank in ranks:
        runs = rank[strategy]
        run = runs["recomp"]
        assert run["error"] is None
        assert run["losses_equal"] and run["steps"] == STEPS
        assert run["grad_diff"] == [0.0] * STEPS
        assert run["weight_diff"] == 0.0
        assert run["names"] == runs["none"]["names"]
        assert runs["none"]["attention_calls"] == [STEPS] * LAYERS
        assert run["attention_calls"] == [STEPS] * LAYERS
        assert run["regions"] == [[STEPS, STEPS]] * LAYERS


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torch_checkpointing_control_on_2_ranks(ranks, strategy):
    """Lightning's FSDP policy (ModelParallelStrategy: PyTorch's wrapper in
    configure_model): the same values, the attention run twice per step, every block
    parameter renamed."""
    for rank in ranks:
        run = rank[strategy]["torch"]
        assert run["error"] is None and run["losses_equal"]
        assert run["grad_diff"] == [0.0] * STEPS and run["weight_diff"] == 0.0
        assert run["attention_calls"] == [2 * STEPS] * LAYERS
        assert all(lc.TORCH_PREFIX in n for n in run["names"] if ".blocks." in n)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_double_checkpointing_is_refused_on_2_ranks(ranks, strategy):
    """FSDPStrategy: recomp in configure_model and activation_checkpointing_policy={Block};
    ModelParallelStrategy: recomp, then PyTorch's wrapper, in configure_model. Refused on
    every rank before the first step; no name changed. It ran first: the runs above came
    after it in the same processes."""
    for rank in ranks:
        run = rank[strategy]["both"]
        assert run["error"] is not None
        assert "PyTorch's checkpoint_wrapper is wrapping Block" in run["error"]
        assert "activation_checkpointing_policy" in run["error"]
        assert run["attention_calls"] == [0] * LAYERS
        assert not any(lc.TORCH_PREFIX in n for n in run["names"])
        plain = [lc.clean(n) for n in rank[strategy]["none"]["names"]]
        assert [lc.clean(n) for n in run["names"]] == plain
