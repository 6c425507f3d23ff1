"""Random changes to a checkpointed module tree between steps, against the unwrapped model.

A checkpoint of a module reads the tensors of the modules its replay runs from a layout
after the first calls (NOTE [ Calls after the first: layouts ] in
``recomp._module_state``), and the layout must notice every change that matters: a
parameter frozen or unfrozen, a bias removed or put in place, a module replaced, a buffer
registered or replaced, a BatchNorm switched between training and eval mode, an SGD step
in place. Each case draws a tree and a sequence of such changes from its seed, applies
them to a plain copy and to a recomp-wrapped copy alike, and compares every gradient and
buffer bit for bit after each step; in a last step a weight is clipped between the
forward and the backward, which recomp must refuse (PyTorch's checkpoint replays with
the clipped weight).

The "plain" cases draw trees of modules that hold a tensor in every parameter slot and
have no buffers (a transformer's, whose calls read every tensor from the layout with
nothing to copy), and changes that keep them so (a parameter or a module replaced, a
parameter frozen, a module added, a region excluded) or end it (a bias removed, a buffer
registered).
"""

from __future__ import annotations

import copy
import random
import warnings

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import recomp.torch as rt  # noqa: E402
from recomp.errors import ParameterChangedError  # noqa: E402

WIDTH = 6


class Block(nn.Module):
    """A linear layer, then what the draw gave: a constant scale buffer, a BatchNorm, a
    step counter the forward updates at every call."""

    def __init__(self, rng: random.Random, plain: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH, bias=plain or rng.random() < 0.5)
        if not plain and rng.random() < 0.4:
            self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))
        self.norm = nn.BatchNorm1d(WIDTH) if not plain and rng.random() < 0.4 else None
        if self.norm is not None and rng.random() < 0.6:
            self.norm.eval()  # frozen statistics
        if not plain and rng.random() < 0.1:
            self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        post = self._modules.get("post")  # a module added by a change
        if post is not None:
            h = post(h)
        scale = self._buffers.get("scale")
        if scale is not None:
            h = h * scale
        if self.norm is not None:
            h = self.norm(h)
        calls = self._buffers.get("calls")
        if calls is not None:
            with torch.no_grad():
                calls.add_(1)
            h = h + 0.01 * calls
        return torch.tanh(h)


def _changes(rng: random.Random, blocks: int, plain: bool) -> list[tuple[str, int]]:
    """Eight steps' changes; half the steps change nothing (later calls read a layout)."""
    kinds = ["freeze", "unfreeze", "bias", "replace", "parameter", "post", "exclude"]
    kinds += ["replace", "parameter", "freeze"] if plain else ["mode", "buffer", "rebind"]
    return [
        (rng.choice(kinds) if rng.random() < 0.5 else "none", rng.randrange(blocks))
        for _ in range(8)
    ]


def _apply(model: nn.Module, kind: str, index: int, seed: int, wrapped: bool) -> None:
    """Change ``model`` (the plain or the wrapped copy: the same change, the same values;
    a region is excluded in the wrapped copy only)."""
    block = model[index]
    values = torch.Generator().manual_seed(seed)
    if kind == "parameter":  # another Parameter object in the slot, the same values
        block.lin.weight = nn.Parameter(block.lin.weight.detach().clone())
    elif kind == "post" and "post" not in block._modules:
        block.post = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            for p in block.post.parameters():
                p.copy_(torch.randn(p.shape, generator=values) * 0.3)
    elif kind == "exclude" and wrapped:
        block.lin = rt.checkpoint_exclude_wrapper(block.lin)
    if kind == "freeze":
        block.lin.weight.requires_grad_(False)
    elif kind == "unfreeze":
        for p in block.parameters():
            p.requires_grad_(True)
    elif kind == "bias":
        if block.lin.bias is None:
            block.lin.bias = nn.Parameter(torch.randn(WIDTH, generator=values))
        else:
            block.lin.bias = None
    elif kind == "replace":
        new = nn.Linear(WIDTH, WIDTH, bias=block.lin.bias is not None)
        with torch.no_grad():
            for p in new.parameters():
                p.copy_(torch.randn(p.shape, generator=values) * 0.3)
        block.lin = new
    elif kind == "mode" and block.norm is not None:
        block.norm.train(not block.norm.training)
    elif kind == "buffer":
        block.register_buffer("scale", torch.rand(WIDTH, generator=values) + 0.5)
    elif kind == "rebind" and "scale" in block._buffers:
        block.scale = block.scale.clone() * 1.1


def _step(model: nn.Module, run: nn.Module, x: torch.Tensor) -> tuple[list, dict]:
    model.zero_grad(set_to_none=True)
    run(x).pow(2).sum().backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.1 * p.grad)  # an SGD step in place: new versions
    return grads, {n: b.clone() for n, b in model.named_buffers()}


@pytest.mark.parametrize("plain_tree", [False, True], ids=["any", "plain"])
@pytest.mark.parametrize("seed", range(24))
def test_random_changes_between_steps_stay_exact(seed: int, plain_tree: bool) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    plain = nn.Sequential(*(Block(rng, plain_tree) for _ in range(3)))
    if rng.random() < 0.5:
        plain[rng.randrange(3)].lin.requires_grad_(False)  # PEFT-like frozen weights
    wrapped = copy.deepcopy(plain)
    run = rt.checkpoint_wrapper(wrapped)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(seed))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no change here is one recomp cannot see coming
        changes = _changes(rng, 3, plain_tree)
        excluded: set[int] = set()  # blocks whose linear is an excluded region
        for step, (kind, index) in enumerate([("none", 0)] * 3 + changes):
            for model in (plain, wrapped):
                _apply(model, kind, index, seed * 100 + step, model is wrapped)
            if kind == "exclude":
                excluded.add(index)
            elif kind == "replace":
                excluded.discard(index)
            want, want_buffers = _step(plain, plain, x)
            got, got_buffers = _step(wrapped, run, x)
            assert len(want) == len(got)
            for i, (a, b) in enumerate(zip(want, got)):
                assert (a is None) == (b is None), (step, kind, i)
                assert a is None or torch.equal(a, b), (step, kind, i)
            assert want_buffers.keys() == got_buffers.keys()
            for name, value in want_buffers.items():
                assert torch.equal(value, got_buffers[name]), (step, kind, name)
    # A weight clipped between the forward and its backward is refused, layout or not,
    # where the replay would read it (an excluded region is not replayed: its own check
    # is in test_parameter_changes.py).
    trained = [
        m for i, m in enumerate(wrapped) if m.lin.weight.requires_grad and i not in excluded
    ]
    if trained:
        out = run(x).sum()
        with torch.no_grad():
            trained[0].lin.weight.clamp_(-0.01, 0.01)
        with pytest.raises(ParameterChangedError, match=r"lin\.weight"):
            out.backward()
