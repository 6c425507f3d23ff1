"""Train a tiny Hugging Face model with recomp, and check it against the same model without.

    python examples/hf_train.py                  # Llama, 4 steps
    python examples/hf_train.py --model mixtral  # a mixture-of-experts model

Two copies of one model train side by side on the same batches with AdamW: one
as built, one with recomp (every decoder layer checkpointed, attention and the
MoE router kept out of the replay). Each step compares the gradients with
``torch.equal``; the script prints a short report and exits with status 1 if any
gradient differs. Models are built from small configs: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer
from transformers.models.mixtral.modeling_mixtral import (
    MixtralAttention,
    MixtralDecoderLayer,
    MixtralTopKRouter,
)

from recomp.torch import ExcludeWrapper, apply_activation_checkpointing

SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
    attention_dropout=0.1,
)


def build(name: str) -> tuple[torch.nn.Module, type, tuple[type, ...]]:
    """A fresh model, its decoder layer class, and the classes to keep out of the replay."""
    torch.manual_seed(0)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**SIZES)), LlamaDecoderLayer, (LlamaAttention,)
    config = MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2)
    return MixtralForCausalLM(config), MixtralDecoderLayer, (MixtralAttention, MixtralTopKRouter)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["llama", "mixtral"], default="llama")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    plain, layer_type, excluded = build(args.model)
    model = copy.deepcopy(plain)
    # The two lines that turn recomp on:
    apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, layer_type),
        exclude_fn=lambda m: isinstance(m, excluded),
    )
    models = {"without recomp": plain.train(), "with recomp": model.train()}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}

    data = torch.Generator().manual_seed(1)
    all_equal = True
    print(f"{args.model}: {sum(p.numel() for p in plain.parameters())} parameters")
    for step in range(args.steps):
        ids = torch.randint(0, SIZES["vocab_size"], (4, args.seq), generator=data)
        losses, grads = {}, {}
        for key, m in models.items():
            torch.manual_seed(100 + step)  # the same dropout masks for both models
            loss = m(ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses[key] = loss.item()
            grads[key] = [p.grad.clone() for p in m.parameters() if p.grad is not None]
            optimizers[key].step()
            optimizers[key].zero_grad(set_to_none=True)
        pairs = list(zip(grads["without recomp"], grads["with recomp"]))
        differ = sum(not torch.equal(a, b) for a, b in pairs)
        same_count = len(grads["without recomp"]) == len(grads["with recomp"])
        all_equal &= differ == 0 and same_count
        print(
            f"step {step}: loss {losses['with recomp']:.4f} (without recomp "
            f"{losses['without recomp']:.4f}), gradients differing: {differ} of {len(pairs)}"
        )

    regions = [m for m in model.modules() if isinstance(m, ExcludeWrapper)]
    counts = sorted({(r.region_runs, r.region_skips) for r in regions})
    print(f"excluded regions: {len(regions)}, (runs, skips) each: {counts}")
    print(f"gradients equal to the model without recomp: {'yes' if all_equal else 'NO'}")
    print("OK" if all_equal else "FAILED: gradients differ")
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
