"""accelerate's FSDP2 preparation of an HF model that recomp wrapped, on gloo ranks.

Not a test module: ``test_accelerate_fsdp2.py`` runs :func:`run` on 2 ranks. Each
variant builds the same tiny Qwen3 model and shards it with accelerate's own
``fsdp2_prepare_model`` (its wrap policy finds the decoder layers by the class
names in ``_no_split_modules``), then trains one step:

* ``reference``: no recomp;
* ``recomp_first``: ``apply_activation_checkpointing`` before accelerate shards it
  (what happens when a wrapped model is handed to HF Trainer with FSDP);
* ``recomp_after``: recomp applied to the sharded model;
* ``accelerate_ac_offload``: the attentions excluded by recomp, then accelerate's own
  activation checkpointing with its offload (``activation_checkpointing=True``,
  ``activation_checkpointing_offload=True``: ``fsdp2_apply_ac`` wraps each layer in
  PyTorch's ``checkpoint_wrapper`` inside ``offload_wrapper``), which checkpoints with
  recomp.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model
from torch.distributed.fsdp import FSDPModule
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3DecoderLayer

from recomp.torch import apply_activation_checkpointing, checkpoint_exclude_wrapper

LAYERS = 2


def build() -> Qwen3ForCausalLM:
    torch.manual_seed(0)  # the same weights on every rank
    config = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(config)


def checkpoint_layers(model: torch.nn.Module) -> None:
    apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, Qwen3DecoderLayer),
        exclude_fn=lambda m: isinstance(m, Qwen3Attention),
    )


def prepare(model: torch.nn.Module, rank: int, ac_offload: bool = False) -> torch.nn.Module:
    options = {"activation_checkpointing": True, "activation_checkpointing_offload": True}
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        cpu_ram_efficient_loading=False,
        **(options if ac_offload else {}),
    )
    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin),
        torch_device_mesh=None,
        mixed_precision="no",
        is_main_process=rank == 0,
    )
    if ac_offload:  # what Accelerator._prepare_fsdp2 does before sharding
        plugin.set_auto_wrap_policy(model)
        model = fsdp2_apply_ac(accelerator, model)
    return fsdp2_prepare_model(accelerator, model)


def run(rank: int, world_size: int) -> dict[str, Any]:
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(10 + rank))
    report: dict[str, Any] = {"rank": rank, "variants": {}}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for variant in ("reference", "recomp_first", "recomp_after", "accelerate_ac_offload"):
        model = build()
        model.train()
        if variant == "recomp_first":
            checkpoint_layers(model)
        if variant == "accelerate_ac_offload":
            for layer in model.model.layers:
                layer.self_attn = checkpoint_exclude_wrapper(layer.self_attn)
        model = prepare(model, rank, ac_offload=variant == "accelerate_ac_offload")
        if variant == "recomp_after":
            checkpoint_layers(model)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads[variant] = {
            n.replace("._checkpoint_wrapped_module", ""): p.grad.to_local().clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        layers = model.model.layers
        report["variants"][variant + "_wrappers"] = sorted(
            {type(m).__name__ for m in model.modules() if "Wrapper" in type(m).__name__}
        )
        for _ in range(2):  # accelerate's offload wrapper around its checkpoint wrapper
            layers = [getattr(m, "_checkpoint_wrapped_module", m) for m in layers]
        report["variants"][variant] = {
            "loss": loss.item(),
            "sharded": sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule)),
            "layer_classes": [type(m).__name__ for m in layers],
            "exclusions": [
                [m.self_attn.region_runs, m.self_attn.region_skips]
                for m in layers
                if hasattr(m.self_attn, "region_runs")
            ],
        }
    ref = grads["reference"]
    for variant in ("recomp_first", "recomp_after", "accelerate_ac_offload"):
        got = grads[variant]
        report["variants"][variant]["grads_bit_equal"] = sorted(got) == sorted(ref) and all(
            torch.equal(got[n], ref[n]) for n in ref
        )
    report["grad_names"] = len(ref)
    return report
