"""Public MindSpore API: ``checkpoint``, the two Cell wrappers, and model-wide wrapping."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mindspore
from mindspore import nn

from .. import _engine, _wrapping
from .._running_stats import warn_unhandled
from .._wrapping import CHECKPOINT_KWARGS, REGION, RegionCounters, check_callable, default_name
from . import _compat
from ._backend import BACKEND, check_pynative
from ._cache import adapt_cache_kwargs
from ._dropout import is_unreplayable_dropout, warn_recomputed_dropout
from ._early_stop import explain_stop_inside_an_op
from ._graph_mode import pynative_only


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Checkpoint ``function(*args, **kwargs)`` with recomp's recompute state installed.

    Built on ``mindspore.recompute(..., use_reentrant=False)`` in PyNative mode;
    its options pass through. ``early_stop`` defaults to False here: MindSpore
    2.10's early stop fails in backward ("Stack input_args_info_stack_ is empty")
    when the last tensor a block saves comes from a dropout. ``context_fn`` is
    composed with recomp's contexts, which are entered first. The random state is
    restored for the replay by recomp, including the per-op kernel seeds that
    MindSpore's own restore misses on CPU; ``save_rng_state=False`` turns that off.
    A Cell in training called with a KV cache gets it turned off, with a warning
    (see ``recomp.mindspore._cache``).
    """
    _engine.check_use_reentrant(use_reentrant, BACKEND.package)
    check_pynative("checkpoint")
    if kwargs.setdefault("early_stop", False):
        context_fn = explain_stop_inside_an_op(context_fn)
    if BACKEND.grad_enabled():
        adapt_cache_kwargs(function, kwargs, ExcludeWrapper)
    warn_recomputed_dropout(function, ExcludeWrapper, "checkpoint")
    restore_rng = bool(kwargs.pop("save_rng_state", True))
    context = _engine.begin(
        BACKEND,
        args,
        kwargs,
        context_fn,
        align_rng=restore_rng,
        restore_rng=restore_rng,
        function=function,
    )
    return mindspore.recompute(
        function,
        *args,
        use_reentrant=False,
        context_fn=context,
        save_rng_state=False,
        **kwargs,
    )


class _NamesKept:
    """Assigning a wrapped Cell back to the attribute it came from keeps its parameters'
    names. MindSpore's ``Cell.__setattr__`` re-prefixes a Cell's parameters with the
    bare attribute name (``layers.0.attn.weight`` becomes ``attn.weight``), which an
    optimizer built right after wrapping sees as duplicates; recomp wraps in place,
    so the Cell is where it was and its names are already right."""

    def update_parameters_name(self, prefix: str = "", recurse: bool = True) -> None:
        named = list(self.parameters_and_names(expand=recurse))  # type: ignore[attr-defined]
        if prefix and named and all(p.name.endswith(f".{prefix}{n}") for n, p in named):
            return
        super().update_parameters_name(prefix, recurse)  # type: ignore[misc]


class CheckpointWrapper(_NamesKept, _wrapping.WrapperMixin, nn.Cell):
    """The class of every Cell wrapped by :func:`checkpoint_wrapper` derives from this.

    ``construct`` runs the Cell's own ``construct`` as a recomp :func:`checkpoint`.
    Hooks registered on the Cell itself run outside the checkpoint; hooks of its
    sub-cells run inside it.
    """

    _recomp_prefix = "Checkpointed"
    _recomp_public = ("checkpoint_kwargs",)
    _recomp_checkpoint_kwargs: dict[str, Any]
    _recomp_instance_method: Callable[..., Any] | None

    @staticmethod
    def _recomp_allocate(cls: type) -> Any:
        return nn.Cell.__new__(cls)

    @property
    def checkpoint_kwargs(self) -> dict[str, Any]:
        """Options passed to every :func:`checkpoint` of this Cell."""
        kwargs: dict[str, Any] = self._recomp_checkpoint_kwargs
        return kwargs

    @pynative_only("checkpoint_wrapper")
    def construct(self, *args: Any, **kwargs: Any) -> Any:
        own = self._recomp_instance_method or super().construct
        return checkpoint(own, *args, **self._recomp_checkpoint_kwargs, **kwargs)

    def extend_repr(self) -> str:
        own = ", ".join(f"{k}={v!r}" for k, v in self._recomp_checkpoint_kwargs.items())
        return ", ".join(part for part in (super().extend_repr(), own) if part)


