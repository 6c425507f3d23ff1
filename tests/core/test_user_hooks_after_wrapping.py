"""Hooks the user registers on a model after recomp wrapped it run as usual: recomp's
one-shot check that the wrappers are reached must not disturb the framework's loop
over the model's hooks (MindSpore iterates them without a copy)."""

from __future__ import annotations

import warnings

import pytest


def _mindspore():
    pytest.importorskip("mindspore")
    import recomp.mindspore as rm
    from ms_models import Block, Stack, tensor

    return rm, Block, lambda: Stack(2), lambda: tensor(2, 5, 8)


def _torch():
    torch = pytest.importorskip("torch")
    import recomp.torch as rt
    from torch_models import Block, stack

    return rt, Block, lambda: stack(2), lambda: torch.randn(2, 5, 8)


FRAMEWORKS = {"mindspore": _mindspore, "torch": _torch}


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_forward_hook_registered_after_wrapping_runs(framework):
    api, block, make, data = FRAMEWORKS[framework]()
    model = make()
    api.apply_activation_checkpointing(model, checkpoint_fn=lambda m: isinstance(m, block))
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append(type(out).__name__))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the wrappers are reached: no warning either
        model(data())
        model(data())
    assert len(seen) == 2


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_apply_unwrap_apply_before_any_forward(framework):
    api, block, make, data = FRAMEWORKS[framework]()
    model = make()
    api.apply_activation_checkpointing(model, checkpoint_fn=lambda m: isinstance(m, block))
    api.unwrap(model)
    api.apply_activation_checkpointing(model, checkpoint_fn=lambda m: isinstance(m, block))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # also: the second wrapping is reached
        model(data())
