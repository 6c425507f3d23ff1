"""No reference cycle holds a tensor after a training step, on either framework.

Run with the garbage collector off: whatever a step leaves in a cycle would stay
until the collector runs (on a device, the difference between fitting and running
out of memory). The collector is then asked what it would free.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest


def tensors_left_in_cycles(step: Callable[[], Any], is_tensor: Callable[[Any], bool]) -> int:
    step()  # warm-up: caches, lazily built state
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            step()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        return sum(1 for obj in gc.garbage if is_tensor(obj))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_the_check_sees_a_tensor_held_by_a_cycle():
    torch = pytest.importorskip("torch")

    def leaky_step():
        holder: dict[str, Any] = {"t": torch.ones(4)}
        holder["self"] = holder

    assert tensors_left_in_cycles(leaky_step, lambda o: isinstance(o, torch.Tensor)) == 3


def test_torch_training_step_leaves_no_tensor_in_a_cycle():
    torch = pytest.importorskip("torch")
    import recomp.torch as rt
    from torch_models import Block, stack

    model = stack(3)
    rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, Block),
        exclude_fn=lambda m: m is not None and isinstance(m, torch.nn.Linear) and m.out_features == 8,
    )
    x = torch.randn(2, 5, 8, requires_grad=True)

    def step():
        model(x).pow(2).sum().backward()
        model.zero_grad(set_to_none=True)

    assert tensors_left_in_cycles(step, lambda o: isinstance(o, torch.Tensor)) == 0


def test_mindspore_training_step_leaves_no_tensor_in_a_cycle():
    ms = pytest.importorskip("mindspore")
    import recomp.mindspore as rm
    from ms_models import Block, Stack, tensor

    model = Stack(3)
    rm.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda c: isinstance(c, Block),
        exclude_fn=lambda c: c is not None and isinstance(c, ms.nn.Dense) and c.out_channels == 8,
    )
    x = tensor(2, 5, 8)
    params = model.trainable_params()
    grad_fn = ms.grad(lambda t: (model(t) ** 2).sum(), None, params)

    def step():
        grads = grad_fn(x)
        assert len(grads) == len(params)

    assert tensors_left_in_cycles(step, lambda o: isinstance(o, ms.Tensor)) == 0


def test_torch_split_backward_leaves_no_tensor_in_a_cycle():
    """An input-gradient pass, then a weight pass over the retained graph (as zero-bubble
    pipeline schedules run it): what recomp keeps between the passes goes with the graph."""
    torch = pytest.importorskip("torch")
    import recomp.torch as rt
    from torch_models import Block, stack

    model = stack(3)
    rt.apply_activation_checkpointing(model, checkpoint_fn=lambda m: isinstance(m, Block))
    x = torch.randn(2, 5, 8, requires_grad=True)

    def step():
        loss = model(x).pow(2).sum()
        torch.autograd.grad(loss, [x], retain_graph=True)
        torch.autograd.grad(loss, list(model.parameters()))

    assert tensors_left_in_cycles(step, lambda o: isinstance(o, torch.Tensor)) == 0


def test_mindspore_dropout_with_kept_masks_leaves_no_tensor_in_a_cycle():
    ms = pytest.importorskip("mindspore")
    vit = pytest.importorskip("mindcv.models.vit")
    import recomp.mindspore as rm
    from ms_models import tensor

    blocks = ms.nn.SequentialCell(
        [vit.Block(dim=16, num_heads=2, proj_drop=0.1, attn_drop=0.1, drop_path=0.1)] * 2
    )
    blocks.set_train()
    rm.apply_activation_checkpointing(blocks, checkpoint_fn=vit.Block)
    assert isinstance(blocks[0].attn.attn_drop, rm.ReplayableDropout)
    x = tensor(2, 5, 16)
    grad_fn = ms.grad(lambda t: (blocks(t) ** 2).sum(), None, blocks.trainable_params())
    assert tensors_left_in_cycles(lambda: grad_fn(x), lambda o: isinstance(o, ms.Tensor)) == 0


@pytest.mark.parametrize("how", ["swap_wrapper", "swap_inputs", "must_swap_policy"])
def test_torch_swap_step_leaves_no_tensor_in_a_cycle(how, monkeypatch):
    """Tensors copied out to the host and back (the offloader's host-copy mode on CPU) go
    with the step's graph, as the tensors a plain checkpoint keeps do."""
    torch = pytest.importorskip("torch")
    import recomp.torch as rt
    from recomp.torch import CheckpointPolicy
    from recomp.torch._offload import ENV_HOST_COPY, default_offloader
    from torch_models import Block, stack

    monkeypatch.setenv(ENV_HOST_COPY, "1")

    def swap_linear_outputs(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.addmm.default:
            return CheckpointPolicy.MUST_SWAP
        return CheckpointPolicy.PREFER_RECOMPUTE

    model = stack(3)
    for i, block in enumerate(model):
        assert isinstance(block, Block)
        if how == "swap_wrapper":
            rt.swap_wrapper(block)
        elif how == "swap_inputs":
            model[i] = rt.checkpoint_wrapper(block, swap_inputs=True)
        else:
            model[i] = rt.checkpoint_wrapper(block, policy_fn=swap_linear_outputs)
    x = torch.randn(2, 5, 8, requires_grad=True)
    offloader = default_offloader()
    moved = []
    monkeypatch.setattr(offloader, "group_opened", moved.append)

    def step():
        model(x).pow(2).sum().backward()
        model.zero_grad(set_to_none=True)
        offloader.synchronize()

    assert tensors_left_in_cycles(step, lambda o: isinstance(o, torch.Tensor)) == 0
    assert moved and all(g.offloaded_bytes > 0 for g in moved)  # the swap did run
