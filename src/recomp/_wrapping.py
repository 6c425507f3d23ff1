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

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ._engine import ExcludedRegion
from .errors import WrapperNotReachedWarning

# Instance attributes recomp sets on a wrapped module (all removed by unwrap).
CHECKPOINT_KWARGS = "_recomp_checkpoint_kwargs"
REGION = "_recomp_region"
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

    def __reduce_ex__(self, protocol: Any) -> Any:
        # copy.deepcopy and pickle rebuild the wrapped class from (mixin, original
        # class), since the cached subclass cannot be found by name.
        reduced = super().__reduce_ex__(protocol)
        cls = type(self)
        base = cls.__dict__.get("_recomp_base")
        if base is None or not isinstance(reduced, tuple) or reduced[1] != (cls,):
            return reduced
        return (_rebuild, (cls.__bases__[0], base), *reduced[2:])


def _rebuild(mixin: type, base: type) -> Any:
    cls = wrapped_class(mixin, base)
    allocate: Callable[[type], Any] = mixin._recomp_allocate  # type: ignore[attr-defined]
    return allocate(cls)


def wrapped_class(mixin: type, base: type) -> type:
    """The cached subclass of (``mixin``, ``base``) that a wrapped module gets."""
    cls = _CLASSES.get((mixin, base))
    if cls is None:
        name = getattr(mixin, "_recomp_prefix", "") + base.__name__
        cls = type(
            name,
            (mixin, base),
            {"__module__": base.__module__, "__qualname__": name, "_recomp_base": base},
        )
        _CLASSES[(mixin, base)] = cls
    return cls


def recomp_wrapper_of(module: Any) -> type | None:
    """The recomp mixin in ``module``'s class, or None."""
    for cls in type(module).__mro__:
        if "_recomp_base" in cls.__dict__:
            return cls.__bases__[0]
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


