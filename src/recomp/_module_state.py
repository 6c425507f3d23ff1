"""Running statistics that a replay must not update a second time (BatchNorm).

A checkpoint's replay runs the recomputed code again, in training mode: a
BatchNorm in it computes its batch statistics again (which the gradient needs)
and also updates its running statistics again (which nothing needs). So, for a
checkpoint of a module, the replay context saves the running statistics of the
BatchNorm-like modules that the replay re-runs when the replay starts, and
writes them back when it ends, also when it stops early or raises. The model
ends up with the statistics it has without checkpointing; the copies live only
while the replay runs and are the size of the statistics, not of activations.

What counts as running statistics is the framework's answer
(``Backend.running_statistics``); modules inside excluded regions are skipped
(the replay does not run them). A module that looks like a BatchNorm but keeps
its statistics where the framework's answer does not look is reported once, when
the checkpoint wrapper is applied (``RunningStatisticsWarning``).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from ._backend import Backend
from ._hooks import CallPart, Stage
from ._region import ExcludedRegion
from .errors import RunningStatisticsWarning


def _replayed_modules(backend: Backend, root: Any, path: str) -> Iterator[tuple[str, Any]]:
    """``root`` and the modules below it that a replay of ``root`` runs (each once)."""
    seen: set[int] = set()
    stack = [(path, root)]
    while stack:
        where, module = stack.pop()
        if id(module) in seen or isinstance(vars(module).get("_recomp_region"), ExcludedRegion):
            continue
        seen.add(id(module))
        yield where, module
        children = list(backend.named_children(module))
        for name, child in reversed(children):
            stack.append((f"{where}.{name}" if where else name, child))


def replayed_statistics(backend: Backend, function: Any) -> list[Any]:
    """The running-statistics tensors that replaying ``function`` would update."""
    root = backend.module_of(function)
    if root is None:
        return []
    tensors: list[Any] = []
    for _, module in _replayed_modules(backend, root, ""):
        found = backend.running_statistics(module)
        if isinstance(found, list):
            tensors.extend(found)
    return tensors


class RestoreStatistics(CallPart):
    """A checkpoint call's part whose replay context saves the running statistics when
    the replay starts and writes them back when it ends (re-entrant, like the other
    replay contexts)."""

    stage = Stage.RESTORED_STATE

    def __init__(self, backend: Backend, tensors: list[Any]) -> None:
        self.backend = backend
        self.tensors = tensors
        self._saved: list[list[Any]] = []

    def contexts(self, call: Any) -> tuple[Any, Any]:
        return None, self

    def __enter__(self) -> None:
        self._saved.append([self.backend.copy(t) for t in self.tensors])

    def __exit__(self, *exc_info: Any) -> None:
        for tensor, value in zip(self.tensors, self._saved.pop()):
            self.backend.copy_into(tensor, value)


# Modules already reported by warn_unhandled (once each).
_reported: weakref.WeakSet[Any] = weakref.WeakSet()


def warn_unhandled(backend: Backend, root: Any, api: str) -> None:
    """Warn once per module about BatchNorm-like modules in ``root``'s replay whose
    running statistics recomp cannot find (they would be updated twice)."""
    unhandled = []
    for path, module in _replayed_modules(backend, root, ""):
        reason = backend.running_statistics(module)
        if isinstance(reason, str) and module not in _reported:
            _reported.add(module)
            unhandled.append(f"{path or type(root).__name__} ({type(module).__name__}: {reason})")
    if unhandled:
        warnings.warn(
            f"{backend.package}.{api}: the replay of {type(root).__name__} re-runs "
            f"BatchNorm-like modules whose running statistics recomp cannot restore: "
            f"{'; '.join(unhandled)}. Their statistics would be updated twice per step. "
            f"Exclude them (exclude_fn, or checkpoint_exclude_wrapper; with copy_output=True "
            f"if the code after them changes their output in place), or keep their statistics "
            f"in buffers named as the framework's BatchNorm does.",
            RunningStatisticsWarning,
            stacklevel=4,
        )
