"""MindSpore wrappers wrap in place: wrappers inside SequentialCell, CellList and CellDict are
reached, a mindcv ResNet trains through them, Parameter.name and checkpoint files stay those
of the unwrapped model, and a zoo that replaces Cell.cells_and_names does not break them."""

from __future__ import annotations

import copy
import os
import tempfile
import warnings

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")  # the PyTorch-only environments skip this file

import recomp  # noqa: E402
import recomp.mindspore as rm  # noqa: E402
from ms_models import Block, Stack, assert_same, copy_params, grads, nn, ops, tensor  # noqa: E402


def is_attn(cell) -> bool:
    return isinstance(cell, nn.Dense) and cell.in_channels == cell.out_channels == 8


def counters(cells) -> list[tuple[int, int]]:
    return [(c.region_runs, c.region_skips) for c in cells]


def test_wrappers_inside_a_sequential_cell_are_reached():
    ref = nn.SequentialCell([Block(8), Block(8)])
    model = nn.SequentialCell([Block(8), Block(8)])
    copy_params(ref, model)
    rm.apply_activation_checkpointing(
        model, checkpoint_fn=lambda c: isinstance(c, Block), exclude_fn=is_attn
    )
    x = tensor(2, 5, 8)
    assert_same(grads(ref, ref.trainable_params(), x), grads(model, model.trainable_params(), x))
    assert counters(b.attn for b in model) == [(1, 1), (1, 1)]
    # the cells SequentialCell runs (its own cell_list) are the wrapped ones
    assert all(isinstance(c, rm.CheckpointWrapper) for c in model.cell_list)
    # setting an element by index keeps working
    model[0] = rm.unwrap(model[0])
    assert not isinstance(model.cell_list[0], rm.CheckpointWrapper)


def test_wrappers_inside_cell_list_and_cell_dict_are_reached():
    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.CellList([Block(8), Block(8)])
            self.heads = nn.CellDict({"a": Block(8), "b": Block(8)})

        def construct(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.heads["a"](x) + self.heads["b"](x)

    ref, model = Net(), Net()
    copy_params(ref, model)
    names = [p.name for p in model.get_parameters()]
    rm.apply_activation_checkpointing(
        model, checkpoint_fn=lambda c: isinstance(c, Block), exclude_fn=is_attn
    )
    assert [p.name for p in model.get_parameters()] == names
    x = tensor(2, 5, 8)
    assert_same(grads(ref, ref.trainable_params(), x), grads(model, model.trainable_params(), x))
    blocks = [*model.layers, model.heads["a"], model.heads["b"]]
    assert all(isinstance(b, rm.CheckpointWrapper) for b in blocks)
    assert counters(b.attn for b in blocks) == [(1, 1)] * 4


def test_mindcv_resnet18_trains_through_checkpointed_basic_blocks():
    """Train mode. Every BatchNorm inside a checkpointed block is excluded, so it runs once
    per step: its moving mean and variance are updated once, as without recomp (a replayed
    BatchNorm would update them a second time)."""
    mindcv = pytest.importorskip("mindcv")
    from mindcv.models.resnet import BasicBlock

    ms.set_seed(0)
    ref = mindcv.models.resnet18(num_classes=10)
    model = mindcv.models.resnet18(num_classes=10)
    copy_params(ref, model)
    ref.set_train(True)
    model.set_train(True)
    names = [p.name for p in model.get_parameters()]
    rm.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda c: isinstance(c, BasicBlock),
        exclude_fn=lambda c: isinstance(c, nn.BatchNorm2d),
    )
    blocks = [c for _, c in model.cells_and_names() if isinstance(c, BasicBlock)]
    assert len(blocks) == 8 and all(isinstance(b, rm.CheckpointWrapper) for b in blocks)
    assert [p.name for p in model.get_parameters()] == names
    x = tensor(2, 3, 32, 32)
    assert_same(grads(ref, ref.trainable_params(), x), grads(model, model.trainable_params(), x))
    excluded = [
        c for b in blocks for _, c in b.cells_and_names() if isinstance(c, rm.ExcludeWrapper)
    ]
    assert len(excluded) == 2 * 8 + 3  # bn1, bn2 per block; the downsample BNs of stages 2-4
    assert counters(excluded) == [(1, 1)] * len(excluded)
    for a, b in zip(ref.get_parameters(), model.get_parameters()):
        assert np.array_equal(a.asnumpy(), b.asnumpy()), a.name  # moving statistics too


