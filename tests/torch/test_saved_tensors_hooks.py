"""``saved_tensors_hooks=(pack, unpack)`` on recomp's checkpoints and excluded regions:
the user's pair sees what a checkpoint saves of its inputs and what an excluded region
keeps for its backward, each tensor packed once and unpacked once per read, with the
gradients of the unwrapped model bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import recomp.torch as rt
from torch_models import assert_same_grads, grads_of

D = 8


class Recorder:
    """A pack/unpack pair that counts its calls; pack keeps a clone, so that a tensor it
    did not see would not reach backward."""

    def __init__(self) -> None:
        self.packed: list[torch.Tensor] = []
        self.unpacked = 0

    def pack(self, t: torch.Tensor) -> tuple[int, torch.Tensor]:
        self.packed.append(t)
        return len(self.packed) - 1, t.detach().clone()

    def unpack(self, kept: tuple[int, torch.Tensor]) -> torch.Tensor:
        self.unpacked += 1
        return kept[1]

    @property
    def pair(self):
        return self.pack, self.unpack


class Region(nn.Module):
    """linear -> tanh -> linear: autograd saves tanh's output twice (tanh, second
    linear), the weights (parameters) and the input (deferred to the replay)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.act = nn.Tanh()
        self.b = nn.Linear(D, D)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.region = Region()
        self.post = nn.Linear(D, D)

    def forward(self, x):
        return self.post(self.region(self.pre(x).sin()).cos())