class ExcludeWrapper(RegionCounters, _NamesKept, _wrapping.WrapperMixin, nn.Cell):
    """The class of every Cell wrapped by :func:`checkpoint_exclude_wrapper` derives from this.

    Inside a recomp checkpoint, a call of the Cell (its hooks included) runs
    once in the forward, keeps its saved tensors and output, and returns the
    cached output when the forward is replayed. Anywhere else it is a plain
    call. ``region_runs`` and ``region_skips`` count executions and skipped
    replays; ``region_saved_bytes`` is what the last call keeps for backward.
    """

    _recomp_prefix = "Excluded"
    _recomp_public = ("region", "region_runs", "region_skips", "region_saved_bytes", "save_output")
    _recomp_region: _engine.ExcludedRegion

    @staticmethod
    def _recomp_allocate(cls: type) -> Any:
        return nn.Cell.__new__(cls)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        check_pynative("checkpoint_exclude_wrapper")
        return self._recomp_region.call(super().__call__, args, kwargs)

    @pynative_only("checkpoint_exclude_wrapper")
    def construct(self, *args: Any, **kwargs: Any) -> Any:
        check_pynative("checkpoint_exclude_wrapper")  # GRAPH_MODE, jit compile this directly
        _wrapping.check_method_call(self._recomp_region, "construct")
        return super().construct(*args, **kwargs)

    def extend_repr(self) -> str:
        own = f"region={self.region.name!r}, save_output={self.save_output}"
        return ", ".join(part for part in (super().extend_repr(), own) if part)


class PlainFunction(nn.Cell):
    """A plain function (or a Primitive) as a Cell, so that it can be an excluded region."""

    def __init__(self, function: Callable[..., Any]) -> None:
        super().__init__(auto_prefix=False)
        object.__setattr__(self, "_recomp_function", function)

    def construct(self, *args: Any, **kwargs: Any) -> Any:
        return self._recomp_function(*args, **kwargs)

    def extend_repr(self) -> str:
        return f"function={default_name(self._recomp_function)}"


def _check_reachable(cell: Any, api: str) -> None:
    """Raise if MindSpore would run ``cell`` without calling its ``construct`` attribute."""
    if _compat.recompute_called(cell):
        raise ValueError(
            f"{api} cannot checkpoint {type(cell).__name__}: Cell.recompute() was called on it, "
            f"so MindSpore runs the construct it saw then and would never reach recomp's "
            f"checkpoint. Drop the recompute() call: recomp's checkpoint replaces it."
        )


def checkpoint_wrapper(module: Any, **checkpoint_kwargs: Any) -> Any:
    """Make every call of ``module`` a recomp :func:`checkpoint` (options pass through).

    Wraps in place and returns the same Cell: its class becomes a subclass of its
    own class and :class:`CheckpointWrapper`, so ``Parameter.name``, containers
    (``SequentialCell``, ``CellList``) and ``isinstance`` checks are unchanged.
    :func:`unwrap` undoes it. A plain function is put in a small Cell first.
    """
    check_callable(module, "checkpoint_wrapper", "Cell")
    _engine.check_use_reentrant(checkpoint_kwargs.pop("use_reentrant", None), BACKEND.package)
    if not isinstance(module, nn.Cell):
        module = PlainFunction(module)
    _wrapping.check_wrappable(_MODEL_OPS, module, CheckpointWrapper, "checkpoint_wrapper")
    warn_recomputed_dropout(module, ExcludeWrapper, "checkpoint_wrapper")
    warn_unhandled(BACKEND, module, "checkpoint_wrapper")
    return _wrapping.wrap_in_place(
        _MODEL_OPS, module, CheckpointWrapper, {CHECKPOINT_KWARGS: checkpoint_kwargs}
    )


