"""MindSpore: BatchNorm inside a checkpoint, replayed, moves its running statistics once.

mindcv ResNet under the default ``apply_activation_checkpointing`` (BasicBlocks
checkpointed, nothing excluded): several training steps end with the moving mean
and variance of the unwrapped model, bit for bit, and the same gradients; also
under mixed precision. The same on a small model of both frameworks, and a
BatchNorm whose statistics recomp cannot find, are tested in
``tests/core/test_running_stats.py``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
mindcv_resnet = pytest.importorskip("mindcv.models.resnet")

import recomp  # noqa: E402
import recomp.mindspore as rm  # noqa: E402
from ms_models import assert_same, copy_params, nn, ops  # noqa: E402


def twins():
    ms.set_seed(0)
    ref = mindcv_resnet.ResNet(mindcv_resnet.BasicBlock, [1, 1, 1, 1], num_classes=3)
    model = mindcv_resnet.ResNet(mindcv_resnet.BasicBlock, [1, 1, 1, 1], num_classes=3)
    copy_params(ref, model)
    ref.set_train()
    model.set_train()
    return ref, model


def train(model, steps):
    """``steps`` SGD steps; each step's gradients (numpy) and the moving statistics after."""
    params = model.trainable_params()
    opt = nn.SGD(params, learning_rate=0.01)
    loss_of = lambda x, y: ops.cross_entropy(model(x), y)  # noqa: E731
    grad_fn = ms.grad(loss_of, None, params)
    history = []
    for step in range(steps):
        rng = np.random.RandomState(step)
        x = ms.Tensor(rng.randn(2, 3, 16, 16).astype(np.float32))
        y = ms.Tensor(rng.randint(0, 3, (2,)).astype(np.int32))
        g = grad_fn(x, y)
        history.append([t.asnumpy() for t in g])
        opt(g)
    stats = {p.name: p.asnumpy() for p in model.get_parameters() if "moving" in p.name}
    return history, stats


def test_mindcv_resnet_running_statistics_equal_unwrapped_after_training():
    ref, model = twins()
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.RunningStatisticsWarning)
        rm.apply_activation_checkpointing(model, checkpoint_fn=mindcv_resnet.BasicBlock)
    ref_history, ref_stats = train(ref, 3)
    history, stats = train(model, 3)
    for want, got in zip(ref_history, history):
        assert_same(want, got)
    assert ref_stats.keys() == stats.keys() and len(stats) == 2 * (1 + 4 * 2 + 3)
    for name, value in ref_stats.items():
        assert np.array_equal(value, stats[name]), (name, np.abs(value - stats[name]).max())


def test_running_statistics_under_mixed_precision_move_once():
    """A Cell with a mixed-precision type (``to_float``, what ``auto_mixed_precision``
    O2/O3 set) is checkpointed through a function that sets the type again for the
    replay; the checkpoint must still see the Cell, or its BatchNorms are replayed
    without their statistics restored (seen: moving means off by up to 0.14)."""
    ref, model = twins()
    rm.apply_activation_checkpointing(model, checkpoint_fn=mindcv_resnet.BasicBlock)
    for net in (ref, model):  # as O2 does: float16, BatchNorms in float32
        net.to_float(ms.float16)
        for _, cell in net.cells_and_names():
            if isinstance(cell, nn.BatchNorm2d):
                cell.to_float(ms.float32)
    assert model.layer1[0].mixed_precision_type is not None
    ref_history, ref_stats = train(ref, 2)
    history, stats = train(model, 2)
    for want, got in zip(ref_history, history):
        assert_same(want, got)
    for name, value in ref_stats.items():
        assert np.array_equal(value, stats[name]), name
