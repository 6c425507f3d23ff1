"""Framework-free parts of the module wrappers: the in-place class swap, model-wide
wrapping, unwrapping and region counters.

A wrapped module is the same object as before: only its class changes, to a
subclass of (recomp mixin, original class) made once per pair and cached (the way
FSDP2's ``fully_shard`` does it). Its attributes, its place in every parent
container (including the run lists of MindSpore's ``SequentialCell``/``CellList``),
the names of its parameters and sub-modules and ``isinstance`` checks against the
original class all stay. What recomp adds lives in the instance ``__dict__`` under
``_recomp_*`` names, which ``unwrap`` removes again.
"""

from __future__ import annotations

import difflib
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ._engine import ExcludedRegion
from ._record import weak_or_nothing
from ._region import REGION_ATTRIBUTE
from ._selection import LayerChoice, Selection, find_layers, walk_named
from .errors import (
    EarlierExclusionsWarning,
    IneffectiveSelectionWarning,
    InstanceRequiredError,
    RecompError,
    SelectionError,
    WrapperNotReachedWarning,
    internal_assert,
)

# Instance attributes recomp sets on a wrapped module (all removed by unwrap).
CHECKPOINT_KWARGS = "_recomp_checkpoint_kwargs"
REGION = REGION_ATTRIBUTE
# A ``forward``/``construct`` assigned on the instance before wrapping: it would
# shadow the mixin's method, so it is moved here while the module is wrapped.
MOVED_METHOD = "_recomp_instance_method"
_RECOMP_ATTRS = (CHECKPOINT_KWARGS, REGION, MOVED_METHOD)

# (mixin, original class) -> the class a wrapped module gets.
_CLASSES: dict[tuple[type, type], type] = {}


