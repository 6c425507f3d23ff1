"""Where activation memory goes, on MindSpore: what one training step saves for
backward and why.

MindSpore PyNative's gradient graph cannot be read without running backward, so
:func:`record_saved_tensors` records the report while the forward runs; its
``record.report`` is the same :class:`SavedTensorsReport` as
``recomp.torch.report.saved_tensors_report`` gives. Guide: docs/tools/report.md.
"""

from __future__ import annotations

from .._report import ReportRow, SavedTensorsReport
from ._memory_report import record_saved_tensors

__all__ = ["ReportRow", "SavedTensorsReport", "record_saved_tensors"]
