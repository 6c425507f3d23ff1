"""Public MindSpore API: ``checkpoint``, the two Cell wrappers, and model-wide wrapping."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import mindspore
from mindspore import nn

from .. import _engine, _wrapping
from .._hyperparallel import without_noop
from .._module_state import warn_unhandled
from .._op_policy import SelectivePart
from .._state import get_recompute_state
from .._wrapping import (
    CHECKPOINT_KWARGS,
    REGION,
    RegionCounters,
    check_callable,
    check_options,
    default_name,
)
from . import _compat, _swap
from ._backend import BACKEND, check_pynative
from ._cache import adapt_cache_kwargs
from ._communicating import (
    communicating_cells,
    issues_collectives,
    warn_own_collective,
    watch_first_forward,
)
from ._dropout import ReplayableDropout, is_unreplayable_dropout, make_dropout_replayable
from ._early_stop import EXPLAIN_EARLY_STOP
from ._graph_mode import pynative_only
from ._plain import PlainFunction
from ._replay_reach import REPLAY_REACHES_EVERY_REGION
from ._selective import create_selective_checkpoint_contexts

# The options a checkpoint wrapper passes to every checkpoint of its Cell:
# ``mindspore.recompute``'s non-reentrant ones, recomp's own and HyperParallel's swap
# options (``recomp.mindspore._swap.checkpoint_swap``).
CHECKPOINT_OPTIONS = (
    "context_fn",
    "cpu_pool",
    "early_stop",
    "exclude_collectives",
    "group_swap",
    "output_recompute",
    "policy_fn",
    "save_rng_state",
    "swap_inputs",
    "use_reentrant",
)


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    use_reentrant: bool | None = None,
    exclude_collectives: bool = True,
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

    HyperParallel's options: ``policy_fn=`` (per op, see
    :func:`recomp.mindspore.hyperparallel.create_selective_checkpoint_contexts`;
    ``MUST_SWAP`` keeps an op's output on the host until the replay reads it, never
    recomputed);
    ``swap_inputs=True`` moves the inputs the checkpoint saves to the host until the
    replay (NOTE [ Swap on MindSpore ] in ``recomp.mindspore._swap``);
    ``group_swap=True`` and ``cpu_pool=`` raise
    :class:`recomp.errors.SwapNotSupportedError`, which says what MindSpore lacks.
    A Cell in training called with a KV cache gets it turned off, with a warning
    (see ``recomp.mindspore._cache``).

    ``exclude_collectives`` (default True): if ``function`` is a Cell (or a Cell's
    method), the sub-cells of it that issue collectives become excluded regions the
    first time, so that the replay does not communicate; the first forward warns
    about a collective that still runs in recomputed code (see NOTE [ Collectives
    in a MindSpore checkpoint ]). False communicates again in the replay.
    """
    _engine.check_use_reentrant(use_reentrant, BACKEND.package)
    _engine.check_flag("exclude_collectives", exclude_collectives)
    if context_fn is not None:  # HyperParallel's no-op context_fn: none
        context_fn = without_noop(context_fn)
    if "saved_tensors_hooks" in kwargs:
        raise ValueError(
            "recomp.mindspore.checkpoint(..., saved_tensors_hooks=...) is not available: on "
            "MindSpore recomp does not yet route a user's pack/unpack pair to what a "
            "checkpoint keeps (PyTorch only). Drop the option, or wrap the call in "
            "mindspore.saved_tensors_hooks(pack, unpack), which sees the inputs it saves."
        )
    policy_fn, swap_inputs = _swap.checkpoint_swap("checkpoint", kwargs)
    check_callable(function, "checkpoint", "Cell")
    _refuse_value_check(kwargs, "checkpoint")
    check_pynative("checkpoint")
    cell = BACKEND.modules.module_of(function) if exclude_collectives else None
    if exclude_collectives:
        exclude_communicating_cells(cell, "checkpoint", once=True)
    make_dropout_replayable(function, MODEL_OPS, "checkpoint", once=True)
    if get_recompute_state() is None and not _compat.records_gradients():
        # NOTE [ Nothing to checkpoint without gradients ] (recomp.torch._api): outside
        # a gradient computation (mindspore.grad, value_and_grad, GradOperation) no
        # graph is built, so the block is called as it is, without the call's parts or
        # MindSpore's recompute (which would still save its inputs and install its
        # hooks). The Cells are prepared above, once, as with gradients: the same Cells
        # run either way.
        return function(*args, **_block_kwargs(kwargs))
    parts: list[_engine.CallPart] = []
    if exclude_collectives:
        watch = watch_first_forward(function if cell is None else cell)
        if watch is not None:
            parts.append(watch)
    if kwargs.setdefault("early_stop", False):
        parts.append(EXPLAIN_EARLY_STOP)
    parts.append(REPLAY_REACHES_EVERY_REGION)
    if policy_fn is not None:
        parts.append(SelectivePart(functools.partial(create_selective_checkpoint_contexts, policy_fn)))
    if BACKEND.grad_enabled():
        adapt_cache_kwargs(function, kwargs, ExcludeWrapper)
    restore_rng = bool(kwargs.pop("save_rng_state", True))
    call = _engine.begin(
        BACKEND,
        args,
        kwargs,
        context_fn,
        parts,
        align_rng=restore_rng,
        restore_rng=restore_rng,
        function=function,
    )
    if policy_fn is None and not swap_inputs:
        return mindspore.recompute(
            call.function,
            *args,
            use_reentrant=False,
            context_fn=call.context_fn,
            save_rng_state=False,
            **kwargs,
        )
    # One swap scope for the call: what MUST_SWAP ops keep and, with swap_inputs, the
    # inputs MindSpore's recompute saves (a saved-tensors hook around it sees them; its
    # own hooks, inside, take what the block saves).
    with _swap.layer_scope(function, hooks=swap_inputs) as finish:
        return finish(
            mindspore.recompute(
                call.function,
                *args,
                use_reentrant=False,
                context_fn=call.context_fn,
                save_rng_state=False,
                **kwargs,
            )
        )


