"""recomp.mindspore.report.record_saved_tensors: the saved-tensor report, recorded during the forward.

Checked against MindSpore's own memory record (the allocator), against the regions'
``region_saved_bytes``, and for what must not be billed: parameters, the given
inputs, deferred inputs, a storage held twice.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")  # the PyTorch-only environments skip this file

import recomp.mindspore as rm  # noqa: E402
import recomp.mindspore.report as rr  # noqa: E402
from ms_models import (  # noqa: E402
    Block,
    Stack,
    assert_same,
    exclude_attention,
    grads,
    held_for_backward,
    nn,
    ops,
    tensor,
    twin_stack,
)
from recomp._report import CACHED, CHECKPOINT_INPUT, DEFERRED, KEPT, OUTSIDE  # noqa: E402


def record_step(model, *inputs):
    step = ms.grad(lambda *xs: (model(*xs) ** 2).sum(), None, model.trainable_params())
    step(*inputs)  # warm-up
    with rr.record_saved_tensors(model, inputs=inputs) as record:
        step(*inputs)
    return record.report


def region_sums(report):
    sums: dict[str, int] = {}
    for row in report.rows:
        if row.region is not None:
            sums[row.region] = sums.get(row.region, 0) + row.bytes
    return sums


class Residual(nn.Cell):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Dense(d, d)
        self.b = nn.Dense(d, d)

    def construct(self, x):
        return x + self.b(ops.tanh(self.a(x)))


@pytest.mark.parametrize("strategy", ["none", "full", "exclude"])
def test_total_is_what_the_allocator_holds_for_backward(strategy):
    d, rows, layers = 256, 256, 4
    act = rows * d * 4
    model = nn.SequentialCell([nn.Dense(d, d)] + [Residual(d) for _ in range(layers)])
    if strategy != "none":
        rm.apply_activation_checkpointing(
            model,
            checkpoint_fn=Residual,
            exclude_fn=(lambda c: c is not None and c.cls_name == "Dense" and c is not model[0])
            if strategy == "exclude"
            else None,
        )
    x = tensor(rows, d)
    report = record_step(model, x)
    held, _ = held_for_backward(model, x, after_loss=True)
    # within 2%: the rest is MindSpore's own (seen: 0.03 of an activation)
    assert report.total_bytes == pytest.approx(held, rel=0.02), report.summary()
    expected = {
        # per layer: a's input (the layer input), tanh's output, b's input (the same);
        # first Dense: its output; the loss's Pow: the model output and its own result
        "none": (2 * layers + 2) * act,
        # the inputs of layers 1 to 3 (layer 0's is the first Dense's output, also an input)
        "full": (layers + 2) * act,
        # a keeps its input (the layer input); a and b cache their outputs; b's input,
        # tanh(a(x)), is rebuilt by the replay (deferred)
        "exclude": (layers * 3 + 2) * act,
    }[strategy]
    assert report.total_bytes == expected, report.summary()
    if strategy == "exclude":
        assert region_sums(report) == pytest.approx(
            {
                f"{i}.{n}": getattr(model[i], n).region_saved_bytes
                for i in range(1, layers + 1)
                for n in "ab"
            }
        )


def test_the_benchmark_decoder_with_excluded_attention():
    """Per-region bytes equal region_saved_bytes. (Not compared with MindSpore's record
    here: on this model its reading at the end of the forward, less the start of the
    step, was 1.8 to 2.8 activations below what the report lists, varying between runs
    of the same step; on the residual stack above they agree within 0.5%.)"""
    from recomp.cli.config import BenchConfig
    from recomp.cli.mindspore.runner import build

    config = BenchConfig(layers=3, hidden=128, heads=2, seq=128, batch=2)
    model, x = build(config)
    layers = {id(layer) for layer in model.layers}
    rm.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda c: id(c) in layers,
        exclude_fn=lambda c: type(c).__name__ == "Attention",
    )
    report = record_step(model, x)
    assert region_sums(report) == {
        f"layers.{i}.attn": layer.attn.region_saved_bytes for i, layer in enumerate(model.layers)
    }
    assert {r.layer for r in report.rows if r.region} == {"layers.0", "layers.1", "layers.2"}
    assert report.by_kind()[KEPT] > 0 and report.by_kind()[CACHED] > 0


def test_rows_name_layers_regions_and_the_saving_cell():
    model = exclude_attention(Stack(2, d=16))
    report = record_step(model, tensor(4, 16))
    rows = [(r.layer, r.region, r.op, r.kind, r.shape) for r in report.rows]
    assert rows == [
        ("layers.0", "layers.0.attn", "output", CACHED, (4, 16)),
        ("layers.1", None, "input", CHECKPOINT_INPUT, (4, 16)),  # layers.0's is x: not billed
        ("layers.1", "layers.1.attn", "output", CACHED, (4, 16)),
        (None, None, "Pow", OUTSIDE, (4, 16)),  # the loss: its input and output
        (None, None, "Pow", OUTSIDE, (4, 16)),
    ]
    # the attention Dense's input, the norm's output, is rebuilt by the replay
    assert [(r.region, r.op) for r in report.deferred] == [
        ("layers.0.attn", "MatMul in layers.0.attn (Dense)"),
        ("layers.1.attn", "MatMul in layers.1.attn (Dense)"),
    ]
    assert "layers.0.attn" in str(report) and "cached output" in report.summary()


def test_parameters_and_inputs_are_not_billed_and_the_unwrapped_total_is_exact():
    """Dense layers save their input and their weight: only the activations count."""
    d, n = 16, 4
    model = nn.SequentialCell([nn.Dense(d, d) for _ in range(n)])
    x = tensor(8, d)
    report = record_step(model, x)
    # each Dense after the first saves its input (the previous output), x itself is not
    # billed; the loss's Pow saves the output and its own result
    assert report.total_bytes == (n - 1 + 2) * 8 * d * 4
    assert all(r.kind == OUTSIDE for r in report.rows)


def test_deferred_inputs_are_listed_not_billed():
    """A Dense region on the block's input keeps nothing of it: the replay rebuilds it."""
    model = exclude_attention(Stack(1, d=16))
    report = record_step(model, tensor(4, 16))
    deferred = [r for r in report.deferred if r.region == "layers.0.attn"]
    assert [(r.kind, r.shape, r.bytes) for r in deferred] == [(DEFERRED, (4, 16), 4 * 16 * 4)]
    assert report.deferred_bytes == 4 * 16 * 4
    assert report.total_bytes == sum(r.bytes for r in report.rows)  # deferred rows apart