def checkpoint_exclude_wrapper(
    module: Any, *, save_output: bool = True, copy_output: bool = False, name: str | None = None
) -> Any:
    """Make a Cell or function a region that recomp checkpoints never replay.

    Wraps a Cell in place and returns it (see :func:`checkpoint_wrapper`); a
    plain function comes back as a small Cell around it.
    ``save_output=False`` does not cache the output: valid only when it goes
    straight into another excluded region (whose saved tensors already hold
    it). The end of the checkpoint's forward raises
    :class:`recomp.errors.OutputNotSavedError` if it went nowhere else.
    ``copy_output=True`` caches a copy of the output instead of an alias: for a
    region whose output the code after it changes in place (a library's
    ``out += identity`` after a normalization, ``ReLU(inplace=True)``), which
    otherwise raises :class:`recomp.errors.CachedValueMutatedError`. It costs
    one more copy of the output.
    """
    check_callable(module, "checkpoint_exclude_wrapper", "Cell")
    if _wrapping.same_region(module, ExcludeWrapper, name, save_output, copy_output, None):
        return module  # wrapped inline again (in the checkpointed function): the same region
    region = _engine.ExcludedRegion(
        BACKEND, name or default_name(module), save_output, copy_output
    )
    if not isinstance(module, nn.Cell):
        module = PlainFunction(module)
    _wrapping.check_wrappable(_MODEL_OPS, module, ExcludeWrapper, "checkpoint_exclude_wrapper")
    return _wrapping.wrap_in_place(_MODEL_OPS, module, ExcludeWrapper, {REGION: region})


def unwrap(module: Any) -> Any:
    """Undo recomp's wrapping of ``module`` and of every Cell below it, in place.

    Restores each wrapped Cell's class and removes recomp's attributes; returns
    ``module`` (or, for a function given to ``checkpoint_exclude_wrapper``, the function).
    """
    return _wrapping.unwrap(_MODEL_OPS, module)


def apply_activation_checkpointing(
    model: Any,
    *,
    checkpoint_fn: Callable[[Any], bool] | type | tuple[type, ...],
    exclude_fn: Callable[[Any], bool] | type | tuple[type, ...] | None = None,
    copy_output_fn: Callable[[Any], bool] | type | tuple[type, ...] | None = None,
    **checkpoint_kwargs: Any,
) -> Any:
    """Checkpoint every sub-cell for which ``checkpoint_fn`` is true, excluding inside them
    every sub-cell for which ``exclude_fn`` is true. Wraps in place (also inside
    ``SequentialCell``/``CellList``/``CellDict``), keeps every ``Parameter.name`` and
    returns the model. Checkpoints are not nested; cells already wrapped are left
    alone. Every cell is checked before any is wrapped: on an error the model is unchanged.

    Active ``nn.Dropout`` cells (and ``Dropout1d/2d/3d``) inside a checkpoint are
    excluded too, whatever ``exclude_fn`` says: MindSpore cannot restore their
    random state, so a replay would draw another mask and give wrong gradients.
    ``copy_output_fn`` gives, for each excluded cell, its ``copy_output=`` option
    (see :func:`checkpoint_exclude_wrapper`). Each ``*_fn`` may also be a class or a
    tuple of classes, meaning ``isinstance(c, classes)``.
    """
    select_checkpoint = _wrapping.as_predicate(checkpoint_fn, "checkpoint_fn", required=True)
    select_exclude = _wrapping.as_predicate(exclude_fn, "exclude_fn")
    select_copy = _wrapping.as_predicate(copy_output_fn, "copy_output_fn")
    _wrapping.check_option_fns(select_exclude, copy_output_fn=select_copy)
    choose_copy = select_copy or (lambda c: False)
    _engine.check_use_reentrant(checkpoint_kwargs.pop("use_reentrant", None), BACKEND.package)
    return _wrapping.apply_activation_checkpointing(
        _MODEL_OPS,
        model,
        select_checkpoint,
        select_exclude,
        lambda c: checkpoint_wrapper(c, **checkpoint_kwargs),
        lambda c, path: checkpoint_exclude_wrapper(c, name=path, copy_output=bool(choose_copy(c))),
        also_exclude=is_unreplayable_dropout,
    )


_MODEL_OPS = _wrapping.ModelOps(
    framework="mindspore",
    module_type=nn.Cell,
    checkpoint_wrapper=CheckpointWrapper,
    exclude_wrapper=ExcludeWrapper,
    method="construct",
    children=lambda c: [(n, child) for n, child in c.name_cells().items() if child is not None],
    is_compiling=lambda: False,
    check_reachable=_check_reachable,
    hooks_may_remove_themselves=False,
)
