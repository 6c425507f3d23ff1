"""Activation memory held after the forward, read from the allocator (glibc mallinfo2).

Each measurement runs in a child process (see memory.py). Activations are
4 MiB, so allocator noise (a few KiB) is far below one activation.
"""

from __future__ import annotations

import pytest

from memory import run_measured

LAYERS = 4

MODEL = """
import torch
from torch import nn
import torch.nn.functional as F
import recomp.torch as rt
torch.manual_seed(0)
B, T, D = 2, 1024, 512
ACT = B * T * D * 4


class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Layer(nn.Module):
    # RMSNorm, then a matmul, then SiLU
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm()
        self.proj = nn.Linear(D, D, bias=False)

    def forward(self, x):
        return F.silu(self.proj(self.norm(x)))


def held_after_forward(model):
    x = torch.randn(B, T, D, requires_grad=True)
    for _ in range(2):  # warm-up: grads and allocator caches exist before measuring
        model(x).sum().backward()
    base = heap_bytes()
    out = model(x)
    held = heap_bytes() - base
    out.sum().backward()
    return held / ACT
"""


def measure(setup: str) -> float:
    code = MODEL + setup + "\nresult = {'acts': held_after_forward(model)}\n"
    return run_measured(code)["acts"]


@pytest.fixture(scope="module")
def figures():
    exclude = f"""
layers = []
for _ in range({LAYERS}):
    layer = Layer()
    layer.proj = rt.checkpoint_exclude_wrapper(layer.proj)
    layers.append(rt.checkpoint_wrapper(layer))
model = nn.Sequential(*layers)
"""
    full = f"""
from torch.utils.checkpoint import checkpoint
class Ckpt(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
    def forward(self, x):
        return checkpoint(self.m, x, use_reentrant=False)
model = nn.Sequential(*[Ckpt(Layer()) for _ in range({LAYERS})])
"""
    return {"exclude": measure(exclude), "full": measure(full)}


def test_full_checkpoint_keeps_one_activation_per_layer(figures):
    # the control: layer outputs only (each is the next checkpoint's input)
    assert figures["full"] == pytest.approx(LAYERS, abs=0.25)


def test_excluded_matmul_does_not_keep_its_deferred_input(figures):
    # layer output + the cached matmul output; the normalised input the matmul
    # saved is deferred to the replay (a design without deferral keeps 3 per layer)
    assert figures["exclude"] == pytest.approx(2 * LAYERS, abs=0.25)


def test_save_output_false_chain_keeps_one_copy():
    chain = """
class Chain(nn.Module):
    def __init__(self, save_first):
        super().__init__()
        self.a = rt.checkpoint_exclude_wrapper(nn.Linear(D, D, bias=False), save_output=save_first)
        # scales (saves nothing), then a matmul that saves its scaled input
        self.b = rt.checkpoint_exclude_wrapper(nn.Sequential(Scale(), nn.Linear(D, D, bias=False)))

    def forward(self, x):
        return torch.tanh(self.b(self.a(x)))


class Scale(nn.Module):
    def forward(self, x):
        return x * 2.0


model = nn.Sequential(*[rt.checkpoint_wrapper(Chain(SAVE)) for _ in range(4)])
"""
    kept = measure(chain.replace("SAVE", "True"))
    chained = measure(chain.replace("SAVE", "False"))
    # per layer: output, b's saved scaled input, b's cached output; plus a's output if cached
    assert kept == pytest.approx(4 * LAYERS, abs=0.3)
    assert chained == pytest.approx(3 * LAYERS, abs=0.3)


def test_region_before_a_residual_add_keeps_nothing_beyond_the_layer_output():
    # x + proj(norm(x)): the replay stops in the region's boundary (it still binds the
    # deferred input there), so neither norm(x) nor proj's output is kept
    residual = f"""
class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm()
        self.proj = rt.checkpoint_exclude_wrapper(nn.Linear(D, D, bias=False))

    def forward(self, x):
        return x + self.proj(self.norm(x))


model = nn.Sequential(*[rt.checkpoint_wrapper(Residual()) for _ in range({LAYERS})])
"""
    assert measure(residual) == pytest.approx(LAYERS, abs=0.25)
