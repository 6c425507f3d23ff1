"""What recomp's wrappers cost where nothing is checkpointed: a wrapped model's forward
under ``torch.no_grad()``, ``torch.inference_mode()`` and ``eval()`` with gradients off,
against the same model unwrapped.

A small decoder (4 layers, width 64, 32 tokens, batch 4) is wrapped as the Get started
page's example does it (each layer checkpointed, its attention excluded). Wrapped and unwrapped
forwards are timed interleaved, many rounds, and the ratios of the medians (wall time
and process CPU time, one intra-op thread) are printed, with the Python function calls one forward makes (``sys.setprofile``), which do not
depend on the machine's load::

    python benchmarks/no_grad_cost.py            # ratio wrapped / unwrapped, per mode
    python benchmarks/no_grad_cost.py --rounds 400

Run it with recomp importable (``PYTHONPATH=src``, or the development environment).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from host_cost import count_events  # run as a script: benchmarks/ is on the path
from torch import nn

from recomp.torch import apply_activation_checkpointing

LAYERS, WIDTH, HEADS, TOKENS, BATCH = 4, 64, 4, 32, 4


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class Layer(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def models() -> tuple[nn.Module, nn.Module]:
    """(unwrapped, wrapped): the same weights."""
    torch.manual_seed(0)
    plain = nn.Sequential(*(Layer(WIDTH, HEADS) for _ in range(LAYERS)))
    wrapped = apply_activation_checkpointing(
        copy.deepcopy(plain), checkpoint_fn=Layer, exclude_fn=Attention
    )
    return plain, wrapped


@contextlib.contextmanager
def eval_no_grad(*models: nn.Module) -> Iterator[None]:
    for m in models:
        m.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m in models:
            m.train()


MODES: dict[str, Callable[..., Any]] = {
    "no_grad": lambda *models: torch.no_grad(),
    "inference_mode": lambda *models: torch.inference_mode(),
    "eval + no_grad": eval_no_grad,
}


def measure(mode: str, rounds: int) -> dict[str, float]:
    plain, wrapped = models()
    x = torch.randn(BATCH, TOKENS, WIDTH)
    times: dict[str, list[float]] = {"plain": [], "wrapped": []}
    cpu: dict[str, list[float]] = {"plain": [], "wrapped": []}
    with MODES[mode](plain, wrapped):
        out_plain, out_wrapped = plain(x), wrapped(x)
        assert torch.equal(out_plain, out_wrapped)
        for _ in range(10):  # warm-up
            plain(x)
            wrapped(x)
        for _ in range(rounds):
            for name, model in (("plain", plain), ("wrapped", wrapped)):
                start, start_cpu = time.perf_counter(), time.process_time()
                model(x)
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
        calls = {
            name: count_events(lambda m=m: m(x), "call")
            for name, m in (("plain", plain), ("wrapped", wrapped))
        }
    plain_s, wrapped_s = statistics.median(times["plain"]), statistics.median(times["wrapped"])
    return {
        "plain_us": plain_s * 1e6,
        "wrapped_us": wrapped_s * 1e6,
        "ratio": wrapped_s / plain_s,
        "cpu_ratio": statistics.median(cpu["wrapped"]) / statistics.median(cpu["plain"]),
        "plain_calls": calls["plain"],
        "wrapped_calls": calls["wrapped"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300, help="timed forwards per model")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, {LAYERS} layers, width {WIDTH}, {TOKENS} tokens, batch {BATCH}"
    )
    print(
        f"{'mode':<16}{'unwrapped us':>14}{'wrapped us':>12}{'ratio':>8}{'cpu ratio':>10}{'Python calls':>22}"
    )
    for mode in MODES:
        r = measure(mode, args.rounds)
        print(
            f"{mode:<16}{r['plain_us']:>14.1f}{r['wrapped_us']:>12.1f}{r['ratio']:>8.3f}"
            f"{r['cpu_ratio']:>10.3f}"
            f"{int(r['plain_calls']):>12} -> {int(r['wrapped_calls'])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