#: Options of ``mindspore.recompute`` itself, never passed on to the block.
_RECOMPUTE_OPTIONS = frozenset({"early_stop", "output_recompute", "save_rng_state"})


def _block_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    if _RECOMPUTE_OPTIONS.isdisjoint(kwargs):
        return kwargs
    return {k: v for k, v in kwargs.items() if k not in _RECOMPUTE_OPTIONS}


def _refuse_value_check(options: dict[str, Any], api: str) -> None:
    """``determinism_check="values"`` compares what PyTorch's replay saves, through its
    checkpoint's saved-tensor hooks; MindSpore's recompute has no check of its own to
    extend, and recomp does not compare values there."""
    if options.get("determinism_check") == "values":
        raise ValueError(
            f'recomp.mindspore.{api}: determinism_check="values" is available on PyTorch '
            "only; MindSpore's recompute does not compare what its replay saves. Drop the "
            "option (recomp checks that the replay calls excluded regions as the forward did)."
        )


def _placed_at(named: list[tuple[str, Any]]) -> str | None:
    """The common path ``X`` of parameters all named ``X + relative name``, if any."""
    places = {p.name[: -len(n)] for n, p in named if p.name.endswith(n)}
    if len(places) != 1 or len(named) != sum(p.name.endswith(n) for n, p in named):
        return None
    return places.pop()


class _NamesKept:
    """Assigning a wrapped Cell back to where it came from keeps its parameters' names.

    MindSpore renames on assignment, and gets it wrong for a Cell that is already in
    place: ``Cell.__setattr__`` re-prefixes the parameters with the bare attribute
    name (``layers.0.attn.weight`` becomes ``attn.weight``, which an optimizer built
    right after wrapping sees as duplicates), and ``SequentialCell``/``CellList``
    item assignment guesses the container's path from the Cell's own parameter
    names, taking the last path segment equal to the index: in a one-element
    container of ``layer1.0.conv1.paths.0.features.0.weight`` it guesses
    ``layer1.0.conv1.paths.0.features.`` and renames the weight
    ``layer1.0.conv1.paths.0.features.0.conv1.paths.0.features.0.weight``. recomp
    wraps in place, so the Cell is where it was and its names are already right:
    a prefix that is such a re-prefixing of the path the names already carry
    keeps them; any other prefix renames as MindSpore does."""

    def update_parameters_name(self, prefix: str = "", recurse: bool = True) -> None:
        named = list(self.parameters_and_names(expand=recurse))  # type: ignore[attr-defined]
        place = _placed_at(named) if prefix and named else None
        if place is not None and (
            place == prefix
            or place.endswith(f".{prefix}")  # attribute assignment: the bare name
            # item assignment: a longer path guessed from the names themselves
            or (prefix.startswith(place) and named[0][1].name.startswith(prefix))
        ):
            return
        super().update_parameters_name(prefix, recurse)  # type: ignore[misc]


