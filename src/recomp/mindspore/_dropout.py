"""MindSpore dropout cells inside a recomp checkpoint: the mask is kept, the output replayed.

NOTE [ Dropout cells replay from their kept mask ]
``nn.Dropout`` builds its primitive once, and on CPU the kernel keeps a random
state of its own in C++ that no Python API can read or restore; ``nn.Dropout1d``
(and ``ops.dropout1d/2d/3d``) draw from an unseeded kernel on every call.
Recomputed as they are, these cells draw a new mask in the replay, and the
backward pairs the forward's activations with another mask (wrong gradients,
with ``mindspore.recompute`` alone as well).

So ``checkpoint_wrapper``, ``checkpoint`` of a Cell and
``apply_activation_checkpointing`` give every such cell inside the checkpoint
the class :class:`ReplayableDropout` (mixed in front of its own class, in place,
like the two wrappers; ``unwrap`` takes it off). Its ``construct`` splits the
dropout in two:

1. drawing the mask: the cell's own primitive, run once, in the forward, as an
   excluded region whose cached output is the mask, as booleans (one byte per
   element; one per channel for the channel dropouts). The replay skips it and
   reads the kept mask; the primitive's random state advances once per step, as
   without recomp.
2. applying it: ``x * mask * (1 / keep_prob)``, computed in float32 with the
   kernel's own float32 scale, which gives the kernel's output and gradient bit
   for bit (checked on the CPU kernels for float16 and float32). It is ordinary
   recomputed code: the forward and the replay run the same ops and save the same
   tensors, so the checkpoint keeps neither the dropout's output nor its input.

A checkpointed block with dropout thus keeps one byte per dropped element instead
of the dropout's output. A subclass that brings its own ``construct`` is not
changed (recomp cannot know what it draws): ``apply_activation_checkpointing``
excludes it, and ``checkpoint_wrapper`` / ``checkpoint`` warn about it. Dropout
that draws from a generator recomp restores (``ops.dropout`` once
``mindspore.set_seed`` was called, ``ops.rand_like``-based cells such as the one
mindnlp 0.3.1 installs as ``nn.Dropout``) replays exactly and is left alone.
The classes are taken from the module that defines them, so that a library that
rebinds ``mindspore.nn.Dropout`` does not change what recomp looks for.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore import dtype as mstype
from mindspore.nn.layer import basic as _basic

from .. import _engine, _wrapping
from .._wrapping import REGION, RegionCounters
from ..errors import UnreplayableDropoutWarning, internal_assert
from . import _compat
from ._backend import BACKEND
from ._compat import with_mixed_precision
from ._graph_mode import pynative_only

_DROPOUT = _basic.Dropout
_DROPOUT_1D = _basic.Dropout1d
_DROPOUT_2D = _basic.Dropout2d
_DROPOUT_3D = _basic.Dropout3d
_FAMILY = (_DROPOUT, _DROPOUT_1D, _DROPOUT_2D, _DROPOUT_3D)

# Cells already made replayable by a call of ``checkpoint`` (each is looked at once).
_checked = _wrapping.FirstLooks()


def _keep_prob(cell: Any) -> float:
    """The probability of keeping an element, as the cell's own construct reads it."""
    if isinstance(cell, _DROPOUT_1D):
        return 1.0 - float(cell.prob)
    p = getattr(cell, "p", None)
    if isinstance(cell, _DROPOUT) and p is not None:
        return 1.0 - float(p)  # nn.Dropout(p=...) leaves keep_prob at its default
    return float(cell.keep_prob)


def is_dropout_cell(cell: Any) -> bool:
    """An ``nn.Dropout``-family cell that draws random numbers when training."""
    if not isinstance(cell, _FAMILY):
        return False
    return _keep_prob(cell) < 1


def _family_base(cls: type) -> type | None:
    """The MindSpore dropout class whose ``construct`` instances of ``cls`` run, if any."""
    for base in _FAMILY:
        if issubclass(cls, base) and cls.construct is base.construct:  # type: ignore[attr-defined]
            return base
    return None


def is_unreplayable_dropout(cell: Any) -> bool:
    """A dropout cell that redraws its mask in a replay and that recomp cannot change:
    a subclass of MindSpore's dropout cells with a ``construct`` of its own."""
    return is_dropout_cell(cell) and _family_base(type(cell)) is None


def _draw_dropout(cell: Any, x: Any) -> Any:
    _, mask = cell.dropout(x)
    return mask.astype(mstype.bool_)


def _draw_channel_mask(primitive: Any, x: Any, spatial: int) -> Any:
    # The mask is constant over the spatial axes: keep one value per channel.
    _, mask = primitive(x)
    index = (Ellipsis,) + (slice(0, 1),) * spatial
    return mask[index].astype(mstype.bool_)


def _draw_dropout_1d(cell: Any, x: Any) -> Any:
    # As ops.dropout1d: a fresh Dropout2D on the input with added axes.
    primitive = ops.Dropout2D(_keep_prob(cell))
    if x.ndim == 2:
        return _draw_channel_mask(primitive, x.expand_dims(0).expand_dims(-1), 2)[0, :, :, 0]
    if x.ndim == 3:
        return _draw_channel_mask(primitive, x.expand_dims(-1), 2)[..., 0]
    raise ValueError(f"For dropout1d, input shape should be 2D or 3D, but got {x.ndim}.")


