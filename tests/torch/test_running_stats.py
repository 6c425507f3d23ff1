"""BatchNorm inside a checkpoint, on torchvision's ResNet: the replay does not update
the running statistics again.

A model trained with recomp ends up with the running statistics (and
``num_batches_tracked``) of the model trained without it, bit for bit, as it does
for the gradients, without excluding its BatchNorms; also with ``retain_graph``
backwards. The same on a small model of both frameworks, and a BatchNorm whose
statistics recomp cannot find, are tested in ``tests/core/test_running_stats.py``.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
models = pytest.importorskip("torchvision.models")

from torch import nn  # noqa: E402

import recomp  # noqa: E402
import recomp.torch as rt  # noqa: E402

BasicBlock = models.resnet.BasicBlock


def resnet_pair():
    torch.manual_seed(0)
    ref = models.resnet18(num_classes=10)
    return ref, copy.deepcopy(ref)


def train(model, steps, *, backwards=1, start=0):
    """``steps`` SGD steps on fixed batches (from batch ``start``); each step's gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    history = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 10, (2,), generator=g)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        for i in range(backwards):
            loss.backward(retain_graph=i + 1 < backwards)
        history.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return history


def assert_same_state(ref, model, ref_history, history):
    for step, (want, got) in enumerate(zip(ref_history, history)):
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"step {step}: gradient {i} differs"
    ref_buffers, buffers = dict(ref.named_buffers()), dict(model.named_buffers())
    assert ref_buffers.keys() == buffers.keys()
    for name, value in ref_buffers.items():
        assert torch.equal(value, buffers[name]), (
            f"{name}: {value.flatten()[:3]} vs {buffers[name].flatten()[:3]}"
        )
    assert int(model.bn1.num_batches_tracked) == len(history)  # a BatchNorm outside every block
    assert int(model.layer1[0].bn1.num_batches_tracked) == len(history)


@pytest.mark.parametrize(
    "options",
    [{}, {"early_stop": False}, {"preserve_rng_state": False}],
    ids=["default", "no_early_stop", "no_rng_state"],
)
def test_resnet18_trains_to_the_unwrapped_state_with_batchnorms_recomputed(options):
    ref, model = resnet_pair()
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.RunningStatisticsWarning)
        rt.apply_activation_checkpointing(model, checkpoint_fn=BasicBlock, **options)
    # From the third step on, the blocks are read from layouts that copy their statistics
    # (NOTE [ Calls after the first: layouts ] in recomp._module_state): no walk.
    ref_history, history = train(ref, 4), train(model, 3)
    assert _walks(lambda: history.extend(train(model, 1, start=3))) == 0
    assert_same_state(ref, model, ref_history, history)


def _walks(run) -> int:
    from call_counts import calls_of

    return sum(n for (_, qual), n in calls_of(run).items() if qual == "_replayed_modules")


def test_retain_graph_backward_twice_restores_after_each_replay():
    ref, model = resnet_pair()
    rt.apply_activation_checkpointing(model, checkpoint_fn=BasicBlock)
    assert_same_state(ref, model, train(ref, 4, backwards=2), train(model, 4, backwards=2))


def test_with_convolutions_excluded_and_a_plain_checkpoint_call():
    """Exclusions inside the block, and recomp.torch.checkpoint called on a module."""
    ref, model = resnet_pair()
    rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=BasicBlock,
        exclude_fn=lambda m: isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3),
    )
    assert model.layer1[0].conv1.region_runs == 0
    ref_history, history = train(ref, 2), train(model, 2)
    assert (model.layer1[0].conv1.region_runs, model.layer1[0].conv1.region_skips) == (2, 2)
    assert_same_state(ref, model, ref_history, history)
    # The functional form, given the module: the same.
    torch.manual_seed(1)
    block = BasicBlock(8, 8)
    plain = copy.deepcopy(block)
    x = torch.randn(2, 8, 6, 6)
    rt.checkpoint(block, x).sum().backward()
    plain(x).sum().backward()
    for a, b in zip(plain.buffers(), block.buffers()):
        assert torch.equal(a, b)
