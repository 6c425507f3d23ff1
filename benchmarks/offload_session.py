"""The offload session on one CUDA device: step time, peak memory and the copies compute
did not hide, against no offload and against full checkpointing, on a Hugging Face Llama
at long sequence.

    PYTHONPATH=src python benchmarks/offload_session.py --json out.json
    PYTHONPATH=src python benchmarks/offload_session.py --device cpu --small   # smoke test

Strategies, each on its own copy of the model, resident side by side, one timed step of
each per round (interleaved, so that drift hits all alike):

* ``none``: no checkpoint, no session (the time to match);
* ``full``: every decoder layer checkpointed (the memory to match);
* ``session``: no checkpoint, an offload session whose budget is ``--fraction`` of what
  ``none`` saves for backward;
* ``exclude-attn+session``: every layer checkpointed with its attention excluded, under a
  session with ``--fraction`` of what that strategy keeps.

Per strategy: median step time and its spread over the rounds, the peak of allocated
memory above the model's resting memory, and for the sessions the counters of the last
step (bytes each way, bytes brought back ahead, copies backward waited for), the copy
time measured on the side stream (CUDA events), the share of it hidden by compute
(``1 - max(0, step - none) / copy time``), the plan's predicted wait, and the relative
difference of the gradients from ``none`` (0 expected: the session moves bytes, not
values). ``--device cpu`` runs the same on CPU in the host-copy test mode (copies between
CPU tensors; times mean nothing there).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any

import torch


def build(args: argparse.Namespace, device: str) -> Any:
    import transformers
    from transformers.models.llama import modeling_llama as llama

    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return llama.LlamaForCausalLM(config).to(device, dtype).train(), llama


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def saved_bytes(model: Any, ids: torch.Tensor) -> int:
    """What one forward saves for backward (each storage once), measured by a session
    with no budget pressure."""
    import recomp.torch as rt

    session = rt.offload_session(1 << 62, min_bytes=0)
    with session:
        model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return session.last_step.saved_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--fraction", type=float, default=0.5, help="budget / saved bytes")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (>= 2)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.small:
        args.layers, args.hidden, args.heads, args.seq, args.vocab = 2, 64, 4, 128, 256
        args.rounds, args.warmup = 2, 2
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --small for the smoke test")
        return 2
    if device == "cpu":
        from recomp.torch._offload import ENV_HOST_COPY

        os.environ[ENV_HOST_COPY] = "1"  # the host-copy test mode: copies between CPU tensors

    import recomp.torch as rt

    base, llama = build(args, device)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    resting = allocated(device)

    def is_layer(m: torch.nn.Module) -> bool:
        return isinstance(m, llama.LlamaDecoderLayer)

    def is_attention(m: torch.nn.Module) -> bool:
        return isinstance(m, llama.LlamaAttention)

    full = copy.deepcopy(base)
    rt.apply_activation_checkpointing(full, checkpoint_fn=is_layer)
    excluded = copy.deepcopy(base)
    rt.apply_activation_checkpointing(excluded, checkpoint_fn=is_layer, exclude_fn=is_attention)
    plain = copy.deepcopy(base)
    budget_plain = int(saved_bytes(plain, ids) * args.fraction)
    budget_excluded = int(saved_bytes(excluded, ids) * args.fraction)
    strategies: dict[str, tuple[Any, Any]] = {
        "none": (base, None),
        "full": (full, None),
        "session": (plain, rt.offload_session(budget_plain)),
        "exclude-attn+session": (excluded, rt.offload_session(budget_excluded)),
    }
    if args.small:  # tiny tensors: let them move
        for name in ("session", "exclude-attn+session"):
            model, _ = strategies[name]
            budget = budget_plain if name == "session" else budget_excluded
            strategies[name] = (model, rt.offload_session(budget, min_bytes=0))
    for _, session in strategies.values():
        if session is not None:
            session.offloader.timing = device == "cuda"

    def step(name: str) -> tuple[float, int, list[torch.Tensor]]:
        model, session = strategies[name]
        model.zero_grad(set_to_none=True)
        sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        copy_before = session.offloader.stats.copy_seconds if session is not None else 0.0
        t0 = time.perf_counter()
        with session if session is not None else _null():
            model(ids, labels=ids).loss.backward()
        if session is not None:
            session.offloader.synchronize()
        sync(device)
        elapsed = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - resting) if device == "cuda" else 0
        if session is not None:
            copies[name].append(session.offloader.stats.copy_seconds - copy_before)
        return elapsed, peak, [p.grad for p in model.parameters()]

    copies: dict[str, list[float]] = {name: [] for name in strategies}
    times: dict[str, list[float]] = {name: [] for name in strategies}
    peaks: dict[str, int] = {}
    grads: dict[str, list[torch.Tensor]] = {}
    for r in range(args.warmup + args.rounds):
        for name in strategies:
            elapsed, peak, g = step(name)
            if r >= args.warmup:
                times[name].append(elapsed)
                peaks[name] = max(peaks.get(name, 0), peak)
            if r == args.warmup + args.rounds - 1:
                grads[name] = [x.detach().float().clone() for x in g]

    reference = grads["none"]
    base_time = statistics.median(times["none"])
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (host-copy mode)",
        "torch": torch.__version__,
        "config": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "batch",
                                                  "fraction", "rounds")},
        "strategies": {},
    }
    for name, (_, session) in strategies.items():
        diff = sum(float((a - b).norm() ** 2) for a, b in zip(grads[name], reference)) ** 0.5
        norm = sum(float(b.norm() ** 2) for b in reference) ** 0.5
        median = statistics.median(times[name])
        row: dict[str, Any] = {
            "step_ms": median * 1e3,
            "spread_ms": (max(times[name]) - min(times[name])) * 1e3,
            "peak_mib": peaks[name] / 2**20,
            "grad_rel_diff": diff / norm if norm else 0.0,
        }
        if session is not None:
            stats = session.last_step
            copy_s = statistics.median(copies[name]) if copies[name] else 0.0
            row.update(
                budget_mib=session.config.budget_bytes / 2**20,
                stats=stats.as_dict(),
                copy_ms=copy_s * 1e3,
                hidden_share=(1.0 - max(0.0, median - base_time) / copy_s)
                if copy_s and device == "cuda"
                else None,
                planned_wait_ms=(session.plan.exposed_seconds or 0.0) * 1e3
                if session.plan is not None
                else None,
                plan=session.plan.summary(limit=4) if session.plan is not None else None,
            )
        results["strategies"][name] = row

    for name, row in results["strategies"].items():
        line = (
            f"{name:22s} step {row['step_ms']:9.2f} ms (±{row['spread_ms'] / 2:.2f})  "
            f"peak {row['peak_mib']:9.1f} MiB  grad diff {row['grad_rel_diff']:.1e}"
        )
        if "stats" in row:
            s = row["stats"]
            line += (
                f"\n{'':22s} budget {row['budget_mib']:.1f} MiB, resident peak "
                f"{s['peak_resident_bytes'] / 2**20:.1f} MiB, out {s['offloaded_bytes'] / 2**20:.1f} "
                f"MiB, back {s['restored_bytes'] / 2**20:.1f} MiB (ahead "
                f"{s['prefetched_bytes'] / 2**20:.1f}), waited-for copies {s['unhidden_copies']}, "
                f"copy time {row['copy_ms']:.2f} ms"
            )
            if row["hidden_share"] is not None:
                line += f", hidden {100 * row['hidden_share']:.0f} %"
        print(line)
    print()
    print(results["strategies"]["session"]["plan"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    # Bit-equal on CPU; on a device, kernels that accumulate in another order from run to
    # run (attention backward) may differ in the last bits, not more.
    bad = [n for n, row in results["strategies"].items() if row["grad_rel_diff"] > 1e-3]
    if bad or (device == "cpu" and any(r["grad_rel_diff"] for r in results["strategies"].values())):
        print(f"gradients differ from 'none': {bad or 'on CPU'}", file=sys.stderr)
        return 1
    return 0


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


if __name__ == "__main__":
    raise SystemExit(main())
