"""HyperParallel's declarative recompute regions (``recomp.torch.hyperparallel``) and
``layers=`` on a Hugging Face Llama built from a config: the decoder layers found as
HyperParallel finds them, gradients bit for bit those of the unwrapped model, each
excluded attention run once and skipped once by its layer's replay, names unchanged,
HF's own checkpointing turned off (and left on by a refusal), ``swap_inputs`` moving
each region's input to the host and back (host-copy mode: exact bytes)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import recomp
import recomp.torch as rt
import recomp.torch.hyperparallel as hp
from host_copies import recorded_host_copies
from recomp._wrapping import recomp_wrapper_of

transformers = pytest.importorskip("transformers")

HIDDEN, SEQ = 64, 32
IDS = torch.randint(0, 100, (2, SEQ), generator=torch.Generator().manual_seed(1))
SAFE = "model_adapter_safe_regions"


def llama(layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=100, use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).train()


def grads(model: nn.Module) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(IDS, labels=IDS).loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_exact(reference: nn.Module, model: nn.Module) -> None:
    for want, got in zip(grads(reference), grads(model), strict=True):
        assert torch.equal(want, got)


def wrapped(model: nn.Module) -> list[str]:
    return [path for path, m in model.named_modules() if recomp_wrapper_of(m) is not None]


LAYER_REGIONS = hp.RecomputePolicy(
    region_patterns=("model.layers.*",), exclude_patterns=("model.layers.*.self_attn",)
)


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> list:  # type: ignore[type-arg]
    yield from recorded_host_copies(monkeypatch)


def test_layer_regions_with_the_attention_excluded_are_exact():
    reference = llama()
    model = copy.deepcopy(reference)
    keys = list(model.state_dict())
    selection = hp.ActivationCheckpointSelection(source=SAFE, layer_indices=[0, 2])
    assert hp.apply_recompute_policy(model, LAYER_REGIONS, selection) is model
    assert wrapped(model) == [
        "model.layers.0", "model.layers.0.self_attn", "model.layers.2", "model.layers.2.self_attn",
    ]
    assert list(model.state_dict()) == keys
    assert all(isinstance(layer, transformers.models.llama.modeling_llama.LlamaDecoderLayer)
               for layer in model.model.layers)
    assert_exact(reference, model)
    attentions = [model.model.layers[i].self_attn for i in (0, 2)]
    assert [(a.region_runs, a.region_skips) for a in attentions] == [(1, 1), (1, 1)]
    rt.unwrap(model)
    assert wrapped(model) == []


def test_leaf_regions_checkpoint_each_part_of_the_first_layers():
    reference = llama()
    model = copy.deepcopy(reference)
    policy = hp.RecomputePolicy(("model.layers.*.mlp", "model.layers.*.input_layernorm"))
    hp.apply_recompute_policy(model, policy, {"layer_count": 2})
    assert wrapped(model) == [
        "model.layers.0.mlp", "model.layers.0.input_layernorm",
        "model.layers.1.mlp", "model.layers.1.input_layernorm",
    ]
    assert_exact(reference, model)


def test_hf_checkpointing_is_turned_off_where_regions_take_over_and_kept_by_a_refusal():
    reference = llama()
    model = copy.deepcopy(reference)
    model.activation_checkpointing_enable()
    layers = list(model.model.layers)
    with pytest.raises(recomp.SelectionError, match="did you mean"):
        hp.apply_recompute_policy(model, hp.RecomputePolicy(("model.layer.*",)), {"layer_count": 1})
    assert all(layer.gradient_checkpointing for layer in layers)  # refused: nothing changed
    hp.apply_recompute_policy(model, LAYER_REGIONS, {"layer_count": 4})
    assert not any(layer.gradient_checkpointing for layer in layers)
    assert_exact(reference, model)
    assert [layer.self_attn.region_skips for layer in layers] == [1, 1, 1, 1]


def test_swap_inputs_moves_each_regions_input_to_the_host_and_back(groups):
    reference = llama(3)
    model = copy.deepcopy(reference)
    hp.apply_recompute_policy(model, LAYER_REGIONS, {"layer_count": 3}, swap_inputs=True)
    layers = list(model.model.layers)
    pairs = hp.SwapManager().pairs
    assert [pairs[b]() for b in layers[1:]] == layers[:-1]
    assert_exact(reference, model)
    # One group per layer, moving the hidden states the checkpoint saves (float32) out and
    # back; the last layer ends the chain of pairs and keeps them.
    hidden = 2 * SEQ * HIDDEN * 4
    assert [(g.offloaded_bytes, g.restored_bytes) for g in groups] == [
        (hidden, hidden), (hidden, hidden), (0, 0)
    ]


def test_layers_of_apply_activation_checkpointing_are_the_decoder_layers():
    reference = llama()
    model = copy.deepcopy(reference)
    rt.apply_activation_checkpointing(model, layers=range(0, 4, 2), exclude_fn="self_attn")
    assert wrapped(model) == [
        "model.layers.0", "model.layers.0.self_attn", "model.layers.2", "model.layers.2.self_attn",
    ]
    assert_exact(reference, model)
    with pytest.raises(recomp.SelectionError, match=r"past the last of the 4 layer\(s\) of LlamaForCausalLM \(positions 0 to 3: 'model.layers.0' to 'model.layers.3'\)"):
        rt.apply_activation_checkpointing(llama(), layers=[4])


def test_submodule_checkpointing_on_the_decoder_layers_is_exact():
    reference = llama(2)
    model = copy.deepcopy(reference)
    assert hp.apply_submodule_checkpointing(list(model.model.layers), has_kv_sharing=True) == 6
    assert wrapped(model) == [
        f"model.layers.{i}.{part}" for i in range(2)
        for part in ("mlp", "input_layernorm", "post_attention_layernorm")
    ]
    assert_exact(reference, model)
