"""What the pipeline tests need to know about the PyTorch they run on."""

from __future__ import annotations

import inspect
from typing import Any


def stage_setup_sends_int64() -> bool:
    """PyTorch 2.9's pipeline stages open their connections by sending an int64 tensor to
    a float32 receive (``_get_init_p2p_neighbors_ops``); gloo refuses the size mismatch
    ("8 vs 4"), so no schedule whose stages have neighbours starts there (two ranks, or
    two stages on one), with or without recomp."""
    from torch.distributed.pipelining import stage

    source = inspect.getsource(stage)
    return "send_tensor = torch.tensor(self.stage_index, device=self.device)" in source


def pipeline_run_marks(timeout: int) -> list[Any]:
    """The marks of a test file that starts pipeline stages on gloo ranks: distributed,
    system-level, bounded by ``timeout`` seconds, skipped where stages cannot start."""
    import pytest

    return [
        pytest.mark.distributed,
        pytest.mark.system,
        pytest.mark.timeout(timeout),
        pytest.mark.skipif(
            stage_setup_sends_int64(),
            reason="this PyTorch's pipeline stages cannot start on gloo (int64 sent to a "
            "float32 receive when stages connect); fixed in the PyTorch of the dev set",
        ),
    ]
