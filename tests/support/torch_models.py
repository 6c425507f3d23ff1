"""Small PyTorch models shared by the tests."""

from __future__ import annotations

import copy

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm residual block: attention-like linear, then an MLP."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm(x))
        return h + self.mlp(h)


def stack(n: int = 3, d: int = 8, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(d) for _ in range(n)])


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def exclude_attention(model: nn.Sequential, checkpoint: bool = True) -> nn.Sequential:
    """Exclude every block's attention from the replay and (with ``checkpoint``)
    checkpoint every block, in place; returns ``model``."""
    import recomp.torch as rt

    for i, blk in enumerate(model):
        blk.attn = rt.checkpoint_exclude_wrapper(blk.attn)
        if checkpoint:
            model[i] = rt.checkpoint_wrapper(blk)
    return model


def grads_of(model: nn.Module, loss_fn, *inputs: torch.Tensor):
    """Run one forward/backward from fresh leaf copies of ``inputs``; return (loss, grads)."""
    model.zero_grad(set_to_none=True)
    leaves = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    loss = loss_fn(model(*leaves))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    for i, x in enumerate(leaves):
        if x.grad is not None:
            grads[f"input{i}"] = x.grad.clone()
    return loss.detach(), grads


def assert_same_grads(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys(), (sorted(expected), sorted(actual))
    for name in expected:
        assert torch.equal(expected[name], actual[name]), (
            f"{name}: max diff {(expected[name] - actual[name]).abs().max().item()}"
        )
