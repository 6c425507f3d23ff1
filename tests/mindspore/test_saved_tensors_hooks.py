"""``saved_tensors_hooks=`` is PyTorch's only: MindSpore's checkpoint refuses it, saying so."""

from __future__ import annotations

import mindspore
import pytest

import recomp.mindspore as rm


def test_checkpoint_refuses_saved_tensors_hooks_naming_the_fix():
    cell = mindspore.nn.Dense(2, 2)
    with pytest.raises(ValueError, match=r"PyTorch only\). Drop the option"):
        rm.checkpoint(cell, mindspore.ops.ones((1, 2)), saved_tensors_hooks=(id, id))
