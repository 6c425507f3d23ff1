"""The swap manager on PyTorch: :class:`SwapManager`, the process's one object that names
each layer's offload groups, pairs layers (``set_forward_prefetch_layer``) and tells the
offloader which group a layer's backward brings back ahead.

The framework-free half (pairs, names, the prefetch at the start of a layer's backward) is
``recomp._swap_pairs.SwapManagerBase``; what is here touches tensors and the offloader.
Also here: :func:`_tensors_in`, the tensors of a layer's output as the swap names walk it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..._swap_pairs import SwapManagerBase
from .._offload import Offloader


def _tensors_in(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors_in(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors_in(item)


class SwapManager(SwapManagerBase):
    """The process's swap manager (every ``SwapManager()`` is the same object).

    Each recomp checkpoint, swap wrapper or ``swap`` call of a layer moves its tensors
    as one group. In backward, the first read of a layer's group brings back, ahead,
    the group of the layer paired with it by :meth:`set_forward_prefetch_layer`, or,
    when none is set, the group of the layer that ran before it in the forward (the
    offloader's own order)."""

    layer_type = nn.Module
    layer_kind = "modules"
    installed: Offloader | None

    def _started(self) -> None:
        self.installed = None

    def grad_outputs(self, outputs: Any) -> Iterator[torch.Tensor]:
        return (t for t in _tensors_in(outputs) if t.requires_grad)

    def group_recorded(self, layer: nn.Module | None, group: Any) -> None:
        super().group_recorded(layer, group)
        offloader = group.offloader
        if self.installed is not offloader:
            offloader.prefetch_pair = self.paired
            self.installed = offloader
