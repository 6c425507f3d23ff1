"""``recomp.torch._compat.saved_tensors``: reading the autograd graph for the saved-tensor
report without unpacking it. Each test fails when PyTorch changes what recomp relies on;
they skip on a PyTorch without ``SavedTensor.data`` (the report says so there)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from recomp.torch import _compat  # noqa: E402


def _require_readable_values():
    if not _compat.saved_values_readable():
        pytest.skip("this PyTorch has no SavedTensor.data (the report says so)")


def test_saved_values_are_read_without_unpacking_and_released_by_backward():
    _require_readable_values()
    x = torch.randn(4, requires_grad=True)
    h = x * 2
    y = h.sin()
    handles = _compat.saved_handles(y.grad_fn)
    assert [name for name, _ in handles] == ["self"]
    value = _compat.packed_value(handles[0][1])
    assert value.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
    y.sum().backward()
    assert _compat.packed_value(handles[0][1]) is None


def test_a_checkpoint_placeholder_leads_to_its_call():
    import torch.utils.checkpoint as tuc

    _require_readable_values()
    x = torch.randn(4, requires_grad=True)
    h = x * 2

    def block(a):
        return a.sin().cos()

    y = tuc.checkpoint(block, h, use_reentrant=False)
    (_name, handle), *_ = _compat.saved_handles(y.grad_fn)
    frame = _compat.checkpoint_frame(handle)
    assert frame is not None
    inputs = [_compat.packed_value(s) for s in _compat.checkpoint_input_handles(frame)]
    assert [t.untyped_storage().data_ptr() for t in inputs] == [h.untyped_storage().data_ptr()]
    function, _context = _compat.checkpoint_function(frame)
    assert function is block
    assert [t.dtype for t in _compat.checkpoint_rng_states(frame)] == [torch.uint8]
    assert _compat.replay_tensors(frame, handle) == []  # no replay yet
    # a plain saved tensor is no placeholder
    z = h.exp()
    assert _compat.checkpoint_frame(_compat.saved_handles(z.grad_fn)[0][1]) is None
    y.sum().backward()
