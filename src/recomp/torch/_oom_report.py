"""``install_oom_report()``: on a CUDA out-of-memory error, print what is held for backward.

How it hooks in:

* **Graph roots.** A report walks the autograd graph from its roots, and at an OOM in
  the middle of a step there is no loss yet. The handle registers a global module
  forward hook (``torch.nn.modules.module.register_module_forward_hook``) that keeps
  a *weak* reference to every tensor output of a module call that has autograd
  history. The live ones are the roots: together they reach everything the step's
  graph holds so far. A dead reference costs nothing; the hook costs one Python call
  per module call, and the pre-hook that remembers the running module another.
* **The error.** PyTorch's CUDA caching allocator calls an out-of-memory observer
  (``torch._C._cuda_attach_out_of_memory_observer``, the one ``_record_memory_history``
  uses for its snapshots) with the device and byte counts, on the allocating thread,
  before it raises ``torch.OutOfMemoryError``. The handle's :meth:`OomReport.on_out_of_memory`
  is that observer: it prints the report, largest holders first, and the excluded
  region, checkpoint phase and module that were running. PyTorch offers no way to
  detach an observer, so one forwarder is attached per process and calls the handles
  installed at the time.
* **Without CUDA** nothing is attached: call ``handle.on_out_of_memory(...)`` yourself
  (as the tests do), or ``handle.report()`` where you catch the error.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, TextIO

import torch
from torch import nn

from .._region import active_region
from .._state import get_recompute_state
from . import _compat
from ._memory_report import SavedTensorsReport, saved_tensors_report

_INSTALLED: list[OomReport] = []


def install_oom_report(
    model: nn.Module | None = None, file: TextIO | None = None, max_rows: int = 30
) -> OomReport:
    """Print a saved-tensor report when a CUDA allocation fails; returns the handle
    (``handle.remove()``, or use it as a context manager). ``model`` names layers and
    regions by path; ``file`` defaults to standard error; ``max_rows`` rows are shown,
    largest first."""
    return OomReport(model, file, max_rows)


class OomReport:
    """An installed OOM report: the roots it tracks and what it prints."""

    def __init__(self, model: nn.Module | None, file: TextIO | None, max_rows: int) -> None:
        self.model = model
        self.file = file
        self.max_rows = max_rows
        self.roots: dict[int, weakref.ref[torch.Tensor]] = {}
        self.running: weakref.ref[nn.Module] | None = None
        self.last_message: str | None = None
        register = torch.nn.modules.module
        self._handles = [
            register.register_module_forward_pre_hook(self._entered),
            register.register_module_forward_hook(self._returned),
        ]
        self.attached = _compat.attach_cuda_oom_observer(_forward_to_installed)
        _INSTALLED.append(self)

    # -- tracking --------------------------------------------------------------------

    def _entered(self, module: nn.Module, args: Any) -> None:
        self.running = weakref.ref(module)

    def _returned(self, module: nn.Module, args: Any, output: Any) -> None:
        for t in _output_tensors(output):
            if t.grad_fn is not None:
                self.track(t)

    def track(self, tensor: torch.Tensor) -> None:
        """Also walk the graph from ``tensor`` (a loss computed outside any module)."""
        key = id(tensor)
        roots = self.roots

        def forget(_ref: object) -> None:
            roots.pop(key, None)

        roots[key] = weakref.ref(tensor, forget)

    # -- reporting -------------------------------------------------------------------

    def report(self) -> SavedTensorsReport:
        """What the graphs of the live tracked outputs hold for backward now."""
        alive = [t for t in (ref() for ref in list(self.roots.values())) if t is not None]
        return saved_tensors_report(alive, self.model)

    def running_description(self) -> str:
        """The excluded region, checkpoint phase and module running on this thread."""
        parts = []
        region = active_region()
        if region is not None:
            parts.append(f"excluded region {region.name!r} (its forward)")
        state = get_recompute_state()
        if state is not None:
            phase = "replay" if state.is_recomputing else "forward"
            parts.append(f"inside a recomp checkpoint's {phase}")
        module = self.running() if self.running is not None else None
        if module is not None:
            path = None
            if self.model is not None:
                path = next((p for p, m in self.model.named_modules() if m is module), None)
            parts.append(f"last module entered: {path or type(module).__name__}")
        return "; ".join(parts) or "no module or region of a tracked step"

    def on_out_of_memory(
        self, device: int, alloc: int, device_allocated: int, device_free: int
    ) -> None:
        """The allocator's observer: print the report (never raises)."""
        try:
            report = self.report()
            message = "\n".join(
                [
                    f"recomp: CUDA out of memory on device {device} allocating {alloc} bytes "
                    f"({device_allocated} allocated, {device_free} free).",
                    f"Running: {self.running_description()}.",
                    "Held for backward, largest first:",
                    report.format(largest_first=True, max_rows=self.max_rows),
                ]
            )
        except Exception as exc:
            message = f"recomp: the out-of-memory report failed: {type(exc).__name__}: {exc}"
        self.last_message = message
        print(message, file=self.file if self.file is not None else sys.stderr, flush=True)

    # -- removal ---------------------------------------------------------------------

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.roots.clear()
        if self in _INSTALLED:
            _INSTALLED.remove(self)

    def __enter__(self) -> OomReport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def _forward_to_installed(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    for handle in list(_INSTALLED):
        handle.on_out_of_memory(device, alloc, device_allocated, device_free)


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """Tensors of a module's output, one level into tuples, lists and dicts (HF outputs)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        values: Any = output.values()
    elif isinstance(output, (tuple, list)):
        values = output
    else:
        return []
    return [v for v in values if isinstance(v, torch.Tensor)]
