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

from typing import Any

from mindspore import nn

from .. import _kv_cache


def adapt_cache_kwargs(function: Any, kwargs: dict[str, Any], exclude_type: type) -> None:
    """Turn the KV cache off, in place in ``kwargs``, for a checkpointed call in training."""
    if not _kv_cache.uses_cache(kwargs):
        return
    cell = _cell_of(function)
    if cell is None or not cell.training:
        return
    children = lambda c: c.name_cells().values()  # noqa: E731
    if _kv_cache.written_once(cell, children, lambda c: isinstance(c, exclude_type)):
        return
    _kv_cache.turn_off(cell, kwargs)


def _cell_of(function: Any) -> nn.Cell | None:
    for candidate in (function, getattr(function, "__self__", None)):
        if isinstance(candidate, nn.Cell):
            return candidate
    return None