def _refuse_cell_recompute(cell: Any, *args: Any, **kwargs: Any) -> None:
    """``Cell.recompute()`` on a Cell recomp wrapped: refused, as wrapping a Cell on which
    it was called is (``_check_reachable``). MindSpore would capture recomp's own
    ``construct`` and replay it, running the excluded regions inside twice."""
    wrapper = _wrapping.recomp_wrapper_of(cell)
    name = "checkpoint_wrapper" if wrapper is CheckpointWrapper else "checkpoint_exclude_wrapper"
    what = (
        "recomp's checkpoint already recomputes it"
        if wrapper is CheckpointWrapper
        else "recomp keeps it out of every replay"
    )
    raise ValueError(
        f"Cell.recompute() was called on {type(cell).__name__}, which recomp wrapped ({name}): "
        f"{what}, and MindSpore's recompute around it would replay its excluded regions as "
        f"well. Drop the recompute() call, or call recomp.mindspore.unwrap(cell) first to use "
        f"MindSpore's recompute instead."
    )


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

    recompute = _refuse_cell_recompute

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
        options = self._recomp_checkpoint_kwargs
        if self.mixed_precision_type is not None:  # set by auto_mixed_precision / to_float
            own = _compat.with_mixed_precision(own, self.mixed_precision_type)
        return checkpoint(own, *args, **options, **kwargs)

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

    recompute = _refuse_cell_recompute

    @staticmethod
    def _recomp_allocate(cls: type) -> Any:
        return nn.Cell.__new__(cls)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        check_pynative("checkpoint_exclude_wrapper")
        return self._recomp_region.call(super().__call__, args, kwargs)

    @pynative_only("checkpoint_exclude_wrapper")
    def construct(self, *args: Any, **kwargs: Any) -> Any:
        check_pynative("checkpoint_exclude_wrapper")  # GRAPH_MODE, jit compile this directly
        self._recomp_region.check_method_call("construct")
        return super().construct(*args, **kwargs)

    def extend_repr(self) -> str:
        own = f"region={self.region.name!r}, save_output={self.save_output}"
        return ", ".join(part for part in (super().extend_repr(), own) if part)


# Cells whose communicating sub-cells a call of ``checkpoint`` already excluded (once each).
_collectives_checked = _wrapping.FirstLooks()


