"""What real code returns from excluded regions and does with it afterwards, on both
frameworks (the ``fw`` fixture, ``tests/support/frameworks.py``).

A model zoo's output container comes back as its own type; a region that changes its
recomputed input in place, and a region whose output later code changes in place
(``copy_output``), give the gradients and running statistics of the unwrapped model.
The containers every framework has are in ``test_regions.py``; PyTorch's own
(``torch.return_types``) and what only PyTorch is tested on are in
``tests/torch/test_outputs.py``.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

import recomp
from frameworks import (
    assert_region_changing_its_input_matches,
    assert_region_output_type,
    assert_same,
)

# name -> (the region's output from two tensors, given the adapter; read back into one tensor)
CONTAINERS = {
    # transformers' BaseModelOutput on PyTorch; an OrderedDict subclass, as mindnlp's, on
    # MindSpore
    "ModelOutput": (
        lambda fw, a, b: fw.model_output(last_hidden_state=a, hidden_states=(b,)),
        lambda o: o.last_hidden_state * o.hidden_states[0],
    ),
    "defaultdict": (
        lambda fw, a, b: defaultdict(list, x=a, y=b),
        lambda o: o["x"] * o["y"] + len(o["missing"]),
    ),
}


@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_region_output_comes_back_as_the_same_type(fw, kind):
    build, read = CONTAINERS[kind]
    assert_region_output_type(fw, lambda a, b: build(fw, a, b), read, kind)


# --------------------------------------------------------------------------- in-place changes


def test_region_that_changes_its_recomputed_input_in_place(fw):
    """The excluded activation writes exp(h) into h, and the code after it reads h."""
    exp = fw.layer_class("Exp", lambda layer, h: fw.in_place("exp", h))
    assert_region_changing_its_input_matches(fw, exp, reads_input_after=True)


def resnet_tail(fw, copy_output=None):
    """(reference, model): a BatchNorm, then the residual add (of a dense layer's output)
    and the ReLU that ResNet's code does in place on the BatchNorm's output. The
    model's BatchNorm is excluded with ``copy_output`` (not at all for None), the model
    checkpointed.

    The BatchNorm's input is the checkpoint's input: MindSpore 2.10 itself rejects
    ``copy_`` on the output of a region whose input was computed inside the checkpoint
    (tests/mindspore/test_guarantees.py, 3.). That case is tested on PyTorch with
    torchvision's ResNet (tests/torch/test_outputs.py)."""

    def body(layer, x):
        out = layer.bn(x)
        fw.in_place("add", out, layer.lin(x))
        return fw.in_place("relu", out)

    tail = fw.layer_class("ResNetTail", body)
    ref, model = fw.twins(lambda: fw.train(tail(lin=fw.dense(4, 4), bn=fw.batch_norm(4))))
    if copy_output is not None:
        model.bn = fw.api.checkpoint_exclude_wrapper(model.bn, copy_output=copy_output)
    return ref, fw.api.checkpoint_wrapper(model)


def test_output_changed_in_place_after_the_region_names_copy_output(fw, recover):
    _, model = resnet_tail(fw, copy_output=False)
    with pytest.raises(recomp.CachedValueMutatedError, match="copy_output=True"):
        fw.grads(model, fw.tensor(5, 4))


def test_copy_output_gives_the_unwrapped_gradients_and_statistics(fw):
    ref, model = resnet_tail(fw, copy_output=True)
    initial = fw.statistics(model.bn)
    x = fw.tensor(5, 4)
    for _ in range(2):
        expected_loss, expected = fw.grads(ref, x)
        loss, got = fw.grads(model, x)
        assert_same([expected_loss], [loss])
        assert_same(expected, got)
    # BatchNorm ran once per step: its running statistics are the unwrapped model's
    # (on PyTorch num_batches_tracked too, 2 as the reference's).
    expected, got = fw.statistics(ref.bn), fw.statistics(model.bn)
    assert expected.keys() == got.keys() == initial.keys()
    for name, value in expected.items():
        assert_same([value], [got[name]])
        assert not (value == initial[name]).all(), f"{name} did not move"
    assert (model.bn.region_runs, model.bn.region_skips) == (2, 2)


def test_a_replayed_batchnorm_updates_its_statistics_once(fw):
    """Not excluded, the BatchNorm runs again in the replay: its second update is undone."""
    ref, model = resnet_tail(fw)
    x = fw.tensor(5, 4)
    fw.grads(ref, x)
    fw.grads(model, x)
    expected, got = fw.statistics(ref.bn), fw.statistics(model.bn)
    assert expected.keys() == got.keys() and got
    for name, value in expected.items():
        assert_same([value], [got[name]])
