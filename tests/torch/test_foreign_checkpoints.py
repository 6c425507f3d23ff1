"""A plain PyTorch checkpoint around what recomp wrapped is refused (``DoubleCheckpointError``).

PyTorch's ``checkpoint_wrapper`` (what Lightning's ``FSDPStrategy(activation_checkpointing_policy=...)``
and Accelerate's FSDP plugin apply) taking a module that recomp checkpoints, or one that
holds modules recomp checkpoints or excludes, is refused as it takes it: nothing was
wrapped, no parameter name changed, the model trains as before. A recomp checkpoint whose
forward starts inside a plain ``torch.utils.checkpoint.checkpoint`` is refused there,
before recomp opened anything, with the plain checkpoint closed. What PyTorch's wrappers
do elsewhere is unchanged. The same in a Lightning run: ``tests/trainers/test_lightning.py``.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    offload_wrapper,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper as TorchCheckpointWrapper,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing as torch_apply,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper as torch_wrapper,
)

import recomp
import recomp.torch as rt
from torch_models import Block, assert_same_grads, exclude_attention, grads_of, stack, twin

SWITCH = "activation_checkpointing_policy"


def names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


def no_saved_tensor_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_checkpoint_wrapper_around_a_recomp_checkpoint_is_refused():
    ref = stack(2)
    model = exclude_attention(twin(ref))
    before = names(model)
    with pytest.raises(recomp.DoubleCheckpointError) as info:
        torch_wrapper(model[0])
    message = str(info.value)
    assert "checkpoint_wrapper is wrapping Block, which recomp checkpoints" in message
    assert SWITCH in message and "_checkpoint_wrapped_module." in message
    assert names(model) == before
    x = torch.randn(3, 4, 8)
    assert_same_grads(grads_of(ref, loss_fn, x)[1], grads_of(model, loss_fn, x)[1])
    assert [b.attn.region_runs for b in model] == [1, 1]


def test_apply_activation_checkpointing_stops_at_the_first_recomp_module():
    model = exclude_attention(stack(2))
    before = names(model)
    with pytest.raises(recomp.DoubleCheckpointError, match=SWITCH):
        torch_apply(model, check_fn=lambda m: isinstance(m, Block))
    assert names(model) == before
    assert not any(isinstance(m, TorchCheckpointWrapper) for m in model.modules())


@pytest.mark.parametrize(
    ("checkpoint", "found", "options"),
    [
        (True, "holds modules that recomp checkpoints (0, 1)", {}),
        (False, "holds modules that recomp excludes (0.attn, 1.attn)",
         {"checkpoint_impl": CheckpointImpl.REENTRANT}),
        (False, "holds modules that recomp excludes (0.attn, 1.attn)",
         {"checkpoint_fn": torch.utils.checkpoint.checkpoint}),
    ],
)
def test_checkpoint_wrapper_around_modules_holding_recomp_wrappers_is_refused(
    checkpoint, found, options
):
    model = exclude_attention(stack(2), checkpoint=checkpoint)
    pattern = re.escape(f"Sequential, which {found}")
    with pytest.raises(recomp.DoubleCheckpointError, match=pattern) as info:
        torch_wrapper(model, **options)
    if not checkpoint:
        assert "Leave checkpoint_impl and checkpoint_fn at their defaults" in str(info.value)


@pytest.mark.parametrize("offload", [False, True])
def test_pytorchs_default_wrapper_around_excluded_regions_checkpoints_with_recomp(offload):
    """What accelerate's FSDP2 activation checkpointing applies (``checkpoint_wrapper(layer,
    preserve_rng_state=False)``, inside ``offload_wrapper`` with its
    ``activation_checkpointing_offload``; Lightning's policy likewise) around blocks whose
    attention recomp excludes: PyTorch's checkpoint becomes recomp's, so the attention
    runs once per step while the rest of each block replays, and the gradients are
    those of the model without checkpointing."""
    ref = stack(2)
    model = exclude_attention(twin(ref), checkpoint=False)
    for i in range(len(model)):
        wrapped = torch_wrapper(model[i], preserve_rng_state=False)
        model[i] = offload_wrapper(wrapped) if offload else wrapped
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    mlp_runs = [0, 0]
    for i, b in enumerate(blocks):
        b.mlp[0].register_forward_hook(lambda *_, i=i: mlp_runs.__setitem__(i, mlp_runs[i] + 1))
    x = torch.randn(3, 4, 8, requires_grad=True)
    for step in (1, 2):
        _, expected = grads_of(ref, loss_fn, x)
        _, actual = grads_of(model, loss_fn, x)
        actual = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in actual.items()}
        assert_same_grads(expected, actual)
        assert [(b.attn.region_runs, b.attn.region_skips) for b in blocks] == [(step, step)] * 2
        assert mlp_runs == [2 * step, 2 * step]  # forward and replay: checkpointed


@pytest.mark.parametrize("how", ["checkpoint_wrapper", "apply_activation_checkpointing"])
def test_pytorchs_wrapper_given_recomps_checkpoint_keeps_the_exclusion(how):
    """``checkpoint_wrapper(block, checkpoint_fn=recomp.torch.checkpoint)`` around blocks
    whose attention recomp excludes checkpoints with recomp: not refused, the gradients
    are those of the model without checkpointing, and each step runs the attention once
    while the rest of the block replays."""
    ref = stack(2)
    model = exclude_attention(twin(ref), checkpoint=False)
    wrap = functools.partial(torch_wrapper, checkpoint_fn=rt.checkpoint)
    if how == "checkpoint_wrapper":
        for i in range(len(model)):
            model[i] = wrap(model[i])
    else:
        torch_apply(model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, Block))
    assert all(isinstance(m, TorchCheckpointWrapper) for m in model)
    blocks = [m._checkpoint_wrapped_module for m in model]
    mlp_runs = [0, 0]  # of the MLP's first linear (the replay stops before the MLP ends)
    for i, b in enumerate(blocks):
        b.mlp[0].register_forward_hook(lambda *_, i=i: mlp_runs.__setitem__(i, mlp_runs[i] + 1))
    x = torch.randn(3, 4, 8, requires_grad=True)
    for step in (1, 2):
        _, expected = grads_of(ref, loss_fn, x)
        _, actual = grads_of(model, loss_fn, x)
        actual = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in actual.items()}
        assert_same_grads(expected, actual)
        assert [(b.attn.region_runs, b.attn.region_skips) for b in blocks] == [(step, step)] * 2
        assert mlp_runs == [2 * step, 2 * step]  # forward and replay: the block is checkpointed


def test_other_wrappers_are_left_alone():
    # PyTorch's checkpoint on modules recomp did not wrap, and its offload wrapper
    # (not a checkpoint) around one it did.
    plain = torch_wrapper(nn.Linear(4, 4))
    assert isinstance(plain, TorchCheckpointWrapper)
    model = exclude_attention(stack(1))
    offloaded = offload_wrapper(model[0])
    x = torch.randn(2, 3, 8)
    loss_fn(offloaded(x)).backward()
    assert (model[0].attn.region_runs, model[0].attn.region_skips) == (1, 1)
    # After unwrap, nothing of recomp is left to protect.
    unwrapped = rt.unwrap(exclude_attention(stack(1)))
    assert isinstance(torch_wrapper(unwrapped[0]), TorchCheckpointWrapper)


def test_recomp_checkpoint_inside_a_plain_checkpoint_is_refused_in_the_forward():
    ref = stack(2)
    model = exclude_attention(twin(ref))
    x = torch.randn(3, 4, 8, requires_grad=True)
    with pytest.raises(recomp.DoubleCheckpointError) as info:
        torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    message = str(info.value)
    assert "recomp's checkpoint of Block.forward is running inside a plain PyTorch" in message
    assert SWITCH in message
    assert no_saved_tensor_hooks()  # the plain checkpoint was closed, recomp opened nothing
    assert [b.attn.region_runs for b in model] == [0, 0]
    assert recomp.get_recompute_state() is None
    # The next step, without the plain checkpoint, is right.
    assert_same_grads(grads_of(ref, loss_fn, x)[1], grads_of(model, loss_fn, x)[1])
    assert [(b.attn.region_runs, b.attn.region_skips) for b in model] == [(1, 1), (1, 1)]


def test_plain_checkpoint_without_gradients_and_recomp_inside_recomp_are_not_refused():
    model = exclude_attention(stack(2))
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    outer = rt.checkpoint_wrapper(nn.Sequential(model))  # recomp around recomp: nested
    loss_fn(outer(x.requires_grad_())).backward()
    assert [b.attn.region_runs for b in model] == [2, 2]  # the no-grad run and the forward
