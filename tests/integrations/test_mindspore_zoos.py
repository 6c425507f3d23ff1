"""recomp.mindspore on cells as model zoos write them (mindcv 0.3.0, mindnlp-style caches).

Each test names what it guards: dropout cells MindSpore cannot replay, the
early-stop failure of MindSpore 2.10, compiled graphs, item assignment on an
excluded region's output, KV caches written by recomputed code, and mindcv's
ViT and ResNet trained with recomp (gradients equal to the unwrapped model).
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")  # the PyTorch-only environments skip this file
from mindspore import mint  # noqa: E402

import recomp  # noqa: E402
import recomp.mindspore as rm  # noqa: E402
from ms_models import (  # noqa: E402
    assert_same,
    copy_params,
    grads,
    held_for_backward,
    nn,
    ops,
    tensor,
)

mindcv_vit = pytest.importorskip("mindcv.models.vit")
mindcv_resnet = pytest.importorskip("mindcv.models.resnet")




def twins(factory, seed=1):
    """Two copies of one model, built under the same seed (nn.Dropout primitives take
    their seeds at construction), with equal parameters, in training mode."""
    ms.set_seed(seed)
    ref = factory()
    ms.set_seed(seed)
    model = factory()
    copy_params(ref, model)
    ref.set_train()
    model.set_train()
    return ref, model


def seeded_grads(f, params, *inputs, seed=5):
    ms.set_seed(seed)
    return grads(f, params, *inputs)


def differs(expected, actual) -> bool:
    return any(not np.array_equal(e, a) for e, a in zip(expected, actual))


def vit_block():
    return mindcv_vit.Block(dim=16, num_heads=2, proj_drop=0.1, attn_drop=0.1)


class DropoutLast(nn.Cell):
    """The last tensor this block saves is a dropout mask; the residual add saves nothing."""

    def __init__(self, dropout: str = "nn") -> None:
        super().__init__()
        self.dense = nn.Dense(8, 8)
        self.drop = nn.Dropout(p=0.25) if dropout == "nn" else None

    def construct(self, x):
        h = ops.tanh(self.dense(x))
        h = self.drop(h) if self.drop is not None else ops.dropout(h, p=0.25)
        return x + h


# --------------------------------------------------------------------------- early stop


def test_default_checkpoint_runs_a_block_whose_last_saved_tensor_is_a_dropout_mask(seeded):
    ref, model = twins(lambda: DropoutLast("ops"))
    wrapped = rm.checkpoint_wrapper(model)
    x = tensor(4, 8)
    expected = seeded_grads(ref, ref.trainable_params(), x)
    assert_same(expected, seeded_grads(wrapped, model.trainable_params(), x))


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="MindSpore 2.10 bug, without recomp: early stop inside a dropout op breaks the "
    "PyNative executor ('Stack input_args_info_stack_ is empty'); recomp's default is off",
)
def test_mindspore_early_stop_at_a_dropout_mask(recover_mindspore):
    """Canary for the early_stop=False default and recomp.mindspore._early_stop: both can
    go once this passes."""
    block = DropoutLast("ops")
    block.set_train()
    ms.grad(lambda t: ms.recompute(block, t, use_reentrant=False, early_stop=True).sum(), 0)(
        tensor(4, 8)
    )


def test_explicit_early_stop_at_a_dropout_mask_raises_recomp_error(recover_mindspore):
    block = DropoutLast("ops")
    block.set_train()
    with pytest.raises(recomp.RecompError, match="early_stop=False"):
        grads(
            lambda t: rm.checkpoint(block, t, early_stop=True),
            block.trainable_params(),
            tensor(4, 8),
        )


def test_early_stop_after_an_nn_dropout_works(seeded):
    """An nn.Dropout made replayable ends in a multiplication, where MindSpore's early
    stop works: the block that ended in the dropout kernel now stops early."""
    ref, model = twins(DropoutLast)
    x = tensor(4, 8)
    expected = seeded_grads(ref, ref.trainable_params(), x)
    wrapped = rm.checkpoint_wrapper(model, early_stop=True)
    assert_same(expected, seeded_grads(wrapped, model.trainable_params(), x))


@pytest.mark.parametrize("early_stop", [None, False, True])
def test_early_stop_is_off_by_default_and_passes_through(early_stop):
    calls = []

    def body(t):
        h = ops.sin(ops.tanh(t))  # sin saves the last tensor of the block
        calls.append(recomp.is_recomputing())  # after it: an early stop never gets here
        return h * 2

    kwargs = {} if early_stop is None else {"early_stop": early_stop}
    ms.grad(lambda t: rm.checkpoint(body, t, **kwargs).sum(), 0)(tensor(3, 4))
    assert calls == ([False] if early_stop else [False, True])


# --------------------------------------------------------------------------- dropout


class DropoutMiddle(nn.Cell):
    def __init__(self, dropout) -> None:
        super().__init__()
        self.dense = nn.Dense(8, 8)
        self.drop = dropout
        self.out = nn.Dense(8, 8)

    def construct(self, x):
        return self.out(ops.sin(self.drop(ops.tanh(self.dense(x)))))


# Seeded at construction: the unwrapped model and its copy draw the same masks.
SEEDED_DROPOUT_CELLS = {
    "nn.Dropout": lambda: nn.Dropout(p=0.5),
    "mindcv Dropout": lambda: sys.modules["mindcv.models.layers.compatibility"].Dropout(p=0.5),
}
# Unseeded on every call: no two runs draw the same mask, checkpoint or not.
CHANNEL_DROPOUT_CELLS = {
    "nn.Dropout1d": (lambda: nn.Dropout1d(p=0.5), (2, 4, 8)),
    "nn.Dropout2d": (lambda: nn.Dropout2d(p=0.5), (2, 2, 3, 8)),
    "nn.Dropout3d": (lambda: nn.Dropout3d(p=0.5), (2, 2, 1, 3, 8)),
}


@pytest.mark.parametrize("wrap", ["checkpoint_wrapper", "apply_activation_checkpointing"])
@pytest.mark.parametrize("kind", list(SEEDED_DROPOUT_CELLS))
def test_dropout_cells_replay_from_their_kept_mask(seeded, kind, wrap):
    ref, model = twins(lambda: DropoutMiddle(SEEDED_DROPOUT_CELLS[kind]()))
    x = tensor(4, 8)
    expected = seeded_grads(ref, ref.trainable_params(), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.UnreplayableDropoutWarning)
        if wrap == "checkpoint_wrapper":
            model = rm.checkpoint_wrapper(model)
        else:
            model = rm.apply_activation_checkpointing(
                model, checkpoint_fn=lambda m: isinstance(m, DropoutMiddle)
            )
    assert isinstance(model.drop, rm.ReplayableDropout)
    assert isinstance(model.drop, type(ref.drop))
    assert type(model.drop).__name__ == type(ref.drop).__name__
    assert_same(expected, seeded_grads(model, model.trainable_params(), x))
    # drawn once, read back by the replay; kept: the mask, one byte per element
    assert (model.drop.region_runs, model.drop.region_skips) == (1, 1)
    assert model.drop.region_saved_bytes == 4 * 8


class _CountingDropout(nn.Dropout):
    """A subclass with a construct of its own: recomp cannot know what it draws."""

    def construct(self, x):
        return super().construct(x)


def test_dropout_subclass_with_its_own_construct_is_excluded_or_reported():
    with pytest.warns(recomp.UnreplayableDropoutWarning, match=r"\(drop\)"):
        rm.checkpoint_wrapper(DropoutMiddle(_CountingDropout(p=0.5)))
    model = rm.apply_activation_checkpointing(
        DropoutMiddle(_CountingDropout(p=0.5)),
        checkpoint_fn=lambda m: isinstance(m, DropoutMiddle),
    )
    assert isinstance(model.drop, rm.ExcludeWrapper)
    model.set_train()
    grads(model, model.trainable_params(), tensor(4, 8))
    assert (model.drop.region_runs, model.drop.region_skips) == (1, 1)


class _Recorded(nn.Cell):
    """Records what it receives in the forward and in the replay."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[bool, list] = {False: [], True: []}

    def construct(self, x):
        self.seen[recomp.is_recomputing()].append(x.asnumpy())
        return x


