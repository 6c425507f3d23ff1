"""recomp on timm models (CPU, no weights): exclusions inside timm's blocks are exact, and
timm's own switch (``set_grad_checkpointing()``, train.py's ``--grad-checkpointing``) meets
recomp as any plain PyTorch checkpoint does: around recomp's checkpoints it is refused,
naming the switch; around hand-made exclusions it replays them, with a warning."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

timm = pytest.importorskip("timm")

from timm.models.vision_transformer import Attention, Block  # noqa: E402

import recomp  # noqa: E402
import recomp.torch as rt  # noqa: E402


def vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224",
        img_size=32,
        patch_size=8,
        num_classes=3,
        depth=2,
        drop_rate=0.1,
        attn_drop_rate=0.1,
        proj_drop_rate=0.1,
    ).train()


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)  # dropout
    model.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    return [p.grad for p in model.parameters()]


def assert_equal(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(expected) == len(got)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert torch.equal(e, g), f"parameter {i}: {(e - g).abs().max()}"


def region_counts(model: torch.nn.Module) -> set[tuple[int, int]]:
    return {(r.region_runs, r.region_skips) for r in model.modules() if isinstance(r, rt.ExcludeWrapper)}


def test_blocks_checkpointed_attention_excluded_is_exact() -> None:
    reference = vit()
    model = copy.deepcopy(reference)
    rt.apply_activation_checkpointing(model, checkpoint_fn=Block, exclude_fn=Attention)
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert_equal(grads(reference), grads(model))
    assert region_counts(model) == {(1, 1)}


def test_timms_switch_around_recomps_checkpoints_is_refused_naming_it() -> None:
    model = vit()
    rt.apply_activation_checkpointing(model, checkpoint_fn=Block, exclude_fn=Attention)
    model.set_grad_checkpointing(True)
    with pytest.raises(recomp.DoubleCheckpointError, match="set_grad_checkpointing"):
        grads(model)


def test_timms_switch_around_exclusions_replays_them_with_a_warning() -> None:
    reference = vit()
    model = copy.deepcopy(reference)
    for block in model.blocks:
        block.attn = rt.checkpoint_exclude_wrapper(block.attn)
    model.set_grad_checkpointing(True)
    expected = grads(reference)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = grads(model)
    assert any(issubclass(w.category, recomp.ForeignCheckpointWarning) for w in caught)
    assert_equal(expected, got)  # not in effect, and still right
    assert region_counts(model) == {(2, 0)}
