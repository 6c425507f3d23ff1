"""MindSpore dropout cells that a replay cannot reproduce, and what recomp does about them.

``nn.Dropout`` builds its primitive once, and on CPU the kernel keeps a random
state of its own in C++ that no Python API can read or restore: recomputed, it
draws a new mask, and the backward then pairs the forward's activations with
another mask (wrong gradients, with ``mindspore.recompute`` alone as well).
``nn.Dropout1d/2d/3d`` (and ``ops.dropout1d/2d/3d``) draw from an unseeded
kernel on every call. ``ops.dropout`` draws from the per-op kernel seeds, which
recomp restores for the replay, so it replays exactly once ``mindspore.set_seed``
was called. ``mint.nn.Dropout`` and ``mint.nn.functional.dropout`` draw from the
default generator, which recomp restores too; MindSpore 2.10 has no CPU kernel
for them.

``apply_activation_checkpointing`` therefore keeps every active cell of the
first kind out of the replay (an excluded region keeps its mask and output),
and ``checkpoint_wrapper`` / ``checkpoint`` warn about each such cell left in
recomputed code.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from mindspore import nn

from ..errors import UnreplayableDropoutWarning

_UNREPLAYABLE = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)

# Cells already checked for recomputed dropout (each is reported once).
_checked: weakref.WeakSet[nn.Cell] = weakref.WeakSet()


def is_unreplayable_dropout(cell: Any) -> bool:
    """An ``nn.Dropout``-family cell that draws random numbers when training."""
    if not isinstance(cell, _UNREPLAYABLE):
        return False
    keep_prob = getattr(cell, "keep_prob", None)
    if keep_prob is not None and keep_prob >= 1:
        return False
    drop_prob = getattr(cell, "p", None)
    if drop_prob is None:
        drop_prob = getattr(cell, "prob", None)  # nn.Dropout1d
    return not (drop_prob is not None and drop_prob <= 0)


def _recomputed_dropouts(cell: nn.Cell, path: str, exclude_type: type) -> Iterator[str]:
    if isinstance(cell, exclude_type):
        return
    if is_unreplayable_dropout(cell):
        yield path or type(cell).__name__
        return
    for name, child in cell.name_cells().items():
        yield from _recomputed_dropouts(child, f"{path}.{name}" if path else name, exclude_type)


def warn_recomputed_dropout(cell: Any, exclude_type: type, api: str) -> None:
    """Warn once per cell about each dropout cell in it that a replay would redraw."""
    if not isinstance(cell, nn.Cell) or cell in _checked:
        return
    _checked.add(cell)
    paths = list(_recomputed_dropouts(cell, "", exclude_type))
    if not paths:
        return
    warnings.warn(
        f"recomp.mindspore.{api}: {type(cell).__name__} contains {len(paths)} active "
        f"nn.Dropout cell(s) that the replay would recompute ({', '.join(paths)}). MindSpore "
        "cannot restore their random state, so the replay draws a new mask and the gradients "
        "are wrong. Wrap each in checkpoint_exclude_wrapper before checkpointing (or use "
        "recomp.mindspore.apply_activation_checkpointing, which does that), or use "
        "ops.dropout with mindspore.set_seed.",
        UnreplayableDropoutWarning,
        stacklevel=3,
    )