class TwoReaders(nn.Cell):
    """Two excluded Dense cells that both save the layer input (a checkpoint input: kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Dense(16, 16)
        self.b = nn.Dense(16, 16)

    def construct(self, x):
        return ops.tanh(self.a(x)) + ops.tanh(self.b(x))


def test_a_storage_held_by_two_regions_is_billed_once():
    model = nn.SequentialCell([nn.Dense(16, 16), TwoReaders()])
    rm.apply_activation_checkpointing(
        model,
        checkpoint_fn=TwoReaders,
        exclude_fn=lambda c: c is not None and c.cls_name == "Dense" and c is not model[0],
    )
    report = record_step(model, tensor(4, 16))
    act = 4 * 16 * 4
    a, b = model[1].a, model[1].b
    assert a.region_saved_bytes == b.region_saved_bytes == 2 * act  # input kept, output cached
    sums = region_sums(report)
    assert sums["1.a"] + sums["1.b"] == 3 * act  # the shared input once
    assert [r for r in report.rows if r.kind == CHECKPOINT_INPUT] == []  # billed to a region
    assert len([r for r in report.rows if r.kind == KEPT]) == 1


def test_recording_changes_no_gradient_and_keeps_no_tensor():
    ref, model = twin_stack(2)
    exclude_attention(model)
    x = tensor(4, 8)
    expected = grads(ref, ref.trainable_params(), x)
    with rr.record_saved_tensors(model, inputs=x) as record:
        actual = grads(model, model.trainable_params(), x)
    assert_same(expected, actual)
    assert record.report.total_bytes > 0
    gc.collect()
    held = [o for o in gc.get_referents(*record.report.rows) if isinstance(o, ms.Tensor)]
    assert held == []
    assert all(
        isinstance(v, (str, int, tuple, type(None)))
        for r in record.report.rows
        for v in vars(r).values()
    )


def test_nothing_is_recorded_outside_the_block_or_during_a_replay():
    model = exclude_attention(Stack(2, d=16))
    x = tensor(4, 16)
    step = ms.grad(lambda t: (model(t) ** 2).sum(), None, model.trainable_params())
    with rr.record_saved_tensors(model, inputs=x) as record:
        step(x)
    once = record.report.total_bytes
    step(x)  # after the block: not recorded
    assert record.report.total_bytes == once
    # the replay (in backward) saves the recomputed MLP's tensors: none of them is billed
    assert all(".mlp" not in r.op for r in record.report.rows if r.layer is not None)


def test_a_dropout_block_bills_the_mask_not_the_output():
    class DropBlock(Block):
        def __init__(self, d: int) -> None:
            super().__init__(d)
            self.drop = nn.Dropout(p=0.5)

        def construct(self, x):
            return super().construct(self.drop(x))

    ms.set_seed(0)
    model = Stack(1, d=16)
    model.layers[0] = DropBlock(16)
    model.set_train(True)  # a Dropout cell draws a mask only in training
    rm.apply_activation_checkpointing(model, checkpoint_fn=DropBlock)
    report = record_step(model, tensor(4, 16))
    masks = [r for r in report.rows if r.region == "layers.0.drop"]
    assert [(r.kind, r.dtype, r.shape) for r in masks] == [(CACHED, "bool", (4, 16))]
    assert np.prod(masks[0].shape) == masks[0].bytes


def test_layers_name_what_is_saved_outside_checkpoints():
    model = Stack(2, d=16)
    x = tensor(4, 16)
    plain = record_step(model, x)
    step = ms.grad(lambda t: (model(t) ** 2).sum(), None, model.trainable_params())
    with rr.record_saved_tensors(model, inputs=x, layers=["layers.0", "layers.1"]) as record:
        step(x)
    report = record.report
    assert report.total_bytes == plain.total_bytes
    by_layer = report.by_layer()
    assert set(by_layer) == {"layers.0", "layers.1", None}  # None: the loss
    # layers.1's norm also saves its input, layers.0's output (layers.0's is x: not billed)
    assert by_layer["layers.1"] == by_layer["layers.0"] + 4 * 16 * 4 > 4 * 16 * 4
    assert all(r.op.startswith(("Pow", "-")) for r in report.rows if r.layer is None)


def test_bad_layers_raise_before_anything_is_recorded():
    model = Stack(1, d=16)
    with (
        pytest.raises(ValueError, match=r"no module of the model at 'layer\.0'"),
        rr.record_saved_tensors(model, layers=["layer.0"]),
    ):
        pass
    with (
        pytest.raises(ValueError, match="pass the model too"),
        rr.record_saved_tensors(layers=["layers.0"]),
    ):
        pass
    # no observer or hook left behind: a step records nothing and runs as before
    from recomp._hooks import OBSERVERS

    assert OBSERVERS.get() == ()


def test_the_report_command_on_mindspore(tmp_path, capsys):
    from recomp.cli.report import main

    png = tmp_path / "report.png"
    args = ["--framework", "mindspore", "--layers", "2", "--hidden", "32", "--seq", "16"]
    assert main([*args, "--summary", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "MindSpore decoder" in out and "layers.1.attn" in out and "kept by region" in out
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 0
    assert main([*args, "--model", "recomp.cli.torch.models:hf_llama"]) == 2
    assert "PyTorch factories only" in capsys.readouterr().err


def test_bench_report_writer_on_mindspore(tmp_path):
    from recomp.cli.config import BenchConfig
    from recomp.cli.saved_tensors import write_strategy_reports

    config = BenchConfig(layers=2, hidden=32, heads=2, seq=16, batch=2)
    written = write_strategy_reports(str(tmp_path), config, ["exclude:attn"], "mindspore")
    text = (tmp_path / "report-mindspore-exclude-attn.txt").read_text()
    assert str(tmp_path / "report-mindspore-exclude-attn.txt") in written
    assert "layers.1.attn" in text and "total held for backward" in text


class PairBlock(nn.Cell):
    """Takes its two inputs as ``kind``: a list, a tuple, a dict or a keyword argument."""

    def __init__(self, d: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a = nn.Dense(d, d)
        self.b = nn.Dense(d, d)

    def construct(self, xs, y=None):
        if self.kind == "dict":
            x, y = xs["x"], xs["y"]
        elif self.kind == "keyword":
            x = xs
        else:
            x, y = xs
        return x + self.a(ops.tanh(y)), y + self.b(ops.tanh(x))


class PairStack(nn.Cell):
    def __init__(self, d: int, layers: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.first = nn.Dense(d, d)
        self.layers = nn.CellList([PairBlock(d, kind) for _ in range(layers)])

    def construct(self, x):
        x = self.first(x)
        y = x * 2
        for layer in self.layers:
            if self.kind == "list":
                x, y = layer([x, y])
            elif self.kind == "tuple":
                x, y = layer((x, y))
            elif self.kind == "dict":
                x, y = layer({"x": x, "y": y})
            else:
                x, y = layer(x, y=y)
        return x + y


@pytest.mark.parametrize("kind", ["list", "tuple", "dict", "keyword"])
def test_checkpoint_inputs_in_lists_tuples_dicts_and_keywords_are_billed(kind):
    """MindSpore's checkpoint holds every input until backward, but only tensors passed
    as arguments themselves reach a saved-tensor hook: the rest is billed from the
    checkpoint's flattened inputs (mindcv's CrossViT passes its branches as a list)."""
    d, rows, layers = 16, 8, 3
    act = rows * d * 4
    model = PairStack(d, layers, kind)
    rm.apply_activation_checkpointing(model, checkpoint_fn=PairBlock)
    report = record_step(model, tensor(rows, d))
    inputs = [(r.layer, r.shape) for r in report.rows if r.kind == CHECKPOINT_INPUT]
    assert inputs == [(f"layers.{i}", (rows, d)) for i in range(layers) for _ in "xy"]
    # the checkpoints' inputs; the loss's Pow saves the model output and its own result
    assert report.by_kind() == {CHECKPOINT_INPUT: 2 * layers * act, OUTSIDE: 2 * act}


class ListResidual(nn.Cell):
    """Takes ``[x, y]`` as one list argument: ``x + b(tanh(a(y)))``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Dense(d, d)
        self.b = nn.Dense(d, d)

    def construct(self, xs):
        x, y = xs
        return x + self.b(ops.tanh(self.a(y)))