@pytest.mark.parametrize("kind", list(CHANNEL_DROPOUT_CELLS))
def test_channel_dropout_cells_replay_the_same_mask(kind):
    """Unseeded: no two runs draw the same mask, so the replay's dropout output is
    compared with the forward's; the kept mask is one byte per channel."""
    factory, shape = CHANNEL_DROPOUT_CELLS[kind]
    model = DropoutMiddle(factory())
    record = _Recorded()
    model.drop = nn.SequentialCell([model.drop, record])
    model.set_train()
    model = rm.checkpoint_wrapper(model)
    grads(model, model.trainable_params(), tensor(*shape))
    (forward,), (replay,) = record.seen[False], record.seen[True]
    assert 0 < np.count_nonzero(forward) < forward.size
    np.testing.assert_array_equal(forward, replay)
    dropout = model.drop[0]
    assert isinstance(dropout, rm.ReplayableDropout)
    assert (dropout.region_runs, dropout.region_skips) == (1, 1)
    assert dropout.region_saved_bytes == shape[0] * shape[1]


@pytest.mark.parametrize(
    "cell", [nn.Dropout(p=0.0), nn.Dropout(keep_prob=1.0), nn.Dropout1d(p=0.0)]
)
def test_inactive_dropout_is_left_alone(cell):
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.UnreplayableDropoutWarning)
        model = rm.apply_activation_checkpointing(
            DropoutMiddle(cell), checkpoint_fn=lambda m: isinstance(m, DropoutMiddle)
        )
    assert type(model.drop) is type(cell)


