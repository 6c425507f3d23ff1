"""What real code passes to and returns from excluded regions (PyTorch).

PyTorch's own containers come back as themselves in the forward and in the
replay; tensors recomp cannot see are refused; PyTorch's in-place activations,
torchvision's ResNet with its BatchNorms excluded (``copy_output``) and a region
wrapper created anew on every call all give the gradients of the unwrapped
model. What holds on both frameworks (a model zoo's output, an input changed in
place, ``copy_output``) is tested in ``tests/core/test_outputs.py``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

import frameworks
import recomp
import recomp.torch as rt
from frameworks import assert_region_changing_its_input_matches, assert_region_output_type

Pair = namedtuple("Pair", "a b")


class DictSub(dict):
    pass


@dataclasses.dataclass
class Hidden:
    hidden: torch.Tensor
    scale: int = 3


class Opaque:
    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


# name -> (build the region's output from two tensors, read it back into one tensor); the
# containers both frameworks have are tested in core/test_regions.py and core/test_outputs.py
CONTAINERS = {
    "topk": (lambda a, b: (a * b).topk(2, dim=-1), lambda o: o.values * 2 + o[0]),
    "max": (lambda a, b: (a * b).max(dim=-1), lambda o: o.values * o.indices),
}


@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_region_output_comes_back_as_the_same_type(kind):
    build, read = CONTAINERS[kind]
    torch.manual_seed(0)
    assert_region_output_type(frameworks.Torch(), build, read, kind)


def test_checkpoint_inputs_and_outputs_keep_their_types():
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    region = rt.checkpoint_exclude_wrapper(lambda d: OrderedDict(s=torch.sin(d["x"])))

    def body(inputs):
        assert isinstance(inputs, DictSub)
        return Pair(region(inputs)["s"].exp(), inputs["x"])

    out = rt.checkpoint(body, DictSub(x=x))
    assert isinstance(out, Pair)
    out.a.sum().backward()
    assert torch.equal(x.grad, (torch.cos(x) * torch.exp(torch.sin(x))).detach())


def test_in_place_change_of_a_dataclass_output_is_caught():
    """A dataclass is looked into: changing its tensor after the region is the same
    error as for a tuple output, instead of silently wrong gradients."""
    lin = nn.Linear(4, 4)
    region = rt.checkpoint_exclude_wrapper(lambda h: Hidden(lin(h)), name="hidden")

    def body(t):
        out = region(torch.cos(t))
        out.hidden.mul_(2)
        return out.hidden.exp()

    with pytest.raises(recomp.CachedValueMutatedError, match=r"'hidden'.*copy_output=True"):
        rt.checkpoint(body, torch.randn(3, 4, requires_grad=True)).sum().backward()


def test_tensors_hidden_in_an_unknown_object_are_refused_in_the_forward():
    region = rt.checkpoint_exclude_wrapper(lambda h: Opaque(torch.sin(h)), name="opaque")
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(recomp.RecompError, match=r"'opaque'.*Opaque.*'hidden'.*register_pytree_node"):
        rt.checkpoint(lambda t: region(t).hidden.sum(), x)
    assert recomp.get_recompute_state() is None
    assert region(x).hidden is not None  # outside a checkpoint it is a plain call


# --------------------------------------------------------------------------- in-place changes


@pytest.mark.parametrize(
    ("activation", "reads_input_after"),
    [
        (lambda: nn.ELU(inplace=True), False),
        (lambda: nn.ReLU(inplace=True), True),
        (lambda: nn.SiLU(inplace=True), True),
    ],
    ids=["ELU(inplace)", "ReLU(inplace)", "SiLU(inplace)"],
)
def test_in_place_activation_that_changes_its_recomputed_input(activation, reads_input_after):
    """PyTorch's activations with ``inplace=True``; an excluded ``exp_`` (on both
    frameworks) is in core/test_outputs.py."""
    torch.manual_seed(0)
    assert_region_changing_its_input_matches(frameworks.Torch(), activation, reads_input_after)


def test_region_that_changes_an_input_it_saved_is_an_error():
    """The saved value would be the changed one: refused, as autograd refuses it."""

    def scale_then_change(h):
        out = h * h  # saves h
        h.add_(1)
        return out

    region = rt.checkpoint_exclude_wrapper(scale_then_change, name="sq")
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(recomp.CachedValueMutatedError, match=r"'sq'.*args\[0\].*in place"):
        rt.checkpoint(lambda t: region(torch.sin(t)).sum(), x)
    assert recomp.get_recompute_state() is None


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_copy_output_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="copy_output must be True or False"):
        rt.checkpoint_exclude_wrapper(nn.Linear(2, 2), copy_output=bad)


def test_copy_output_and_save_output_false_exclude_each_other():
    with pytest.raises(ValueError, match=r"copy_output=True.*save_output=False"):
        rt.checkpoint_exclude_wrapper(nn.Linear(2, 2), copy_output=True, save_output=False)


# --------------------------------------------------------------------------- inline wrappers


def test_wrapper_created_inside_the_checkpointed_function():
    x = torch.randn(5, requires_grad=True)
    counts = []

    def body(t):
        region = rt.checkpoint_exclude_wrapper(torch.sin)  # a new wrapper on every call
        out = torch.cos(region(torch.exp(t)))
        counts.append((region.region_runs, region.region_skips))
        return out

    rt.checkpoint(body, x, early_stop=False).sum().backward()  # a replay that runs to the end
    expected = torch.autograd.grad(torch.cos(torch.sin(torch.exp(x))).sum(), x)[0]
    assert torch.equal(x.grad, expected)
    assert counts == [(1, 0), (0, 1)]  # ran in the forward, skipped in the replay


def test_wrapper_around_a_module_created_inside_the_checkpointed_function():
    """Wrapping the same module again with the same options gives the same region back."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    ref = copy.deepcopy(lin)
    x = torch.randn(2, 4, requires_grad=True)

    def body(t):
        return rt.checkpoint_exclude_wrapper(lin)(torch.sin(t)).tanh()

    rt.checkpoint(body, x, early_stop=False).sum().backward()
    assert (lin.region_runs, lin.region_skips) == (1, 1)
    x_ref = x.detach().clone().requires_grad_()
    ref(torch.sin(x_ref)).tanh().sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(lin.weight.grad, ref.weight.grad)
    with pytest.raises(ValueError, match="already wrapped by recomp"):
        rt.checkpoint_exclude_wrapper(lin, copy_output=True)  # other options: not the same


