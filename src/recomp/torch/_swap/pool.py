"""Host memory for swapped tensors (``cpu_pool``): :class:`PinnedMemoryPool`, and the check
of the two options every swap name takes, ``group_swap`` and ``cpu_pool``.

The offloader (``recomp.torch._offload``) takes its host blocks from a scope's pool when
it has one and gives them back when the graph that held them is freed.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ...errors import RecompError


def _check_swap_options(group_swap: Any, cpu_pool: Any) -> None:
    if not isinstance(group_swap, bool):
        raise TypeError(f"group_swap must be a bool, got {group_swap!r}.")
    if cpu_pool is not None and not isinstance(cpu_pool, PinnedMemoryPool):
        raise TypeError(
            f"cpu_pool must be a recomp.torch.PinnedMemoryPool or None, got {cpu_pool!r}."
        )


class PinnedMemoryPool:
    """Host memory for swapped tensors, reused across steps and bounded: blocks of a
    power of two bytes (at least 1 KiB; sizes above ``align_limit`` exactly), pinned
    where CUDA is available. More than ``max_host_bytes`` in use raises."""

    def __init__(self, max_host_bytes: int, align_limit: int = 2 * 1024**3) -> None:
        for name, value in (("max_host_bytes", max_host_bytes), ("align_limit", align_limit)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be an int > 0, got {value!r}.")
        self.max_host_bytes = max_host_bytes
        self.align_limit = align_limit
        self.reserved_bytes = 0  # blocks allocated, free or in use
        self.in_use_bytes = 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def block_size(self, size: int) -> int:
        """The bytes a block for ``size`` bytes takes."""
        if size > self.align_limit:
            return size
        return max(1024, 1 << (size - 1).bit_length())

    def acquire(self, size: int) -> torch.Tensor:
        """A uint8 host block of at least ``size`` bytes."""
        block_size = self.block_size(size)
        with self._lock:
            free = self._free.get(block_size)
            if free:
                block = free.pop()
            else:
                if self.reserved_bytes + block_size > self.max_host_bytes:
                    self._trim(block_size)
                if self.reserved_bytes + block_size > self.max_host_bytes:
                    raise RecompError(
                        f"PinnedMemoryPool capacity exceeded: {size} bytes asked, "
                        f"{self.in_use_bytes} of {self.max_host_bytes} in use. Give the "
                        f"pool more (max_host_bytes) or swap less (policy_fn)."
                    )
                block = torch.empty(
                    block_size, dtype=torch.uint8, pin_memory=torch.cuda.is_available()
                )
                self.reserved_bytes += block_size
            self.in_use_bytes += block_size
        return block

    def release(self, block: torch.Tensor) -> None:
        """Give a block back (the offloader does, when the host copy is no longer needed)."""
        with self._lock:
            self.in_use_bytes -= block.numel()
            self._free.setdefault(block.numel(), []).append(block)

    def fits(self, size: int) -> bool:
        """Whether :meth:`acquire` of ``size`` bytes would succeed now."""
        block_size = self.block_size(size)
        with self._lock:
            if self._free.get(block_size):
                return True
            spare = sum(s * len(b) for s, b in self._free.items())
            return self.reserved_bytes - spare + block_size <= self.max_host_bytes

    def clear(self) -> None:
        """Free every block not in use (``reserved_bytes`` falls to ``in_use_bytes``)."""
        with self._lock:
            for size, blocks in self._free.items():
                self.reserved_bytes -= size * len(blocks)
            self._free.clear()

    def _trim(self, needed: int) -> None:
        for size in sorted(self._free, reverse=True):
            blocks = self._free[size]
            while blocks and self.reserved_bytes + needed > self.max_host_bytes:
                blocks.pop()
                self.reserved_bytes -= size
