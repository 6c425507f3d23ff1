"""Where activation memory goes, on PyTorch: what the autograd graph holds for backward
and why (the library of ``recomp report``).

:func:`saved_tensors_report` walks the graph behind a loss after the forward and bills
every storage held for backward once, by checkpointed layer, excluded region, op and
kind (kept by a region, cached output, offloaded, checkpoint input, saved outside
checkpoints, ...); :func:`print_saved_tensors_report` prints it. :func:`label_layers`
names the layers of tensors saved outside checkpoints, and :func:`install_oom_report`
prints the report when a CUDA allocation fails. ``recomp.mindspore.report`` records the
same report on MindSpore. Guide: docs/tools/report.md.
"""

from __future__ import annotations

from ._memory_report import (
    ReportRow,
    SavedTensorsReport,
    label_layers,
    print_saved_tensors_report,
    saved_tensors_report,
)
from ._oom_report import OomReport, install_oom_report

__all__ = [
    "OomReport",
    "ReportRow",
    "SavedTensorsReport",
    "install_oom_report",
    "label_layers",
    "print_saved_tensors_report",
    "saved_tensors_report",
]