def test_inline_lambda_wrapper_matches_by_its_code():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)

    def body(t):
        return rt.checkpoint_exclude_wrapper(lambda h: torch.tanh(lin(h)))(torch.sin(t)).exp()

    rt.checkpoint(body, x).sum().backward()
    ref = x.detach().clone().requires_grad_()
    lin_grad = lin.weight.grad.clone()
    lin.weight.grad = None
    torch.tanh(lin(torch.sin(ref))).exp().sum().backward()
    assert torch.equal(x.grad, ref.grad) and torch.equal(lin_grad, lin.weight.grad)


def test_replay_calling_other_code_says_what_differs():
    calls = []

    def body(t):
        calls.append(None)
        fn = torch.sin if len(calls) == 1 else torch.tanh
        return torch.cos(rt.checkpoint_exclude_wrapper(fn)(torch.exp(t)))

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(recomp.ReplayMismatchError, match=r"'tanh'.*tanh.*forward called 'sin'.*sin"):
        rt.checkpoint(body, x).sum().backward()


# --------------------------------------------------------------------------- torchvision ResNet


def _resnet_pair():
    """(reference, copy) of torchvision's ResNet-18, and its BasicBlock class."""
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    ref = models.resnet18(num_classes=10)
    return ref, copy.deepcopy(ref), models.resnet.BasicBlock


def _resnet_step(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


def test_torchvision_resnet_with_batchnorms_excluded_matches_unwrapped():
    """Every BatchNorm excluded, with copy_output (ReLU(inplace=True) and `out += identity`
    change its output afterwards): gradients and running statistics of the unwrapped
    model, each BatchNorm run once per step."""
    ref, model, BasicBlock = _resnet_pair()
    is_bn = lambda m: isinstance(m, nn.BatchNorm2d)  # noqa: E731
    rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, BasicBlock),
        exclude_fn=is_bn,
        copy_output_fn=is_bn,
    )
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    for _ in range(2):
        assert torch.equal(_resnet_step(ref, x, y), _resnet_step(model, x, y))
        for p_ref, p in zip(ref.parameters(), model.parameters()):
            assert torch.equal(p_ref.grad, p.grad)
    for b_ref, b in zip(ref.buffers(), model.buffers()):
        assert torch.equal(b_ref, b)
    regions = [m for m in model.modules() if isinstance(m, rt.ExcludeWrapper)]
    assert len(regions) == 19  # the BatchNorms inside the 8 blocks, downsamples included
    assert all((r.region_runs, r.region_skips) == (2, 2) for r in regions)


def test_torchvision_resnet_batchnorm_excluded_without_copy_output_names_the_option():
    _, model, BasicBlock = _resnet_pair()
    rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, BasicBlock),
        exclude_fn=lambda m: isinstance(m, nn.BatchNorm2d),
    )
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    with pytest.raises(recomp.CachedValueMutatedError, match="copy_output_fn="):
        _resnet_step(model, x, y)


def test_replayed_batchnorms_leave_the_statistics_of_the_unwrapped_model():
    ref, model, BasicBlock = _resnet_pair()
    rt.apply_activation_checkpointing(model, checkpoint_fn=lambda m: isinstance(m, BasicBlock))
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    _resnet_step(ref, x, y)
    _resnet_step(model, x, y)
    assert all(torch.equal(a, b) for a, b in zip(ref.buffers(), model.buffers()))


def test_copy_output_fn_needs_exclude_fn():
    with pytest.raises(ValueError, match=r"copy_output_fn.*no exclude_fn"):
        rt.apply_activation_checkpointing(
            nn.Sequential(nn.Linear(2, 2)), checkpoint_fn=lambda m: False, copy_output_fn=bool
        )
