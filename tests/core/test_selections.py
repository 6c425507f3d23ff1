"""MindSpore: what ``apply_activation_checkpointing`` is asked to select, on mindcv models.

Selections that take no effect warn (``IneffectiveSelectionWarning``) naming what
and why; predicates are checked before anything is wrapped.
"""

from __future__ import annotations

import warnings

import pytest

ms = pytest.importorskip("mindspore")
mindcv_resnet = pytest.importorskip("mindcv.models.resnet")

import recomp  # noqa: E402
import recomp.mindspore as rm  # noqa: E402
from ms_models import grads, nn, tensor  # noqa: E402
from recomp._wrapping import recomp_wrapper_of  # noqa: E402


def resnet():
    return mindcv_resnet.ResNet(mindcv_resnet.BasicBlock, [1, 1, 1, 1], num_classes=3)


def apply(model, **kwargs):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        rm.apply_activation_checkpointing(model, **kwargs)
    return [str(w.message) for w in record if w.category is recomp.IneffectiveSelectionWarning]


def wrapped(model):
    return [n for n, c in model.cells_and_names() if recomp_wrapper_of(c) is not None]


def test_checkpoint_fn_of_the_wrong_block_class_warns():
    model = resnet()  # built from BasicBlock, not Bottleneck
    (message,) = apply(model, checkpoint_fn=lambda c: isinstance(c, mindcv_resnet.Bottleneck))
    assert "checkpoint_fn matched no module of ResNet" in message and "BasicBlock" in message
    assert wrapped(model) == []


def test_exclude_fn_matching_only_cells_outside_checkpoints_warns():
    model = resnet()
    (message,) = apply(
        model,
        checkpoint_fn=lambda c: isinstance(c, mindcv_resnet.BasicBlock),
        exclude_fn=lambda c: isinstance(c, nn.Dense),  # the classifier, outside every block
    )
    assert "outside every checkpoint ('classifier')" in message
    # The same for the checkpointed block itself.
    model = resnet()
    (message,) = apply(
        model,
        checkpoint_fn=lambda c: isinstance(c, mindcv_resnet.BasicBlock),
        exclude_fn=lambda c: isinstance(c, mindcv_resnet.BasicBlock),
    )
    assert (
        "checkpointed modules themselves ('layer1.0', 'layer2.0', 'layer3.0' and 1 more)" in message
    )
    # Excluding the convolutions inside: silent.
    assert (
        apply(
            resnet(),
            checkpoint_fn=lambda c: isinstance(c, mindcv_resnet.BasicBlock),
            exclude_fn=lambda c: isinstance(c, nn.Conv2d),
        )
        == []
    )


class Block(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Dense(8, 8)
        self.out = nn.Dense(8, 8)

    def construct(self, x):
        return self.out(ms.ops.tanh(self.dense.construct(x)))  # bypasses the Cell call


def test_excluded_cell_called_through_construct_warns():
    block = Block()
    apply(
        block,
        checkpoint_fn=lambda c: isinstance(c, Block),
        exclude_fn=lambda c: c is block.dense,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            grads(block, block.trainable_params(), tensor(4, 8))
    messages = [str(w.message) for w in record if w.category is recomp.IneffectiveSelectionWarning]
    assert len(messages) == 1
    assert "'dense' was called as .construct(...)" in messages[0]
    assert block.dense.region_runs == 0


def test_classes_select_by_isinstance_and_other_values_raise():
    by_class, by_lambda = resnet(), resnet()
    assert apply(by_class, checkpoint_fn=mindcv_resnet.BasicBlock, exclude_fn=(nn.Conv2d,)) == []
    apply(
        by_lambda,
        checkpoint_fn=lambda c: isinstance(c, mindcv_resnet.BasicBlock),
        exclude_fn=lambda c: isinstance(c, nn.Conv2d),
    )
    assert wrapped(by_class) == wrapped(by_lambda) and len(wrapped(by_class)) == 4 + 8 + 3
    model = resnet()
    (message,) = apply(model, checkpoint_fn=nn.Identity)  # never called as nn.Identity(cell)
    assert "matched no module" in message and wrapped(model) == []
    with pytest.raises(TypeError, match="exclude_fn must be a class, a tuple of classes or a"):
        rm.apply_activation_checkpointing(
            model, checkpoint_fn=mindcv_resnet.BasicBlock, exclude_fn=["Conv2d"]
        )
    assert wrapped(model) == []
