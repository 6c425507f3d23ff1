"""Every replay that does not match its forward raises ``recomp.ReplayMismatchError``,
which on PyTorch is also a ``torch.utils.checkpoint.CheckpointError``: code that catches
either catches it. PyTorch's own report of the mismatch (other tensors saved) becomes
recomp's error with recomp's explanation, raised ``from`` PyTorch's."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

import recomp
import recomp.torch as rt


def test_replay_mismatch_error_is_a_checkpoint_error():
    assert issubclass(recomp.ReplayMismatchError, CheckpointError)
    assert issubclass(recomp.ReplayMismatchError, recomp.RecompError)


def _skipping_body():
    lin = nn.Linear(4, 4)
    region = rt.checkpoint_exclude_wrapper(nn.Linear(4, 4), name="router")

    def body(x):
        h = lin(x).sin()
        if not recomp.is_recomputing():  # the replay skips the region
            h = region(h)
        return h.cos()

    return body


@pytest.mark.parametrize("debug", [False, True])
def test_a_replay_that_skips_a_region_raises_replay_mismatch(debug):
    body = _skipping_body()
    x = torch.randn(2, 4, requires_grad=True)
    out = rt.checkpoint(body, x, debug=debug)
    with pytest.raises(recomp.ReplayMismatchError) as info:
        out.sum().backward()
    message = str(info.value)
    assert "take the same path in the forward and in the replay" in message
    assert "different number of tensors was saved" in message  # PyTorch's words stay
    assert ("Ops in the replay" in message) == debug
    cause = info.value.__cause__
    while isinstance(cause, recomp.RecompError):  # debug=True reports recomp's error again
        cause = cause.__cause__
    assert type(cause) is CheckpointError  # raised from PyTorch's own error


def test_a_replay_that_saves_other_shapes_is_caught_by_both_except_clauses():
    def body(t):
        h = t.tanh()
        return (h[:2] if recomp.is_recomputing() else h).sin()

    x = torch.randn(4, 8, requires_grad=True)
    for caught in (recomp.ReplayMismatchError, CheckpointError):
        with pytest.raises(caught, match="different metadata") as info:
            rt.checkpoint(body, x).sum().backward()
        assert type(info.value) is recomp.ReplayMismatchError


def test_recomps_own_mismatch_is_also_a_checkpoint_error():
    wrapped = rt.checkpoint_exclude_wrapper(nn.Linear(4, 4), name="lin")

    def diverging(x):
        y = wrapped(x)
        if recomp.is_recomputing():
            y = wrapped(y)  # an extra call the forward never made
        return y.tanh()

    with pytest.raises(CheckpointError, match="'lin'"):
        rt.checkpoint(diverging, torch.randn(2, 4, requires_grad=True)).sum().backward()


def test_other_checkpoint_errors_stay_pytorchs():
    """A second backward through a freed graph is not a replay mismatch."""
    x = torch.randn(3, requires_grad=True)
    out = rt.checkpoint(lambda t: t.sin().cos(), x).sum()
    out.backward(retain_graph=False)
    with pytest.raises(RuntimeError) as info:
        out.backward()
    assert not isinstance(info.value, recomp.ReplayMismatchError)


class _Sin(nn.Module):
    def forward(self, t):
        return t.sin()


def test_a_replay_that_passes_a_region_another_input_shape_raises():
    """The region's input is made inside the checkpoint, so the region keeps none of it and
    takes the replay's; a replay that makes another one is refused, naming the region."""
    region = rt.checkpoint_exclude_wrapper(_Sin(), name="sin")

    def body(t):
        h = t * 2
        return region(h[:2] if recomp.is_recomputing() else h).cos()

    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(recomp.ReplayMismatchError, match="region 'sin' a different input"):
        rt.checkpoint(body, x).sum().backward()


def test_strides_of_size_one_dimensions_may_differ_in_the_replay():
    """A (1, 4) tensor with strides (1, 1) and one with strides (4, 1) hold the same elements
    at the same places: a replay that passes the region the other one is not a mismatch
    (a kept output copied with another layout does that, seen with nested checkpoints)."""
    region = rt.checkpoint_exclude_wrapper(_Sin(), name="sin")

    def body(t):
        h = (t * 2).t()  # (1, 4), strides (1, 1)
        if recomp.is_recomputing():
            h = torch.empty(1, 4).copy_(h)  # strides (4, 1)
        return region(h).cos()

    x = torch.randn(4, 1, requires_grad=True)
    rt.checkpoint(body, x).sum().backward()
    expected = x.detach().requires_grad_()
    body_plain = (expected * 2).t().sin().cos().sum()
    body_plain.backward()
    torch.testing.assert_close(x.grad, expected.grad)
    assert region.region_runs == 1
