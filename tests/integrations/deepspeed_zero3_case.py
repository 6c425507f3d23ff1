"""Run by ``test_deepspeed_zero3.py`` in its own process (DeepSpeed reads its accelerator
from the environment when first imported): a two-block model under DeepSpeed ZeRO-3 on
CPU, one process on gloo, with each block's attention excluded from a recomp checkpoint.

Prints one line per mode: how many tensors on the full data of the attention weights are
alive after the forward, and the gradients' checksum; exits non-zero if the gradients
differ from those without recomp.
"""

from __future__ import annotations

import gc
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29531")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")

import deepspeed
import torch
from deepspeed.utils import safe_get_full_grad
from torch import nn

import recomp.torch as rt

# Shapes no other tensor of the model has: a live 2-D tensor of one of them is the
# gathered data of an attention weight.
ATTENTION_SHAPES = {(24, 16), (16, 24)}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 24, bias=False)
        self.o = nn.Linear(24, 16, bias=False)

    def forward(self, x):
        return self.o(torch.softmax(self.q(x), dim=-1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.attn = Attention()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        h = x + self.attn(self.norm(x))
        return h + self.down(torch.tanh(self.up(h)))


def full_attention_data_alive() -> int:
    gc.collect()
    return sum(
        1
        for obj in gc.get_objects()
        if isinstance(obj, torch.Tensor)
        and not isinstance(obj, nn.Parameter)
        and tuple(obj.shape) in ATTENTION_SHAPES
        and obj.untyped_storage().nbytes() > 0
    )


def run(mode: str) -> tuple[int, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    if mode == "excluded":
        for block in model:
            rt.checkpoint_exclude_wrapper(block.attn)
            rt.checkpoint_wrapper(block)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    loss = engine(x).square().sum()
    alive = full_attention_data_alive()
    engine.backward(loss)
    # Flattened: a gradient of an attention weight must not count as its data.
    grads = [safe_get_full_grad(p).flatten().clone() for p in engine.module.parameters()]
    return alive, grads


def main() -> int:
    deepspeed.init_distributed(dist_backend="gloo")
    alive_plain, want = run("plain")
    alive, got = run("excluded")
    print(f"plain: {alive_plain} alive")
    print(f"excluded: {alive} alive")
    same = len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))
    print(f"gradients equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