def test_unwrap_and_exclusion_take_the_kept_mask_off():
    block = vit_block()
    rm.checkpoint_wrapper(block)
    drops = [block.attn.attn_drop, block.attn.proj_drop, block.mlp.drop]
    classes = [type(d) for d in vit_block().cells_and_names()]
    assert all(isinstance(d, rm.ReplayableDropout) for d in drops)
    assert "ReplayableDropout" in repr(block)
    rm.unwrap(block)
    assert not any(isinstance(d, rm.ReplayableDropout) for d in drops)
    assert [type(d) for d in block.cells_and_names()] == classes
    # excluded by hand after wrapping: it runs once, its mask and output are kept
    rm.checkpoint_wrapper(block)
    block.mlp.drop = rm.checkpoint_exclude_wrapper(block.mlp.drop)
    assert isinstance(block.mlp.drop, rm.ExcludeWrapper)
    assert not isinstance(block.mlp.drop, rm.ReplayableDropout)


def test_checkpoint_of_a_cell_makes_its_dropout_replayable(seeded):
    ref, block = twins(lambda: DropoutMiddle(nn.Dropout(p=0.5)))
    x = tensor(4, 8)
    expected = seeded_grads(ref, ref.trainable_params(), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.UnreplayableDropoutWarning)
        actual = seeded_grads(lambda t: rm.checkpoint(block, t), block.trainable_params(), x)
    assert_same(expected, actual)
    assert isinstance(block.drop, rm.ReplayableDropout)


def test_ops_dropout_replays_exactly_in_recomputed_code(seeded):
    ref, model = twins(lambda: DropoutMiddle(lambda t: ops.dropout(t, p=0.5)))
    wrapped = rm.checkpoint_wrapper(model)
    x = tensor(4, 8)
    assert_same(
        seeded_grads(ref, ref.trainable_params(), x),
        seeded_grads(wrapped, model.trainable_params(), x),
    )


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="MindSpore 2.10 has no CPU kernel for DropoutExt (mint dropout)",
)
@pytest.mark.parametrize(
    "dropout",
    [lambda: mint.nn.Dropout(p=0.5), lambda: lambda t: mint.nn.functional.dropout(t, p=0.5)],
    ids=["mint.nn.Dropout", "mint.nn.functional.dropout"],
)
def test_mint_dropout_replays_exactly(seeded, recover_mindspore, dropout):
    """Canary: mint dropout draws from the generator recomp restores; test it once it runs."""
    ref, model = twins(lambda: DropoutMiddle(dropout()))
    wrapped = rm.checkpoint_wrapper(model)
    x = tensor(4, 8)
    expected = seeded_grads(ref, ref.trainable_params(), x)
    assert_same(expected, seeded_grads(wrapped, model.trainable_params(), x))


# --------------------------------------------------------------------------- compiled graphs


class Holder(nn.Cell):
    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def construct(self, x):
        return self.inner(x) * 2


