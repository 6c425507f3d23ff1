"""Tools that find layer classes by name see a wrapped model as it was.

accelerate's FSDP wrap policies (FSDP1 ``set_auto_wrap_policy``, FSDP2
``fsdp2_prepare_auto_wrap_policy``), HF's ``_no_split_modules`` and DeepSpeed's
leaf-module lists match ``module.__class__.__name__``; the class a wrapped module
reports must be named as the one it had, while recomp still knows it is wrapped
(tested on both frameworks in ``tests/core/test_name_lookups.py``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.utils.dataclasses import get_module_class_from_name  # noqa: E402
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

import recomp.torch as rt  # noqa: E402


def qwen3():
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
    )
    return transformers.Qwen3ForCausalLM(config)


def wrapped_qwen3():
    model = qwen3()
    rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, modeling_qwen3.Qwen3DecoderLayer),
        exclude_fn=lambda m: isinstance(m, modeling_qwen3.Qwen3Attention),
    )
    return model


def test_accelerate_fsdp2_policy_finds_the_wrapped_layers():
    model = wrapped_qwen3()
    assert model._no_split_modules  # the policy goes by these names
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap"
    )
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    chosen = [name for name, module in model.named_modules() if policy(module)]
    assert chosen == ["model.layers.0", "model.layers.1"]


@pytest.mark.parametrize("names", [None, ["Qwen3DecoderLayer"]])
def test_accelerate_fsdp1_policy_finds_the_wrapped_layers(names):
    model = wrapped_qwen3()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=names,
    )
    plugin.set_auto_wrap_policy(model)  # raised "Could not find the transformer layer class"
    (layer_cls,) = plugin.auto_wrap_policy.keywords["transformer_layer_cls"]
    assert all(isinstance(layer, layer_cls) for layer in model.model.layers)


def test_no_split_modules_name_lookup():
    """``device_map`` planning keeps modules whole whose class name is in ``_no_split_modules``."""
    model = wrapped_qwen3()
    assert get_module_class_from_name(model, "Qwen3DecoderLayer") is type(model.model.layers[0])
    unsplit = {
        name
        for name, module in model.named_modules()
        if type(module).__name__ in model._no_split_modules
    }
    assert unsplit == {"model.layers.0", "model.layers.1"}
