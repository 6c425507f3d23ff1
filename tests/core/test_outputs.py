"""What real code passes to and returns from excluded regions (MindSpore PyNative).

The same guarantees as tests/torch/test_outputs.py: containers come back as
their own type (mindnlp's ``ModelOutput`` is an ``OrderedDict`` subclass), a
region that changes its input in place and a region whose output later code
changes in place (``copy_output``) give the unwrapped model's gradients.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

import frameworks  # noqa: E402
import recomp  # noqa: E402
import recomp.mindspore as rm  # noqa: E402
from frameworks import assert_region_output_type  # noqa: E402
from ms_models import copy_params, nn, ops, tensor  # noqa: E402


class ModelOutput(OrderedDict):
    """An OrderedDict whose keys read as attributes, as model zoos return."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


# the containers both frameworks have are tested in core/test_regions.py
CONTAINERS = {
    "ModelOutput": (lambda a, b: ModelOutput(h=a, s=b), lambda o: o.h * o.s),
}


def _equal(a, b) -> bool:
    return np.array_equal(a.asnumpy(), b.asnumpy())


@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_region_output_comes_back_as_the_same_type(kind):
    build, read = CONTAINERS[kind]
    assert_region_output_type(frameworks.MindSpore(), build, read, kind)


class Exp(nn.Cell):
    """On CPU, MindSpore 2.10's ``exp_``/``add_`` return a new tensor; ``copy_`` writes
    in place."""

    def construct(self, h):
        h.copy_(ops.exp(h))
        return h


class ChangesInput(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Dense(4, 4)
        self.act = Exp()
        self.out = nn.Dense(4, 4)

    def construct(self, x):
        h = self.lin(x)
        return self.out(self.act(h)) + h * 3  # reads the input the region changed


def _grads(model, x):
    return ms.grad(lambda t: (model(t) ** 2).sum(), 0, model.trainable_params())(x)


def test_region_that_changes_its_recomputed_input_in_place():
    ref = ChangesInput()
    model = ChangesInput()
    copy_params(ref, model)
    model.act = rm.checkpoint_exclude_wrapper(model.act)
    model = rm.checkpoint_wrapper(model)
    x = tensor(3, 4)
    expected, got = _grads(ref, x), _grads(model, x)
    assert _equal(expected[0], got[0])
    assert all(_equal(e, g) for e, g in zip(expected[1], got[1]))


class AddAfter(nn.Cell):
    """A projection of the layer's input, then the code after it writes its output
    in place (``copy_``: on CPU, MindSpore 2.10's ``add_`` returns a new tensor)."""

    def __init__(self, copy_output: bool | None) -> None:
        super().__init__()
        self.lin = nn.Dense(4, 4)
        self.norm = nn.Dense(4, 4)
        if copy_output is not None:
            self.norm = rm.checkpoint_exclude_wrapper(self.norm, copy_output=copy_output)

    def construct(self, x):
        out = self.norm(x)
        out.copy_(out + self.lin(x))
        return ops.tanh(out)


def test_output_changed_in_place_after_the_region_names_copy_output(recover_mindspore):
    model = rm.checkpoint_wrapper(AddAfter(copy_output=False))
    with pytest.raises(recomp.CachedValueMutatedError, match="copy_output=True"):
        _grads(model, tensor(5, 4))


def test_copy_output_gives_the_unwrapped_gradients():
    ref = AddAfter(copy_output=None)
    model = AddAfter(copy_output=True)
    copy_params(ref, model)
    model = rm.checkpoint_wrapper(model)
    x = tensor(5, 4)
    expected, got = _grads(ref, x), _grads(model, x)
    assert _equal(expected[0], got[0])
    assert all(_equal(e, g) for e, g in zip(expected[1], got[1]))
