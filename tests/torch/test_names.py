"""Wrapping in place leaves every name of the model as it was: PEFT LoRA adapters on a
small HF Llama save, load and train through recomp's wrappers as without them; hooks,
copies, unwrapping and bad input."""

from __future__ import annotations

import copy
import tempfile
import warnings

import pytest
import torch
from torch import nn

import recomp
import recomp.torch as rt
from torch_models import Block, assert_same_grads, grads_of, stack, twin

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaAttention,
    LlamaDecoderLayer,
)

LAYERS = 2


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    return LlamaForCausalLM(config)


def with_lora(model: nn.Module, seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    # init_lora_weights=False: lora_B is random too, so that every adapter weight matters
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(model, config)


def checkpoint_layers(model: nn.Module) -> nn.Module:
    return rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, LlamaDecoderLayer),
        exclude_fn=lambda m: isinstance(m, LlamaAttention),
    )


def attentions(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, LlamaAttention)]


def names(model: nn.Module) -> dict[str, list[str]]:
    return {
        "modules": [n for n, _ in model.named_modules()],
        "parameters": [n for n, _ in model.named_parameters()],
        "buffers": [n for n, _ in model.named_buffers()],
        "state_dict": list(model.state_dict()),
    }


def lora_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(5))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_peft_lora_names_state_dict_and_gradients_are_those_of_the_unwrapped_model():
    ref = with_lora(tiny_llama())
    model = with_lora(tiny_llama())
    checkpoint_layers(model)
    assert names(model) == names(ref)
    for name, module in model.named_modules():
        assert model.get_submodule(name) is module
    assert all(isinstance(m, rt.ExcludeWrapper) for m in attentions(model))
    layers = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
    assert len(layers) == LAYERS and all(isinstance(m, rt.CheckpointWrapper) for m in layers)

    adapter_ref = get_peft_model_state_dict(ref)
    adapter = get_peft_model_state_dict(model)
    assert len(adapter_ref) == 4 * LAYERS  # lora_A and lora_B of q_proj and v_proj
    assert list(adapter) == list(adapter_ref)
    assert all(torch.equal(adapter[k], adapter_ref[k]) for k in adapter_ref)

    expected = lora_grads(ref)
    actual = lora_grads(model)
    assert len(expected) == 4 * LAYERS
    assert_same_grads(expected, actual)
    assert [(m.region_runs, m.region_skips) for m in attentions(model)] == [(1, 1)] * LAYERS


def test_peft_adapter_saved_from_a_wrapped_model_loads_into_a_wrapped_model():
    source = with_lora(tiny_llama())
    checkpoint_layers(source)
    with tempfile.TemporaryDirectory() as tmp:
        source.save_pretrained(tmp)
        base = checkpoint_layers(tiny_llama())  # wrapped before the adapter is injected
        loaded = PeftModel.from_pretrained(base, tmp, is_trainable=True)
        plain = PeftModel.from_pretrained(tiny_llama(), tmp, is_trainable=True)
    want = get_peft_model_state_dict(source)
    got = get_peft_model_state_dict(loaded)
    assert len(want) == 4 * LAYERS and list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    # every lora weight of the loaded model is the saved one (lora_B included)
    saved = dict(source.named_parameters())
    loaded_lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert len(loaded_lora) == 4 * LAYERS
    for name, param in loaded_lora.items():
        assert torch.equal(param, saved[name]), name
    assert names(loaded) == names(plain)
    assert_same_grads(lora_grads(plain), lora_grads(loaded))


def test_wrapping_keeps_the_object_its_names_and_isinstance():
    ref = stack(2)
    model = twin(ref)
    blocks = list(model)
    for blk in blocks:
        assert rt.checkpoint_exclude_wrapper(blk.attn) is blk.attn
        assert rt.checkpoint_wrapper(blk, preserve_rng_state=False) is blk
    assert list(model) == blocks
    assert all(isinstance(b, Block) and isinstance(b, rt.CheckpointWrapper) for b in model)
    assert isinstance(model[0].attn, nn.Linear) and isinstance(model[0].attn, rt.ExcludeWrapper)
    assert names(model) == names(ref)
    assert model[0].checkpoint_kwargs == {"preserve_rng_state": False}
    text = repr(model)
    assert "CheckpointedBlock(" in text and "preserve_rng_state=False" in text
    assert "ExcludedLinear(in_features=8, out_features=8, bias=True, region='Linear'" in text
    x = torch.randn(2, 8, requires_grad=True)
    assert_same_grads(
        grads_of(ref, lambda o: o.sum(), x)[1], grads_of(model, lambda o: o.sum(), x)[1]
    )
    assert [(b.attn.region_runs, b.attn.region_skips) for b in model] == [(1, 1), (1, 1)]


def test_deepcopy_of_a_wrapped_model_is_wrapped_and_independent():
    ref = stack(2)
    model = twin(ref)
    rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, Block),
        exclude_fn=lambda m: m.__class__ is nn.Linear and m.in_features == m.out_features,
    )
    clone = copy.deepcopy(model)
    assert type(clone[0]) is type(model[0]) and type(clone[0].attn) is type(model[0].attn)
    assert clone[0].attn.region is not model[0].attn.region
    x = torch.randn(2, 8, requires_grad=True)
    assert_same_grads(
        grads_of(ref, lambda o: o.sum(), x)[1], grads_of(clone, lambda o: o.sum(), x)[1]
    )
    assert [(b.attn.region_runs, b.attn.region_skips) for b in clone] == [(1, 1), (1, 1)]
    assert [(b.attn.region_runs, b.attn.region_skips) for b in model] == [(0, 0), (0, 0)]


