"""What ``apply_activation_checkpointing`` is asked to select, on a transformers model.

The selection the Hugging Face guide (docs/guides/huggingface.md) documents for a Llama
model takes effect, and so does not warn. Selections that take no effect warn (``IneffectiveSelectionWarning``) naming
what and why, and predicates are checked before anything is wrapped: tested on both
frameworks in ``tests/core/test_selections.py``.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.models.llama import modeling_llama  # noqa: E402

import recomp  # noqa: E402
import recomp.torch as rt  # noqa: E402
from recomp._wrapping import recomp_wrapper_of  # noqa: E402

Layer, Attention = modeling_llama.LlamaDecoderLayer, modeling_llama.LlamaAttention


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    return transformers.LlamaForCausalLM(config)


def selection_warnings(record):
    return [str(w.message) for w in record if w.category is recomp.IneffectiveSelectionWarning]


def apply(model, **kwargs):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        rt.apply_activation_checkpointing(model, **kwargs)
    return selection_warnings(record)


def wrapped(model):
    return [n for n, m in model.named_modules() if recomp_wrapper_of(m) is not None]


def test_documented_selection_does_not_warn():
    model = llama()
    assert (
        apply(
            model,
            checkpoint_fn=lambda m: isinstance(m, Layer),
            exclude_fn=lambda m: isinstance(m, Attention),
        )
        == []
    )
    # Applying it again finds everything already in place: still silent.
    assert (
        apply(
            model,
            checkpoint_fn=lambda m: isinstance(m, Layer),
            exclude_fn=lambda m: isinstance(m, Attention),
        )
        == []
    )
    assert wrapped(model) == [
        "model.layers.0",
        "model.layers.0.self_attn",
        "model.layers.1",
        "model.layers.1.self_attn",
    ]
