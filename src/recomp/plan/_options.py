"""What the planner may choose for a layer: its candidate regions, and the options built
from them (no checkpoint, full checkpoint, checkpoints with sets of candidates excluded,
and the same checkpoints selective)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from torch import nn

from ._layers import outermost_matches
from .planner import OptionSlot

# More candidates than this: only single exclusions and all of them together are options.
MAX_COMBINED = 5


def find_candidates(
    layer: nn.Module, exclude: Callable[[nn.Module], bool] | None = None
) -> list[tuple[str, nn.Module]]:
    """Candidate regions of a layer: the outermost sub-modules ``exclude`` accepts, or by
    default the direct children that hold parameters."""
    if exclude is None:
        return [
            (name, child)
            for name, child in layer.named_children()
            if next(child.parameters(), None) is not None
        ]
    return outermost_matches(layer, exclude)


def option_sets(count: int) -> list[tuple[int, ...]]:
    """Sets of candidate indices to offer as exclusions (all non-empty ones when few)."""
    if count == 0:
        return []
    if count <= MAX_COMBINED:
        return [
            combo
            for size in range(1, count + 1)
            for combo in itertools.combinations(range(count), size)
        ]
    return [(i,) for i in range(count)] + [tuple(range(count))]


def layer_option_sets(count: int) -> list[tuple[tuple[int, ...] | None, bool]]:
    """The options of a layer with ``count`` candidates, as (excluded candidate indices,
    selective), in the order of ``OptionSlot``: no checkpoint (``None``), full
    checkpoint (nothing excluded, ``()``), the sets of candidate indices of
    ``option_sets``; then the same checkpoints selective (expensive ops' outputs kept:
    ``recomp.plan.policy``)."""
    fixed: dict[OptionSlot, tuple[int, ...] | None] = {OptionSlot.NONE: None, OptionSlot.FULL: ()}
    checkpoints = [(), *option_sets(count)]
    return (
        [(fixed[slot], False) for slot in sorted(fixed)]
        + [(s, False) for s in checkpoints[1:]]
        + [(s, True) for s in checkpoints]
    )
