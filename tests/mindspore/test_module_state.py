"""MindSpore: state a checkpointed Cell keeps outside the autograd graph, in Parameters
without gradients (its own running statistics, under names of its own, updated with
``ops.assign``): the replay reads what the forward read and the update happens once
(``recomp._module_state``). Trained with and without recomp, compared bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

import recomp.mindspore as rm  # noqa: E402
from ms_models import nn, ops  # noqa: E402


class RunningAverage(nn.Cell):
    """Keeps a running average of its output in a Parameter without gradients, updated
    with ``ops.assign``, and reads the updated value in the same forward."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.dense = nn.Dense(width, width)
        self.average = ms.Parameter(
            ms.Tensor(np.zeros(width, np.float32)), requires_grad=False, name="average"
        )

    def construct(self, x):
        y = self.dense(x)
        ops.assign(self.average, self.average * 0.9 + 0.1 * ops.stop_gradient(y).mean(0))
        return ops.tanh(y - self.average) * y


class Twice(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.first = RunningAverage()
        self.second = RunningAverage()

    def construct(self, x):
        return self.second(ops.relu(self.first(x)))


def train(wrap, steps=3, **options):
    """SGD steps on fixed batches; each step's gradients and the averages at the end."""
    ms.set_seed(0)
    model = Twice()
    run = rm.checkpoint_wrapper(model, **options) if wrap else model
    params = model.trainable_params()
    opt = nn.SGD(params, learning_rate=0.1)
    gradients_of = ms.grad(lambda x: (run(x) ** 2).sum(), None, params)
    history = []
    for step in range(steps):
        x = ms.Tensor(np.random.RandomState(step).randn(3, 4).astype(np.float32))
        grads = gradients_of(x)
        history.append([g.asnumpy() for g in grads])
        opt(grads)
    return history, [model.first.average.asnumpy(), model.second.average.asnumpy()]


@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "full"])
def test_statistics_a_cell_assigns_itself_are_replayed_as_read_and_updated_once(early_stop):
    want_grads, want_state = train(False)
    got_grads, got_state = train(True, early_stop=early_stop)
    for step, (want, got) in enumerate(zip(want_grads, got_grads)):
        for i, (a, b) in enumerate(zip(want, got)):
            assert np.array_equal(a, b), f"step {step}, gradient {i}: {np.abs(a - b).max()}"
    for a, b in zip(want_state, got_state):
        assert np.array_equal(a, b), np.abs(a - b).max()
