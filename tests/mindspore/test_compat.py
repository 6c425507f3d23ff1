"""``recomp.mindspore._compat``: every use of MindSpore's private API. Each test fails when
MindSpore changes what recomp relies on."""

from __future__ import annotations

import pytest

ms = pytest.importorskip("mindspore")

from recomp.mindspore import _compat  # noqa: E402


def test_executor_queries():
    seen = []

    def f(x):
        seen.append(_compat.grad_enabled())
        return (x * x).sum()

    x = ms.Tensor([1.0, 2.0])
    assert not _compat.in_backward()
    ms.grad(f)(x)
    assert seen == [True]
    _compat.sync()


def test_version_counts_copy_into():
    t = ms.ops.zeros((3,), ms.float32)
    before = _compat.version(t)
    t.copy_(ms.ops.ones((3,), ms.float32))
    _compat.sync()
    assert _compat.version(t) == before + 1


def test_requires_grad_marks_recorded_outputs():
    flags = []

    def f(x):
        y = x * 2
        flags.append(_compat.requires_grad(y))
        return y.sum()

    ms.grad(f)(ms.Tensor([1.0, 2.0]))
    assert flags == [True]


def test_function_base_and_as_strided():
    class Double(_compat.function_base()):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    grad = ms.grad(lambda x: Double.apply(x).sum())(ms.Tensor([1.0, 2.0]))
    assert grad.asnumpy().tolist() == [2.0, 2.0]
    base = ms.Tensor([[1.0, 2.0], [3.0, 4.0]])
    view = _compat.as_strided()(base, (2,), (2,), 1)
    assert view.asnumpy().tolist() == [2.0, 4.0]


def test_recompute_called_follows_cell_recompute():
    cell = ms.nn.Dense(2, 2)
    assert not _compat.recompute_called(cell)
    cell.recompute()
    assert _compat.recompute_called(cell)


def test_forward_hooks_run_is_true_until_the_hook_runner_is_replaced(monkeypatch):
    cell = ms.nn.Dense(2, 2)
    seen = []
    cell.register_forward_hook(lambda c, inputs, output: seen.append(c))
    cell(ms.ops.ones((1, 2), ms.float32))
    assert seen == [cell] and _compat.forward_hooks_run()
    monkeypatch.setattr(ms.nn.Cell, "_run_forward_hook", lambda self, *a: a[-1])
    assert not _compat.forward_hooks_run()


def test_kernel_seeds_are_a_dict_that_dropout_fills():
    ms.set_seed(1)
    ms.ops.dropout(ms.ops.ones((8,), ms.float32), p=0.5)
    seeds = _compat.kernel_seeds()
    assert isinstance(seeds, dict) and seeds
