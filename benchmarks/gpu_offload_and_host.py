"""On one CUDA device, side by side in one process: (1) the host cost of each checkpointing
strategy on a small Hugging Face Llama whose kernels take microseconds (the step is bound
by the host), and (2) the memory and time of holding checkpoint inputs in host memory:
Hugging Face's ``offload=True`` with PyTorch's checkpoint and with recomp's (where it is
``swap_inputs=True``), and PyTorch's ``MUST_CPU_OFFLOAD`` policy under recomp; (3) the
same at long sequence (``--parts long``): 4 layers of Qwen3-8B's shape (hidden 4096, MLP
12288, 32 heads, 8 key-value heads) at 32,768 tokens, where input offload is published to
cut the peak by about 14 % for about 2 % of step time (the whole 8B model under
DeepSpeed); the figure printed here is the activations' part of the peak, for 4 layers.

    PYTHONPATH=src python benchmarks/gpu_offload_and_host.py --json out.json
    PYTHONPATH=src python benchmarks/gpu_offload_and_host.py --parts long --rounds 4

Models stay resident and timed steps are interleaved (one step of each strategy per
round); the medians and the spread (min-max over the rounds) are printed, with the
process CPU time per step beside the wall time. Gradients are compared with the first
strategy of each part (relative norm of the difference, over all parameters).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
from functools import partial
from typing import Any

import torch
import transformers
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers.models.llama import modeling_llama as llama

import recomp.torch as rt

SDPA = {
    getattr(torch.ops.aten, n).default
    for n in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, n)
}


DEVICE = "cuda"
CUDA = True


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if CUDA else 0


def build(
    hidden: int, inter: int, layers: int, heads: int, kv: int, seq: int, arch: str = "llama"
) -> Any:
    shape = dict(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=32000,
        max_position_embeddings=seq, attn_implementation="sdpa", use_cache=False,
    )
    torch.manual_seed(0)
    if arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=hidden // heads, **shape)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        model = llama.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    return model.to(DEVICE, torch.bfloat16).train()


def is_layer(m: torch.nn.Module) -> bool:
    # Hugging Face's decoder layers (LlamaDecoderLayer, Qwen3DecoderLayer) by name: the
    # parts below check the class of the attention the same way.
    return type(m).__name__.endswith("DecoderLayer")


def is_attention(m: torch.nn.Module) -> bool:
    return type(m).__name__.endswith("Attention")


def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return CheckpointPolicy.MUST_SAVE if op in SDPA else CheckpointPolicy.PREFER_RECOMPUTE


def offload_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    if op is torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_CPU_OFFLOAD
    return CheckpointPolicy.PREFER_RECOMPUTE


def prepare(base: Any, strategy: str) -> Any:
    m = copy.deepcopy(base)
    attn = is_attention
    if strategy == "hf-gc":
        m.activation_checkpointing_enable()
    elif strategy == "hf-gc-offload":
        m.activation_checkpointing_enable(offload=True)
    elif strategy == "recomp-hf-offload":
        rt.hf_activation_checkpointing(m)
        m.activation_checkpointing_enable(offload=True)
    elif strategy == "recomp-full":
        rt.apply_activation_checkpointing(m, checkpoint_fn=is_layer)
    elif strategy == "recomp-exclude-attn":
        rt.apply_activation_checkpointing(m, checkpoint_fn=is_layer, exclude_fn=attn)
    elif strategy == "recomp-mm-cpu-offload":
        rt.apply_activation_checkpointing(m, checkpoint_fn=is_layer, policy_fn=offload_matmuls)
    elif strategy == "sac-sdpa":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        context_fn = partial(create_selective_checkpoint_contexts, sac_policy)
        apply_activation_checkpointing(
            m, checkpoint_wrapper_fn=partial(checkpoint_wrapper, context_fn=context_fn),
            check_fn=is_layer,
        )
    elif strategy != "none":
        raise ValueError(strategy)
    return m


def run_part(name: str, base: Any, strategies: list[str], ids: torch.Tensor, rounds: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    models: dict[str, Any] = {}
    reference = None
    for s in strategies:
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        try:
            m = prepare(base, s)
            m.zero_grad(set_to_none=True)
            m(input_ids=ids, labels=ids).loss.backward()
            grads = [p.grad.float() for p in m.parameters()]
            if reference is None:
                reference, diff = grads, 0.0
            else:
                num = sum(((g - r) ** 2).sum() for g, r in zip(grads, reference)) ** 0.5
                den = sum((r**2).sum() for r in reference) ** 0.5
                diff = float(num / den)
            del grads
            m.zero_grad(set_to_none=True)
            models[s] = m
            rows.append({"part": name, "strategy": s, "grad_rel_diff": diff, "wall": [], "cpu": [], "peak": []})
        except Exception as exc:
            rows.append({"part": name, "strategy": s, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    reference = None
    for _ in range(rounds):
        for r in rows:
            if "error" in r:
                continue
            m = models[r["strategy"]]
            _sync()
            base_alloc = _allocated()
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            c0, t0 = time.process_time(), time.perf_counter()
            m(input_ids=ids, labels=ids).loss.backward()
            _sync()
            r["wall"].append((time.perf_counter() - t0) * 1e3)
            r["cpu"].append((time.process_time() - c0) * 1e3)
            r["peak"].append((_peak() - base_alloc) / 2**30)
            m.zero_grad(set_to_none=True)
    first = next((r for r in rows if "error" not in r), None)
    for r in rows:
        if "error" in r:
            print(f"{name:6} {r['strategy']:22} ERROR {r['error']}", flush=True)
            continue
        for k in ("wall", "cpu", "peak"):
            v = r[k][1:] or r[k]  # the first round warms caches
            r[k + "_median"], r[k + "_min"], r[k + "_max"] = statistics.median(v), min(v), max(v)
        ratio = r["wall_median"] / first["wall_median"] if first else float("nan")
        print(
            f"{name:6} {r['strategy']:22} wall {r['wall_median']:8.2f} ms "
            f"[{r['wall_min']:.2f}-{r['wall_max']:.2f}] x{ratio:.2f}  cpu {r['cpu_median']:8.2f} ms  "
            f"peak {r['peak_median']:7.3f} GiB  grad diff {r['grad_rel_diff']:.1e}",
            flush=True,
        )
    del models
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--json")
    p.add_argument("--parts", default="host,offload")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run at small sizes")
    p.add_argument("--small", action="store_true", help="the offload part at a small size")
    a = p.parse_args()
    global DEVICE, CUDA
    DEVICE, CUDA = a.device, a.device == "cuda"
    name = torch.cuda.get_device_name() if CUDA else "CPU"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {name}", flush=True)
    results: list[dict[str, Any]] = []
    parts = a.parts.split(",")
    if "host" in parts:
        base = build(hidden=256, inter=688, layers=8, heads=4, kv=2, seq=256)
        ids = torch.randint(0, 32000, (2, 256), device=DEVICE)
        results += run_part(
            "host", base,
            ["none", "hf-gc", "recomp-full", "sac-sdpa", "recomp-exclude-attn"],
            ids, a.rounds * 3,
        )
        del base
    if "offload" in parts:
        size = dict(hidden=256, inter=688, layers=2, heads=4, kv=2, seq=128) if a.small else dict(
            hidden=2048, inter=5632, layers=8, heads=16, kv=4, seq=4096
        )
        base = build(**size)
        ids = torch.randint(0, 32000, (2, size["seq"]), device=DEVICE)
        results += run_part(
            "offload", base,
            ["hf-gc", "hf-gc-offload", "recomp-hf-offload", "recomp-full", "recomp-mm-cpu-offload"],
            ids, a.rounds,
        )
        del base
    if "long" in parts:
        size = dict(hidden=256, inter=768, layers=2, heads=4, kv=2, seq=256) if a.small else dict(
            hidden=4096, inter=12288, layers=4, heads=32, kv=8, seq=32768
        )
        base = build(arch="qwen3", **size)
        ids = torch.randint(0, 32000, (1, size["seq"]), device=DEVICE)
        results += run_part(
            "long", base, ["hf-gc", "hf-gc-offload", "recomp-hf-offload"], ids, a.rounds
        )
        del base
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
