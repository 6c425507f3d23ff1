"""``recomp.torch._compat.hf``: transformers' private layer and model attributes. Each test
fails when transformers changes what recomp relies on."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from recomp.torch import _compat  # noqa: E402


def test_hf_layers_that_only_read_their_cache_say_so():
    modeling_layers = pytest.importorskip("transformers.modeling_layers")
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma
    from transformers.models.llama import modeling_llama

    assert _compat.hf_layer_keeps_cache(modeling_diffusion_gemma.DiffusionGemmaDecoderTextLayer)
    assert not _compat.hf_layer_keeps_cache(modeling_llama.LlamaDecoderLayer)
    assert not _compat.hf_layer_keeps_cache(modeling_layers.GradientCheckpointingLayer)


def test_hf_models_name_their_layer_classes():
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100)
    )
    assert _compat.hf_no_split_modules(model) == {"GPT2Block"}
    assert _compat.hf_no_split_modules(torch.nn.Linear(2, 2)) == frozenset()


def _tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=100,
    )
    return transformers.LlamaForCausalLM(config).train()


def test_hf_layers_keep_the_checkpoint_function_hf_calls():
    import functools

    import torch.utils.checkpoint

    model = _tiny_llama()
    layer = model.model.layers[0]
    assert _compat.hf_checkpoint_function(layer) is None  # never turned on
    model.activation_checkpointing_enable()
    function = _compat.hf_checkpoint_function(layer)
    assert isinstance(function, functools.partial)
    assert function.func is torch.utils.checkpoint.checkpoint
    assert function.keywords == {"use_reentrant": False}
    calls = []

    def counting(fn, *args, **kwargs):
        calls.append((fn, args))
        return function(fn, *args, **kwargs)

    _compat.set_hf_checkpoint_function(layer, counting)
    assert _compat.hf_checkpoint_function(layer) is counting
    ids = torch.randint(0, 100, (1, 4))
    model(ids, labels=ids, use_cache=False).loss.backward()
    assert len(calls) == 1


def test_the_call_hf_makes_is_told_from_calls_through_its_switch():
    import functools

    model = _tiny_llama()
    layer = model.model.layers[0]
    model.activation_checkpointing_enable()
    seen = []
    _compat.set_hf_checkpoint_function(layer, lambda fn, *args: seen.append(fn) or fn(*args))
    ids = torch.randint(0, 100, (1, 4))
    model(ids, use_cache=False)
    (hf_call,) = seen
    assert _compat.is_hf_checkpoint_call(layer, hf_call)
    # Calls that go through HF's switch again, and another layer's call.
    for other in (layer, layer.forward, functools.partial(type(layer).forward, layer)):
        assert not _compat.is_hf_checkpoint_call(layer, other)
    assert not _compat.is_hf_checkpoint_call(_tiny_llama().model.layers[0], hf_call)


def test_hfs_offload_checkpoint_function_is_told_from_pytorchs():
    import torch.utils.checkpoint

    model = _tiny_llama()
    layer = model.model.layers[0]
    model.activation_checkpointing_enable(offload=True)
    function = _compat.hf_checkpoint_function(layer)
    assert _compat.is_hf_offload_checkpoint(function.func)
    model.activation_checkpointing_enable()
    assert not _compat.is_hf_offload_checkpoint(_compat.hf_checkpoint_function(layer).func)
    assert not _compat.is_hf_offload_checkpoint(torch.utils.checkpoint.checkpoint)
    # What recomp reads it as, swap_inputs=True, is what it does: PyTorch's checkpoint
    # saves its inputs, and save_on_cpu packs them (a hook around the checkpoint sees them).
    seen = []
    x = torch.randn(2, 4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False)
    assert any(t is x for t in seen)


def _tiny_unet():
    pytest.importorskip("diffusers")
    from diffusers_models import tiny_unet

    return tiny_unet()


def test_diffusers_models_list_the_modules_their_switch_sets():
    model = _tiny_unet()
    assert _compat.diffusers_model(model) is model
    found = dict(_compat.diffusers_checkpointing_modules(model, model))
    # Each down, mid and up block and each Transformer2DModel: where diffusers' switch
    # stores its function (not what they hand it: resnets, transformer blocks).
    assert set(found) == {
        "down_blocks.0",
        "down_blocks.0.attentions.0",
        "down_blocks.1",
        "mid_block",
        "mid_block.attentions.0",
        "up_blocks.0",
        "up_blocks.1",
        "up_blocks.1.attentions.0",
        "up_blocks.1.attentions.1",
    }
    model.enable_gradient_checkpointing()
    stored = {
        path for path, m in model.named_modules() if vars(m).get("_gradient_checkpointing_func")
    }
    assert stored == set(found)
    assert _compat.diffusers_model(_tiny_llama()) is None
    # Held by another module (PEFT's PeftModel): found, with paths in the holder.
    holder = torch.nn.ModuleDict({"base": model})
    assert _compat.diffusers_model(holder) is model
    assert {path for path, _ in _compat.diffusers_checkpointing_modules(holder, model)} == {
        f"base.{path}" for path in found
    }
    assert _compat.diffusers_model(torch.nn.Linear(2, 2)) is None


def test_diffusers_default_checkpoint_function_is_told_from_others():
    model = _tiny_unet()
    model.enable_gradient_checkpointing()
    function = vars(model.down_blocks[0])["_gradient_checkpointing_func"]
    assert _compat.is_diffusers_default_checkpoint(function)
    import torch.utils.checkpoint

    assert not _compat.is_diffusers_default_checkpoint(torch.utils.checkpoint.checkpoint)
    model.enable_gradient_checkpointing(gradient_checkpointing_func=lambda m, *a: m(*a))
    assert not _compat.is_diffusers_default_checkpoint(
        vars(model.down_blocks[0])["_gradient_checkpointing_func"]
    )
