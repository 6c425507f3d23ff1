"""Guarantees of recomp.torch reached through what only PyTorch has.

The guarantees both frameworks give (RNG after a skipped region, second-order
gradients, in-place writes inside the forward, foreign checkpoints, nesting,
mixed precision, a thread paused mid-step, what is freed) are tested once for
both in ``tests/core/test_guarantees.py``. Here: two backwards of one graph
(``retain_graph``), in-place changes that MindSpore refuses or does not share
(behind the boundary, and after the checkpoint returned), selective
checkpointing, ``set_checkpoint_early_stop``, two threads training at once
(MindSpore cannot run two gradient computations at once) and the long memory
soak against ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

import recomp
import recomp.torch as rt
from torch_models import assert_same_grads, exclude_attention, grads_of, stack, twin


def test_retain_graph_second_backward_gives_the_same_gradients():
    ref = stack(2)
    model = exclude_attention(twin(ref))
    x = torch.randn(3, 4, 8)

    def twice(m):
        m.zero_grad(set_to_none=True)
        loss = m(x).pow(2).sum()
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in m.parameters()]
        loss.backward()
        return first, [p.grad.clone() for p in m.parameters()]

    (ref1, ref2), (got1, got2) = twice(ref), twice(model)
    for a, b in zip(ref1 + ref2, got1 + got2):
        assert torch.equal(a, b)
    assert [blk.attn.region_runs for blk in model] == [1, 1]
    assert [blk.attn.region_skips for blk in model] == [2, 2]  # one replay per backward


def test_in_place_change_of_the_cached_output_raises_naming_the_region():
    """The region's input is computed inside the checkpoint, so its output passes the
    boundary; MindSpore refuses in-place ops there itself
    (tests/mindspore/test_guarantees.py), PyTorch lets recomp see them."""
    lin = rt.checkpoint_exclude_wrapper(nn.Linear(4, 4), name="proj")

    def body(t):
        y = lin(torch.sin(t))
        y.add_(1)  # the replay would add 1 to the cached value a second time
        return torch.tanh(y)

    # caught at the end of the checkpoint's forward already
    with pytest.raises(recomp.CachedValueMutatedError, match=r"'proj'.*modified in place"):
        rt.checkpoint(body, torch.randn(2, 4, requires_grad=True))


# After the checkpoint returned. On MindSpore the checkpoint's outputs are not the
# region's: an in-place op on them is refused, or changes nothing recomp holds.


def test_in_place_change_of_a_returned_cached_output_raises_in_the_replay():
    lin = rt.checkpoint_exclude_wrapper(nn.Linear(4, 4), name="proj")
    x = torch.randn(2, 4, requires_grad=True)
    out = rt.checkpoint(lambda t: (lin(torch.sin(t)), torch.tanh(t) * 2), x)
    region_out, other = out
    region_out.mul_(2)  # after the checkpoint; the replay would hand on the changed value
    with pytest.raises(recomp.CachedValueMutatedError, match=r"'proj'.*modified in place"):
        (torch.tanh(region_out).sum() + other.sum()).backward()


def test_in_place_change_of_a_saved_tensor_raises_naming_the_region():
    region = rt.checkpoint_exclude_wrapper(torch.sigmoid, name="gate")  # sigmoid saves its output
    x = torch.randn(2, 4, requires_grad=True)
    out = rt.checkpoint(lambda t: region(torch.cos(t)), x)
    out.mul_(2)  # outside the checkpoint, after the region returned
    with pytest.raises(recomp.CachedValueMutatedError, match="'gate'"):
        out.sum().backward()


def test_selective_checkpointing_policy_does_not_see_excluded_ops():
    """SAC saves every aten.mm; the excluded region's mm must not shift SAC's per-op cache."""
    torch.manual_seed(0)
    # no bias: the region's linear runs aten.mm too, the op the policy caches
    ref = nn.ModuleDict({k: nn.Linear(8, 8, bias=False) for k in "abc"})
    model = twin(ref)
    model["b"] = rt.checkpoint_exclude_wrapper(model["b"])

    def body(m, t):
        h = torch.relu(t @ m["a"].weight.t())
        h = torch.sin(m["b"](h))
        return torch.tanh(h @ m["c"].weight.t())

    def policy(ctx, op, *args, **kwargs):
        return (
            CheckpointPolicy.MUST_SAVE
            if op is torch.ops.aten.mm.default
            else CheckpointPolicy.PREFER_RECOMPUTE
        )

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    x = torch.randn(5, 8, requires_grad=True)
    x1, x2 = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    body(ref, x1).pow(2).sum().backward()
    rt.checkpoint(body, model, x2, context_fn=context_fn).pow(2).sum().backward()
    assert torch.equal(x1.grad, x2.grad)
    for name in ("a", "c"):
        assert torch.equal(ref[name].weight.grad, model[name].weight.grad)
    assert torch.equal(ref["b"].weight.grad, model["b"].weight.grad)
    assert model["b"].region_runs == 1


@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_on_and_off(early_stop):
    ref = stack(2)
    model = exclude_attention(twin(ref))
    x = torch.randn(2, 3, 8, requires_grad=True)
    with set_checkpoint_early_stop(early_stop):
        _, g = grads_of(model, lambda o: o.pow(2).sum(), x)
    _, g_ref = grads_of(ref, lambda o: o.pow(2).sum(), x)
    assert_same_grads(g_ref, g)


def test_two_threads_training_two_models():
    results = {}
    barrier = threading.Barrier(2)

    def train(seed):
        torch.manual_seed(seed)
        ref = stack(2, seed=seed)
        model = exclude_attention(twin(ref))
        x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        barrier.wait()
        ok = True
        for _ in range(20):
            _, g_ref = grads_of(ref, lambda o: o.pow(2).sum(), x)
            _, g = grads_of(model, lambda o: o.pow(2).sum(), x)
            ok &= all(torch.equal(g_ref[k], g[k]) for k in g_ref)
        results[seed] = (ok, [blk.attn.region_runs for blk in model])

    threads = [threading.Thread(target=train, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == {1: (True, [20, 20]), 2: (True, [20, 20])}


@pytest.mark.system
def test_two_thousand_steps_keep_memory_flat():
    """Heap in use (mallinfo2) grows by no more over 2,000 steps with recomp than with
    torch.utils.checkpoint alone (some torch versions grow a little by themselves)."""
    from memory import run_measured

    result = run_measured(
        """
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
import recomp.torch as rt


class Plain(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def growth(use_recomp):
    torch.manual_seed(0)
    layers = []
    for _ in range(2):
        layer = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 32))
        if use_recomp:
            layer[1] = rt.checkpoint_exclude_wrapper(layer[1])
            layers.append(rt.checkpoint_wrapper(layer))
        else:
            layers.append(Plain(layer))
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, 32)

    def step():
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        opt.step()

    for _ in range(200):
        step()
    base = heap_bytes()
    for _ in range(2000):
        step()
    return heap_bytes() - base, model


plain, _ = growth(False)
recomp_growth, model = growth(True)
result = {
    "plain": plain,
    "recomp": recomp_growth,
    "runs": model[0][1].region_runs,
}
"""
    )
    assert result["runs"] == 2200
    # 64 KiB over 2,000 steps: a leak of one 16x32 float activation a step would be 4 MiB.
    # The heap can also shrink by as much in a run (the allocator hands pages back), so a
    # plain run that shrank counts as no growth, not as a negative allowance.
    assert result["recomp"] - max(result["plain"], 0) < 64 << 10, result
