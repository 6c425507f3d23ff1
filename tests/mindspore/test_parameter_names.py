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


class OneBlockStage(ms.nn.Cell):
    """mindcv's ResNet-like stage of one block, the block's parameters below
    segments equal to its index (``stage.0.branch.0.0.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        branch = ms.nn.SequentialCell(
            [ms.nn.SequentialCell([ms.nn.Dense(4, 4), ms.nn.BatchNorm1d(4)])]
        )
        self.stage = ms.nn.SequentialCell([ms.nn.SequentialCell([branch])])
        self.head = ms.nn.CellList([ms.nn.SequentialCell([ms.nn.Dense(4, 4)])])

    def construct(self, x):
        return self.head[0](self.stage(x))


def test_item_assignment_into_a_one_element_container_keeps_the_names():
    """SequentialCell and CellList item assignment guess the container's path from the
    cell's own names; with one element, they guess too long a path."""
    model = OneBlockStage()
    before = names(model)
    branch = model.stage[0][0]
    branch[0] = rm.checkpoint_exclude_wrapper(branch[0])
    model.stage[0] = rm.checkpoint_wrapper(model.stage[0])
    model.head[0] = rm.checkpoint_wrapper(model.head[0])
    assert names(model) == before
    ms.nn.Momentum(model.trainable_params(), learning_rate=0.1, momentum=0.9)


def test_mindspore_renames_an_unwrapped_cell_put_back_into_a_one_element_container():
    """Canary for the path guess above: the same assignment without recomp renames."""
    model = OneBlockStage()
    before = names(model)
    model.stage[0] = model.stage[0]
    assert names(model) != before
