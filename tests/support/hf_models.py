"""Tiny Hugging Face causal LMs built from configs, as ``recomp plan --model`` factories
(``hf_models:tiny_llama``): the factories take the size options they declare."""

from __future__ import annotations

from typing import Any

import torch


def tiny_llama(layers: int = 2, hidden: int = 32, heads: int = 2) -> Any:
    """A seeded ``LlamaForCausalLM``: vocabulary 100, MLP width 2 * hidden."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        vocab_size=100,
    )
    return LlamaForCausalLM(config)


def tiny_qwen3(layers: int = 2, hidden: int = 32, heads: int = 2) -> Any:
    """A seeded ``Qwen3ForCausalLM``: vocabulary 100, MLP width 2 * hidden."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads,
        vocab_size=100,
    )
    return Qwen3ForCausalLM(config)
