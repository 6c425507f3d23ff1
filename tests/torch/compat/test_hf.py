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