def test_checkpoint_files_round_trip_exactly():
    ref = Stack(2)
    model = Stack(2)
    copy_params(ref, model)
    rm.apply_activation_checkpointing(
        model, checkpoint_fn=lambda c: isinstance(c, Block), exclude_fn=is_attn
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "wrapped.ckpt")
        ms.save_checkpoint(model, path)
        saved = ms.load_checkpoint(path)
        assert list(saved) == [p.name for p in ref.get_parameters()]
        fresh = Stack(2)
        rm.apply_activation_checkpointing(
            fresh, checkpoint_fn=lambda c: isinstance(c, Block), exclude_fn=is_attn
        )
        _, missing = ms.load_param_into_net(fresh, saved, strict_load=True)
        assert not missing
    for a, b in zip(fresh.get_parameters(), ref.get_parameters()):
        assert a.name == b.name and np.array_equal(a.asnumpy(), b.asnumpy())


def mindnlp_style_cells_and_names(self, name_prefix=""):
    """What mindnlp 0.3.x installs on every Cell: no ``cells`` argument."""
    yield name_prefix, self
    for name, cell in self._cells.items():
        if cell is not None:
            yield from cell.cells_and_names(
                name_prefix=f"{name_prefix}.{name}" if name_prefix else name
            )


def test_a_zoo_that_replaces_cells_and_names_keeps_working(monkeypatch):
    monkeypatch.setattr(nn.Cell, "cells_and_names", mindnlp_style_cells_and_names)
    ref = Stack(2)
    model = Stack(2)
    copy_params(ref, model)
    names = [p.name for p in model.get_parameters()]
    model.layers[0].attn = rm.checkpoint_exclude_wrapper(model.layers[0].attn)
    model.layers[0] = rm.checkpoint_wrapper(model.layers[0])
    rm.apply_activation_checkpointing(
        model, checkpoint_fn=lambda c: isinstance(c, Block), exclude_fn=is_attn
    )
    assert [n for n, _ in model.cells_and_names()] == [n for n, _ in ref.cells_and_names()]
    assert [p.name for p in model.get_parameters()] == names
    x = tensor(2, 5, 8)
    assert_same(grads(ref, ref.trainable_params(), x), grads(model, model.trainable_params(), x))
    assert counters(b.attn for b in model.layers) == [(1, 1), (1, 1)]


def test_wrapping_keeps_the_object_isinstance_and_parameter_names():
    block = Block(8)
    names = [p.name for p in block.get_parameters()]
    attn = block.attn
    assert rm.checkpoint_exclude_wrapper(block.attn, name="attn") is attn
    assert rm.checkpoint_wrapper(block) is block
    assert isinstance(block, Block) and isinstance(block.attn, nn.Dense)
    assert [p.name for p in block.get_parameters()] == names
    text = repr(block)
    assert text.startswith("CheckpointedBlock(")
    assert "(attn): ExcludedDense(input_channels=8, output_channels=8, has_bias=True, " in text
    assert "region='attn', save_output=True)" in text


def test_deepcopy_and_unwrap():
    ref = Stack(2)
    model = Stack(2)
    copy_params(ref, model)
    before = [(type(c), set(c.__dict__)) for _, c in model.cells_and_names()]
    rm.apply_activation_checkpointing(
        model, checkpoint_fn=lambda c: isinstance(c, Block), exclude_fn=is_attn
    )
    clone = copy.deepcopy(model)
    assert type(clone.layers[0]) is type(model.layers[0])
    x = tensor(2, 5, 8)
    assert_same(grads(ref, ref.trainable_params(), x), grads(clone, clone.trainable_params(), x))
    assert counters(b.attn for b in clone.layers) == [(1, 1), (1, 1)]
    assert counters(b.attn for b in model.layers) == [(0, 0), (0, 0)]
    assert rm.unwrap(model) is model
    assert [(type(c), set(c.__dict__)) for _, c in model.cells_and_names()] == before
    with pytest.raises(ValueError, match="carries no recomp wrapper"):
        rm.unwrap(model)
    fn = rm.checkpoint_exclude_wrapper(ops.sin)
    assert isinstance(fn, rm.ExcludeWrapper) and list(fn.get_parameters()) == []
    assert rm.unwrap(fn) is ops.sin


