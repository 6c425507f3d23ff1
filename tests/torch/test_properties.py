"""Property test: random programs give the same gradients with recomp as without it (PyTorch).

Each example is a random program from ``random_programs`` (ops, excluded regions
with pytree inputs and outputs, save_output=False chains, nested checkpoints),
run once with plain calls and once with ``recomp.torch.checkpoint`` around the
checkpoint blocks and ``checkpoint_exclude_wrapper`` around the regions. What is
compared, and how many programs each search checks, is in
``program_properties``; this file supplies PyTorch's way of running a program.
A program that asks for two backwards runs ``backward(retain_graph=True)`` twice
on one forward (its gradients accumulate).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from torch import nn

import program_properties as pp
import random_programs as rp
import recomp.torch as rt
from torch_programs import OPS, RegionModule, region_params


class Identity(torch.autograd.Function):
    """What the reference puts where recomp put its boundary (see rp.BoundaryMirror):
    the same inputs and outputs, values passed through, no gradient for the inputs."""

    @staticmethod
    def forward(ctx, n_saved, *tensors):
        ctx.n_saved = n_saved
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors[n_saved:])

    @staticmethod
    def backward(ctx, *grads):
        return (None,) * (1 + ctx.n_saved) + grads


def _identity(saved, outputs):
    return Identity.apply(len(saved), *saved, *outputs)


def run(program: rp.Program, mode: str, mirror: rp.BoundaryMirror) -> pp.Outcome:
    """One forward and one or two backwards (``mode``: see ``program_properties.runtime``)."""
    xs, ps = rp.initial_values(program)
    inputs = [torch.tensor(x, requires_grad=True) for x in xs]
    params = {n: nn.Parameter(torch.tensor(v)) for n, v in ps.items()}

    def exclude(r, fn):
        target = RegionModule(fn, region_params(r, params)) if r.as_module else fn
        return rt.checkpoint_exclude_wrapper(target, save_output=r.save_output, name=r.name)

    runtime, running = pp.runtime(mode, mirror, OPS, rt.checkpoint, exclude)
    with running:
        loss, executions, regions = rp.run_program(program, runtime, inputs, params)
        for _ in range(2 if program.backward_twice else 1):
            loss.backward(retain_graph=program.backward_twice)
    grads = {f"input{k}": x.grad for k, x in enumerate(inputs)}
    grads.update({n: p.grad for n, p in params.items()})
    found = {k: None if g is None else g.numpy().copy() for k, g in grads.items()}
    return pp.Outcome([found], executions, regions, forwards=1)


@pp.search(system=False)
@given(program=rp.programs())
def test_random_program_gradients_match_unwrapped(program):
    pp.check_gradients_match_unwrapped(program, run, _identity)


@pytest.mark.system
@pytest.mark.timeout(3600)
@pp.search(system=True)
@given(program=rp.programs())
def test_random_program_gradients_match_unwrapped_longer_search(program):
    pp.check_gradients_match_unwrapped(program, run, _identity)
