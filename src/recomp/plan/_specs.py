"""The published models ``recomp simulate`` and ``recomp.plan.models`` know: each
release's ``config.json`` values, where they come from and its exact parameter count.
Framework-free (the command's parser lists them without importing PyTorch);
``recomp.plan.models`` builds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: transformers' model families used here.
_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


@dataclass(frozen=True)
class ModelSpec:
    """A published model: its family, the config values of its release, where they come
    from, and the parameter count of the transformers model built from them (embeddings
    and output head included; DeepSeek-V3's multi-token-prediction module, which the
    transformers model does not build, excluded)."""

    name: str
    family: str
    values: dict[str, Any]
    source: str
    parameters: int
    note: str = ""

    @property
    def moe(self) -> bool:
        return self.family != "llama"


_LLAMA_31 = {
    "vocab_size": 128256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}

#: The models, by name. Parameter counts: the published totals (the Hub's safetensors
#: metadata), which the tests check against the built model exactly.
MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "llama-3.1-8b",
            "llama",
            {
                **_LLAMA_31,
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
            },
            "https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
            8_030_261_248,
        ),
        ModelSpec(
            "llama-3.1-70b",
            "llama",
            {
                **_LLAMA_31,
                "hidden_size": 8192,
                "intermediate_size": 28672,
                "num_hidden_layers": 80,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
            },
            "https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json",
            70_553_706_496,
        ),
        ModelSpec(
            "llama-3.1-405b",
            "llama",
            {
                **_LLAMA_31,
                "hidden_size": 16384,
                "intermediate_size": 53248,
                "num_hidden_layers": 126,
                "num_attention_heads": 128,
                "num_key_value_heads": 8,
            },
            "https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json",
            405_853_388_800,
        ),
        ModelSpec(
            "mixtral-8x22b",
            "mixtral",
            {
                "vocab_size": 32000,
                "hidden_size": 6144,
                "intermediate_size": 16384,
                "num_hidden_layers": 56,
                "num_attention_heads": 48,
                "num_key_value_heads": 8,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 65536,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "tie_word_embeddings": False,
            },
            "https://huggingface.co/mistralai/Mixtral-8x22B-v0.1/blob/main/config.json",
            140_620_634_112,
        ),
        ModelSpec(
            "deepseek-v3",
            "deepseek_v3",
            {
                "vocab_size": 129280,
                "hidden_size": 7168,
                "intermediate_size": 18432,
                "moe_intermediate_size": 2048,
                "num_hidden_layers": 61,
                "num_attention_heads": 128,
                "num_key_value_heads": 128,
                "n_shared_experts": 1,
                "n_routed_experts": 256,
                "routed_scaling_factor": 2.5,
                "kv_lora_rank": 512,
                "q_lora_rank": 1536,
                "qk_rope_head_dim": 64,
                "v_head_dim": 128,
                "qk_nope_head_dim": 128,
                "n_group": 8,
                "topk_group": 4,
                "num_experts_per_tok": 8,
                "first_k_dense_replace": 3,
                "norm_topk_prob": True,
                "max_position_embeddings": 163840,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 40.0,
                    "original_max_position_embeddings": 4096,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                },
            },
            "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json",
            671_026_404_352,
            note="published as 671B (the paper; the exact count here is the config's); the 61 "
            "layers of the main model, whose released "
            "checkpoint's 685B add the multi-token-prediction module (14B)",
        ),
        ModelSpec(
            "qwen3-30b-a3b",
            "qwen3_moe",
            {
                "vocab_size": 151936,
                "hidden_size": 2048,
                "intermediate_size": 6144,
                "moe_intermediate_size": 768,
                "num_hidden_layers": 48,
                "num_attention_heads": 32,
                "num_key_value_heads": 4,
                "head_dim": 128,
                "num_experts": 128,
                "num_experts_per_tok": 8,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "rms_norm_eps": 1e-6,
                "max_position_embeddings": 40960,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "tie_word_embeddings": False,
            },
            "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json",
            30_532_122_624,
        ),
        ModelSpec(
            "qwen3-235b-a22b",
            "qwen3_moe",
            {
                "vocab_size": 151936,
                "hidden_size": 4096,
                "intermediate_size": 12288,
                "moe_intermediate_size": 1536,
                "num_hidden_layers": 94,
                "num_attention_heads": 64,
                "num_key_value_heads": 4,
                "head_dim": 128,
                "num_experts": 128,
                "num_experts_per_tok": 8,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "rms_norm_eps": 1e-6,
                "max_position_embeddings": 40960,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "tie_word_embeddings": False,
            },
            "https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json",
            235_093_634_560,
        ),
    )
}


def model_names() -> list[str]:
    return list(MODELS)


def spec(name: str) -> ModelSpec:
    """The model called ``name`` (case-insensitive), or a ``KeyError`` naming the known ones."""
    key = name.lower()
    if key not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[key]


def layer_kinds(model: ModelSpec | str, num_layers: int | None = None) -> list[str]:
    """Per layer of the model (or of its first ``num_layers``): ``"dense"`` or ``"moe"``."""
    s = spec(model) if isinstance(model, str) else model
    n = s.values["num_hidden_layers"] if num_layers is None else num_layers
    if s.family == "llama":
        return ["dense"] * n
    if s.family == "deepseek_v3":
        k = s.values["first_k_dense_replace"]
        return ["dense" if i < k else "moe" for i in range(n)]
    if s.family == "qwen3_moe":
        step, only = s.values["decoder_sparse_step"], set(s.values["mlp_only_layers"])
        return ["moe" if i not in only and (i + 1) % step == 0 else "dense" for i in range(n)]
    return ["moe"] * n


def num_experts(s: ModelSpec) -> int:
    """The routed experts of a mixture-of-experts model."""
    v = s.values
    return int(v.get("n_routed_experts") or v.get("num_local_experts") or v["num_experts"])
