"""BatchNorm inside a checkpoint, on both frameworks (the ``fw`` fixture,
``tests/support/frameworks.py``): the replay does not update the running statistics again.

A model trained with recomp ends with the running statistics of the model trained
without it, bit for bit, as it does with the gradients, without excluding its
BatchNorms; a BatchNorm-like layer whose statistics recomp cannot find is named when
the checkpoint wrapper is applied. The model-zoo checks (torchvision's and mindcv's
ResNet) and what only one framework has (``retain_graph``, mixed precision) are in
``tests/torch/test_running_stats.py`` and ``tests/mindspore/test_running_stats.py``.
"""

from __future__ import annotations

import warnings

import pytest

import recomp
from frameworks import assert_same


def bn_net(fw):
    """(reference, model): a dense stem with a BatchNorm outside every block, then two
    residual blocks (dense, BatchNorm, ReLU, dense), then a dense head; and the block class."""
    ops = fw.ops
    block = fw.layer_class("Block", lambda b, x: x + b.out(ops.relu(b.bn(b.lin(x)))))

    def body(net, x):
        h = ops.relu(net.bn(net.stem(x)))
        for layer in net.layers:
            h = layer(h)
        return net.head(h)

    net = fw.layer_class("BatchNormNet", body)

    def build():
        blocks = [
            block(lin=fw.dense(8, 8), bn=fw.batch_norm(8), out=fw.dense(8, 8)) for _ in range(2)
        ]
        return fw.train(
            net(
                stem=fw.dense(4, 8),
                bn=fw.batch_norm(8),
                layers=fw.layer_list(blocks),
                head=fw.dense(8, 3),
            )
        )

    ref, model = fw.twins(build)
    return ref, model, block


@pytest.mark.parametrize(
    "options",
    [{}, {"early_stop": True}, {"early_stop": False}, {"rng_state": False}],
    ids=["default", "early_stop", "no_early_stop", "no_rng_state"],
)
def test_a_model_trained_with_recomp_ends_with_the_unwrapped_running_statistics(fw, options):
    ref, model, block = bn_net(fw)
    if "rng_state" in options:  # preserve_rng_state on PyTorch, save_rng_state on MindSpore
        options = {fw.rng_state_option: options["rng_state"]}
    initial = fw.statistics(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.RunningStatisticsWarning)
        fw.api.apply_activation_checkpointing(model, checkpoint_fn=block, **options)
    assert [name for name, layer in fw.named_layers(model) if isinstance(layer, block)] == [
        "layers.0",
        "layers.1",
    ]
    batches = [fw.tensor(6, 4, seed=step) for step in range(3)]
    ref_history, history = fw.fit(ref, batches), fw.fit(model, batches)
    for step, (want, got) in enumerate(zip(ref_history, history)):
        assert len(want) == len(got) == len(fw.parameters(model)), step
        assert_same(want, got)
    expected, got = fw.statistics(ref), fw.statistics(model)
    assert expected.keys() == got.keys() == initial.keys()
    # the stem's BatchNorm and the two blocks': moving mean and variance each
    assert sum(fw.running_mean in name for name in got) == 3
    for name, value in expected.items():
        assert_same([value], [got[name]])
        assert not (value == initial[name]).all(), f"{name} did not move"


def ema_block(fw):
    """A block whose BatchNorm-like ``bn1`` keeps its statistics under a name of its own."""
    block = fw.layer_class("Block", lambda b, x: b.out(fw.ops.relu(b.bn1(b.conv1(x)))))
    return fw.train(block(conv1=fw.dense(8, 8), bn1=fw.ema_batch_norm(8), out=fw.dense(8, 8)))


def test_a_batchnorm_whose_statistics_recomp_cannot_find_is_named_at_wrap_time(fw):
    block = ema_block(fw)
    with pytest.warns(
        recomp.RunningStatisticsWarning,
        match=rf"bn1 \(EmaBatchNorm: no tensor attribute named {fw.running_mean}",
    ):
        fw.api.checkpoint_wrapper(block)
    x = fw.tensor(2, 8)
    assert block(x).shape == x.shape
    fw.api.unwrap(block)
    # Excluded, as the message says, it runs once and nothing is reported.
    ema = type(block.bn1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.RunningStatisticsWarning)
        fw.api.apply_activation_checkpointing(
            block, checkpoint_fn=type(block), exclude_fn=ema, copy_output_fn=ema
        )
    fw.grads(block, x)
    assert (block.bn1.region_runs, block.bn1.region_skips) == (1, 1)
