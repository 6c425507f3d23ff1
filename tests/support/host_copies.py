"""The offloader's host-copy mode for CPU tests: CPU tensors copied as a device's would
be, and every offload group opened during a test recorded, in order (their
``offloaded_bytes`` and ``restored_bytes`` are exact)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def recorded_host_copies(monkeypatch: Any) -> Iterator[list[Any]]:
    """For a fixture (``yield from``): host-copy mode on, the groups opened, and at the end
    every copy finished."""
    from recomp.torch._offload import ENV_HOST_COPY, default_offloader

    monkeypatch.setenv(ENV_HOST_COPY, "1")
    opened: list[Any] = []
    offloader = default_offloader()
    monkeypatch.setattr(offloader, "group_opened", opened.append)
    yield opened
    offloader.synchronize()
    assert offloader.pending_copies == 0
