"""Excluded regions inside recomp.torch checkpoints: run counts and gradients.

Every gradient comparison is exact (torch.equal) against the same model
without checkpoints: on CPU, with the same op order, the results are bitwise
identical, so any replay or caching mistake shows.
"""

from __future__ import annotations

import gc
import weakref
from collections import namedtuple

import pytest
import torch
from torch import nn

import recomp
import recomp.torch as rt
from torch_models import Block, assert_same_grads, grads_of, twin


def square_sum(out):
    return out.pow(2).sum()


class Router(nn.Module):
    """Returns a namedtuple with int64 top-k indices (no gradient) and a non-tensor leaf."""

    Out = namedtuple("Out", ["weights", "indices", "info"])

    def __init__(self, d=8, experts=4):
        super().__init__()
        self.gate = nn.Linear(d, experts)

    def forward(self, inputs):
        logits = self.gate(inputs["x"]) * inputs["scale"]
        weights, indices = torch.topk(torch.softmax(logits, -1), k=2, dim=-1)
        return self.Out(weights, indices, {"k": 2, "bias": [inputs["extra"][0] + 1]})


class MoELike(nn.Module):
    def __init__(self, d=8, experts=4):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = Router(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, x):
        h = self.norm(x)
        out = self.router({"x": h, "scale": 2.0, "extra": (h * 0.5,)})
        assert out.info["k"] == 2
        y = torch.zeros_like(h) + out.info["bias"][0]
        for k in range(2):
            for e, expert in enumerate(self.experts):
                mask = (out.indices[..., k] == e).unsqueeze(-1).to(h.dtype)
                y = y + mask * out.weights[..., k : k + 1] * expert(h)
        return x + y


def test_nested_pytrees_and_outputs_without_grad_pass_through():
    torch.manual_seed(1)
    ref = MoELike()
    model = twin(ref)
    model.router = rt.checkpoint_exclude_wrapper(model.router)
    model = rt.checkpoint_wrapper(model)
    x = torch.randn(6, 8, requires_grad=True)
    _, g_ref = grads_of(ref, square_sum, x)
    _, g = grads_of(model, square_sum, x)
    assert_same_grads(g_ref, g)
    assert model.router.region_runs == 1 and model.router.region_skips == 1


def test_plain_function_can_be_excluded():
    calls = []

    def gelu_mm(a, b):
        calls.append(1)
        return torch.nn.functional.gelu(a @ b)

    wrapped = rt.checkpoint_exclude_wrapper(gelu_mm)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    rt.checkpoint(lambda t: torch.sin(wrapped(torch.cos(t), w)), x).sum().backward()
    expected_w, expected_x = torch.autograd.grad(torch.sin(gelu_mm(torch.cos(x), w)).sum(), (w, x))
    assert len(calls) == 2  # one in the checkpoint's forward, one for the reference above
    assert torch.equal(w.grad, expected_w) and torch.equal(x.grad, expected_x)


