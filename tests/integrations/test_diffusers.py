"""recomp as the checkpoint function of diffusers' gradient checkpointing
(``hf_activation_checkpointing`` on a diffusers model), on a UNet and a Flux transformer
built from tiny configs (CPU, no weights).

diffusers' switch (``enable_gradient_checkpointing()``, which its training scripts call for
``--gradient_checkpointing``) stores one function on every module that checkpoints
sub-modules (a block's resnets, a transformer's blocks) and hands it those sub-modules.
With recomp's checkpoint there, an excluded attention runs once per step and the gradients
equal, with ``torch.equal`` and dropout on, those of the same model without checkpointing
and those of diffusers' own checkpointing.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from diffusers import FluxTransformer2DModel, UNet2DConditionModel  # noqa: E402
from diffusers.models.attention import FeedForward  # noqa: E402
from diffusers.models.attention_processor import Attention  # noqa: E402
from diffusers.models.transformers.transformer_flux import FluxAttention  # noqa: E402

import recomp  # noqa: E402
from diffusers_models import tiny_unet  # noqa: E402
from recomp.torch import (  # noqa: E402
    ExcludeWrapper,
    checkpoint_wrapper,
    hf_activation_checkpointing,
    unwrap,
)


def unet() -> UNet2DConditionModel:
    return tiny_unet(dropout=0.1).train()


def unet_step(model: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    sample = torch.randn(2, 4, 8, 8, generator=generator)
    text = torch.randn(2, 5, 16, generator=generator)
    torch.manual_seed(123)  # dropout
    out = model(sample, torch.tensor([3, 7]), encoder_hidden_states=text).sample
    loss = (out**2).mean()
    loss.backward()
    return loss.detach()


def flux() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    ).train()


def flux_step(model: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    out = model(
        hidden_states=torch.randn(2, 16, 4, generator=generator),
        encoder_hidden_states=torch.randn(2, 6, 32, generator=generator),
        pooled_projections=torch.randn(2, 32, generator=generator),
        timestep=torch.tensor([0.3, 0.6]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(6, 3),
    ).sample
    loss = (out**2).mean()
    loss.backward()
    return loss.detach()


#: Each model with its step and what is excluded: the UNet's attentions, and the Flux
#: transformer's attentions and feed-forward networks (in its double-stream blocks).
MODELS = {
    "unet": (unet, unet_step, Attention),
    "flux": (flux, flux_step, (FluxAttention, FeedForward)),
}


def assert_same_grads(reference: torch.nn.Module, model: torch.nn.Module) -> None:
    expected = dict(reference.named_parameters())
    got = dict(model.named_parameters())
    assert expected.keys() == got.keys()  # the names stay
    for name, p in expected.items():
        g = got[name].grad
        assert (p.grad is None) == (g is None), name
        assert p.grad is None or torch.equal(p.grad, g), f"{name}: {(p.grad - g).abs().max()}"


def region_counts(model: torch.nn.Module) -> set[tuple[int, int]]:
    return {(r.region_runs, r.region_skips) for r in model.modules() if isinstance(r, ExcludeWrapper)}


def functions(model: torch.nn.Module) -> list[Any]:
    return [
        vars(m)["_gradient_checkpointing_func"]
        for m in model.modules()
        if "_gradient_checkpointing_func" in vars(m) and hasattr(m, "gradient_checkpointing")
    ]


def is_recomps(function: Any) -> bool:
    return repr(function).startswith("recomp.torch.checkpoint")


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_equal_no_checkpointing_and_diffusers_own(name: str) -> None:
    factory, step, excluded = MODELS[name]
    reference = factory()
    own = copy.deepcopy(reference)
    own.enable_gradient_checkpointing()
    model = hf_activation_checkpointing(copy.deepcopy(reference), exclude_fn=excluded)
    assert model.is_gradient_checkpointing  # diffusers' switch is on, with recomp's function
    assert functions(model) and all(is_recomps(f) for f in functions(model))
    assert model.state_dict().keys() == reference.state_dict().keys()
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.ForeignCheckpointWarning)
        losses = [step(m) for m in (reference, own, model)]
    assert torch.equal(losses[0], losses[2]) and torch.equal(losses[1], losses[2])
    assert_same_grads(reference, model)
    assert_same_grads(own, model)
    # Every excluded module ran once and was skipped by the one replay of its block.
    assert region_counts(model) == {(1, 1)}


def test_switch_turned_on_again_keeps_recomp_and_off_turns_it_off() -> None:
    reference = unet()
    model = hf_activation_checkpointing(copy.deepcopy(reference), exclude_fn=Attention)
    # A training script turns the switch on (again) with diffusers' default function.
    model.enable_gradient_checkpointing()
    assert not any(is_recomps(f) for f in functions(model))
    unet_step(reference)
    unet_step(model)
    assert all(is_recomps(f) for f in functions(model))
    assert_same_grads(reference, model)
    assert region_counts(model) == {(1, 1)}
    # Off: nothing is checkpointed, the excluded modules run as plain calls.
    model.disable_gradient_checkpointing()
    for m in (reference, model):
        m.zero_grad(set_to_none=True)
        unet_step(m)
    assert_same_grads(reference, model)
    assert region_counts(model) == {(2, 1)}


def test_unwrap_gives_back_diffusers_function_and_classes() -> None:
    reference = unet()
    model = copy.deepcopy(reference)
    model.enable_gradient_checkpointing()
    hf_activation_checkpointing(model, exclude_fn=Attention)
    unwrap(model)
    # diffusers' own function again (the one its switch made), the switch still on
    assert all(
        f.__qualname__ == "ModelMixin.enable_gradient_checkpointing.<locals>._gradient_checkpointing_func"
        for f in functions(model)
    )
    assert model.is_gradient_checkpointing
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]
    assert not any("_recomp_hf_checkpointing" in vars(m) for m in model.modules())
    own = copy.deepcopy(reference)
    own.enable_gradient_checkpointing()
    unet_step(own)
    unet_step(model)
    assert_same_grads(own, model)


def test_another_function_given_to_diffusers_is_refused() -> None:
    model = hf_activation_checkpointing(unet(), exclude_fn=Attention)

    def mine(module: torch.nn.Module, *args: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False)

    model.enable_gradient_checkpointing(gradient_checkpointing_func=mine)
    with pytest.raises(recomp.RecompError, match="unwrap"):
        unet_step(model)


def test_checkpoint_wrapper_inside_is_refused_before_anything_changes() -> None:
    model = unet()
    block = model.down_blocks[0].resnets[0]
    model.down_blocks[0].resnets[0] = checkpoint_wrapper(block)
    with pytest.raises(ValueError, match="checkpointed twice"):
        hf_activation_checkpointing(model, exclude_fn=Attention)
    assert not any(isinstance(m, ExcludeWrapper) for m in model.modules())
    assert not model.is_gradient_checkpointing


def test_a_model_without_diffusers_checkpointing_is_refused() -> None:
    class Plain(diffusers.ModelMixin):  # ModelMixin's default: no gradient checkpointing
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.gradient_checkpointing = False

    model = Plain()
    with pytest.raises(ValueError, match="not a diffusers model that supports"):
        hf_activation_checkpointing(model, exclude_fn=torch.nn.Linear)
    assert not any(isinstance(m, ExcludeWrapper) for m in model.modules())


def test_diffusers_own_function_with_exclusions_warns_naming_the_fix() -> None:
    reference = unet()
    model = copy.deepcopy(reference)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Attention):
                setattr(module, name, recomp.torch.checkpoint_exclude_wrapper(child))
    model.enable_gradient_checkpointing()  # PyTorch's checkpoint replays the regions
    unet_step(reference)
    with pytest.warns(recomp.ForeignCheckpointWarning, match="hf_activation_checkpointing"):
        unet_step(model)
    assert_same_grads(reference, model)  # not in effect, and still right
    assert region_counts(model) == {(2, 0)}


def test_recomp_checkpoints_under_diffusers_own_switch_are_refused_naming_it() -> None:
    from diffusers.models.resnet import ResnetBlock2D

    model = unet()
    recomp.torch.apply_activation_checkpointing(model, checkpoint_fn=ResnetBlock2D)
    model.enable_gradient_checkpointing()  # PyTorch's checkpoint around recomp's
    with pytest.raises(recomp.DoubleCheckpointError, match="enable_gradient_checkpointing"):
        unet_step(model)


@pytest.mark.parametrize("how", ["add_adapter", "get_peft_model"])
def test_lora_on_a_unet_both_ways(how: str) -> None:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["to_q", "to_v"], init_lora_weights="gaussian")
    reference = unet().requires_grad_(False)
    if how == "add_adapter":  # diffusers' own: the model stays a UNet
        reference.add_adapter(config)
    else:
        reference = get_peft_model(reference, config)
    model = hf_activation_checkpointing(copy.deepcopy(reference), exclude_fn=Attention)
    unet_step(reference)
    unet_step(model)
    assert_same_grads(reference, model)
    assert region_counts(model) == {(1, 1)}
