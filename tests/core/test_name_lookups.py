"""MindSpore: a wrapped Cell reports the class name it had (``cls_name``, ``__class__.__name__``),
as tools that look layer classes up by name expect; recomp still knows it is wrapped."""

from __future__ import annotations

import copy

import pytest

ms = pytest.importorskip("mindspore")
mindcv_resnet = pytest.importorskip("mindcv.models.resnet")

import recomp.mindspore as rm  # noqa: E402
from recomp._wrapping import recomp_wrapper_of  # noqa: E402


def test_wrapped_cells_report_the_original_names():
    model = mindcv_resnet.ResNet(mindcv_resnet.BasicBlock, [1, 1, 1, 1], num_classes=3)
    rm.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda c: isinstance(c, mindcv_resnet.BasicBlock),
        exclude_fn=lambda c: isinstance(c, ms.nn.Conv2d),
    )
    block = model.layer1[0]
    assert recomp_wrapper_of(block) is rm.CheckpointWrapper
    assert recomp_wrapper_of(block.conv1) is rm.ExcludeWrapper
    for cell, base in ((block, mindcv_resnet.BasicBlock), (block.conv1, ms.nn.Conv2d)):
        assert type(cell) is not base
        assert type(cell).__name__ == cell.cls_name == base.__name__
        assert type(cell).__qualname__ == base.__qualname__
    names = {type(c).__name__ for _, c in model.cells_and_names()}
    assert "BasicBlock" in names
    assert not any(n.startswith(("Checkpointed", "Excluded")) for n in names)
    text = repr(block)
    assert text.startswith("CheckpointedBasicBlock(") and "(conv1): ExcludedConv2d(" in text
    clone = copy.deepcopy(block)
    assert recomp_wrapper_of(clone) is rm.CheckpointWrapper and clone.cls_name == "BasicBlock"
    rm.unwrap(model)
    assert type(model.layer1[0]) is mindcv_resnet.BasicBlock
