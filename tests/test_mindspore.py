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
from ms_models import Block, Stack, assert_same, copy_params, grads, nn, ops, tensor  # noqa: E402


def wrapped_stack(n=3):
    ref = Stack(n)
    model = Stack(n)
    copy_params(ref, model)
    for i in range(n):
        model.layers[i].attn = rm.checkpoint_exclude_wrapper(model.layers[i].attn)
        model.layers[i] = rm.checkpoint_wrapper(model.layers[i])
    return ref, model


def test_gradients_equal_unwrapped_and_region_runs_once():
    ref, model = wrapped_stack()
    x = tensor(4, 5, 8)
    for step in (1, 2):
        assert_same(
            grads(ref, ref.trainable_params(), x), grads(model, model.trainable_params(), x)
        )
        assert [layer.attn.region_runs for layer in model.layers] == [step] * 3
        assert [layer.attn.region_skips for layer in model.layers] == [step] * 3


def test_without_exclusion_the_region_is_replayed():
    calls = []

    class Counting(nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = nn.Dense(8, 8)

        def construct(self, x):
            calls.append(1)
            return self.dense(x)

    inner = Counting()
    wrapped = rm.checkpoint_wrapper(inner)
    grads(wrapped, wrapped.trainable_params(), tensor(2, 8))
    assert len(calls) == 2


def test_plain_call_outside_checkpoint_and_without_grad():
    dense = nn.Dense(4, 4)
    plain = nn.Dense(4, 4)
    copy_params(dense, plain)
    wrapped = rm.checkpoint_exclude_wrapper(dense)
    x = tensor(2, 4)
    assert np.array_equal(wrapped(x).asnumpy(), plain(x).asnumpy())
    with ms._no_grad():
        rm.checkpoint(lambda t: wrapped(t) * 2, x)
    assert (wrapped.region_runs, wrapped.region_skips) == (2, 0)


def test_same_wrapper_called_several_times_replays_in_order():
    dense = nn.Dense(6, 6)
    ref = nn.Dense(6, 6)
    copy_params(dense, ref)
    wrapped = rm.checkpoint_exclude_wrapper(dense)

    def body(m, x):
        a = ops.tanh(m(x))
        b = ops.sin(m(a * 2))
        return ops.cos(m(b + a))

    x = tensor(3, 6)
    expected = grads(lambda t: body(ref, t), ref.trainable_params(), x)
    actual = grads(lambda t: rm.checkpoint(body, wrapped, t), dense.trainable_params(), x)
    assert_same(expected, actual)
    assert (wrapped.region_runs, wrapped.region_skips) == (3, 3)


def test_several_invocations_keep_separate_caches():
    dense = nn.Dense(5, 5)
    ref = nn.Dense(5, 5)
    copy_params(dense, ref)
    wrapped = rm.checkpoint_exclude_wrapper(dense)
    xs = [tensor(2, 5, seed=i) * (i + 1) for i in range(3)]

    def total(m, ckpt):
        f = (
            (lambda t: rm.checkpoint(lambda u: ops.relu(m(ops.tanh(u))), t))
            if ckpt
            else (lambda t: ops.relu(m(ops.tanh(t))))
        )
        return lambda *ts: sum((f(t) ** 2).sum() for t in ts)

    expected = grads(total(ref, False), ref.trainable_params(), *xs, loss=lambda v: v)
    actual = grads(total(wrapped, True), dense.trainable_params(), *xs, loss=lambda v: v)
    assert_same(expected, actual)
    assert (wrapped.region_runs, wrapped.region_skips) == (3, 3)


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


def test_save_output_false_chain():
    up, down = nn.Dense(8, 16), nn.Dense(16, 8)
    ref_up, ref_down = nn.Dense(8, 16), nn.Dense(16, 8)
    copy_params(up, ref_up)
    copy_params(down, ref_down)
    first = rm.checkpoint_exclude_wrapper(nn.SequentialCell([up, nn.ReLU()]), save_output=False)
    second = rm.checkpoint_exclude_wrapper(down)
    x = tensor(4, 8)
    params = ref_up.trainable_params() + ref_down.trainable_params()
    expected = grads(lambda t: ops.tanh(ref_down(ops.relu(ref_up(ops.sin(t))))), params, x)
    actual = grads(
        lambda t: rm.checkpoint(lambda u: ops.tanh(second(first(ops.sin(u)))), t),
        up.trainable_params() + down.trainable_params(),
        x,
    )
    assert_same(expected, actual)
    assert (first.region_runs, second.region_runs) == (1, 1)
    # the ReLU's saved output is the one copy of `first`'s output; no cache on top
    assert first.region_saved_bytes == 4 * 16 * 4


def test_save_output_false_output_that_feeds_no_excluded_region_raises(recover_mindspore):
    first = rm.checkpoint_exclude_wrapper(nn.Dense(4, 4), save_output=False, name="proj")
    with pytest.raises(recomp.OutputNotSavedError, match=r"'proj'.*save_output=True"):
        grads(
            lambda t: rm.checkpoint(lambda u: ops.tanh(first(u)), t),
            first.trainable_params(),
            tensor(2, 4),
        )


def test_nested_exclusion_raises(recover_mindspore):
    class Two(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a = rm.checkpoint_exclude_wrapper(nn.Dense(4, 4), name="inner_a")

        def construct(self, x):
            return self.a(x)

    wrapped = rm.checkpoint_exclude_wrapper(Two(), name="outer")
    with pytest.raises(recomp.NestedExclusionError, match=r"'inner_a'.*inside.*'outer'"):
        grads(lambda t: rm.checkpoint(wrapped, t), wrapped.trainable_params(), tensor(2, 4))


def test_replay_that_calls_regions_differently_raises(recover_mindspore):
    wrapped = rm.checkpoint_exclude_wrapper(nn.Dense(4, 4), name="lin")

    def diverging(x):
        y = wrapped(x)
        if recomp.is_recomputing():
            y = wrapped(y)
        return ops.tanh(y)

    with pytest.raises(recomp.ReplayMismatchError, match=r"'lin'.*recorded only 1"):
        grads(lambda t: rm.checkpoint(diverging, t), wrapped.trainable_params(), tensor(2, 4))


def test_failure_inside_region_leaves_no_state(recover_mindspore):
    class Flaky(nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = nn.Dense(4, 4)
            self.fail = True

        def construct(self, x):
            y = self.dense(x)
            if self.fail:
                raise ValueError("boom")
            return y

    flaky = Flaky()
    wrapped = rm.checkpoint_exclude_wrapper(flaky)
    body = lambda t: rm.checkpoint(lambda u: ops.tanh(wrapped(ops.sin(u))), t)  # noqa: E731
    with pytest.raises(ValueError, match="boom"):
        grads(body, flaky.trainable_params(), tensor(2, 4))
    from recomp import _testing

    assert recomp.get_recompute_state() is None and _testing.active_region_name() is None
    flaky.fail = False
    expected = grads(
        lambda u: ops.tanh(flaky.dense(ops.sin(u))), flaky.trainable_params(), tensor(2, 4)
    )
    assert_same(expected, grads(body, flaky.trainable_params(), tensor(2, 4)))
    assert (wrapped.region_runs, wrapped.region_skips) == (1, 1)


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


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="non-reentrant"):
        rm.checkpoint(ops.sin, tensor(2), use_reentrant=True)
    with pytest.raises(ValueError, match="non-reentrant"):
        rm.checkpoint_wrapper(nn.Dense(2, 2), use_reentrant=True)
    for bad in (None, 3, "dense"):
        with pytest.raises(ValueError, match="Cell or a callable"):
            rm.checkpoint_exclude_wrapper(bad)
        with pytest.raises(ValueError, match="Cell or a callable"):
            rm.checkpoint_wrapper(bad)
    for bad in (1, None, "no"):
        with pytest.raises(ValueError, match="save_output must be True or False"):
            rm.checkpoint_exclude_wrapper(nn.Dense(2, 2), save_output=bad)


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
