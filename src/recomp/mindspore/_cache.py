"""KV caches written by recomputed code (MindSpore), handled as recomp does for Hugging Face.

A decoder layer that appends to a Python-side cache (mindnlp's ``DynamicCache``
keeps lists of tensors, written by each attention module under its
``layer_idx``) appends again when the replay re-runs it during backward: the
cache then holds the layer's keys twice. A checkpointed Cell called in
training with gradients on and with ``use_cache=True`` or a cache argument
therefore gets ``use_cache=False`` and no cache, with a warning, as Hugging
Face's own checkpointing does; a cache that already holds entries (a prefix)
cannot be dropped without changing the result, so that is an error. Where every
sub-cell with a ``layer_idx`` is inside an excluded region, the cache is written
once and left alone. Code that writes a cache recomp cannot see (an attribute,
a global) guards the write with ``recomp.is_recomputing()``.
"""

from __future__ import annotations

import warnings
from typing import Any

from mindspore import nn

from ..errors import RecompError

# Keyword arguments under which mindnlp / HF-style layers receive a KV cache.
CACHE_KWARGS = ("past_key_value", "past_key_values", "layer_past", "cache")


def adapt_cache_kwargs(function: Any, kwargs: dict[str, Any], exclude_type: type) -> None:
    """Turn the KV cache off, in place in ``kwargs``, for a checkpointed call in training."""
    uses_cache = bool(kwargs.get("use_cache")) or any(
        kwargs.get(name) is not None for name in CACHE_KWARGS
    )
    if not uses_cache:
        return
    cell = _cell_of(function)
    if cell is None or not cell.training or _cache_written_once(cell, exclude_type):
        return
    changed = []
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
        changed.append("use_cache=False")
    for name in CACHE_KWARGS:
        cache = kwargs.get(name)
        if cache is None:
            continue
        if _holds_entries(cache):
            raise RecompError(
                f"{type(cell).__name__} is checkpointed by recomp and was given a KV cache that "
                f"already holds entries ({name}=...) in training. Its replay would write the "
                "cache a second time during backward, and dropping the cache would drop those "
                "entries. Exclude the cells that write the cache (the attention, via exclude_fn "
                "or checkpoint_exclude_wrapper) so that it is written once, or do not checkpoint "
                "this cell."
            )
        kwargs[name] = None
        changed.append(f"{name}=None")
    warnings.warn(
        f"The KV cache is turned off ({', '.join(changed)}) for {type(cell).__name__}, which "
        "recomp checkpoints in training: its replay would write the cache a second time during "
        "backward. Hugging Face's own checkpointing does the same. Pass use_cache=False in "
        "training to silence this, or exclude the attention cells so that the cache is "
        "written once and kept.",
        UserWarning,
        stacklevel=4,
    )


def _cell_of(function: Any) -> nn.Cell | None:
    for candidate in (function, getattr(function, "__self__", None)):
        if isinstance(candidate, nn.Cell):
            return candidate
    return None


def _holds_entries(cache: Any) -> bool:
    seq_length = getattr(cache, "get_seq_length", None)
    if seq_length is not None:
        try:
            return int(seq_length()) > 0
        except Exception:  # a cache type whose length needs arguments we do not know
            return True
    try:
        return len(cache) > 0
    except TypeError:
        return True


def _cache_written_once(cell: nn.Cell, exclude_type: type) -> bool:
    """True if every sub-cell that addresses the cache (has an int ``layer_idx``) is excluded."""
    writers = excluded = 0

    def visit(sub: nn.Cell, in_region: bool) -> None:
        nonlocal writers, excluded
        in_region = in_region or isinstance(sub, exclude_type)
        if sub is not cell and isinstance(getattr(sub, "layer_idx", None), int):
            writers += 1
            excluded += in_region
            return
        for child in sub.name_cells().values():
            visit(child, in_region)

    visit(cell, False)
    return writers > 0 and writers == excluded