WRAPPERS = {
    "checkpoint_wrapper": lambda: rm.checkpoint_wrapper(nn.Dense(4, 4)),
    "checkpoint_exclude_wrapper": lambda: rm.checkpoint_exclude_wrapper(nn.Dense(4, 4)),
}


def graph_mode_call(cell, x):
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        return cell(x)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.mark.parametrize("api", list(WRAPPERS))
def test_graph_mode_call_of_a_wrapper_raises_recomp_error_before_compiling(
    tmp_path, monkeypatch, recover_mindspore, api
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(recomp.RecompError, match=rf"recomp.mindspore.{api} needs PyNative"):
        graph_mode_call(WRAPPERS[api](), tensor(2, 4))
    assert not list(tmp_path.rglob("analyze_fail.ir"))


@pytest.mark.parametrize("api", list(WRAPPERS))
@pytest.mark.parametrize("how", ["graph_mode", "jit", "jit_construct"])
def test_compiled_model_holding_a_wrapper_raises_recomp_error(
    tmp_path, monkeypatch, recover_mindspore, api, how
):
    """MindSpore analyses the graph when it meets the wrapper, and writes its
    rank_0/om/analyze_fail.ir for any failure there; the message is recomp's."""
    monkeypatch.chdir(tmp_path)
    model = Holder(WRAPPERS[api]())
    x = tensor(2, 4)
    with pytest.raises(recomp.RecompError, match="PYNATIVE_MODE"):
        if how == "graph_mode":
            graph_mode_call(model, x)
        elif how == "jit":
            ms.jit(model.construct)(x)
        else:

            class Compiled(nn.Cell):
                def __init__(self) -> None:
                    super().__init__()
                    self.model = model

                @ms.jit
                def construct(self, t):
                    return self.model(t)

            Compiled()(x)


def test_pynative_call_after_a_compile_attempt_works(tmp_path, monkeypatch, recover_mindspore):
    monkeypatch.chdir(tmp_path)
    dense = nn.Dense(4, 4)
    ref = nn.Dense(4, 4)
    copy_params(dense, ref)
    wrapped = rm.checkpoint_wrapper(dense)
    with pytest.raises(recomp.RecompError):
        graph_mode_call(Holder(wrapped), tensor(2, 4))
    assert_same(
        grads(ref, ref.trainable_params(), tensor(2, 4)),
        grads(wrapped, dense.trainable_params(), tensor(2, 4)),
    )


# --------------------------------------------------------------------------- item assignment


class SetItemAfterRegion(nn.Cell):
    def __init__(self, region_op, computed_input: bool) -> None:
        super().__init__()
        self.region = nn.SequentialCell([nn.Dense(8, 8), region_op])
        self.out = nn.Dense(8, 8)
        self.computed_input = computed_input

    def construct(self, x):
        h = self.region(ops.sin(x) if self.computed_input else x)
        h[:, 0] = 0
        h[1:, 2:4] = h[1:, 2:4] * 3
        return self.out(ops.tanh(h)) + h


@pytest.mark.parametrize("region_op", [nn.Identity, nn.Tanh], ids=["keeps_input", "keeps_output"])
@pytest.mark.parametrize("computed_input", [False, True])
def test_item_assignment_on_an_excluded_regions_output(region_op, computed_input):
    ref, model = twins(lambda: SetItemAfterRegion(region_op(), computed_input))
    model.region = rm.checkpoint_exclude_wrapper(model.region, name="region")
    wrapped = rm.checkpoint_wrapper(model)
    x = tensor(4, 8)
    assert_same(grads(ref, ref.trainable_params(), x), grads(wrapped, model.trainable_params(), x))
    assert (model.region.region_runs, model.region.region_skips) == (1, 1)


# --------------------------------------------------------------------------- KV caches


class ListCache:
    """The shape of mindnlp's DynamicCache: per-layer lists of keys, appended to by layer."""

    def __init__(self) -> None:
        self.keys: list = []

    def update(self, key, layer_idx: int):
        if len(self.keys) <= layer_idx:
            self.keys.append(key)
        else:
            self.keys[layer_idx] = ops.cat([self.keys[layer_idx], key], axis=1)
        return self.keys[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if len(self.keys) <= layer_idx else int(self.keys[layer_idx].shape[1])


class CachingAttention(nn.Cell):
    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.key = nn.Dense(8, 8)
        self.value = nn.Dense(8, 8)

    def construct(self, x, past_key_value=None):
        k = self.key(x)
        if past_key_value is not None:
            k = past_key_value.update(k, self.layer_idx)
        scores = ops.softmax(ops.matmul(x, k.swapaxes(1, 2)), axis=-1)
        return ops.matmul(scores, self.value(x))


class CachingLayer(nn.Cell):
    def __init__(self, layer_idx: int = 0) -> None:
        super().__init__()
        self.attn = CachingAttention(layer_idx)
        self.mlp = nn.Dense(8, 8)

    def construct(self, x, past_key_value=None, use_cache=False):
        h = x + self.attn(x, past_key_value if use_cache else None)
        return h + ops.tanh(self.mlp(h))


def cache_step(layer, cache, use_cache=True):
    x = tensor(2, 3, 8)
    params = layer.trainable_params()
    return ms.grad(lambda t: layer(t, past_key_value=cache, use_cache=use_cache).sum(), 0, params)(
        x
    )


def test_bare_recompute_writes_the_cache_twice(recover_mindspore):
    layer = CachingLayer()
    layer.set_train()
    cache = ListCache()
    x = tensor(2, 3, 8)
    # the replay appends the same 3 positions again, and then fails on the longer keys
    with pytest.raises(RuntimeError, match="MatMul"):
        ms.grad(
            lambda t: ms.recompute(
                layer, t, past_key_value=cache, use_cache=True, use_reentrant=False
            ).sum(),
            0,
        )(x)
    assert cache.get_seq_length() == 6


def test_checkpoint_turns_the_cache_off_in_training_with_a_warning():
    ref, layer = twins(CachingLayer)
    wrapped = rm.checkpoint_wrapper(layer)
    cache = ListCache()
    with pytest.warns(UserWarning, match=r"KV cache is turned off \(use_cache=False"):
        actual = cache_step(wrapped, cache)
    assert cache.get_seq_length() == 0
    expected = cache_step(ref, None, use_cache=False)
    assert_same(
        [expected[0].asnumpy(), *(g.asnumpy() for g in expected[1])],
        [actual[0].asnumpy(), *(g.asnumpy() for g in actual[1])],
    )


def test_excluded_attention_writes_the_cache_once_and_keeps_it():
    ref, layer = twins(CachingLayer)
    layer.attn = rm.checkpoint_exclude_wrapper(layer.attn)
    wrapped = rm.checkpoint_wrapper(layer)
    cache, ref_cache = ListCache(), ListCache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        actual = cache_step(wrapped, cache)
    expected = cache_step(ref, ref_cache)
    assert cache.get_seq_length() == ref_cache.get_seq_length() == 3
    assert np.array_equal(cache.keys[0].asnumpy(), ref_cache.keys[0].asnumpy())
    assert_same(
        [expected[0].asnumpy(), *(g.asnumpy() for g in expected[1])],
        [actual[0].asnumpy(), *(g.asnumpy() for g in actual[1])],
    )
    assert (layer.attn.region_runs, layer.attn.region_skips) == (1, 1)


def test_a_cache_holding_a_prefix_is_an_error(recover_mindspore):
    layer = CachingLayer()
    layer.set_train()
    cache = ListCache()
    cache.update(tensor(2, 1, 8), 0)
    with pytest.raises(recomp.RecompError, match="already holds entries"):
        cache_step(rm.checkpoint_wrapper(layer), cache)
    assert cache.get_seq_length() == 1


def test_cache_is_left_alone_in_eval_mode_and_without_grad():
    layer = CachingLayer()  # eval mode: no replay to protect against
    cache = ListCache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rm.checkpoint_wrapper(layer)(tensor(2, 3, 8), past_key_value=cache, use_cache=True)
    assert cache.get_seq_length() == 3


class AttributeCache(nn.Cell):
    """A cache recomp cannot see (an attribute): the write is guarded by is_recomputing()."""

    def __init__(self, guarded: bool) -> None:
        super().__init__()
        self.dense = nn.Dense(8, 8)
        self.guarded = guarded
        self.cache: list = []

    def construct(self, x):
        h = self.dense(x)
        if not (self.guarded and recomp.is_recomputing()):
            self.cache.append(h)
        return ops.tanh(h)


@pytest.mark.parametrize("guarded", [False, True])
def test_is_recomputing_guards_a_cache_write(guarded):
    cell = AttributeCache(guarded)
    wrapped = rm.checkpoint_wrapper(cell)
    grads(wrapped, cell.trainable_params(), tensor(2, 8))
    assert len(cell.cache) == (1 if guarded else 2)


# --------------------------------------------------------------------------- mindcv models


def small_vit():
    return mindcv_vit.VisionTransformer(
        image_size=16,
        patch_size=8,
        embed_dim=16,
        depth=2,
        num_heads=2,
        num_classes=3,
        drop_rate=0.1,
        proj_drop_rate=0.1,
        attn_drop_rate=0.1,
        drop_path_rate=0.2,
    )


@pytest.mark.parametrize("exclude", ["attention", "nothing"])
def test_mindcv_vit_gradients_equal_unwrapped(seeded, exclude):
    ref, model = twins(small_vit)
    exclude_fn = (lambda m: isinstance(m, mindcv_vit.Attention)) if exclude == "attention" else None
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.UnreplayableDropoutWarning)
        rm.apply_activation_checkpointing(
            model, checkpoint_fn=lambda m: isinstance(m, mindcv_vit.Block), exclude_fn=exclude_fn
        )
    x = tensor(2, 3, 16, 16)
    expected = seeded_grads(ref, ref.trainable_params(), x)
    assert_same(expected, seeded_grads(model, model.trainable_params(), x))
    for block in model.blocks:
        assert isinstance(block, rm.CheckpointWrapper)
        regions = (
            [block.attn]
            if exclude == "attention"
            else [
                block.attn.attn_drop,
                block.attn.proj_drop,
            ]
        )
        assert [(r.region_runs, r.region_skips) for r in regions] == [(1, 1)] * len(regions)
        if exclude == "nothing":
            assert all(isinstance(r, rm.ReplayableDropout) for r in regions)
        # Mlp applies its one nn.Dropout twice
        assert (block.mlp.drop.region_runs, block.mlp.drop.region_skips) == (2, 2)
    # the second block has drop_path > 0: its DropPath's own nn.Dropout keeps its mask too
    assert model.blocks[1].drop_path1.dropout.region_runs == 1


def small_pit(drop: float = 0.1):
    mindcv_pit = pytest.importorskip("mindcv.models.pit")
    return mindcv_pit.PoolingTransformer(
        image_size=32,
        patch_size=4,
        stride=2,
        base_dims=[16, 16],
        depth=[2, 2],
        heads=[2, 4],
        mlp_ratio=4.0,
        num_classes=10,
        drop_rate=drop,
        attn_drop_rate=drop,
        drop_path_rate=drop,
    )


def test_mindcv_pit_checkpointed_keeps_a_fraction_of_its_activations(seeded):
    """Every block checkpointed, dropout on: exact, and what is kept for backward is
    well under a third of the unwrapped model's (it was two thirds while the dropout
    cells were excluded and kept their outputs)."""
    mindcv_pit = pytest.importorskip("mindcv.models.pit")
    ref, model = twins(small_pit)
    x = tensor(4, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.UnreplayableDropoutWarning)
        rm.apply_activation_checkpointing(model, checkpoint_fn=mindcv_pit.Block)
    expected = seeded_grads(ref, ref.trainable_params(), x)
    assert_same(expected, seeded_grads(model, model.trainable_params(), x))
    unwrapped, unwrapped_peak = held_for_backward(ref, x)
    checkpointed, checkpointed_peak = held_for_backward(model, x)
    assert checkpointed < unwrapped / 3, (checkpointed, unwrapped)
    assert checkpointed_peak < unwrapped_peak


def small_resnet():
    return mindcv_resnet.ResNet(mindcv_resnet.BasicBlock, [1, 1, 1, 1], num_classes=3)


def test_mindcv_resnet_gradients_and_running_statistics_equal_unwrapped():
    """3x3 convolutions and BatchNorms excluded: gradients equal, and the running
    statistics move once per step, as without checkpoints (``out += identity``
    follows bn2)."""
    ref, model = twins(small_resnet)
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        for j in range(len(stage)):
            down_sample = stage[j].down_sample
            if down_sample is not None:  # a SequentialCell: its children replaced by index
                down_sample[1] = rm.checkpoint_exclude_wrapper(down_sample[1])
            stage[j] = rm.apply_activation_checkpointing(
                stage[j],
                checkpoint_fn=lambda m: isinstance(m, mindcv_resnet.BasicBlock),
                exclude_fn=lambda m: (
                    isinstance(m, nn.BatchNorm2d)
                    or (isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3))
                ),
            )
    x = tensor(2, 3, 8, 8)  # two samples: layer4's 1x1 maps still have a batch variance
    assert_same(grads(ref, ref.trainable_params(), x), grads(model, model.trainable_params(), x))
    assert_same(moving_stats(ref), moving_stats(model))
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        block = stage[0]
        assert isinstance(block, rm.CheckpointWrapper)
        regions = (block.conv1, block.bn1, block.conv2, block.bn2)
        assert [(r.region_runs, r.region_skips) for r in regions] == [(1, 1)] * 4