def same_region(
    module: Any,
    exclude_wrapper: type,
    name: str | None,
    save_output: Any,
    copy_output: Any,
    offloader: Any,
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
        and region.offloader is offloader
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
    wrapped = [m for m in _walk(ops, module) if recomp_wrapper_of(m) is not None]
    if not wrapped:
        raise ValueError(
            f"{type(module).__name__} carries no recomp wrapper (neither it nor a module "
            f"below it was wrapped by checkpoint_wrapper or checkpoint_exclude_wrapper)."
        )
    for m in wrapped:
        if "_recomp_base" not in type(m).__dict__:
            raise ValueError(
                f"{type(m).__name__} was wrapped again after recomp (its class is now "
                f"{type(m).__qualname__}); undo that wrapping before unwrapping recomp's."
            )
    for m in wrapped:
        m.__class__ = type(m).__dict__["_recomp_base"]
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


def apply_activation_checkpointing(
    ops: ModelOps,
    model: Any,
    checkpoint_fn: Callable[[Any], bool],
    exclude_fn: Callable[[Any], bool] | None,
    wrap_checkpoint: Callable[[Any], Any],
    wrap_exclude: Callable[[Any, str], Any],
) -> Any:
    """Wrap, in place, each sub-module for which ``checkpoint_fn`` holds with
    ``wrap_checkpoint``, and inside those each sub-module for which ``exclude_fn``
    holds with ``wrap_exclude`` (named by its path, for error messages). Checkpoints
    are not nested; modules already wrapped are left as they are. Every module is
    checked before any is changed, so an error leaves the model as it was. Returns
    the model."""
    if not isinstance(model, ops.module_type):
        raise ValueError(
            f"apply_activation_checkpointing needs a {ops.module_type.__module__}."
            f"{ops.module_type.__qualname__}, got {type(model).__name__}."
        )
    planned: list[tuple[Any, str, bool]] = []  # (module, path, checkpoint?)
    claimed: set[int] = set()

    def plan(module: Any, path: str, checkpoint: bool) -> None:
        if id(module) not in claimed:
            claimed.add(id(module))
            planned.append((module, path, checkpoint))

    def exclude_inside(module: Any, path: str) -> None:
        if exclude_fn is None:
            return
        for name, child in ops.children(module):
            child_path = f"{path}.{name}" if path else name
            if isinstance(child, ops.exclude_wrapper) or id(child) in claimed:
                continue
            if not isinstance(child, ops.checkpoint_wrapper) and exclude_fn(child):
                plan(child, child_path, False)
            else:
                exclude_inside(child, child_path)

    def visit(module: Any, path: str) -> None:
        if isinstance(module, ops.exclude_wrapper) or id(module) in claimed:
            return
        if isinstance(module, ops.checkpoint_wrapper):
            exclude_inside(module, path)
        elif checkpoint_fn(module):
            plan(module, path, True)
            exclude_inside(module, path)
        else:
            for name, child in ops.children(module):
                visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    for module, _, checkpoint in planned:
        mixin = ops.checkpoint_wrapper if checkpoint else ops.exclude_wrapper
        check_wrappable(ops, module, mixin, "apply_activation_checkpointing")
    # Exclusions first: a checkpoint wrapper then sees its final contents (the
    # MindSpore one warns about what its replay cannot reproduce).
    for module, path, checkpoint in planned:
        if not checkpoint:
            wrap_exclude(module, path)
    for module, _, checkpoint in planned:
        if checkpoint:
            wrap_checkpoint(module)
    if planned:
        ReachCheck(ops, model, [(m, p) for m, p, _ in planned])
    return model


class ReachCheck:
    """Warns if the model's first forward after wrapping calls none of the wrapped modules.

    A wrapper that is never called is a silent no-op: the model trains as without
    recomp. One-shot hooks record whether any wrapped module ran; the model's
    forward hook checks that once, then removes them all. A copy or a pickle of
    the model gets a check that has already finished (its hooks do nothing).
    """

    def __init__(self, ops: ModelOps, model: Any, wrapped: list[tuple[Any, str]]) -> None:
        self.is_compiling = ops.is_compiling
        self.model_name = type(model).__qualname__
        self.paths = [path or "(the model itself)" for _, path in wrapped]
        self.reached = False
        self.done = False
        self.handles = [module.register_forward_pre_hook(self.mark) for module, _ in wrapped]
        self.handles.append(model.register_forward_hook(self.check))

    def mark(self, module: Any, args: Any) -> None:
        # Only eager calls count (``check`` skips compiled ones too). Under compilation
        # the hook may be traced inside a checkpoint's body, where Dynamo of PyTorch 2.9
        # refuses a write to an object from outside it (a graph break; 2.13 allows it).
        if not self.is_compiling():
            self.reached = True

    def check(self, module: Any, args: Any, output: Any) -> None:
        if self.done or self.is_compiling():
            return
        self.done = True
        for handle in self.handles:
            handle.remove()
        self.handles = []
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
    check.is_compiling = _not_compiling
    check.model_name, check.paths, check.handles = "", [], []
    check.reached = check.done = True
    return check


def check_option_fns(exclude_fn: Any, **option_fns: Any) -> None:
    """Per-region option callables of ``apply_activation_checkpointing`` need ``exclude_fn``."""
    for name, fn in option_fns.items():
        if fn is not None and exclude_fn is None:
            raise ValueError(
                f"{name} chooses an option of the excluded modules, but no exclude_fn was given: "
                f"pass exclude_fn too ({name} is asked only about the modules it excludes)."
            )


def check_callable(module: Any, api: str, kind: str) -> None:
    if not callable(module):
        raise ValueError(
            f"{api} needs a {kind} or a callable, got {type(module).__name__} ({module!r}). "
            f"Pass the {kind} (or function) itself."
        )


def default_name(module: Any) -> str:
    return getattr(module, "__name__", None) or type(module).__name__