def test_hooks_on_a_checkpointed_module_run_outside_the_checkpoint():
    block = Block(8)
    calls = []
    block.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    block.register_forward_hook(lambda m, args, out: calls.append("post"))
    inner = []
    block.mlp.register_forward_pre_hook(lambda m, args: inner.append(1))
    rt.checkpoint_wrapper(block)
    block(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert calls == ["pre", "post"]  # not run again by the replay
    assert len(inner) == 2  # a sub-module's hook is inside: forward and replay


def test_hooks_on_an_excluded_module_run_inside_the_region():
    block = Block(8)
    calls = []
    block.attn.register_forward_hook(lambda m, args, out: calls.append(1))
    rt.checkpoint_exclude_wrapper(block.attn)
    rt.checkpoint_wrapper(block, early_stop=False)  # the replay runs to the end
    block(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert len(calls) == 1 and block.attn.region_skips == 1


def test_forward_replaced_on_the_instance_is_still_checkpointed():
    torch.manual_seed(0)
    ref = Block(8)
    block = twin(ref)
    calls = []
    original = block.forward

    def patched(x):  # accelerate-style: module.forward = ...
        calls.append(1)
        return original(x)

    block.forward = patched
    rt.checkpoint_wrapper(block)
    x = torch.randn(2, 8, requires_grad=True)
    assert_same_grads(
        grads_of(ref, lambda o: o.sum(), x)[1], grads_of(block, lambda o: o.sum(), x)[1]
    )
    assert len(calls) == 2  # the forward and the replay
    rt.unwrap(block)
    assert block.forward is patched


def test_unwrap_restores_class_and_attributes():
    ref = stack(2)
    model = twin(ref)
    before = [(type(m), set(m.__dict__)) for m in model.modules()]
    rt.apply_activation_checkpointing(
        model, checkpoint_fn=lambda m: isinstance(m, Block), exclude_fn=lambda m: m is model[0].attn
    )
    assert rt.unwrap(model) is model
    assert [(type(m), set(m.__dict__)) for m in model.modules()] == before
    x = torch.randn(2, 8, requires_grad=True)
    assert_same_grads(
        grads_of(ref, lambda o: o.sum(), x)[1], grads_of(model, lambda o: o.sum(), x)[1]
    )
    with pytest.raises(ValueError, match="carries no recomp wrapper"):
        rt.unwrap(model)
    fn = rt.checkpoint_exclude_wrapper(torch.sin)
    assert isinstance(fn, rt.ExcludeWrapper) and list(fn.parameters()) == []
    assert rt.unwrap(fn) is torch.sin


def test_wrapping_twice_is_a_clear_error_that_changes_nothing():
    block = rt.checkpoint_wrapper(Block(8), early_stop=False)
    cls = type(block)
    for wrap in (rt.checkpoint_wrapper, rt.checkpoint_exclude_wrapper):
        with pytest.raises(ValueError, match=r"already wrapped by recomp.*unwrap"):
            wrap(block)
        assert type(block) is cls and block.checkpoint_kwargs == {"early_stop": False}


def test_a_name_the_wrapper_needs_is_a_clear_error_and_the_model_is_unchanged():
    class HasRegion(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.region = nn.Linear(8, 8)

        def forward(self, x):
            return self.region(x)

    model = nn.Sequential(Block(8), HasRegion())
    with pytest.raises(ValueError, match=r"'region'.*Rename"):
        rt.apply_activation_checkpointing(
            model,
            checkpoint_fn=lambda m: m is model,
            exclude_fn=lambda m: isinstance(m, (HasRegion, nn.LayerNorm)),
        )
    assert not any(
        isinstance(m, (rt.CheckpointWrapper, rt.ExcludeWrapper)) for m in model.modules()
    )


def test_slicing_a_wrapped_container_gives_a_plain_one():
    seq = rt.checkpoint_wrapper(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
    head = seq[0:2]
    assert type(head) is nn.Sequential and head[0] is seq[0]
    with pytest.raises(TypeError, match="checkpoint_wrapper"):
        rt.CheckpointWrapper()


def test_a_wrapped_model_whose_forward_reaches_no_wrapper_warns_once():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block(8)
            self.run = self.block.forward  # bound before wrapping: bypasses the wrapper

        def forward(self, x):
            return self.run(x)

    net = Net()
    rt.apply_activation_checkpointing(net, checkpoint_fn=lambda m: isinstance(m, Block))
    x = torch.randn(2, 8)
    with pytest.warns(recomp.WrapperNotReachedWarning, match="wrapped 'block' in .*Net"):
        net(x)
    assert not net._forward_hooks and not net.block._forward_pre_hooks  # checked once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net(x)


def test_a_wrapped_model_that_reaches_its_wrappers_does_not_warn_and_keeps_no_hooks():
    model = stack(2)
    rt.apply_activation_checkpointing(
        model, checkpoint_fn=lambda m: isinstance(m, Block), exclude_fn=lambda m: m is model[1].attn
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert (model[1].attn.region_runs, model[1].attn.region_skips) == (1, 1)