class ConvBN(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def construct(self, x):
        return ops.tanh(self.bn(self.conv(x)))


def moving_stats(cell):
    return [p.asnumpy() for p in cell.get_parameters() if "moving" in p.name]


@pytest.mark.parametrize("exclude_bn", [False, True])
def test_batchnorm_running_statistics(exclude_bn):
    """The replay runs BatchNorm again, but its running statistics move once, recomputed
    (the replay's update is undone) or excluded."""
    ref, model = twins(ConvBN)
    if exclude_bn:
        model.bn = rm.checkpoint_exclude_wrapper(model.bn)
    wrapped = rm.checkpoint_wrapper(model)
    x = tensor(2, 2, 5, 5)
    assert_same(grads(ref, ref.trainable_params(), x), grads(wrapped, model.trainable_params(), x))
    assert not differs(moving_stats(ref), moving_stats(model))


class SequentialMlp(nn.Cell):
    """The common zoo pattern: a dropout as a child of an nn.SequentialCell."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((8,))
        self.mlp = nn.SequentialCell(
            [nn.Dense(8, 16), nn.GELU(), nn.Dropout(p=0.5), nn.Dense(16, 8)]
        )

    def construct(self, x):
        return x + self.mlp(self.norm(x))


def test_dropout_inside_a_sequential_cell_replays_its_mask(seeded):
    ref, model = twins(SequentialMlp)
    model = rm.apply_activation_checkpointing(
        model, checkpoint_fn=lambda m: isinstance(m, SequentialMlp)
    )
    x = tensor(4, 8)
    expected = seeded_grads(ref, ref.trainable_params(), x)
    assert_same(expected, seeded_grads(model, model.trainable_params(), x))
    assert isinstance(model.mlp[2], rm.ReplayableDropout)
    assert (model.mlp[2].region_runs, model.mlp[2].region_skips) == (1, 1)


def test_private_mindspore_api_used_here_is_present():
    """Fails when MindSpore renames what recomp.mindspore._compat looks up."""
    from recomp.mindspore import _compat

    assert issubclass(_compat.stop_recomputation_error(), Exception)
    assert len(_compat.graph_parser_lookups()) == 2


def test_mindcv_sknet_blocks_wrapped_by_item_assignment_keep_parameter_names():
    """Each of this SKNet's stages holds one block, whose parameter paths repeat the
    index 0 (``layer1.0.conv1.paths.0.features.0.weight``): item assignment back into
    the stage and into the branch's SequentialCell keeps every name."""
    mindcv_sknet = pytest.importorskip("mindcv.models.sknet")
    model = mindcv_sknet.SKNet(mindcv_sknet.SelectiveKernelBasic, [1, 1, 1, 1], num_classes=3)
    before = [p.name for p in model.get_parameters()]
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        for path in stage[0].conv1.paths:
            path.features[1] = rm.checkpoint_exclude_wrapper(path.features[1])  # BatchNorm
        stage[0] = rm.checkpoint_wrapper(stage[0])
    after = [p.name for p in model.get_parameters()]
    assert after == before
    assert len(set(after)) == len(after)
    nn.Momentum(model.trainable_params(), learning_rate=0.1, momentum=0.9)
