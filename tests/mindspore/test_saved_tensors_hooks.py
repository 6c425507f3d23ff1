"""``saved_tensors_hooks=`` is PyTorch's only: MindSpore's checkpoint refuses it, saying so,
before anything runs (no kernel is launched here: a later test may still set the device)."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore")

import recomp.mindspore as rm


def test_checkpoint_refuses_saved_tensors_hooks_naming_the_fix():
    calls = []
    with pytest.raises(ValueError, match=r"PyTorch only\). Drop the option"):
        rm.checkpoint(calls.append, 1.0, saved_tensors_hooks=(id, id))
    assert calls == []
