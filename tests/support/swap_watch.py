"""Watch recomp's swap scopes in host-copy mode: what each offload group moved and what each
scope's chosen tensors left on the device (recomp's own bookkeeping)."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import pytest

from recomp.torch import _compat
from recomp.torch import _swap as swap_module
from recomp.torch._offload import ENV_HOST_COPY, default_offloader


def watch_swap_scopes(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[Any]]]:
    """For a fixture: host-copy mode on; ``"groups"``, every offload group opened (one per
    swap or offload scope, one per offloading region call), in order; ``"stayed"``, per
    swap scope that finished, the storages its chosen tensors left on the device, with
    their bytes. After the test, every copy has finished."""
    monkeypatch.setenv(ENV_HOST_COPY, "1")
    seen: dict[str, list[Any]] = {"groups": [], "stayed": []}
    off = default_offloader()
    monkeypatch.setattr(off, "group_opened", seen["groups"].append)
    finish = swap_module.SwapScope.finish

    def watched(self: swap_module.SwapScope, outputs: object) -> None:
        pending = list(self.pending)
        finish(self, outputs)
        stayed: dict[Hashable, int] = {}
        for kept in pending:
            if kept.tensor is not None:
                stayed[_compat.storage_key(kept.tensor)] = kept.tensor.untyped_storage().nbytes()
        seen["stayed"].append(stayed)

    monkeypatch.setattr(swap_module.SwapScope, "finish", watched)
    yield seen
    off.synchronize()
    assert off.pending_copies == 0
