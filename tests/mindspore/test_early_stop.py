"""MindSpore 2.10 cannot end an early-stopping replay inside an op its Python op runner
is running (dropout, BatchNorm, LayerNorm): with ``early_stop=True`` recomp names the op
and the fix instead of MindSpore's "Stack input_args_info_stack_ is empty"; blocks whose
last saved tensor comes from another op stop early as asked."""

from __future__ import annotations

import pytest

ms = pytest.importorskip("mindspore")

import numpy as np  # noqa: E402
from mindspore import nn, ops  # noqa: E402

import recomp  # noqa: E402
import recomp.mindspore as rm  # noqa: E402


class Ending(nn.Cell):
    """A small conv block whose last op is ``last``."""

    def __init__(self, last: str) -> None:
        super().__init__()
        self.last = last
        self.conv = nn.Conv2d(4, 4, 3, pad_mode="same")
        self.bn = nn.BatchNorm2d(4)
        self.ln = nn.LayerNorm((8,), begin_norm_axis=-1, begin_params_axis=-1)

    def construct(self, x):
        h = self.conv(x).tanh()
        if self.last == "batchnorm":
            return self.bn(h)
        if self.last == "layernorm":
            return self.ln(h)
        if self.last == "softmax":
            return ops.softmax(h, -1)
        return ops.matmul(h, h)


def images():
    return ms.Tensor(np.random.default_rng(0).standard_normal((2, 4, 8, 8)).astype(np.float32))


@pytest.mark.parametrize(("last", "op"), [("batchnorm", "BatchNorm"), ("layernorm", "LayerNorm")])
def test_early_stop_inside_an_op_names_it_and_the_fix(recover_mindspore, last, op):
    block = rm.checkpoint_wrapper(Ending(last), early_stop=True)
    block.set_train()
    with pytest.raises(recomp.RecompError, match=f"inside {op}.*early_stop=False"):
        ms.grad(lambda t: block(t).sum(), 0, block.trainable_params())(images())


@pytest.mark.parametrize("last", ["softmax", "matmul"])
def test_early_stop_after_a_single_output_op_runs_and_is_exact(last):
    ref = Ending(last)
    block = Ending(last)
    for p, q in zip(ref.get_parameters(), block.get_parameters()):
        q.set_data(p.value().copy())
    wrapped = rm.checkpoint_wrapper(block, early_stop=True)
    for cell in (ref, wrapped):
        cell.set_train()
    x = images()
    expected = ms.grad(lambda t: ref(t).sum(), 0, ref.trainable_params())(x)
    actual = ms.grad(lambda t: wrapped(t).sum(), 0, wrapped.trainable_params())(x)
    for e, a in zip([expected[0], *expected[1]], [actual[0], *actual[1]]):
        np.testing.assert_array_equal(e.asnumpy(), a.asnumpy())


def test_the_default_needs_no_explanation():
    # recomp's default on MindSpore is early_stop=False: the block whose last saved tensor
    # comes from inside BatchNorm, which early_stop=True cannot stop in, runs and is exact
    # (gradients and running statistics as without checkpointing).
    ref = Ending("batchnorm")
    block = Ending("batchnorm")
    for p, q in zip(ref.get_parameters(), block.get_parameters()):
        q.set_data(p.value().copy())
    wrapped = rm.checkpoint_wrapper(block)
    for cell in (ref, wrapped):
        cell.set_train()
    x = images()
    expected = ms.grad(lambda t: ref(t).sum(), 0, ref.trainable_params())(x)
    actual = ms.grad(lambda t: wrapped(t).sum(), 0, wrapped.trainable_params())(x)
    for e, a in zip([expected[0], *expected[1]], [actual[0], *actual[1]]):
        np.testing.assert_array_equal(e.asnumpy(), a.asnumpy())
    for name in ("moving_mean", "moving_variance"):
        np.testing.assert_array_equal(
            getattr(ref.bn, name).asnumpy(), getattr(block.bn, name).asnumpy()
        )