class Model(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _loss(y):
    return y.square().sum()


def _models(n: int = 2):
    torch.manual_seed(0)
    plain = Model(n)
    return plain, copy.deepcopy(plain), torch.randn(3, D, requires_grad=True)


def _activation_saves(module: nn.Module, x: torch.Tensor) -> int:
    """How many activations (not parameters, not ``x``) autograd saves running ``module``."""
    params = {p.data_ptr() for p in module.parameters()}
    count = 0

    def pack(t):
        nonlocal count
        if t.data_ptr() not in params and t.data_ptr() != x.data_ptr():
            count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return count


def test_checkpoint_inputs_packed_once_unpacked_once_per_replay():
    torch.manual_seed(0)
    lin = nn.Linear(D, D)
    x = torch.randn(3, D, requires_grad=True)
    w = torch.randn(3, D, requires_grad=True)
    rec = Recorder()
    y = rt.checkpoint(lambda a, b: lin(a * b).tanh(), x, w, saved_tensors_hooks=rec.pair)
    # Each input once; no empty placeholder (PyTorch 2.9's checkpoint saves one beside them).
    assert [t is x or t is w for t in rec.packed] == [True, True]
    assert rec.unpacked == 0
    y.sum().backward(retain_graph=True)
    assert rec.unpacked == 2
    y.sum().backward()  # a second backward replays again: one more read of each input
    assert (len(rec.packed), rec.unpacked) == (2, 4)


def test_an_empty_input_is_kept_as_it_is():
    """An empty tensor holds no memory: it does not reach pack (the placeholder PyTorch 2.9's
    checkpoint saves is one), and its gradient is still there."""
    torch.manual_seed(0)
    x = torch.randn(3, D, requires_grad=True)
    empty = torch.empty(0, requires_grad=True)
    rec = Recorder()
    def fn(a, e):
        return a.tanh() * (1 + e.sum())

    rt.checkpoint(fn, x, empty, saved_tensors_hooks=rec.pair).sum().backward()
    assert [t is x for t in rec.packed] == [True]
    assert rec.unpacked == 1
    x0, e0 = x.detach().clone().requires_grad_(), empty.detach().clone().requires_grad_()
    fn(x0, e0).sum().backward()
    assert torch.equal(x.grad, x0.grad) and torch.equal(empty.grad, e0.grad)


def test_apply_activation_checkpointing_routes_the_pair_to_inputs_and_regions():
    plain, wrapped, x = _models()
    expected = grads_of(plain, _loss, x)
    rec = Recorder()
    rt.apply_activation_checkpointing(
        wrapped, checkpoint_fn=Block, exclude_fn="region", saved_tensors_hooks=rec.pair
    )
    got = grads_of(wrapped, _loss, x)
    assert torch.equal(expected[0], got[0])
    assert_same_grads(expected[1], got[1])
    # Per layer: its input (the checkpoint's), the region's kept activations, its output.
    region_saves = _activation_saves(plain.layers[0].region, torch.randn(3, D))
    assert region_saves == 2  # tanh's output, saved by tanh and by the second linear
    assert len(rec.packed) == 2 * (1 + region_saves + 1)
    # Backward reads each once: the input and the cached output in the replay, the
    # region's saved tensors in its backward.
    assert rec.unpacked == len(rec.packed)
    for layer in wrapped.layers:
        assert (layer.region._recomp_region.runs, layer.region._recomp_region.skips) == (1, 1)


def test_region_pair_without_a_checkpoint_pair():
    plain, wrapped, x = _models(1)
    rec = Recorder()
    rt.checkpoint_wrapper(wrapped.layers[0])
    rt.checkpoint_exclude_wrapper(wrapped.layers[0].region, saved_tensors_hooks=rec.pair)
    expected = grads_of(plain, _loss, x)
    got = grads_of(wrapped, _loss, x)
    assert_same_grads(expected[1], got[1])
    assert len(rec.packed) == 3  # the two saves of tanh's output and the cached output
    assert rec.unpacked == 3


def test_region_pair_wins_over_the_checkpoint_pair():
    plain, wrapped, x = _models(1)
    outer, inner = Recorder(), Recorder()
    rt.checkpoint_wrapper(wrapped.layers[0], saved_tensors_hooks=outer.pair)
    rt.checkpoint_exclude_wrapper(wrapped.layers[0].region, saved_tensors_hooks=inner.pair)
    expected = grads_of(plain, _loss, x)
    got = grads_of(wrapped, _loss, x)
    assert_same_grads(expected[1], got[1])
    assert (len(outer.packed), outer.unpacked) == (1, 1)  # the checkpoint's input
    assert (len(inner.packed), inner.unpacked) == (3, 3)


def test_composed_with_an_enclosing_saved_tensors_hooks_context():
    """The enclosing hooks see what the code around the checkpoints saves; the pair sees
    what the checkpoints keep; nothing is packed twice and gradients are unchanged."""
    plain, wrapped, x = _models()
    expected = grads_of(plain, lambda y: _loss(y.exp()), x)
    rec = Recorder()
    rt.apply_activation_checkpointing(
        wrapped, checkpoint_fn=Block, exclude_fn="region", saved_tensors_hooks=rec.pair
    )
    outer = Recorder()
    with torch.autograd.graph.saved_tensors_hooks(*outer.pair):
        got = grads_of(wrapped, lambda y: _loss(y.exp()), x)
    assert_same_grads(expected[1], got[1])
    assert len(rec.packed) == 8
    # exp saves its output, square its input: both outside every checkpoint.
    assert len(outer.packed) == 2 and outer.unpacked == 2
    assert not any(t is u for t in outer.packed for u in rec.packed)


def test_without_the_pair_an_enclosing_context_sees_the_checkpoint_inputs_only():
    """For contrast: an enclosing context does not reach what a region keeps (recomp's own
    hook takes it), which is what the option is for."""
    _, wrapped, x = _models(1)
    rt.apply_activation_checkpointing(wrapped, checkpoint_fn=Block, exclude_fn="region")
    outer = Recorder()
    with torch.autograd.graph.saved_tensors_hooks(*outer.pair):
        wrapped(x).sum().backward()
    # PyTorch 2.9's checkpoint also saves an empty placeholder of its own (2.14 does not).
    packed = [t for t in outer.packed if t.numel() > 0]
    assert len(packed) == 1 and packed[0] is x


@pytest.mark.parametrize("bad", [None.__class__, (print,), (print, 3), "pack", (nn.Linear, print)])
def test_bad_pair_refused_before_anything_changes(bad):
    _, wrapped, x = _models(1)
    before = copy.deepcopy(wrapped.state_dict())
    with pytest.raises(ValueError, match=r"saved_tensors_hooks=\(pack, unpack\)"):
        rt.apply_activation_checkpointing(
            wrapped, checkpoint_fn=Block, exclude_fn="region", saved_tensors_hooks=bad
        )
    assert type(wrapped.layers[0]) is Block and type(wrapped.layers[0].region) is Region
    assert wrapped.state_dict().keys() == before.keys()
    with pytest.raises(ValueError, match=r"Pass saved_tensors_hooks=\(pack, unpack\)"):
        rt.checkpoint(wrapped, x, saved_tensors_hooks=bad)
    with pytest.raises(ValueError, match=r"Pass saved_tensors_hooks=\(pack, unpack\)"):
        rt.checkpoint_exclude_wrapper(wrapped.layers[0].region, saved_tensors_hooks=bad)
    assert type(wrapped.layers[0].region) is Region


def test_conflicting_options_refused():
    _, wrapped, x = _models(1)
    rec = Recorder()
    with pytest.raises(ValueError, match="swap_inputs"):
        rt.checkpoint(wrapped, x, saved_tensors_hooks=rec.pair, swap_inputs=True)
    with pytest.raises(ValueError, match="offload"):
        rt.checkpoint_exclude_wrapper(
            wrapped.layers[0].region, saved_tensors_hooks=rec.pair, offload=True
        )
    with pytest.raises(ValueError, match="offload_fn"):
        rt.apply_activation_checkpointing(
            wrapped,
            checkpoint_fn=Block,
            exclude_fn="region",
            offload_fn="region",
            saved_tensors_hooks=rec.pair,
        )
    assert type(wrapped.layers[0]) is Block and type(wrapped.layers[0].region) is Region
    assert rec.packed == []


def test_region_wrapped_again_inline_with_the_same_pair_is_the_same_region():
    rec = Recorder()
    region = rt.checkpoint_exclude_wrapper(Region(), saved_tensors_hooks=rec.pair)
    assert rt.checkpoint_exclude_wrapper(region, saved_tensors_hooks=rec.pair) is region
    assert "saved_tensors_hooks" in repr(region)

