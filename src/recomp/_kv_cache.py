"""KV caches passed to a layer that recomp checkpoints in training (both frameworks).

A replay re-runs the layer's forward, so a cache the layer appends to would be
written twice (and, with a prefix, the replay would see the wrong length).
Hugging Face's own checkpointing turns the cache off in training; recomp does
the same where the cache would be written by recomputed code, and keeps it
where every module that writes it is an excluded region (written once).
How a framework finds the layer and its children is passed in.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

from .errors import RecompError

#: keyword arguments under which HF-style layers receive a KV cache
CACHE_KWARGS = ("past_key_value", "past_key_values", "layer_past", "cache")


def uses_cache(kwargs: dict[str, Any]) -> bool:
    return bool(kwargs.get("use_cache")) or any(
        kwargs.get(name) is not None for name in CACHE_KWARGS
    )


def written_once(
    layer: Any, children: Callable[[Any], Iterable[Any]], is_excluded: Callable[[Any], bool]
) -> bool:
    """True if every module below ``layer`` that writes the cache (:func:`_cache_writers`)
    runs inside an excluded region."""
    writers, excluded = _cache_writers(layer, children, is_excluded)
    return writers > 0 and writers == excluded


def rewritten(
    layer: Any, children: Callable[[Any], Iterable[Any]], is_excluded: Callable[[Any], bool]
) -> bool:
    """True if some module below ``layer`` that writes the cache (:func:`_cache_writers`)
    runs outside every excluded region, so that a replay of ``layer`` writes the cache
    again. A layer with no such module (an encoder layer) writes no cache, whatever
    ``use_cache`` it is given."""
    writers, excluded = _cache_writers(layer, children, is_excluded)
    return writers > excluded


def _cache_writers(
    layer: Any, children: Callable[[Any], Iterable[Any]], is_excluded: Callable[[Any], bool]
) -> tuple[int, int]:
    """(modules below ``layer`` that write the cache, how many of them are excluded).

    A module writes the cache where it addresses it (an int ``layer_idx``, as HF's
    attention modules have) and is no encoder's: an attention module that says
    ``is_decoder=False`` (BERT's, RoBERTa's and ELECTRA's encoders, BART's and T5's
    encoder stacks: they carry a ``layer_idx`` too) never writes one; Whisper's encoder
    attention has no ``layer_idx``."""
    # An explicit stack, not a recursive local function: a closure that refers to itself
    # is a reference cycle, left to the garbage collector on every call (every step).
    writers = excluded = 0
    stack: list[tuple[Any, bool]] = [(layer, False)]
    while stack:
        module, in_region = stack.pop()
        in_region = in_region or is_excluded(module)
        if module is not layer and isinstance(getattr(module, "layer_idx", None), int):
            if getattr(module, "is_decoder", True) is not False:
                writers += 1
                excluded += in_region
            continue
        stack.extend((child, in_region) for child in children(module))
    return writers, excluded


def turn_off(layer: Any, kwargs: dict[str, Any], *, drop_caches: bool = True) -> None:
    """Set ``use_cache=False`` and (with ``drop_caches``) every cache argument to None, in
    place in ``kwargs``, with a warning; a cache that already holds entries is an error
    (dropping it would change the result)."""
    changed = []
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
        changed.append("use_cache=False")
    for name in CACHE_KWARGS if drop_caches else ():
        cache = kwargs.get(name)
        if cache is None:
            continue
        if holds_entries(cache):
            raise RecompError(
                f"{type(layer).__name__} is checkpointed by recomp and was given a KV cache that "
                f"already holds entries ({name}=...) in training. Its recomputed forward would "
                "write the cache a second time during backward, and dropping the cache would "
                "drop those entries. Exclude the modules that write the cache (the attention, "
                "via exclude_fn or checkpoint_exclude_wrapper) so that it is written once, or do "
                "not checkpoint this layer."
            )
        kwargs[name] = None
        changed.append(f"{name}=None")
    if changed:
        warnings.warn(
            f"The KV cache is turned off ({', '.join(changed)}) for {type(layer).__name__}, "
            "which recomp checkpoints in training: the recomputed forward would write the cache "
            "a second time during backward. Hugging Face's own checkpointing does the same. Pass "
            "use_cache=False in training to silence this, or exclude the attention modules "
            "(exclude_fn) so that the cache is written once and kept.",
            UserWarning,
            stacklevel=5,
        )


def holds_entries(cache: Any) -> bool:
    """Whether a cache passed to a layer already holds entries (a prefix), as far as can be told."""
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