class WrapperMixin:
    """What both frameworks' wrapper mixins share. Not instantiated on its own."""

    # Set on each cached subclass: the class the module had before wrapping.
    _recomp_base: type
    # Prefix of the cached subclass's name ("Checkpointed" + "Block").
    _recomp_prefix = ""
    # Public names the mixin adds; a module that already has one cannot be wrapped.
    _recomp_public: tuple[str, ...] = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A wrapped container that builds a new instance of its own class (slicing a
        # Sequential or SequentialCell) gets a plain one of the original class.
        base = getattr(cls, "_recomp_base", None)
        if base is None:
            raise TypeError(
                f"{cls.__name__} marks modules wrapped by recomp and is not built directly: "
                f"use checkpoint_wrapper(module) or checkpoint_exclude_wrapper(module)."
            )
        obj = base.__new__(base, *args, **kwargs)
        obj.__init__(*args, **kwargs)
        return obj

    @staticmethod
    def _recomp_allocate(cls: type) -> Any:
        """A new, uninitialised instance of ``cls`` (the framework's own allocation)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        # The class reports the original name (tools that look classes up by name
        # must find it); the repr still shows the wrapper.
        return self._recomp_prefix + super().__repr__()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # copy.deepcopy and pickle rebuild the wrapped class from (mixin, original
        # class), since the cached subclass cannot be found by name.
        reduced = super().__reduce_ex__(protocol)
        cls = type(self)
        base = cls.__dict__.get("_recomp_base")
        if base is None or not isinstance(reduced, tuple) or reduced[1] != (cls,):
            return reduced
        return (_rebuild, (cls.__dict__["_recomp_mixin"], base), *reduced[2:])


def _rebuild(mixin: type, base: type) -> Any:
    cls = wrapped_class(mixin, base)
    allocate: Callable[[type], Any] = mixin._recomp_allocate  # type: ignore[attr-defined]
    return allocate(cls)


def wrapped_class(mixin: type, base: type) -> type:
    """The cached subclass of (``mixin``, ``base``) that a wrapped module gets.

    It carries ``base``'s name, qualified name and module: code that finds layer
    classes by ``module.__class__.__name__`` (accelerate's FSDP wrap policies,
    ``_no_split_modules``, DeepSpeed's leaf modules) sees the model as it was.
    ``recomp_wrapper_of`` tells the wrapped class apart, and the repr shows it.
    Its instance layout is always ``base``'s, so that a module's class can be
    swapped both ways (see ``_layout_root``).
    """
    cls = _CLASSES.get((mixin, base))
    if cls is None:
        namespace = {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "_recomp_base": base,
            "_recomp_mixin": mixin,
        }
        cls = type(base.__name__, (mixin, base), namespace)
        if not _same_layout(cls, base):
            cls = _mixin_first(mixin, base)(base.__name__, (base, mixin), namespace)
        _CLASSES[(mixin, base)] = cls
    return cls


# NOTE [ Keeping the instance layout of a wrapped class ]
# Python lets ``module.__class__`` change only between classes of one instance
# layout, found by walking each class's ``__base__`` while nothing is added to the
# layout: the two walks must end at one class, or at two that add the same slots to
# the same ``__base__``. A class made as (mixin, base) takes the mixin as its
# ``__base__`` (the first of bases with equal layouts wins), so its walk ends at
# recomp's mixin, whose ``__base__`` is ``object``. That matches a module class whose
# walk also ends at a class directly on ``object`` (``nn.Module``, ``Cell``), but not
# one whose bases put a slot-free class first (``class Router(ABC, MegatronModule)``,
# ``Generic[T]`` first): there the walk ends at a class on ``ABC``. For those the
# wrapped class lists ``base`` first (so ``base`` is its ``__base__`` and the layout
# is ``base``'s own) and a metaclass derived from ``base``'s puts the mixin's methods
# first in the method resolution order again, as (mixin, base) would have.


def _layout_root(cls: type) -> type:
    """Where Python's walk for a ``__class__`` assignment check stops (see the NOTE)."""
    while True:
        parent = cls.__base__
        if parent is None or _layout(cls) != _layout(parent):
            return cls
        cls = parent


def _layout(cls: type) -> tuple[int, ...]:
    return (cls.__basicsize__, cls.__itemsize__, cls.__dictoffset__, cls.__weakrefoffset__)


def _same_layout(new: type, old: type) -> bool:
    new_root, old_root = _layout_root(new), _layout_root(old)
    return new_root is old_root or (
        new_root.__base__ is old_root.__base__ and _layout(new_root) == _layout(old_root)
    )


_METACLASSES: dict[type, type] = {}


def _mixin_first(mixin: type, base: type) -> type:
    """A metaclass for a class made as (``base``, ``mixin``) whose method resolution
    order is the one (``mixin``, ``base``) would have (see the NOTE)."""
    meta = type(base)
    made = _METACLASSES.get(meta)
    if made is None:

        def mro(cls: type) -> list[type]:
            base_mro = cls.__dict__["_recomp_base"].__mro__
            own = [c for c in cls.__dict__["_recomp_mixin"].__mro__ if c not in base_mro]
            return [cls, *own, *base_mro]

        made = type(f"MixinFirst{meta.__name__}", (meta,), {"mro": mro, "__module__": __name__})
        _METACLASSES[meta] = made
    return made


class FirstLooks:
    """Modules a check already looked at. A check that runs on every call of
    ``checkpoint`` (every step) looks at each module the first time only; weak
    references, so a module dropped by the user is dropped here too."""

    def __init__(self) -> None:
        self._seen: weakref.WeakSet[Any] = weakref.WeakSet()

    def __contains__(self, module: Any) -> bool:
        return module in self._seen

    def first(self, module: Any) -> bool:
        """True the first time ``module`` is looked at, False after."""
        if module in self._seen:
            return False
        self._seen.add(module)
        return True


def recomp_wrapper_of(module: Any) -> type | None:
    """The recomp mixin in ``module``'s class, or None."""
    for cls in type(module).__mro__:
        if "_recomp_base" in cls.__dict__:
            mixin: type = cls.__dict__["_recomp_mixin"]
            return mixin
    return None


class RegionCounters:
    """Read-only counters of an exclude wrapper (mixed into each framework's class)."""

    @property
    def region(self) -> ExcludedRegion:
        """The excluded region behind this wrapper (its ``name`` appears in errors)."""
        region: ExcludedRegion = self._recomp_region  # type: ignore[attr-defined]
        return region

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

    @property
    def save_output(self) -> bool:
        """Whether the output is cached for the replay (see ``checkpoint_exclude_wrapper``)."""
        return self.region.save_output


@dataclass(frozen=True)
class ModelOps:
    """How to walk and wrap one framework's module tree."""

    framework: str
    module_type: type
    checkpoint_wrapper: type
    exclude_wrapper: type
    # "forward" or "construct": the method the checkpoint mixin overrides.
    method: str
    children: Callable[[Any], Iterable[tuple[str, Any]]]
    # True while a compiler traces the model (the reach check then stays out of the way).
    is_compiling: Callable[[], bool]
    # Raises if the framework would run ``module`` without calling the wrapper's method.
    check_reachable: Callable[[Any, str], None]
    # Whether a module's hook may remove itself while it runs: PyTorch loops over a copy
    # of the hooks; MindSpore loops over the dictionary itself, and removing a hook that
    # others follow breaks that loop ("OrderedDict mutated during iteration").
    hooks_may_remove_themselves: bool = True
    # For a module whose class another library derived from recomp's after wrapping
    # (a PyTorch parametrization): the class it gets when recomp's is taken out from
    # under the other one, given (module, recomp's class, the original class); None
    # where the framework knows no way.
    rebase_foreign: Callable[[Any, type, type], type | None] = lambda m, wrapped, base: None
    # Whether a forward hook on the model runs now: a library may have replaced the
    # framework's hook runner with one that fails (mindnlp 0.3.1 on MindSpore).
    forward_hooks_run: Callable[[], bool] = lambda: True
    # The framework's list and dict containers (where a model's layers are found:
    # NOTE [ A model's layers ] in _selection.py).
    layer_containers: tuple[type, ...] = ()
    # Whether a module hook that the compiler traces now may write to a Python object (a
    # side effect the compiler replays after its graph): where it may, a compiled call of
    # a wrapped module counts as reaching it (a model whose layers were compiled one by one
    # before its first forward).
    hooks_may_write_while_compiling: Callable[[], bool] = lambda: False


def same_region(
    module: Any,
    exclude_wrapper: type,
    name: str | None,
    save_output: Any,
    copy_output: Any,
    placer: Any,
) -> bool:
    """Whether ``module`` is already an excluded region with these options, so that
    ``checkpoint_exclude_wrapper`` called on it again (inline, in the checkpointed
    function, as region APIs are often used) can return it unchanged."""
    if not isinstance(module, exclude_wrapper):
        return False
    region: ExcludedRegion = module._recomp_region  # type: ignore[attr-defined]
    return (
        region.save_output is save_output
        and region.copy_output is copy_output
        and (region.placer is placer or region.placer == placer)
        and (name is None or name == region.name)
    )


def check_wrappable(ops: ModelOps, module: Any, mixin: type, api: str) -> None:
    """Raise, changing nothing, if ``module`` cannot be wrapped in place by ``mixin``."""
    existing = recomp_wrapper_of(module)
    if existing is not None:
        raise ValueError(
            f"{type(module).__name__} is already wrapped by recomp "
            f"({'checkpoint_wrapper' if existing is ops.checkpoint_wrapper else 'checkpoint_exclude_wrapper'}). "
            f"A module carries one recomp wrapper: call recomp.{ops.framework}.unwrap(module) "
            f"first to wrap it differently."
        )
    if mixin is ops.checkpoint_wrapper:
        ops.check_reachable(module, api)
    public: tuple[str, ...] = getattr(mixin, "_recomp_public", ())
    taken = [name for name in public if _has_attribute(module, name)]
    if taken:
        raise ValueError(
            f"{api} cannot wrap {type(module).__name__}: it already has "
            f"{', '.join(repr(n) for n in taken)}, which the wrapped module must expose for "
            f"recomp. Rename that attribute of {type(module).__name__}."
        )


def _has_attribute(module: Any, name: str) -> bool:
    try:
        getattr(module, name)
    except AttributeError:
        return False
    return True


def wrap_in_place(ops: ModelOps, module: Any, mixin: type, attrs: dict[str, Any]) -> Any:
    """Give ``module`` the class (``mixin``, its class) and recomp's attributes."""
    try:
        module.__class__ = wrapped_class(mixin, type(module))
    except TypeError as exc:
        raise ValueError(
            f"recomp cannot give {type(module).__name__} a wrapper class ({exc}). Wrap a "
            f"module defined in Python, or pass a function to checkpoint_exclude_wrapper."
        ) from exc
    if mixin is ops.checkpoint_wrapper:
        attrs = {**attrs, MOVED_METHOD: module.__dict__.pop(ops.method, None)}
    module.__dict__.update(attrs)
    region = attrs.get(REGION)
    if region is not None:
        region.module = weak_or_nothing(module)
    return module


def unwrap(ops: ModelOps, module: Any) -> Any:
    """Undo recomp's wrapping of ``module`` and of every module below it."""
    if not isinstance(module, ops.module_type):
        raise ValueError(
            f"recomp.{ops.framework}.unwrap needs a module wrapped by recomp, got "
            f"{type(module).__name__} ({module!r})."
        )
    fn = getattr(module, "_recomp_function", None)
    if fn is not None and recomp_wrapper_of(module) is not None:
        return fn
    named = [(p, m) for p, m in walk_named(ops.children, module) if recomp_wrapper_of(m) is not None]
    wrapped = [m for _, m in named]
    if not wrapped:
        raise ValueError(
            f"{type(module).__name__} carries no recomp wrapper (neither it nor a module "
            f"below it was wrapped by checkpoint_wrapper or checkpoint_exclude_wrapper)."
        )
    pending = [
        path or type(module).__name__
        for path, m in named
        if REGION in m.__dict__ and m.__dict__[REGION].last_call() is not None
    ]
    if pending:
        raise RecompError(
            f"recomp.{ops.framework}.unwrap: excluded region(s) {_shown(pending)} ran in a "
            f"forward whose backward has not run yet, and that backward's replay needs them "
            f"wrapped. Call unwrap after the backward (or before the forward); to drop that "
            f"step instead, let go of its outputs and loss first. Nothing was unwrapped."
        )
    # Modules whose class another library derived from recomp's after wrapping: recomp's
    # class is taken out from under that one where the framework knows how; everything
    # is decided before anything changes.
    rebased: dict[int, type] = {}
    stuck = []
    for path, m in named:
        if "_recomp_base" in type(m).__dict__:
            continue
        ours = next(c for c in type(m).__mro__ if "_recomp_base" in c.__dict__)
        new_class = ops.rebase_foreign(m, ours, ours.__dict__["_recomp_base"])
        if new_class is None:
            stuck.append(
                f"{path or type(module).__name__} ({type(m).__module__}.{type(m).__qualname__})"
            )
        else:
            rebased[id(m)] = new_class
    if stuck:
        raise ValueError(
            f"recomp.{ops.framework}.unwrap: {len(stuck)} module(s) got another class on top of "
            f"recomp's after recomp wrapped them: {', '.join(stuck[:3])}. recomp cannot take its "
            f"class out from under that one, so nothing was unwrapped. Undo that other wrapping "
            f"first, call unwrap, then apply it again if you still need it."
        )
    for m in wrapped:
        m.__class__ = rebased.get(id(m)) or type(m).__dict__["_recomp_base"]
        moved = m.__dict__.pop(MOVED_METHOD, None)
        for name in _RECOMP_ATTRS:
            m.__dict__.pop(name, None)
        if moved is not None:
            m.__dict__[ops.method] = moved
    return module


def _walk(ops: ModelOps, root: Any) -> list[Any]:
    """``root`` and every module below it, each once (children as the framework lists them)."""
    seen = {id(root)}
    out = [root]
    for module in out:
        for _, child in ops.children(module):
            if id(child) not in seen:
                seen.add(id(child))
                out.append(child)
    return out


def check_model(ops: ModelOps, model: Any, api: str) -> None:
    """Refuse, changing nothing, a ``model`` that is not a module of the framework (a
    module class among them: the model itself is needed, not its class)."""
    if isinstance(model, type):
        raise instance_required(model, api, f"{ops.framework} model")
    if not isinstance(model, ops.module_type):
        raise ValueError(
            f"{api} needs a {ops.module_type.__module__}.{ops.module_type.__qualname__}, "
            f"got {type(model).__name__}."
        )


def read_selections(
    ops: ModelOps,
    model: Any,
    api: str,
    values: dict[str, Any],
    required: tuple[str, ...] = (),
) -> dict[str, Selection | None]:
    """The selections of a whole-model call (``api``), by argument name, each read by
    ``Selection.parse`` (those in ``required`` must select something), and their module
    paths checked against ``model``'s (measured from the model). Raises, changing
    nothing, on a model that is no module, a bad selection or a path matching nothing."""
    check_model(ops, model, api)
    named = walk_named(ops.children, model)
    paths = {id(m): p for p, m in named}
    out: dict[str, Selection | None] = {}
    for argument, value in values.items():
        selection = Selection.parse(
            value,
            argument,
            api,
            ops.module_type,
            required=argument in required,
            locate=lambda m: paths.get(id(m)) or None,
        )
        if selection is not None:
            selection.check_paths(api, named, type(model).__name__)
        out[argument] = selection
    return out


def check_something_to_checkpoint(api: str, checkpoint_fn: Any, layers: Any) -> None:
    """A whole-model call needs ``checkpoint_fn`` or ``layers`` (``SelectionError``)."""
    if checkpoint_fn is None and layers is None:
        raise SelectionError(
            f"{api}: checkpoint_fn got None and no layers were given, so nothing is chosen "
            f"to checkpoint. Pass checkpoint_fn (the modules to checkpoint: a class, a module "
            f"path such as 'layers.*', a function of a module) or layers (the layers to "
            f"checkpoint whole, by position: range(16), [0, 4, 8])."
        )


def read_layers(
    ops: ModelOps, model: Any, api: str, value: Any, argument: str = "layers"
) -> list[tuple[str, Any]] | None:
    """The layers ``value`` (``layers=`` of a whole-model call: positions, see
    :class:`LayerChoice`) chooses among ``model``'s, with their paths; None for None.
    Raises ``SelectionError``, changing nothing, on a bad value, a model without layers
    or a position past its last layer."""
    choice = LayerChoice.parse(value, argument, api)
    if choice is None:
        return None
    check_model(ops, model, api)
    layers = find_layers(ops.children, model, ops.layer_containers, api, argument)
    return choice.resolve(layers, api, type(model).__name__)


def held_to_layers(
    checkpoint: Selection | None, layers: list[tuple[str, Any]] | None, argument: str = "layers"
) -> Selection:
    """What a whole-model call checkpoints: ``checkpoint`` (``checkpoint_fn``) held to
    ``layers`` where given, the layers themselves where ``checkpoint`` is None."""
    if layers is None:
        internal_assert(checkpoint is not None, "checkpoint_fn is required without layers=")
        return checkpoint  # type: ignore[return-value]
    return (checkpoint or Selection.every_module(argument)).within(layers)


@dataclass
class WrapPlan:
    """What a whole-model call will wrap, found and checked before anything changes
    (:func:`plan_checkpointing`); :meth:`carry_out` wraps."""

    ops: ModelOps
    model: Any
    # (module, path, checkpoint?) in the order found.
    planned: list[tuple[Any, str, bool]]
    # Paths of the checkpoints, planned or already wrapped (in the selection's layers).
    checkpoints: list[str]
    # Paths of the modules excluded by ``exclude``, planned or already wrapped.
    exclusions: list[str]
    # Paths of modules selected as checkpoints that ``exclude`` also selects.
    excluded_checkpoints: list[str]
    # Regions in earlier checkpoints that ``exclude`` does not select.
    kept_earlier: list[str]

    def carry_out(
        self, wrap_checkpoint: Callable[[Any], Any], wrap_exclude: Callable[[Any, str], Any]
    ) -> None:
        """Wrap what was planned: exclusions first (a checkpoint wrapper then sees its
        final contents; the MindSpore one warns about what its replay cannot
        reproduce), then the checkpoints; then the reach check."""
        for module, path, is_checkpoint in self.planned:
            if not is_checkpoint:
                wrap_exclude(module, path)
        for module, _, is_checkpoint in self.planned:
            if is_checkpoint:
                wrap_checkpoint(module)
        if self.planned:
            ReachCheck(self.ops, self.model, [(m, p) for m, p, _ in self.planned])


def plan_checkpointing(
    ops: ModelOps,
    model: Any,
    checkpoint: Selection,
    exclude: Selection | None,
    also_exclude: Callable[[Any], bool] | None = None,
    api: str = "apply_activation_checkpointing",
) -> WrapPlan:
    """What :func:`apply_activation_checkpointing` wraps, every module checked
    (``check_wrappable``) and nothing changed."""
    check_model(ops, model, api)
    planned: list[tuple[Any, str, bool]] = []  # (module, path, checkpoint?)
    claimed: set[int] = set()
    checkpoints: list[str] = []
    exclusions: list[str] = []
    excluded_checkpoints: list[str] = []
    kept_earlier: list[str] = []

    def plan(module: Any, path: str, is_checkpoint: bool) -> None:
        if id(module) not in claimed:
            claimed.add(id(module))
            planned.append((module, path, is_checkpoint))

    def exclude_inside(module: Any, path: str, earlier: bool) -> None:
        if exclude is None and also_exclude is None:
            return
        for name, child in ops.children(module):
            child_path = f"{path}.{name}" if path else name
            if isinstance(child, ops.exclude_wrapper):
                exclusions.append(child_path)
                if (
                    earlier
                    and exclude is not None
                    and not exclude.matches(child_path, child)
                    and not (also_exclude is not None and also_exclude(child))
                ):
                    kept_earlier.append(child_path)
                continue
            if id(child) in claimed:
                continue
            if isinstance(child, ops.checkpoint_wrapper):
                exclude_inside(child, child_path, earlier)
            elif exclude is not None and exclude.matches(child_path, child):
                exclusions.append(child_path)
                plan(child, child_path, False)
            elif also_exclude is not None and also_exclude(child):
                plan(child, child_path, False)
            else:
                exclude_inside(child, child_path, earlier)

    def visit(module: Any, path: str) -> None:
        if isinstance(module, ops.exclude_wrapper) or id(module) in claimed:
            return
        if isinstance(module, ops.checkpoint_wrapper):
            # Checkpoints are not nested: nothing below an earlier one is checkpointed,
            # and exclusions are added only in the layers the selection is held to.
            if checkpoint.in_scope(path):
                checkpoints.append(path)
                exclude_inside(module, path, True)
        elif checkpoint.matches(path, module):
            checkpoints.append(path)
            if exclude is not None and exclude.matches(path, module):
                excluded_checkpoints.append(path or "(the model itself)")
            plan(module, path, True)
            exclude_inside(module, path, False)
        else:
            for name, child in ops.children(module):
                visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    for module, _, is_checkpoint in planned:
        mixin = ops.checkpoint_wrapper if is_checkpoint else ops.exclude_wrapper
        check_wrappable(ops, module, mixin, api)
    return WrapPlan(ops, model, planned, checkpoints, exclusions, excluded_checkpoints, kept_earlier)


def apply_activation_checkpointing(
    ops: ModelOps,
    model: Any,
    checkpoint: Selection,
    exclude: Selection | None,
    wrap_checkpoint: Callable[[Any], Any],
    wrap_exclude: Callable[[Any, str], Any],
    also_exclude: Callable[[Any], bool] | None = None,
    api: str = "apply_activation_checkpointing",
) -> Any:
    """Wrap, in place, each sub-module that ``checkpoint`` selects with
    ``wrap_checkpoint``, and inside those each sub-module that ``exclude`` (or the
    framework's own ``also_exclude``) selects with ``wrap_exclude`` (named by its path,
    for error messages). Paths are measured from ``model``. Checkpoints are not nested;
    modules already wrapped are left as they are. Every module is checked before any is
    changed, so an error leaves the model as it was. Warns (``IneffectiveSelectionWarning``)
    when ``checkpoint`` or ``exclude`` selects nothing that takes effect, and
    (``EarlierExclusionsWarning``) when checkpoints wrapped before hold excluded regions
    that ``exclude`` does not select: those stay, this call adds to them (NOTE [ A second
    call adds exclusions ]). Returns the model."""
    wrap = plan_checkpointing(ops, model, checkpoint, exclude, also_exclude, api)
    wrap.carry_out(wrap_checkpoint, wrap_exclude)
    checkpoints, exclusions = wrap.checkpoints, wrap.exclusions
    excluded_checkpoints, kept_earlier = wrap.excluded_checkpoints, wrap.kept_earlier
    if not checkpoints and checkpoint.scope == ():
        pass  # no layer was chosen (layers=range(0)): nothing to checkpoint, as asked
    elif not checkpoints and checkpoint.scope is not None:
        _warn_selection(
            f"{checkpoint.argument} matched no module in the {len(checkpoint.scope)} layer(s) "
            f"chosen by layers= ({_shown(list(checkpoint.scope))}), so nothing is "
            f"checkpointed and the model trains as without recomp. Leave checkpoint_fn out "
            f"to checkpoint those layers whole, or make it select modules inside them.",
            api,
        )
    elif not checkpoints:
        _warn_selection(
            f"{checkpoint.argument} matched no module of {type(model).__name__}, so nothing is "
            f"checkpointed and the model trains as without recomp. Its module classes "
            f"include {_class_names(ops, model)}; check that {checkpoint.argument} tests for "
            f"one of them (a class of the same name imported from another module is another "
            f"class).",
            api,
        )
    elif exclude is not None:
        _check_exclusions(ops, model, exclude, exclusions, excluded_checkpoints, api)
    if kept_earlier:
        warnings.warn(
            f"{api}: checkpoints wrapped before this call hold excluded regions that this "
            f"{exclude.argument if exclude is not None else 'exclude_fn'} does not select: "
            f"{_shown(kept_earlier)}. They stay excluded: a call adds its exclusions to those "
            f"already in place, it does not replace them. To have only this call's "
            f"exclusions, call recomp.{ops.framework}.unwrap(model) first and apply again.",
            EarlierExclusionsWarning,
            stacklevel=3,
        )
    return model


# NOTE [ A second call adds exclusions ]
# apply_activation_checkpointing on a model it (or checkpoint_exclude_wrapper) wrapped
# before leaves every wrapper in place and adds what this call selects: new checkpoints
# where ``checkpoint_fn`` selects modules no checkpoint encloses, new excluded regions
# where ``exclude_fn`` selects modules inside a checkpoint. It never unwraps: an earlier
# region may be a hand-made one, carry options (offload, copy_output) this call does not
# know, or be waited for by a backward still to run. Where an earlier checkpoint holds a
# region this call's ``exclude_fn`` does not select, the result is not what this call
# alone says, so it warns (EarlierExclusionsWarning), naming the regions and
# ``unwrap(model)`` as the way to start over. ``exclude_fn=None`` says nothing about
# exclusions: no warning. The framework's own exclusions (``also_exclude``: MindSpore's
# communicating sub-cells and unreplayable dropouts) are never counted as earlier ones.


def _check_exclusions(
    ops: ModelOps,
    model: Any,
    exclude: Selection,
    exclusions: list[str],
    excluded_checkpoints: list[str],
    api: str,
) -> None:
    """Warn when ``exclude`` selected modules where an exclusion cannot take effect."""
    name = exclude.argument
    reasons = []
    if excluded_checkpoints:
        reasons.append(
            f"it matches checkpointed modules themselves ({_shown(excluded_checkpoints)}): a "
            f"module is either checkpointed or excluded, and these are checkpointed; to keep "
            f"part of one out of the replay, make {name} select its sub-modules"
        )
    if not exclusions:
        outside = [
            path or "(the model itself)"
            for path, module in _outside_checkpoints(ops, model, "")
            if exclude.matches(path, module)
        ]
        if outside:
            reasons.append(
                f"it matches only modules outside every checkpoint ({_shown(outside)}), "
                f"which no replay recomputes anyway"
            )
        elif not excluded_checkpoints:
            reasons.append("it matches no module inside a checkpoint")
    if reasons:
        head = (
            f"{name} excluded no module inside a checkpoint: "
            if not exclusions
            else f"{name} excluded {len(exclusions)} module(s), but "
        )
        _warn_selection(f"{head}{'; '.join(reasons)}.", api)


def _outside_checkpoints(ops: ModelOps, module: Any, path: str) -> Iterable[tuple[str, Any]]:
    """``module`` and the modules below it that no checkpoint encloses."""
    if isinstance(module, ops.checkpoint_wrapper):
        return
    yield path, module
    for name, child in ops.children(module):
        yield from _outside_checkpoints(ops, child, f"{path}.{name}" if path else name)


def _class_names(ops: ModelOps, model: Any, limit: int = 8) -> str:
    """The model's module classes, those of the model's own code before the framework's."""
    names: list[str] = []
    for module in _walk(ops, model):
        name = type(module).__name__
        if name not in names:
            names.append(name)
    own = {
        type(m).__name__
        for m in _walk(ops, model)
        if type(m).__module__.split(".")[0] != ops.framework
    }
    names.sort(key=lambda name: name not in own)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _shown(paths: list[str], limit: int = 3) -> str:
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(repr(p) for p in paths[:limit]) + more


def _warn_selection(message: str, api: str) -> None:
    # Called from apply_activation_checkpointing: the user's call is 3 frames up.
    warnings.warn(f"{api}: {message}", IneffectiveSelectionWarning, stacklevel=4)


class ReachCheck:
    """Warns if the model's first forward after wrapping calls none of the wrapped modules.

    A wrapper that is never called is a silent no-op: the model trains as without
    recomp. One-shot hooks record whether any wrapped module ran; the model's
    forward hook checks that once, then removes them all. Where forward hooks
    cannot run (see ``ModelOps.forward_hooks_run``), a forward pre-hook on the
    model checks at the start of its second call instead. A copy or a pickle of
    the model gets a check that has already finished (its hooks do nothing).
    """

    def __init__(self, ops: ModelOps, model: Any, wrapped: list[tuple[Any, str]]) -> None:
        self.is_compiling = ops.is_compiling
        self.may_write_compiled = ops.hooks_may_write_while_compiling
        self.remove_running_hook = ops.hooks_may_remove_themselves
        self.model_name = type(model).__qualname__
        self.paths = [path or "(the model itself)" for _, path in wrapped]
        self.reached = False
        self.done = False
        self.model_calls = 0
        self.handles = [module.register_forward_pre_hook(self.mark) for module, _ in wrapped]
        if ops.forward_hooks_run():
            self.handles.append(model.register_forward_hook(self.check))
        else:
            self.handles.append(model.register_forward_pre_hook(self.check_at_next_call))

    def check_at_next_call(self, module: Any, args: Any) -> None:
        if not self.done and not self.is_compiling():
            self.model_calls += 1
            if self.model_calls == 2:
                self.check(module, args, None)

    def mark(self, module: Any, args: Any) -> None:
        # A compiled call counts where the hook may write (``check`` itself skips
        # compiled calls of the model): traced inside a checkpoint's body, Dynamo of
        # PyTorch 2.9 refuses a write to an object from outside it (a graph break; 2.13
        # allows it); a checkpointed layer's own hook runs outside its checkpoint.
        if not self.is_compiling() or self.may_write_compiled():
            self.reached = True

    def check(self, module: Any, args: Any, output: Any) -> None:
        if self.done or self.is_compiling():
            return
        self.done = True
        # The last handle is this hook's own: where the framework's loop over the
        # model's hooks cannot take a removal (see ModelOps), it stays and does nothing.
        keep = 0 if self.remove_running_hook else 1
        for handle in self.handles[: len(self.handles) - keep]:
            handle.remove()
        self.handles = self.handles[len(self.handles) - keep :]
        if not self.reached:
            shown = ", ".join(repr(p) for p in self.paths[:3])
            more = f" and {len(self.paths) - 3} more" if len(self.paths) > 3 else ""
            warnings.warn(
                f"apply_activation_checkpointing wrapped {shown}{more} in {self.model_name}, "
                f"but the model's first forward called none of the wrapped modules, so no "
                f"checkpoint or exclusion is in effect. The model runs them some other way "
                f"(a method or a copy taken before wrapping, a compiled graph): wrap the "
                f"modules its forward calls.",
                WrapperNotReachedWarning,
                stacklevel=2,
            )

    def __reduce__(self) -> Any:
        return (_finished_check, ())


def _not_compiling() -> bool:
    return False


def _finished_check() -> ReachCheck:
    check = ReachCheck.__new__(ReachCheck)
    check.is_compiling = check.may_write_compiled = _not_compiling
    check.remove_running_hook = True
    check.model_name, check.paths, check.handles = "", [], []
    check.model_calls = 0
    check.reached = check.done = True
    return check


def check_option_fns(exclude_fn: Any, **option_fns: Any) -> None:
    """Per-region option selections of ``apply_activation_checkpointing`` need ``exclude_fn``."""
    for name, fn in option_fns.items():
        if fn is not None and exclude_fn is None:
            raise ValueError(
                f"{name} chooses an option of the excluded modules, but no exclude_fn was given: "
                f"pass exclude_fn too ({name} is asked only about the modules it excludes)."
            )


def instance_required(cls: type, api: str, kind: str) -> InstanceRequiredError:
    """The error for the class ``cls`` passed to ``api``, which needs a ``kind``."""
    name = cls.__name__
    return InstanceRequiredError(
        f"{api} needs a {kind}, got the class {name} itself: calling it would build a new "
        f"{name}, not run one. Pass an instance, e.g. {api}({name}(...)), or the one your "
        f"model holds ({api}(model.layer))."
    )


def check_callable(module: Any, api: str, kind: str) -> None:
    """Refuse, before anything changes, what cannot be checkpointed or excluded: a
    non-callable (``None``), and a class, which a call would construct rather than run."""
    if isinstance(module, type):
        raise instance_required(module, api, f"{kind} or a callable")
    if not callable(module):
        raise ValueError(
            f"{api} needs a {kind} or a callable, got {type(module).__name__} ({module!r}). "
            f"Pass the {kind} (or function) itself."
        )


def check_options(api: str, given: dict[str, Any], accepted: tuple[str, ...]) -> None:
    """Refuse checkpoint options ``api`` does not know (a typo would otherwise reach the
    module's ``forward``/``construct`` as a keyword argument on every call)."""
    unknown = [name for name in given if name not in accepted]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, accepted, n=1)
        if close:
            hints.append(f"{name!r} (did you mean {close[0]!r}?)")
        else:
            hints.append(repr(name))
    raise TypeError(
        f"{api} got unknown option(s) {', '.join(hints)}. It accepts "
        f"{', '.join(accepted)}; arguments of the wrapped module are passed when it is called."
    )


def default_name(module: Any) -> str:
    return getattr(module, "__name__", None) or type(module).__name__