_DRAW: dict[type, Callable[[Any, Any], Any]] = {
    _DROPOUT: _draw_dropout,
    _DROPOUT_1D: _draw_dropout_1d,
    _DROPOUT_2D: lambda cell, x: _draw_channel_mask(cell.dropout2d, x, 2),
    _DROPOUT_3D: lambda cell, x: _draw_channel_mask(cell.dropout3d, x, 3),
}


def apply_mask(x: Any, mask: Any, keep_prob: float) -> Any:
    """``x * mask / keep_prob`` exactly as MindSpore's dropout kernels compute it."""
    scale = Tensor(np.float32(1) / np.float32(keep_prob), mstype.float32)
    compute = mstype.float64 if x.dtype == mstype.float64 else mstype.float32
    if compute != mstype.float32:
        scale = scale.astype(compute)
    out = x.astype(compute) * mask.astype(compute) * scale
    return out.astype(x.dtype)


class ReplayableDropout(RegionCounters, _wrapping.WrapperMixin, nn.Cell):
    """The class recomp gives a MindSpore dropout cell inside a checkpoint.

    It draws the mask with the cell's own primitive once, keeps it for the replay
    and applies it to the replay's input (see NOTE [ Dropout cells replay from
    their kept mask ]); outside a checkpoint it is the same dropout. The region
    counters count the draws (``region_runs``) and the replays that read the kept
    mask (``region_skips``); ``region_saved_bytes`` is the mask's size.
    """

    _recomp_prefix = "Replayable"
    _recomp_public = ("region", "region_runs", "region_skips", "region_saved_bytes")
    _recomp_region: _engine.ExcludedRegion

    @staticmethod
    def _recomp_allocate(cls: type) -> Any:
        return nn.Cell.__new__(cls)

    @pynative_only("checkpoint_wrapper")
    def construct(self, x: Any) -> Any:
        keep_prob = _keep_prob(self)
        if not self.training or keep_prob >= 1:
            return x
        draw = _DRAW[self._recomp_base_dropout]
        mask = self._recomp_region.call(lambda t: draw(self, t), (ops.stop_gradient(x),), {})
        if self.mixed_precision_type is not None:
            # auto_mixed_precision would cast the float32 arithmetic to the cell's type
            return with_mixed_precision(apply_mask, _compat.no_mixed_precision())(
                x, mask, keep_prob
            )
        return apply_mask(x, mask, keep_prob)

    @property
    def _recomp_base_dropout(self) -> type:
        base = _family_base(type(self)._recomp_base)
        internal_assert(base is not None, "a ReplayableDropout runs a MindSpore dropout's construct")
        return base  # type: ignore[return-value]


def _dropout_cells(cell: nn.Cell, path: str, exclude_type: type) -> Iterator[tuple[str, Any]]:
    """(path, cell) for each active dropout cell that code run by ``cell`` would recompute."""
    if isinstance(cell, exclude_type):
        return
    if is_dropout_cell(cell):
        yield path or type(cell).__name__, cell
        return
    for name, child in cell.name_cells().items():
        if child is not None:
            yield from _dropout_cells(child, f"{path}.{name}" if path else name, exclude_type)


def make_dropout_replayable(
    cell: Any, model_ops: _wrapping.ModelOps, api: str, *, once: bool = False
) -> None:
    """Give each dropout cell below ``cell`` that a replay would recompute the class
    :class:`ReplayableDropout`; warn about those it cannot take. With ``once`` (a
    ``checkpoint`` call, every step), only the first call for ``cell`` looks."""
    if not isinstance(cell, nn.Cell):
        return
    if once and not _checked.first(cell):
        return
    unreplayable = []
    owner = type(cell).__name__
    for path, dropout in _dropout_cells(cell, "", model_ops.exclude_wrapper):
        if isinstance(dropout, ReplayableDropout):
            continue
        if dropout is cell or _family_base(type(dropout)) is None or _wrapping.recomp_wrapper_of(dropout):
            unreplayable.append(path)
            continue
        region = _engine.ExcludedRegion(BACKEND, f"{owner}.{path} (dropout mask)", True, False)
        _wrapping.wrap_in_place(model_ops, dropout, ReplayableDropout, {REGION: region})
    if unreplayable:
        _warn_unreplayable(cell, unreplayable, api)


def _warn_unreplayable(cell: Any, paths: list[str], api: str) -> None:
    warnings.warn(
        f"recomp.mindspore.{api}: {type(cell).__name__} contains {len(paths)} active "
        f"dropout cell(s) that the replay would recompute and that recomp cannot make "
        f"replayable ({', '.join(paths)}): a subclass of nn.Dropout with a construct of its "
        "own draws a new mask in the replay, and the gradients are wrong. Wrap each in "
        "checkpoint_exclude_wrapper before checkpointing (apply_activation_checkpointing "
        "does that), or draw with ops.dropout after mindspore.set_seed.",
        UnreplayableDropoutWarning,
        stacklevel=4,
    )
