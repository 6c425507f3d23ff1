"""``group_swap``: a layer's small whole-storage tensors of one dtype and device packed into
one buffer, so that each goes to the host and comes back in one copy (:func:`_bucket`,
called by the swap scope when its layer returns).
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import torch

from .. import _compat
from .._offload import OffloadHandle

#: group_swap: tensors below this size share one copy per dtype and device; a bucket
#: holds at most this many bytes and at least two tensors.
BUCKET_BYTES = 32 << 20


class _Chosen(Protocol):
    """What :func:`_bucket` needs of a tensor the scope chose (``scope._Kept``): the
    tensor, until something holds it for the scope (``held``)."""

    tensor: torch.Tensor | None
    held: Any


_K = TypeVar("_K", bound=_Chosen)


class _Bucket:
    """Small tensors of one layer packed into one buffer: one copy out, one copy back
    per backward pass (the members are views of the restored buffer)."""

    __slots__ = ("handle", "members", "reads", "resident")

    def __init__(self, handle: OffloadHandle, members: int) -> None:
        self.handle = handle
        self.members = members
        self.reads = 0
        self.resident: torch.Tensor | None = None

    def read(self) -> torch.Tensor:
        buffer = self.resident
        if buffer is None:
            buffer = self.resident = self.handle.get()
        self.reads += 1
        if self.reads >= self.members:  # every member read in this pass
            self.resident, self.reads = None, 0
        return buffer


class _InBucket:
    """A member of a :class:`_Bucket`: where its elements are in the buffer."""

    __slots__ = ("bucket", "offset", "size", "stride")

    def __init__(self, bucket: _Bucket, offset: int, t: torch.Tensor) -> None:
        self.bucket = bucket
        self.offset = offset
        self.size = t.size()
        self.stride = t.stride()

    def changed(self) -> bool:
        return False  # the buffer is recomp's own: nothing else writes it

    def get(self) -> torch.Tensor:
        return self.bucket.read().as_strided(self.size, self.stride, self.offset)


def _bucketable(t: torch.Tensor) -> bool:
    if type(t) is not torch.Tensor or t.layout is not torch.strided:
        return False
    nbytes = t.numel() * t.element_size()
    return bool(
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == nbytes
        and 0 < nbytes < BUCKET_BYTES
    )


def _bucket(group: Any, moving: list[_K]) -> list[_K]:
    """Pack the small whole-storage tensors of ``moving`` into buckets put in ``group``;
    return the rest, to be put one by one."""
    rest: list[_K] = []
    by_kind: dict[tuple[torch.dtype, torch.device], list[_K]] = {}
    seen: set[Any] = set()
    for kept in moving:
        t = kept.tensor
        key = _compat.storage_key(t) if t is not None else None
        if t is None or not _bucketable(t) or key in seen:
            rest.append(kept)
            continue
        seen.add(key)
        by_kind.setdefault((t.dtype, t.device), []).append(kept)
    for members in by_kind.values():
        chunks: list[list[_K]] = [[]]
        size = 0
        for kept in members:
            n = kept.tensor.numel() * kept.tensor.element_size()  # type: ignore[union-attr]
            if size + n > BUCKET_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(kept)
            size += n
        for chunk in chunks:
            if len(chunk) < 2:
                rest.extend(chunk)
                continue
            with torch.no_grad(), _compat.no_dispatch_modes():
                flat = torch.cat([k.tensor.reshape(-1) for k in chunk])  # type: ignore[union-attr]
            handle = group.put(flat, force=True)
            if handle is None:
                rest.extend(chunk)
                continue
            bucket = _Bucket(handle, len(chunk))
            offset = 0
            for kept in chunk:
                t = kept.tensor
                kept.held, kept.tensor = _InBucket(bucket, offset, t), None  # type: ignore[arg-type]
                offset += t.numel()  # type: ignore[union-attr]
    return rest
