"""MindSpore: every ``Parameter.name`` stays what it was, whichever way a Cell is wrapped,
so an optimizer built right after wrapping sees each parameter once, under its path."""

from __future__ import annotations

import pytest

ms = pytest.importorskip("mindspore")

import recomp.mindspore as rm  # noqa: E402
from ms_models import Stack, tensor  # noqa: E402


def names(cell):
    return [p.name for p in cell.get_parameters()]


def test_assigning_the_wrapped_cell_back_to_its_attribute_keeps_the_names():
    model = Stack(2)
    before = names(model)
    for block in model.layers:
        block.attn = rm.checkpoint_exclude_wrapper(block.attn)
        block.mlp = rm.checkpoint_exclude_wrapper(block.mlp)  # a SequentialCell
    assert names(model) == before
    for i in range(len(model.layers)):
        model.layers[i] = rm.checkpoint_wrapper(model.layers[i])
    assert names(model) == before
    # What users do next: an optimizer over the parameters (duplicate names fail here).
    ms.nn.Momentum(model.trainable_params(), learning_rate=0.1, momentum=0.9)
    grads = ms.grad(lambda t: (model(t) ** 2).sum(), None, model.trainable_params())(
        tensor(2, 5, 8)
    )
    assert len(grads) == len(before)
    assert names(model) == before


def test_a_plain_cell_assigned_elsewhere_is_still_renamed_as_mindspore_does():
    """Only a wrapped Cell put back where it already is keeps its names; a Cell moved
    to an attribute of another name gets MindSpore's own renaming."""
    model = Stack(2)
    block = model.layers[0]
    block.other = rm.checkpoint_exclude_wrapper(ms.nn.Dense(8, 8))
    assert {"other.weight", "other.bias"} <= set(names(block))
