"""A checkpoint's inputs kept split over a process group between its forward and its
replay (``checkpoint(..., partition_inputs=group)``): Megatron-Core's
``distribute_saved_activations`` and DeepSpeed's ``partition_activations``.

NOTE [ Partitioned checkpoint inputs ]
A non-reentrant checkpoint keeps its inputs for the replay and nothing else; under tensor
parallelism every rank of the group holds the same inputs. With ``partition_inputs``
each floating-point input the checkpoint saves is kept as this rank's 1-D slice of it
(the flattened tensor padded to a multiple of the group's size, 1/n of it per rank),
and the replay gathers it back, one ``all_gather_into_tensor`` per input, before it
reads it. The values are the forward's, bit for bit: nothing is reduced.

The slices are taken by saved-tensors hooks around the framework's checkpoint, which see
the checkpoint's own saved inputs and nothing the checkpointed function saves (the
checkpoint's own hooks are innermost there), so excluded regions, kept collective
results and per-op policies keep what they keep, whole. The input tensor itself is
released where nothing else holds it. Megatron-Core's convention (``first=``, the call's
first input) splits that input only, in place: its data becomes the slice when the
forward returns, so that its memory is released while the caller still holds the
tensor, and the tensor gets its data back when the replay gathers it. (Splitting other
inputs in place would change tensors that later layers read: rotary tables, masks.)

The gather is an ordinary collective of the backward pass: it runs once per replay,
outside what ``exclude_collectives`` keeps (that is for the collectives of the
checkpointed function).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PartitionedInputs", "for_call"]


def for_call(partition_inputs: Any) -> PartitionedInputs:
    """The hooks of one checkpoint call given ``partition_inputs``: a process group (or
    the :class:`PartitionedInputs` a trainer's adapter made for the call)."""
    if isinstance(partition_inputs, PartitionedInputs):
        return partition_inputs
    _check_group(partition_inputs)
    return PartitionedInputs(partition_inputs)


def _check_group(group: Any) -> None:
    """``partition_inputs`` must be a process group of an initialized
    ``torch.distributed`` (an error naming what to pass otherwise)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "checkpoint(..., partition_inputs=group) needs torch.distributed initialized "
            "(init_process_group) and the group to split the inputs over (the "
            "tensor-parallel group)."
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"partition_inputs must be a torch.distributed ProcessGroup (the group to "
            f"split the checkpoint's inputs over), got {type(group).__name__}."
        )


class _Slice:
    """One saved input as this rank keeps it."""

    __slots__ = ("numel", "owner", "piece", "shape")

    def __init__(self, piece: torch.Tensor, shape: torch.Size, numel: int, owner: Any) -> None:
        self.piece = piece
        self.shape = shape
        self.numel = numel
        self.owner = owner  # the input tensor whose data is the slice (in place), or None


class PartitionedInputs:
    """The saved-tensors hooks of one checkpoint call with ``partition_inputs``; their
    counters (``kept_bytes``: what this rank keeps of the partitioned inputs,
    ``released_bytes``: what it does not, ``gathers``) add up over the call's forward
    and replay."""

    def __init__(self, group: Any, first: torch.Tensor | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.first = first  # Megatron's convention: this input only, in place
        self.slices: list[_Slice] = []
        self.kept_bytes = 0
        self.released_bytes = 0
        self.gathers = 0

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        if self.first is not None and tensor is not self.first:
            return tensor
        if not tensor.is_floating_point() or tensor.numel() < self.size or self.size == 1:
            return tensor
        numel = tensor.numel()
        per_rank = -(-numel // self.size)
        flat = tensor.detach().reshape(-1)
        start = min(self.rank * per_rank, numel)
        piece = flat[start : start + per_rank]
        if piece.numel() < per_rank:  # the last ranks' padding
            piece = torch.cat([piece, piece.new_zeros(per_rank - piece.numel())])
        else:
            piece = piece.clone()
        owner = tensor if tensor is self.first else None
        kept = _Slice(piece, tensor.shape, numel, owner)
        self.slices.append(kept)
        self.kept_bytes += piece.numel() * piece.element_size()
        self.released_bytes += (numel - piece.numel()) * piece.element_size()
        return kept

    def forward_done(self) -> None:
        """After the forward: the first input's data becomes its slice (``first=``)."""
        for kept in self.slices:
            if kept.owner is not None:
                kept.owner.data = kept.piece

    def unpack(self, kept: Any) -> torch.Tensor:
        if not isinstance(kept, _Slice):
            return kept  # type: ignore[no-any-return]
        whole = kept.piece.new_empty(kept.piece.numel() * self.size)
        dist.all_gather_into_tensor(whole, kept.piece, group=self.group)
        self.gathers += 1
        full = whole[: kept.numel].view(kept.shape)
        if kept.owner is not None:
            kept.owner.data = full
            return kept.owner  # type: ignore[no-any-return]
        return full
