"""What the pipeline tests need to know about the PyTorch they run on."""

from __future__ import annotations

import inspect


def stage_setup_sends_int64() -> bool:
    """PyTorch 2.9's pipeline stages open their connections by sending an int64 tensor to
    a float32 receive (``_get_init_p2p_neighbors_ops``); gloo refuses the size mismatch
    ("8 vs 4"), so no schedule whose stages have neighbours starts there (two ranks, or
    two stages on one), with or without recomp."""
    from torch.distributed.pipelining import stage

    source = inspect.getsource(stage)
    return "send_tensor = torch.tensor(self.stage_index, device=self.device)" in source
