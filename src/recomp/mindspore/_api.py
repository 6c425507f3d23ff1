"""Public MindSpore API: ``checkpoint``, the two Cell wrappers, and model-wide wrapping."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mindspore
from mindspore import nn

from .. import _engine, _wrapping
from .._wrapping import WRAPPED, RegionCounters, check_callable, default_name
from ._backend import BACKEND, check_pynative
from ._cache import adapt_cache_kwargs
from ._dropout import exclude_dropout_too, warn_recomputed_dropout
from ._early_stop import explain_stop_in_dropout
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
    _engine.check_use_reentrant(use_reentrant, "mindspore")
    check_pynative("checkpoint")
    if kwargs.setdefault("early_stop", False):
        context_fn = explain_stop_in_dropout(context_fn)
    if BACKEND.grad_enabled():
        adapt_cache_kwargs(function, kwargs, ExcludeWrapper)
    warn_recomputed_dropout(function, ExcludeWrapper, "checkpoint")
    restore_rng = bool(kwargs.pop("save_rng_state", True))
    context = _engine.begin(
        BACKEND, args, kwargs, context_fn, align_rng=restore_rng, restore_rng=restore_rng
    )
    return mindspore.recompute(
        function,
        *args,
        use_reentrant=False,
        context_fn=context,
        save_rng_state=False,
        **kwargs,
    )


class _TransparentWrapper(nn.Cell):
    """A Cell around ``_checkpoint_wrapped_module`` that looks like it from outside.

    ``Parameter.name`` (what ``save_checkpoint`` and ``load_param_into_net``
    match on) stays what it would be without the wrapper: the inner cell takes
    the wrapper's own place in ``cells_and_names``, and wrapping a cell that
    already sits in a model keeps its parameters' names. Unknown attributes
    fall through to the inner cell.
    """

    def __init__(self, inner: Any) -> None:
        super().__init__(auto_prefix=False)
        qualified = isinstance(inner, nn.Cell) and any(
            param.name != name for name, param in inner.parameters_and_names()
        )
        setattr(self, WRAPPED, inner)
        # True when the inner cell's parameters already carry their model path.
        self._recomp_keep_names = qualified

    def cells_and_names(
        self, cells: Any = None, name_prefix: str = ""
    ) -> Iterator[tuple[str, Any]]:
        seen = cells if cells else set()
        if self in seen:
            return
        seen.add(self)
        yield name_prefix, self
        inner = self._cells.get(WRAPPED)
        if inner is not None:
            yield from inner.cells_and_names(seen, name_prefix)

    def update_parameters_name(self, prefix: str = "", recurse: bool = True) -> None:
        if not self._recomp_keep_names:
            super().update_parameters_name(prefix, recurse)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_cells", {}).get(WRAPPED) or self.__dict__.get(WRAPPED)
            if inner is None or name == WRAPPED:
                raise
            return getattr(inner, name)

    def __getitem__(self, key: Any) -> Any:
        return getattr(self, WRAPPED)[key]


class CheckpointWrapper(_TransparentWrapper):
    """Runs every call of the wrapped Cell as a recomp :func:`checkpoint`."""

    def __init__(self, module: Any, **checkpoint_kwargs: Any) -> None:
        check_callable(module, "checkpoint_wrapper", "Cell")
        _engine.check_use_reentrant(checkpoint_kwargs.pop("use_reentrant", None), "mindspore")
        super().__init__(module)
        self.checkpoint_kwargs = checkpoint_kwargs
        warn_recomputed_dropout(module, ExcludeWrapper, "checkpoint_wrapper")

    @pynative_only("checkpoint_wrapper")
    def construct(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(getattr(self, WRAPPED), *args, **self.checkpoint_kwargs, **kwargs)


class ExcludeWrapper(RegionCounters, _TransparentWrapper):
    """Keeps the wrapped Cell or function out of the replay of recomp checkpoints.

    Inside a recomp checkpoint, it runs once in the forward, keeps its saved
    tensors and output, and returns the cached output when the forward is
    replayed. Anywhere else it is a plain call. ``region_runs`` and
    ``region_skips`` count executions and skipped replays; ``region_saved_bytes``
    is what the last call keeps for backward.
    """

    def __init__(self, module: Any, *, save_output: bool = True, name: str | None = None) -> None:
        check_callable(module, "checkpoint_exclude_wrapper", "Cell")
        _engine.check_save_output(save_output)
        super().__init__(module)
        self.save_output = save_output
        self.region = _engine.ExcludedRegion(BACKEND, name or default_name(module), save_output)

    @pynative_only("checkpoint_exclude_wrapper")
    def construct(self, *args: Any, **kwargs: Any) -> Any:
        check_pynative("checkpoint_exclude_wrapper")
        return self.region.call(getattr(self, WRAPPED), args, kwargs)


def checkpoint_wrapper(module: Any, **checkpoint_kwargs: Any) -> CheckpointWrapper:
    """Wrap ``module`` so that every call is a recomp :func:`checkpoint` (options pass through)."""
    return CheckpointWrapper(module, **checkpoint_kwargs)


def checkpoint_exclude_wrapper(
    module: Any, *, save_output: bool = True, name: str | None = None
) -> ExcludeWrapper:
    """Wrap a Cell or function so that recomp checkpoints never replay it.

    ``save_output=False`` does not cache the output: valid only when it goes
    straight into another excluded region (whose saved tensors already hold
    it). The end of the checkpoint's forward raises
    :class:`recomp.errors.OutputNotSavedError` if it went nowhere else.
    """
    return ExcludeWrapper(module, save_output=save_output, name=name)


def apply_activation_checkpointing(
    model: Any,
    *,
    checkpoint_fn: Callable[[Any], bool],
    exclude_fn: Callable[[Any], bool] | None = None,
    **checkpoint_kwargs: Any,
) -> Any:
    """Checkpoint every sub-cell for which ``checkpoint_fn`` is true, excluding inside them
    every sub-cell for which ``exclude_fn`` is true. Wraps in place, keeps every
    ``Parameter.name``, and returns the model (a new wrapper if ``model`` itself
    is checkpointed). Checkpoints are not nested; cells already wrapped are left alone.

    Active ``nn.Dropout`` cells (and ``Dropout1d/2d/3d``) inside a checkpoint are
    excluded too, whatever ``exclude_fn`` says: MindSpore cannot restore their
    random state, so a replay would draw another mask and give wrong gradients.
    """
    return _wrapping.apply_activation_checkpointing(
        _MODEL_OPS, model, checkpoint_fn, exclude_dropout_too(exclude_fn), checkpoint_kwargs
    )


_MODEL_OPS = _wrapping.ModelOps(
    module_type=nn.Cell,
    checkpoint_wrapper=CheckpointWrapper,
    exclude_wrapper=ExcludeWrapper,
    children=lambda c: list(c.name_cells().items()),
    replace_child=lambda c, name, child: c.insert_child_to_cell(name, child),
)
