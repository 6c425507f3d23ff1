"""The PyTorch side of the random programs (``random_programs``): each op of the program
language as a PyTorch function, and a region as a module that owns its parameters.
Shared by the property test and the offload tests that run the same programs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import random_programs as rp


def _rms(x, g):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * g


OPS = {
    "sin": lambda a, p, at: torch.sin(a[0]),
    "tanh": lambda a, p, at: torch.tanh(a[0]),
    "exp_tanh": lambda a, p, at: torch.exp(torch.tanh(a[0])),
    "relu": lambda a, p, at: torch.relu(a[0]),
    "silu": lambda a, p, at: F.silu(a[0]),
    "add": lambda a, p, at: a[0] + a[1],
    "mul": lambda a, p, at: a[0] * a[1],
    "sub": lambda a, p, at: a[0] - a[1],
    "matmul": lambda a, p, at: a[0] @ p[0],
    "matmul_act": lambda a, p, at: a[0] @ a[1],
    "layernorm": lambda a, p, at: F.layer_norm(a[0], a[0].shape[-1:], p[0], p[1]),
    "rmsnorm": lambda a, p, at: _rms(a[0], p[0]),
    "reshape": lambda a, p, at: a[0].reshape(at[0]),
    "transpose": lambda a, p, at: a[0].transpose(*at),
    "sum": lambda a, p, at: a[0].sum(at[0], keepdim=True),
    "argmax": lambda a, p, at: a[0].argmax(-1, keepdim=True),
    "gather": lambda a, p, at: torch.gather(a[0], -1, a[1]),
    "square_sum": lambda a, p, at: (a[0] * a[0]).sum(),
}


class RegionModule(nn.Module):
    """A region as an nn.Module that owns (shares) the parameters its body uses."""

    def __init__(self, fn, params):
        super().__init__()
        self.fn = fn
        self.used = nn.ParameterList(params)

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def region_params(region: rp.Region, params: dict) -> list:
    names = dict.fromkeys(n for s in region.body for n in getattr(s, "params", ()))
    return [params[n] for n in names]