def exclude_communicating_cells(cell: Any, api: str, *, once: bool = False) -> None:
    """Make each innermost sub-cell of ``cell`` that issues collectives an excluded
    region, and warn if ``cell`` issues one in its own code (see NOTE [ Collectives in
    a MindSpore checkpoint ]). Every sub-cell is checked before any is wrapped. With
    ``once`` (a ``checkpoint`` call, every step), only the first call for ``cell`` looks."""
    if not isinstance(cell, nn.Cell):
        return
    if once and not _collectives_checked.first(cell):
        return
    own, found = communicating_cells(
        cell,
        skip=lambda c: isinstance(c, (ExcludeWrapper, ReplayableDropout)),
        can_exclude=lambda c: _wrapping.recomp_wrapper_of(c) is None,
    )
    if own:
        warn_own_collective(cell, own, api)
    for _, child, _ in found:
        _wrapping.check_wrappable(MODEL_OPS, child, ExcludeWrapper, api)
    for path, child, _ in found:
        checkpoint_exclude_wrapper(child, name=f"{type(cell).__name__}.{path}")


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

    MindSpore's dropout cells inside (``nn.Dropout``, ``Dropout1d/2d/3d``) get the
    class :class:`recomp.mindspore.ReplayableDropout` the same way: the forward
    keeps their mask (one byte per element) and the replay applies it again, so
    the gradients are exact and neither the dropout's output nor its input is kept.

    With ``exclude_collectives=True`` (the default) the innermost sub-cells that
    issue collectives become excluded regions now (see :func:`checkpoint`);
    ``unwrap`` takes them off with the rest.
    """
    check_callable(module, "checkpoint_wrapper", "Cell")
    _refuse_value_check(checkpoint_kwargs, "checkpoint_wrapper")
    check_options("checkpoint_wrapper", checkpoint_kwargs, CHECKPOINT_OPTIONS)
    _engine.check_use_reentrant(checkpoint_kwargs.pop("use_reentrant", None), BACKEND.package)
    exclude_collectives = checkpoint_kwargs.get("exclude_collectives", True)
    _engine.check_flag("exclude_collectives", exclude_collectives)
    _swap.checkpoint_swap("checkpoint_wrapper", dict(checkpoint_kwargs))  # checked now, not later
    if not isinstance(module, nn.Cell):
        module = PlainFunction(module)
    _wrapping.check_wrappable(MODEL_OPS, module, CheckpointWrapper, "checkpoint_wrapper")
    warn_unhandled(BACKEND, module, "checkpoint_wrapper")
    if exclude_collectives:
        exclude_communicating_cells(module, "checkpoint_wrapper")
    _wrapping.wrap_in_place(
        MODEL_OPS, module, CheckpointWrapper, {CHECKPOINT_KWARGS: checkpoint_kwargs}
    )
    make_dropout_replayable(module, MODEL_OPS, "checkpoint_wrapper")
    return module


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
    if isinstance(module, ReplayableDropout):
        # A dropout cell that recomp made replayable, now excluded: it runs once either way.
        _wrapping.unwrap(MODEL_OPS, module)
    _wrapping.check_wrappable(MODEL_OPS, module, ExcludeWrapper, "checkpoint_exclude_wrapper")
    return _wrapping.wrap_in_place(MODEL_OPS, module, ExcludeWrapper, {REGION: region})


def unwrap(module: Any) -> Any:
    """Undo recomp's wrapping of ``module`` and of every Cell below it, in place.

    Restores each wrapped Cell's class and removes recomp's attributes; returns
    ``module`` (or, for a function given to ``checkpoint_exclude_wrapper``, the function).
    The hooks of ``swap_wrapper`` are removed too.
    """
    if isinstance(module, type):
        raise _wrapping.instance_required(module, "unwrap", "Cell wrapped by recomp")
    swapped = _swap.unwrap_swaps(module)
    if swapped and not any(
        _wrapping.recomp_wrapper_of(c) is not None for _, c in module.cells_and_names()
    ):
        return module  # only swap wrappers below it
    return _wrapping.unwrap(MODEL_OPS, module)


# What each selection argument may be (see recomp._selection).
Selects = type | str | Callable[[Any], bool] | list[Any] | tuple[Any, ...]


def apply_activation_checkpointing(
    model: Any,
    *,
    checkpoint_fn: Selects | None = None,
    exclude_fn: Selects | None = None,
    copy_output_fn: Selects | None = None,
    layers: Sequence[int] | None = None,
    **checkpoint_kwargs: Any,
) -> Any:
    """Checkpoint every sub-cell ``checkpoint_fn`` selects, excluding inside them every
    sub-cell ``exclude_fn`` selects. Wraps in place (also inside
    ``SequentialCell``/``CellList``/``CellDict``), keeps every ``Parameter.name`` and
    returns the model. Checkpoints are not nested. Every cell is checked before any is
    wrapped: on an error the model is unchanged.

    Each of ``checkpoint_fn``, ``exclude_fn`` and ``copy_output_fn`` is a *selection*: a
    Cell class (``isinstance``), a cell path (a string matched against the end of each
    cell's dotted path in ``model``, at a dot, with ``fnmatch`` wildcards: ``"attn"``,
    ``"layers.*.mlp"``), a function of a Cell returning true for the cells to select, or
    a list or tuple of these (a cell any of them selects). Anything else, a Cell instance
    where its class or path was meant, or a path that matches no cell of ``model`` raises
    :class:`recomp.SelectionError`, and a class passed as ``model``
    :class:`recomp.InstanceRequiredError`, before anything is wrapped.
    ``copy_output_fn`` selects the excluded cells that get ``copy_output=True`` (see
    :func:`checkpoint_exclude_wrapper`).

    ``layers`` holds the checkpoints to some of the model's layers, by position from 0
    (``range(16)``, ``[0, 4, 8]``), as on PyTorch: ``checkpoint_fn`` then selects among
    the cells of those layers, and without it the chosen layers are checkpointed whole.
    The layers are those of a ``CellList``/``SequentialCell`` named ``layers`` (or, in a
    Hugging Face port, below the cell with ``gradient_checkpointing``), else the children
    of a model that is itself one; a bad value raises :class:`recomp.SelectionError`
    before anything is wrapped.

    Active ``nn.Dropout`` cells (and ``Dropout1d/2d/3d``) inside a checkpoint keep
    their mask for the replay (see :func:`checkpoint_wrapper`); a subclass of them
    with a ``construct`` of its own is excluded, whatever ``exclude_fn`` says:
    MindSpore cannot restore its random state, so a replay would draw another mask.

    With ``exclude_collectives=True`` (the default), the innermost sub-cells inside a
    checkpoint that issue collectives are excluded too (see :func:`checkpoint`);
    ``exclude_collectives=False`` lets the replay communicate again.

    Called again on a model wrapped before, it leaves every wrapper in place and adds:
    checkpoints where ``checkpoint_fn`` selects cells outside every checkpoint, excluded
    regions where ``exclude_fn`` selects cells inside one. It never removes an earlier
    call's exclusions; where an earlier checkpoint holds excluded regions this
    ``exclude_fn`` does not select, it says so with an
    :class:`recomp.EarlierExclusionsWarning` naming them. To replace the exclusions,
    :func:`unwrap` the model first and apply again.
    """
    api = "apply_activation_checkpointing"
    _wrapping.check_something_to_checkpoint(api, checkpoint_fn, layers)
    selected = _wrapping.read_selections(
        MODEL_OPS,
        model,
        api,
        {"checkpoint_fn": checkpoint_fn, "exclude_fn": exclude_fn, "copy_output_fn": copy_output_fn},
        required=("checkpoint_fn",) if layers is None else (),
    )
    chosen = _wrapping.read_layers(MODEL_OPS, model, api, layers)
    select_checkpoint = _wrapping.held_to_layers(selected["checkpoint_fn"], chosen)
    select_exclude, select_copy = selected["exclude_fn"], selected["copy_output_fn"]
    _wrapping.check_option_fns(select_exclude, copy_output_fn=select_copy)
    also_exclude = model_options(api, checkpoint_kwargs)

    def exclude_region(cell: Any, path: str) -> Any:
        copy = select_copy is not None and select_copy.matches(path, cell)
        return checkpoint_exclude_wrapper(cell, name=path, copy_output=copy)

    return _wrapping.apply_activation_checkpointing(
        MODEL_OPS,
        model,
        select_checkpoint,
        select_exclude,
        lambda c: checkpoint_wrapper(c, **checkpoint_kwargs),
        exclude_region,
        also_exclude=also_exclude,
    )


def model_options(api: str, checkpoint_kwargs: dict[str, Any]) -> Callable[[Any], bool]:
    """Check the checkpoint options of a whole-model call (``api``) before anything is
    wrapped (``use_reentrant`` popped); return what MindSpore excludes on its own: the
    unreplayable dropouts and, with ``exclude_collectives`` (the default), the sub-cells
    that issue collectives."""
    _refuse_value_check(checkpoint_kwargs, api)
    check_options(api, checkpoint_kwargs, CHECKPOINT_OPTIONS)
    _engine.check_use_reentrant(checkpoint_kwargs.pop("use_reentrant", None), BACKEND.package)
    _swap.checkpoint_swap(api, dict(checkpoint_kwargs))
    exclude_collectives = checkpoint_kwargs.get("exclude_collectives", True)
    _engine.check_flag("exclude_collectives", exclude_collectives)
    communicates = issues_collectives() if exclude_collectives else (lambda c: False)
    return lambda c: is_unreplayable_dropout(c) or communicates(c)


MODEL_OPS = _wrapping.ModelOps(
    framework="mindspore",
    module_type=nn.Cell,
    checkpoint_wrapper=CheckpointWrapper,
    exclude_wrapper=ExcludeWrapper,
    method="construct",
    children=lambda c: [(n, child) for n, child in c.name_cells().items() if child is not None],
    is_compiling=lambda: False,
    check_reachable=_check_reachable,
    hooks_may_remove_themselves=False,
    forward_hooks_run=_compat.forward_hooks_run,
    layer_containers=(nn.CellList, nn.SequentialCell, nn.CellDict),
)
