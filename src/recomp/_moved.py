"""Public names that moved: the old place keeps each for one release, with a warning.

NOTE [ Moved names ]

``MOVED`` lists, per package, every name that left its ``__all__`` and where it went.
The package's module-level ``__getattr__`` (made by :func:`moved_names`) answers for
those names only: each access of an old name issues one ``DeprecationWarning`` that
names the new place, then returns the object from there (the same object: nothing is
copied or wrapped). The names are not in the packages' ``__all__``, so ``from
recomp.torch import *`` neither imports nor warns about them. Documented, as a table
of old and new names, in docs/reference/index.md ("Moved names"); a test compares
that table with this one.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

_TORCH_HP = "recomp.torch.hyperparallel"
_TORCH_REPORT = "recomp.torch.report"
_MS_HP = "recomp.mindspore.hyperparallel"
_MS_REPORT = "recomp.mindspore.report"
_SOLVER = "recomp.plan.solver"

#: package -> {old name: "new.module.name"}
MOVED: dict[str, dict[str, str]] = {
    "recomp.torch": {
        **{
            name: f"{_TORCH_HP}.{name}"
            for name in (
                "AsyncSaveOnCpu",
                "PinnedMemoryPool",
                "SwapManager",
                "async_save_on_cpu",
                "create_native_selective_checkpoint_contexts",
                "create_selective_checkpoint_contexts",
                "get_class_activation_wrapper",
                "ignore_sac_ops",
                "is_compiling",
                "noop_context_fn",
                "swap_tensor_wrapper",
            )
        },
        **{
            name: f"{_TORCH_REPORT}.{name}"
            for name in (
                "OomReport",
                "ReportRow",
                "SavedTensorsReport",
                "install_oom_report",
                "label_layers",
                "print_saved_tensors_report",
                "saved_tensors_report",
            )
        },
        "SwapPolicyError": "recomp.errors.SwapPolicyError",
    },
    "recomp.mindspore": {
        **{
            name: f"{_MS_HP}.{name}"
            for name in (
                "AsyncSaveOnCpu",
                "SwapManager",
                "async_save_on_cpu",
                "create_selective_checkpoint_contexts",
                "ignore_sac_ops",
                "swap_tensor_wrapper",
            )
        },
        "record_saved_tensors": f"{_MS_REPORT}.record_saved_tensors",
        "SwapNotSupportedError": "recomp.errors.SwapNotSupportedError",
        "SwapPolicyError": "recomp.errors.SwapPolicyError",
    },
    "recomp.plan": {
        **{
            name: f"{_SOLVER}.{name}"
            for name in (
                "Choice",
                "LayerOptions",
                "NearTie",
                "Option",
                "Solution",
                "evaluate",
                "minimum_bytes",
                "solve",
                "solve_with_ties",
            )
        },
        "BudgetTooSmallError": "recomp.errors.BudgetTooSmallError",
        "PlanFormatError": "recomp.errors.PlanFormatError",
    },
}


def message(package: str, name: str) -> str:
    """The warning for an access of ``package.name``."""
    return f"{package}.{name} moved to {MOVED[package][name]}; the old name goes away in the next release."


def resolve(package: str, name: str) -> Any:
    """The object ``package.name`` now is, from its new place (no warning)."""
    module, _, attribute = MOVED[package][name].rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def _probed_by_import() -> bool:
    """Whether the access is ``from package import name``'s first look: the import
    system checks with ``hasattr`` (``importlib._bootstrap._handle_fromlist``) whether a
    package has the name before it reads it, and only the read should warn. (A Python
    whose import system is written otherwise makes such an import warn twice; nothing
    else changes. The tests import an old name this way and count the warnings.)"""
    frame = inspect.currentframe()
    try:
        caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
        return (
            caller is not None
            and caller.f_code.co_name == "_handle_fromlist"
            and caller.f_globals.get("__name__") == "importlib._bootstrap"
        )
    finally:
        del frame  # a frame held in its own locals would keep the caller's alive


def moved_names(package: str, lazy: Mapping[str, str] | None = None) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: see NOTE [ Moved names ]. ``lazy``: public
    names imported on first use, each with the module it comes from (no warning)."""
    table = MOVED[package]
    lazy = dict(lazy or {})

    def __getattr__(name: str) -> Any:
        if name in lazy:
            return getattr(importlib.import_module(lazy[name]), name)
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if not _probed_by_import():
            warnings.warn(message(package, name), DeprecationWarning, stacklevel=2)
        return resolve(package, name)

    return __getattr__
