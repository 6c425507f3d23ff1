"""Parameters whose data a framework releases after the forward and gathers again for
backward (DeepSpeed ZeRO-3, FSDP1): an excluded region keeps the Parameter object itself,
as autograd saves a leaf, so the released data is freed after the forward.

``GatheredLinear`` behaves as a ZeRO-3 linear layer: its weight's full values live
elsewhere (``full``, standing in for the other ranks' shards), are gathered into a fresh
buffer before its forward and again before its backward, and the parameter's ``.data`` is
set to an empty tensor after each. Every gathered buffer wraps a NumPy array, whose weak
reference tells whether any tensor on that memory is still alive.
"""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from torch import nn  # noqa: E402

import recomp.torch as rt  # noqa: E402


class _GatherForBackward(torch.autograd.Function):
    """Identity on the layer's output; its backward gathers the weight first, as ZeRO-3's
    backward pre-hook does."""

    @staticmethod
    def forward(ctx, layer, out):
        ctx.layer = layer
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.layer.gather()
        return None, grad


class GatheredLinear(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.full = torch.randn(features, features)
        self.weight = nn.Parameter(torch.empty(0))
        self.buffers_gathered: list[weakref.ref] = []
        self.weight.register_post_accumulate_grad_hook(lambda p: self.release())
        self.register_forward_pre_hook(lambda module, args: module.gather())
        self.register_forward_hook(lambda module, args, out: module.release())

    def gather(self) -> None:
        array = self.full.numpy().copy()
        self.buffers_gathered.append(weakref.ref(array))
        self.weight.data = torch.from_numpy(array)

    def release(self) -> None:
        self.weight.data = torch.empty(0)

    def forward(self, x):
        # ``mm`` saves its second operand as it is: here the Parameter itself (as
        # ZeRO-3's own linear function saves it).
        return _GatherForBackward.apply(self, torch.mm(x, self.weight))

    def gathered_alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.buffers_gathered)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.attn = GatheredLinear(8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(torch.tanh(self.attn(self.norm(x)))) + x


def make_model(mode: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    for block in model:
        if mode == "excluded":
            rt.checkpoint_exclude_wrapper(block.attn)
        if mode != "plain":
            rt.checkpoint_wrapper(block)
    return model


@pytest.mark.parametrize("mode", ["plain", "full", "excluded"])
def test_released_data_is_freed_after_the_forward(mode):
    model = make_model(mode)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    loss = model(x).square().sum()
    layers = [block.attn for block in model]
    assert all(layer.weight.numel() == 0 for layer in layers)
    alive = sum(layer.gathered_alive() for layer in layers)
    assert alive == 0, f"{alive} gathered weight buffers kept alive after the forward"
    loss.backward()
    assert all(layer.weight.numel() == 0 for layer in layers)  # released after backward too

    grads = [x.grad, *(p.grad for p in model.parameters())]
    reference = make_model("plain")
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).square().sum().backward()
    want = [x_ref.grad, *(p.grad for p in reference.parameters())]
    for i, (a, b) in enumerate(zip(want, grads)):
        assert torch.equal(a, b), f"gradient {i} differs"


def test_an_alias_of_a_parameter_is_still_kept_as_saved():
    """A view of a parameter (``weight.t()`` saved by ``linear``) is not the parameter:
    kept as autograd would keep it, and the gradients stay exact."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    reference = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    reference.load_state_dict(block.state_dict())
    rt.checkpoint_exclude_wrapper(block[0])
    rt.checkpoint_wrapper(block)
    x = torch.randn(3, 8)
    block(x).sum().backward()
    reference(x).sum().backward()
    for a, b in zip(reference.parameters(), block.parameters()):
        assert torch.equal(a.grad, b.grad)
