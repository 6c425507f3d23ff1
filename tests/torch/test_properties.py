"""Property test: random programs give the same gradients with recomp as without it (PyTorch).

Each example is a random program from ``random_programs`` (ops, excluded regions
with pytree inputs and outputs, save_output=False chains, nested checkpoints).
It runs once with plain calls and once with ``recomp.torch.checkpoint`` around
the checkpoint blocks and ``checkpoint_exclude_wrapper`` around the regions.
Gradients of the inputs and of every parameter must be bitwise equal: on CPU
the same ops run on the same values. The one legitimate difference is the order
of float sums when recomp adds its boundary node to the graph (see
``random_programs.BoundaryMirror``): such programs must be bitwise equal to a
plain run with an identity node in the boundary's place, and within 1e-5 of the
plain run. Each region must run exactly as often as the forward calls it (never
in a replay). ``RECOMP_PROPERTY_EXAMPLES=N`` runs a longer search.
"""

from __future__ import annotations

import contextlib
import os

import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

import random_programs as rp
import recomp.torch as rt
from torch_programs import OPS, RegionModule, region_params

CI = bool(os.environ.get("CI"))
SETTINGS = settings(
    # RECOMP_PROPERTY_EXAMPLES: a longer local search.
    max_examples=int(os.environ.get("RECOMP_PROPERTY_EXAMPLES", 200 if CI else 600)),
    deadline=None,
    derandomize=CI,
    database=None if CI else settings.default.database,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


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


def _plain_checkpoint(fn, *args, early_stop):
    return fn(*args)


def run(program: rp.Program, mode: str, mirror: rp.BoundaryMirror):
    """Forward and backward. ``mode``: "recomp" (checkpoints and exclusions; records the
    boundaries in ``mirror``), "plain" (no recomp at all) or "mirrored" (plain, with
    ``mirror``'s identity nodes). Return ({name: grad as numpy}, region body executions,
    region callables)."""
    xs, ps = rp.initial_values(program)
    inputs = [torch.tensor(x, requires_grad=True) for x in xs]
    params = {n: nn.Parameter(torch.tensor(v)) for n, v in ps.items()}

    if mode == "recomp":

        def region(r, fn):
            fn = mirror.recording(fn)
            target = RegionModule(fn, region_params(r, params)) if r.as_module else fn
            return rt.checkpoint_exclude_wrapper(target, save_output=r.save_output, name=r.name)

        runtime = rp.Runtime(OPS, rt.checkpoint, region)
        spying = mirror.spying()
    else:
        region = (lambda r, fn: mirror.mirrored(fn)) if mode == "mirrored" else (lambda r, fn: fn)
        runtime = rp.Runtime(OPS, _plain_checkpoint, region)
        spying = contextlib.nullcontext()

    with spying:
        loss, executions, callables = rp.run_program(program, runtime, inputs, params)
        for _ in range(2 if program.backward_twice else 1):
            loss.backward(retain_graph=program.backward_twice)
    grads = {f"input{k}": x.grad for k, x in enumerate(inputs)}
    grads.update({n: p.grad for n, p in params.items()})
    return (
        {k: None if g is None else g.numpy().copy() for k, g in grads.items()},
        executions,
        callables,
    )


@SETTINGS
@given(program=rp.programs())
def test_random_program_gradients_match_unwrapped(program):
    mirror = rp.BoundaryMirror(_identity)
    actual, executions, wrappers = run(program, "recomp", mirror)
    expected, plain_executions, _ = run(program, "plain", mirror)
    # Bitwise equal, unless recomp put a boundary into the graph: then bitwise equal to
    # the reference with identity nodes in its place, and close to the plain one.
    rp.assert_same_gradients(expected, actual, exact=not mirror.boundaries)
    if mirror.boundaries:
        mirrored, _, _ = run(program, "mirrored", mirror)
        rp.assert_same_gradients(mirrored, actual, exact=True)
    calls = program.calls_per_region()
    assert plain_executions == calls
    # Each region body ran once per call in the forward, never in a replay.
    assert executions == calls
    assert [w.region_runs for w in wrappers] == calls
