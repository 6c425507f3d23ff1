"""What ``apply_activation_checkpointing`` is asked to select, on real models.

Selections that take no effect warn (``IneffectiveSelectionWarning``) naming what
and why; predicates are checked before anything is wrapped.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mistral import modeling_mistral  # noqa: E402

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


def test_checkpoint_fn_of_a_class_from_another_model_warns():
    model = llama()
    # MistralDecoderLayer is not LlamaDecoderLayer, whatever the two have in common.
    (message,) = apply(
        model, checkpoint_fn=lambda m: isinstance(m, modeling_mistral.MistralDecoderLayer)
    )
    assert "checkpoint_fn matched no module of LlamaForCausalLM" in message
    assert "LlamaDecoderLayer" in message  # the classes the model does have
    assert wrapped(model) == []


def test_exclude_fn_matching_only_modules_outside_checkpoints_warns():
    model = llama()
    (message,) = apply(
        model,
        checkpoint_fn=lambda m: isinstance(m, Layer),
        exclude_fn=lambda m: isinstance(m, nn.Embedding),
    )
    assert "exclude_fn excluded no module inside a checkpoint" in message
    assert "outside every checkpoint ('model.embed_tokens')" in message
    assert wrapped(model) == ["model.layers.0", "model.layers.1"]


def test_exclude_fn_matching_the_checkpointed_module_warns():
    model = llama()
    (message,) = apply(
        model,
        checkpoint_fn=lambda m: isinstance(m, Layer),
        exclude_fn=lambda m: isinstance(m, Layer),
    )
    assert "exclude_fn excluded no module inside a checkpoint" in message
    assert "checkpointed modules themselves ('model.layers.0', 'model.layers.1')" in message
    # Part of it working, part of it not: the part that does nothing is named.
    model = llama()
    (message,) = apply(
        model,
        checkpoint_fn=lambda m: isinstance(m, Layer),
        exclude_fn=lambda m: isinstance(m, (Layer, Attention)),
    )
    assert "exclude_fn excluded 2 module(s), but it matches checkpointed modules" in message


def test_exclude_fn_matching_nothing_warns():
    model = llama()
    (message,) = apply(
        model,
        checkpoint_fn=lambda m: isinstance(m, Layer),
        exclude_fn=lambda m: isinstance(m, modeling_mistral.MistralAttention),
    )
    assert "it matches no module inside a checkpoint" in message


class ForwardCallingLayer(Layer):
    """A decoder layer written to call its attention through ``.forward``."""

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        h = self.input_layernorm(hidden_states)
        h, _ = self.self_attn.forward(
            hidden_states=h,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
        )
        h = residual + h
        return h + self.mlp(self.post_attention_layernorm(h))


def test_excluded_module_called_through_forward_warns_once():
    model = llama()
    for i, layer in enumerate(model.model.layers):
        replacement = ForwardCallingLayer(model.config, i)
        replacement.load_state_dict(layer.state_dict())
        model.model.layers[i] = replacement
    apply(
        model,
        checkpoint_fn=lambda m: isinstance(m, Layer),
        exclude_fn=lambda m: isinstance(m, Attention),
    )
    ids = torch.randint(0, 100, (2, 8))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            model(ids, labels=ids, use_cache=False).loss.backward()
    messages = selection_warnings(record)
    assert len(messages) == 2  # once per excluded module, not per call
    assert "'model.layers.0.self_attn' was called as .forward(...)" in messages[0]
    assert model.model.layers[0].self_attn.region_runs == 0
    # Outside a checkpoint (no_grad, eval) the method call is fine and silent.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(ids, use_cache=False)


def test_a_class_or_a_tuple_of_classes_selects_by_isinstance():
    by_lambda, by_class = llama(), llama()
    apply(
        by_lambda,
        checkpoint_fn=lambda m: isinstance(m, Layer),
        exclude_fn=lambda m: isinstance(m, (Attention, modeling_llama.LlamaMLP)),
    )
    assert (
        apply(by_class, checkpoint_fn=Layer, exclude_fn=(Attention, modeling_llama.LlamaMLP)) == []
    )
    assert wrapped(by_class) == wrapped(by_lambda)
    assert len(wrapped(by_class)) == 6  # 2 layers, their attention and MLP
    ids = torch.randint(0, 100, (2, 8))
    for model in (by_lambda, by_class):
        model(ids, labels=ids, use_cache=False).loss.backward()
    for a, b in zip(by_lambda.parameters(), by_class.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_a_class_is_never_called_as_a_predicate():
    model = llama()
    # nn.Identity(module) would build an Identity, which is truthy: the root was checkpointed.
    (message,) = apply(model, checkpoint_fn=nn.Identity)
    assert "checkpoint_fn matched no module" in message
    assert wrapped(model) == []


@pytest.mark.parametrize(
    ("kwargs", "argument", "hint"),
    [
        ({"checkpoint_fn": "LlamaDecoderLayer"}, "checkpoint_fn", "pass the class itself"),
        (
            {"checkpoint_fn": [Layer]},
            "checkpoint_fn",
            "as a tuple: checkpoint_fn=(LlamaDecoderLayer,)",
        ),
        ({"checkpoint_fn": None}, "checkpoint_fn", "got NoneType"),
        (
            {"checkpoint_fn": Layer, "exclude_fn": "LlamaAttention"},
            "exclude_fn",
            "type(m).__name__",
        ),
        (
            {"checkpoint_fn": Layer, "exclude_fn": Attention, "copy_output_fn": 1},
            "copy_output_fn",
            "int",
        ),
    ],
)
def test_a_selection_that_is_no_predicate_raises_and_changes_nothing(kwargs, argument, hint):
    model = llama()
    with pytest.raises(
        TypeError, match=rf"apply_activation_checkpointing: {argument} must be"
    ) as info:
        rt.apply_activation_checkpointing(model, **kwargs)
    assert hint in str(info.value)
    assert wrapped(model) == []