def test_region_output_returned_from_checkpoint_and_deferred_input():
    """The region is the last thing in the block: its boundary alone triggers the replay."""
    lin = nn.Linear(8, 8)
    ref = twin(lin)
    wrapped = rt.checkpoint_exclude_wrapper(lin)
    x = torch.randn(2, 3, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    (ref(torch.tanh(x)) * 3).sum().backward()
    (rt.checkpoint(lambda t: wrapped(torch.tanh(t)), x2) * 3).sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(ref.weight.grad, lin.weight.grad)


def test_save_output_false_output_also_used_by_recomputed_code_raises_in_replay():
    first = rt.checkpoint_exclude_wrapper(nn.Linear(4, 4), save_output=False, name="proj")
    second = rt.checkpoint_exclude_wrapper(nn.Linear(4, 4))

    def body(t):
        y = first(t)
        return second(y) + torch.tanh(y)  # tanh is recomputed and needs y

    out = rt.checkpoint(body, torch.randn(2, 4, requires_grad=True))
    with pytest.raises(recomp.OutputNotSavedError, match=r"'proj'.*save_output=True"):
        out.sum().backward()


def test_cache_is_freed_with_the_graph():
    """After backward, and when the output is dropped without backward, cached outputs die."""
    captured = []

    class Capture(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            captured.append(weakref.ref(y))
            return y

    wrapped = rt.checkpoint_exclude_wrapper(Capture())
    for do_backward in (True, False):
        captured.clear()
        out = rt.checkpoint(
            lambda t: torch.relu(wrapped(torch.tanh(t))), torch.randn(4, 8, requires_grad=True)
        )
        if do_backward:
            out.sum().backward()
        del out
        gc.collect()
        assert captured[0]() is None


def test_recompute_state_is_shared_by_forward_and_replay():
    seen = []

    def body(x):
        state = recomp.get_recompute_state()
        resource = state.get_resource("token", object)
        seen.append((state.is_recomputing, state.invocation_id, resource))
        return torch.sin(x)

    x = torch.randn(3, requires_grad=True)
    rt.checkpoint(body, x).sum().backward()
    rt.checkpoint(body, x).sum().backward()
    (f1, id1, r1), (p1, id1b, r1b), (f2, id2, _), (p2, _, _) = seen
    assert (f1, p1, f2, p2) == (False, True, False, True)
    assert id1 == id1b and r1 is r1b
    assert id1 != id2
    assert recomp.get_recompute_state() is None and not recomp.is_recomputing()


def test_user_context_fn_is_composed_inside_recomp_state():
    events = []

    class Ctx:
        def __init__(self, tag):
            self.tag = tag

        def __enter__(self):
            events.append((self.tag, recomp.is_recomputing()))

        def __exit__(self, *a):
            return False

    x = torch.randn(3, requires_grad=True)
    rt.checkpoint(torch.sin, x, context_fn=lambda: (Ctx("fwd"), Ctx("replay"))).sum().backward()
    # recomp's state is entered first, so the user's replay context already sees it
    assert events == [("fwd", False), ("replay", True)]


def test_view_of_input_is_deferred_not_kept():
    """linear on a 3-D input saves a 2-D view: it must become a deferred handle."""
    from recomp import _testing

    kinds = []
    lin = nn.Linear(8, 8)
    wrapped = rt.checkpoint_exclude_wrapper(lin)
    x = torch.randn(2, 3, 8, requires_grad=True)
    with _testing.observe(deferred=kinds.append):  # called with "is a view"
        out = rt.checkpoint(lambda t: torch.tanh(wrapped(torch.sin(t))), x)
    assert kinds and any(kinds), "the region's saved input was not deferred"
    out.sum().backward()
    expected = torch.autograd.grad(torch.tanh(twin(lin)(torch.sin(x))).sum(), x)[0]
    assert torch.equal(x.grad, expected)


Pair = namedtuple("Pair", "first second")


@pytest.mark.parametrize(
    "how", ["positional", "keyword", "tuple-keyword", "dict-keyword", "list", "namedtuple"]
)
def test_a_checkpoint_input_a_region_saves_is_kept_not_deferred_however_it_is_passed(how):
    """The checkpoint keeps its inputs: a region that saves one keeps it as it is (a
    deferred handle would ask the replay for a tensor it does not recompute), wherever
    the input sits among the checkpoint's arguments."""
    from recomp import _testing

    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    wrapped = rt.checkpoint_exclude_wrapper(lin)
    x = torch.randn(4, 8, requires_grad=True)
    other = torch.randn(4, 8)
    args, kwargs = {
        "positional": ((x, 3), {"scale": 1.0}),
        "keyword": ((), {"x": x, "mask": None}),
        "tuple-keyword": ((), {"pair": (other, x), "flag": True}),
        "dict-keyword": ((), {"table": {"x": x}}),
        "list": (([other, x],), {}),
        "namedtuple": ((Pair(other, x),), {}),
    }[how]

    def function(*args, **kwargs):
        found = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if t is x]
        return torch.tanh(wrapped(found[0]))

    kinds = []
    with _testing.observe(deferred=kinds.append):
        out = rt.checkpoint(function, *args, **kwargs)
    assert kinds == []
    out.sum().backward()
    expected = torch.autograd.grad(torch.tanh(twin(lin)(x)).sum(), x)[0]
    assert torch.equal(x.grad, expected)


def test_block_with_every_kind_of_region():
    ref = Block(8)
    model = twin(ref)
    model.attn = rt.checkpoint_exclude_wrapper(model.attn)
    model.mlp[0] = rt.checkpoint_exclude_wrapper(model.mlp[0])
    model = rt.checkpoint_wrapper(model)
    x = torch.randn(2, 4, 8, requires_grad=True)
    _, g_ref = grads_of(ref, square_sum, x)
    _, g = grads_of(model, square_sum, x)
    assert_same_grads(g_ref, g)


class ResidualTail(nn.Module):
    """The excluded projection is the last thing before a residual add (which saves nothing)."""

    def __init__(self, d=8):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return x + self.proj(self.norm(x))


@pytest.mark.parametrize("early_stop", [True, False])
def test_output_that_no_replayed_code_needs_is_not_kept(early_stop):
    """With early stop the replay ends in the region's boundary: its cached output is dropped."""
    torch.manual_seed(0)
    ref = ResidualTail()
    model = twin(ref)
    model.proj = rt.checkpoint_exclude_wrapper(model.proj)
    model = rt.checkpoint_wrapper(model, early_stop=early_stop)
    x = torch.randn(2, 3, 8, requires_grad=True)
    out = model(x)
    output_bytes = 2 * 3 * 8 * 4
    assert model.proj.region_saved_bytes == (0 if early_stop else output_bytes)
    _, g_ref = grads_of(ref, square_sum, x)
    _, g = grads_of(model, square_sum, x)
    assert_same_grads(g_ref, g)
    del out
    assert model.proj.region_runs == 2  # once per forward above, never in a replay


def test_output_that_gets_no_gradient_leaves_parameters_without_grad():
    """The boundary passes "no gradient" on as such, not as zeros (optimizers tell them apart)."""
    used, unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def pair(t):
        return used(t), unused(t)

    region = rt.checkpoint_exclude_wrapper(pair)
    x = torch.randn(2, 4, requires_grad=True)
    a, _ = rt.checkpoint(lambda t: region(torch.sin(t)), x)
    a.sum().backward()
    assert used.weight.grad is not None
    assert unused.weight.grad is None and unused.bias.grad is None


def test_a_region_called_under_no_grad_inside_a_checkpoint_runs_once():
    """A region the checkpointed code calls under ``torch.no_grad()`` (a teacher's
    logits, a mask) is recorded in the forward and skipped in the replay like any
    other; the replay, under the same ``no_grad``, reads its output."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.teacher = nn.Linear(4, 4)
            self.student = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                target = self.teacher(x)
            return torch.sin(self.student(x)) * target

    torch.manual_seed(0)
    ref = Block()
    model = rt.checkpoint_wrapper(twin(ref))
    model.teacher = rt.checkpoint_exclude_wrapper(model.teacher)
    x = torch.randn(3, 4)
    _, g_ref = grads_of(ref, square_sum, x)
    _, g = grads_of(model, square_sum, x)
    assert_same_grads(g_ref, g)
    assert (model.teacher.region_runs, model.teacher.region_skips) == (1, 1)