class ListStack(nn.Cell):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.first = nn.Dense(d, d)
        self.layers = nn.CellList([ListResidual(d) for _ in range(layers)])

    def construct(self, x):
        h = self.first(x)
        g = h * 2  # every layer's second input
        for layer in self.layers:
            h = layer([h, g])
        return h


@pytest.mark.parametrize("strategy", ["full", "exclude"])
def test_with_list_inputs_the_total_is_what_the_allocator_holds(strategy):
    """Without checkpoints the inputs' container does not matter (the residual stack
    above compares that mode); on this graph MindSpore's record then reads one
    activation above what its hooks see (6 against 7.03), see docs/tools/report.md."""
    d, rows, layers = 256, 256, 3
    act = rows * d * 4
    model = ListStack(d, layers)
    if strategy != "none":
        rm.apply_activation_checkpointing(
            model,
            checkpoint_fn=ListResidual,
            exclude_fn=(lambda c: c is not None and c.cls_name == "Dense" and c is not model.first)
            if strategy == "exclude"
            else None,
        )
    x = tensor(rows, d)
    report = record_step(model, x)
    held, _ = held_for_backward(model, x, after_loss=True)
    assert report.total_bytes == pytest.approx(held, rel=0.02), report.summary()
    expected = {
        # each layer's h, and g once; the loss
        "full": (layers + 1 + 2) * act,
        # kept: a's input g (once); cached: a's and b's outputs; inputs h; the loss
        "exclude": (1 + 2 * layers + layers + 2) * act,
    }[strategy]
    assert report.total_bytes == expected, report.summary()
