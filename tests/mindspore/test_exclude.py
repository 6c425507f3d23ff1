"""recomp.mindspore: excluded regions in PyNative checkpoints, wrappers, errors.

Gradients are compared exactly (np.array_equal) with the same model without
checkpoints: on CPU the recomputed code runs the same kernels on the same values.
"""

from __future__ import annotations

import os
import tempfile
from collections import namedtuple

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")  # the PyTorch-only environments skip this file

import recomp  # noqa: E402
import recomp.mindspore as rm  # noqa: E402
from ms_models import (  # noqa: E402
    Block,
    Stack,
    assert_same,
    copy_params,
    exclude_attention,
    grads,
    nn,
    ops,
    tensor,
    twin_stack,
)


def wrapped_stack(n=3):
    ref, model = twin_stack(n)
    return ref, exclude_attention(model)


Routed = namedtuple("Routed", ["weights", "indices", "info"])


class Router(nn.Cell):
    def __init__(self):
        super().__init__()
        self.gate = nn.Dense(8, 4)

    def construct(self, inputs):
        logits = self.gate(inputs["x"]) * inputs["scale"]
        weights, indices = ops.topk(ops.softmax(logits, -1), 2)
        return Routed(weights, indices, {"k": 2, "bias": [inputs["extra"][0] + 1]})


class MoELike(nn.Cell):
    def __init__(self, router):
        super().__init__()
        self.norm = nn.LayerNorm((8,))
        self.router = router
        self.experts = nn.CellList([nn.Dense(8, 8) for _ in range(4)])

    def construct(self, x):
        h = self.norm(x)
        out = self.router({"x": h, "scale": 2.0, "extra": (h * 0.5,)})
        y = ops.zeros_like(h) + out.info["bias"][0]
        for k in range(2):
            for e, expert in enumerate(self.experts):
                mask = (out.indices[..., k] == e).astype(ms.float32).expand_dims(-1)
                y = y + mask * out.weights[..., k : k + 1] * expert(h)
        return x + y


def test_nested_pytrees_and_integer_outputs_pass_through():
    ref = MoELike(Router())
    model = MoELike(Router())
    copy_params(ref, model)
    model.router = rm.checkpoint_exclude_wrapper(model.router)
    model = rm.checkpoint_wrapper(model)
    x = tensor(6, 8)
    assert_same(grads(ref, ref.trainable_params(), x), grads(model, model.trainable_params(), x))
    assert (model.router.region_runs, model.router.region_skips) == (1, 1)


def test_region_at_block_end_with_deferred_input_keeps_only_its_output():
    dense = nn.Dense(8, 8)
    ref = nn.Dense(8, 8)
    copy_params(dense, ref)
    wrapped = rm.checkpoint_exclude_wrapper(dense)
    # 2-D: MindSpore's Dense copies a 3-D input into a 2-D tensor, a new storage
    # that cannot be told apart from any other tensor the region computed
    x = tensor(6, 8)
    expected = grads(lambda t: ref(ops.tanh(t)) * 3, ref.trainable_params(), x)
    actual = grads(
        lambda t: rm.checkpoint(lambda u: wrapped(ops.tanh(u)), t) * 3, dense.trainable_params(), x
    )
    assert_same(expected, actual)
    # the input tanh(x) is deferred to the replay: only the output (6*8 floats) is kept
    assert wrapped.region_saved_bytes == 6 * 8 * 4


def test_graph_mode_is_rejected_with_the_fix():
    wrapped = rm.checkpoint_exclude_wrapper(nn.Dense(2, 2))
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(recomp.RecompError, match="PyNative"):
            rm.checkpoint(ops.sin, tensor(2))
        with pytest.raises(recomp.RecompError, match="PYNATIVE_MODE"):
            wrapped.construct(tensor(2, 2))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def test_parameter_names_and_checkpoint_files_round_trip():
    ref, model = wrapped_stack(2)
    assert [p.name for p in model.get_parameters()] == [p.name for p in ref.get_parameters()]
    assert model.layers[0].attn.in_channels == 8  # attributes fall through
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "wrapped.ckpt")
        ms.save_checkpoint(model, path)
        plain = Stack(2)
        _, missing = ms.load_param_into_net(plain, ms.load_checkpoint(path), strict_load=True)
        assert not missing
        for a, b in zip(plain.get_parameters(), ref.get_parameters()):
            assert np.array_equal(a.asnumpy(), b.asnumpy())
        ms.save_checkpoint(plain, path)
        _, back = wrapped_stack(2)
        _, missing = ms.load_param_into_net(back, ms.load_checkpoint(path), strict_load=True)
        assert not missing
        for a, b in zip(back.get_parameters(), ref.get_parameters()):
            assert np.array_equal(a.asnumpy(), b.asnumpy())


def test_wrapping_at_construction_gets_the_same_names():
    class Layer(nn.Cell):
        def __init__(self, wrap):
            super().__init__()
            dense = nn.Dense(4, 4)
            self.attn = rm.checkpoint_exclude_wrapper(dense) if wrap else dense

        def construct(self, x):
            return self.attn(x)

    class Net(nn.Cell):
        def __init__(self, wrap):
            super().__init__()
            self.layer = rm.checkpoint_wrapper(Layer(wrap)) if wrap else Layer(wrap)

        def construct(self, x):
            return self.layer(x)

    assert (
        [p.name for p in Net(True).get_parameters()]
        == [p.name for p in Net(False).get_parameters()]
        == [
            "layer.attn.weight",
            "layer.attn.bias",
        ]
    )


def test_apply_activation_checkpointing():
    ref = Stack(3)
    model = Stack(3)
    copy_params(ref, model)
    out = rm.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda c: isinstance(c, Block),
        exclude_fn=lambda c: (
            c is not None
            and isinstance(c, nn.Dense)
            and c.in_channels == c.out_channels == 8
            and not isinstance(c, nn.SequentialCell)
        ),
    )
    assert out is model
    assert all(isinstance(layer, rm.CheckpointWrapper) for layer in model.layers)
    assert isinstance(model.layers[0].attn, rm.ExcludeWrapper)
    assert model.layers[1].attn.region.name == "layers.1.attn"
    assert [p.name for p in model.get_parameters()] == [p.name for p in ref.get_parameters()]
    x = tensor(2, 5, 8)
    assert_same(grads(ref, ref.trainable_params(), x), grads(model, model.trainable_params(), x))
    assert [layer.attn.region_runs for layer in model.layers] == [1, 1, 1]


def test_a_replay_that_skips_a_region_raises_replay_mismatch(recover_mindspore):
    """The replay leaves out a region its forward called: recomp's error at the end of the
    replay, not MindSpore's 'Unpack is being triggered for a tensor' in backward."""
    lin = nn.Dense(4, 4)
    region = rm.checkpoint_exclude_wrapper(nn.Dense(4, 4), name="router")

    def body(x):
        h = ops.sin(lin(x))
        if not recomp.is_recomputing():
            h = region(h)
        return ops.cos(h)

    step = ms.grad(lambda x: rm.checkpoint(body, x).sum(), 0)
    with pytest.raises(recomp.ReplayMismatchError, match=r"ended without calling excluded region 'router'"):
        step(tensor(2, 4))