def test_wrapping_twice_is_a_clear_error():
    block = rm.checkpoint_wrapper(Block(8))
    with pytest.raises(ValueError, match=r"already wrapped by recomp.*unwrap"):
        rm.checkpoint_exclude_wrapper(block)
    assert isinstance(block, rm.CheckpointWrapper) and not isinstance(block, rm.ExcludeWrapper)


def test_a_cell_configured_with_mindspore_recompute_is_rejected():
    block = Block(8)
    block.recompute()  # MindSpore would run the construct it captured, never recomp's
    with pytest.raises(ValueError, match=r"Cell.recompute\(\) was called.*Drop the recompute"):
        rm.checkpoint_wrapper(block)
    assert type(block) is Block
    model = Stack(2)
    model.layers[1].recompute()
    with pytest.raises(ValueError, match="recompute"):
        rm.apply_activation_checkpointing(
            model, checkpoint_fn=lambda c: isinstance(c, Block), exclude_fn=is_attn
        )
    assert all(type(c) in (Block, nn.Dense) for c in [*model.layers, model.layers[0].attn])


def test_a_wrapped_model_whose_construct_reaches_no_wrapper_warns_once():
    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block(8)
            self.run = self.block.construct  # bound before wrapping: bypasses the wrapper

        def construct(self, x):
            return self.run(x)

    net = Net()
    rm.apply_activation_checkpointing(net, checkpoint_fn=lambda c: isinstance(c, Block))
    with pytest.warns(recomp.WrapperNotReachedWarning, match="wrapped 'block' in .*Net"):
        net(tensor(2, 8))
    # Checked once: the wrapper's hook is gone; the model's own stays (MindSpore loops
    # over a Cell's hooks without a copy) and does nothing from now on.
    assert not net.block._forward_pre_hook and len(net._forward_hook) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net(tensor(2, 8))


def test_construct_replaced_on_the_instance_is_still_checkpointed():
    ref = Block(8)
    block = Block(8)
    copy_params(ref, block)
    calls = []
    original = block.construct

    def patched(x):
        calls.append(1)
        return original(x)

    block.construct = patched
    rm.checkpoint_exclude_wrapper(block.attn)
    rm.checkpoint_wrapper(block)
    x = tensor(2, 8)
    assert_same(grads(ref, ref.trainable_params(), x), grads(block, block.trainable_params(), x))
    assert len(calls) == 2  # the forward and the replay
    assert (block.attn.region_runs, block.attn.region_skips) == (1, 1)
    rm.unwrap(block)
    assert block.construct is patched


@pytest.mark.parametrize("wrapped", ["block", "attn"])
def test_cell_recompute_on_a_wrapped_cell_is_refused(wrapped):
    """The other order of the test above: recompute() after recomp wrapped the Cell would
    replay recomp's construct, running its excluded regions twice."""
    ref, block = Block(8), Block(8)
    copy_params(ref, block)
    block.attn = rm.checkpoint_exclude_wrapper(block.attn)
    block = rm.checkpoint_wrapper(block)
    target = block if wrapped == "block" else block.attn
    wrapper = "checkpoint_wrapper" if wrapped == "block" else "checkpoint_exclude_wrapper"
    refused = rf"Cell.recompute\(\) was called on .*\({wrapper}\).*unwrap"
    with pytest.raises(ValueError, match=refused):
        target.recompute()
    assert getattr(target, "_recompute_cell", None) is None  # MindSpore's recompute not set
    x = tensor(2, 5, 8)
    assert_same(grads(ref, ref.trainable_params(), x), grads(block, block.trainable_params(), x))
    assert (block.attn.region_runs, block.attn.region_skips) == (1, 1)


def test_the_value_check_is_refused_with_a_clear_error():
    """``determinism_check="values"`` compares what PyTorch's replay saves; MindSpore's
    recompute has nothing to compare it with, so every entry point refuses it."""
    x = tensor(2, 8)
    with pytest.raises(ValueError, match=r'determinism_check="values" is available on PyTorch only'):
        rm.checkpoint(ops.sin, x, determinism_check="values")
    with pytest.raises(ValueError, match=r"checkpoint_wrapper: determinism_check"):
        rm.checkpoint_wrapper(nn.Dense(8, 8), determinism_check="values")
    with pytest.raises(ValueError, match=r"apply_activation_checkpointing: determinism_check"):
        rm.apply_activation_checkpointing(
            Stack(), checkpoint_fn=lambda c: isinstance(c, Block), determinism_check="values"
        )
