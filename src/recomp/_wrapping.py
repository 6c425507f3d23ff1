"""Framework-free parts of the module wrappers: model-wide wrapping and region counters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._engine import ExcludedRegion

# The attribute holding the wrapped module, in both frameworks. It is the name
# PyTorch's own checkpoint_wrapper uses, which torch.distributed's state-dict
# utilities strip from keys.
WRAPPED = "_checkpoint_wrapped_module"


class RegionCounters:
    """Read-only counters of an exclude wrapper (mixed into each framework's class)."""

    region: ExcludedRegion

    @property
    def region_runs(self) -> int:
        """How many times the wrapped module executed."""
        return self.region.runs

    @property
    def region_skips(self) -> int:
        """How many replays returned the cached output instead of executing it."""
        return self.region.skips

    @property
    def region_saved_bytes(self) -> int:
        """Activation bytes the last call keeps until backward (saved tensors + cached output)."""
        return self.region.saved_bytes


@dataclass(frozen=True)
class ModelOps:
    """How to walk and rewrite one framework's module tree."""

    module_type: type
    checkpoint_wrapper: type
    exclude_wrapper: type
    children: Callable[[Any], list[tuple[str, Any]]]
    replace_child: Callable[[Any, str, Any], None]


def apply_activation_checkpointing(
    ops: ModelOps,
    model: Any,
    checkpoint_fn: Callable[[Any], bool],
    exclude_fn: Callable[[Any], bool] | None,
    checkpoint_kwargs: dict[str, Any],
    offload_fn: Callable[[Any], Any] | None = None,
) -> Any:
    """Wrap, in place, each sub-module for which ``checkpoint_fn`` holds in a checkpoint
    wrapper, and inside those each sub-module for which ``exclude_fn`` holds in an exclude
    wrapper (named by its path, for error messages). Checkpoints are not nested; modules
    already wrapped are left as they are. Returns the model, or its wrapper."""
    if not isinstance(model, ops.module_type):
        raise ValueError(
            f"apply_activation_checkpointing needs a {ops.module_type.__module__}."
            f"{ops.module_type.__qualname__}, got {type(model).__name__}."
        )

    def exclude_inside(module: Any, path: str) -> None:
        if exclude_fn is None:
            return
        for name, child in ops.children(module):
            child_path = f"{path}.{name}" if path else name
            if isinstance(child, ops.exclude_wrapper):
                continue
            if exclude_fn(child):
                offload = offload_fn(child) if offload_fn is not None else False
                options = {"offload": offload} if offload is not False else {}
                wrapper = ops.exclude_wrapper(child, name=child_path, **options)
                ops.replace_child(module, name, wrapper)
            else:
                exclude_inside(child, child_path)

    def visit(module: Any, path: str) -> Any:
        if isinstance(module, ops.exclude_wrapper):
            return module
        if isinstance(module, ops.checkpoint_wrapper):
            exclude_inside(getattr(module, WRAPPED), path)
            return module
        if checkpoint_fn(module):
            exclude_inside(module, path)
            return ops.checkpoint_wrapper(module, **checkpoint_kwargs)
        for name, child in ops.children(module):
            wrapped = visit(child, f"{path}.{name}" if path else name)
            if wrapped is not child:
                ops.replace_child(module, name, wrapped)
        return module

    return visit(model, "")


def check_callable(module: Any, api: str, kind: str) -> None:
    if not callable(module):
        raise ValueError(
            f"{api} needs a {kind} or a callable, got {type(module).__name__} ({module!r}). "
            f"Pass the {kind} (or function) itself."
        )


def default_name(module: Any) -> str:
    return getattr(module, "__name__", None) or type(module).__name__
