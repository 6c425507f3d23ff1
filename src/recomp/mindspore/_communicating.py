"""Sub-cells that communicate, excluded from a checkpoint's replay (``exclude_collectives``).

NOTE [ Collectives in a MindSpore checkpoint ]
MindSpore has no hook below autodiff through which a replay could read a kept
collective result and still get the collective's own backward (``AllReduce``'s
gradient is itself an all-reduce). An excluded region has both: it runs once,
keeps its output and what its ops save, and its backward is the one recorded in
the forward. So with ``exclude_collectives=True`` (the default) a checkpoint
excludes the innermost sub-cells that issue a collective themselves:

* found when the checkpoint is set up, by looking at each sub-cell: a
  communication primitive held as an attribute (or in a list, dict or object
  held as one), or named by its ``construct``, directly or through a function, a
  method of the cell or a custom ``_Function``'s ``forward`` that it names
  (``_SEARCH_DEPTH`` calls deep; MindSpore's own functions are known by identity,
  not followed). A cell that issues a collective itself is excluded whole;
  otherwise its sub-cells are looked at.
* checked at the first forward of each checkpointed cell (or function given to
  ``checkpoint`` on its own, which has no sub-cells to exclude): a collective that
  runs in its recomputed code outside every excluded region warns once
  (``CollectiveReplayedWarning``), naming the innermost cell running it. That
  covers the checkpointed cell's own ``construct`` (which cannot be excluded from
  its own checkpoint) and what the search above cannot see (a primitive built
  from a string, a collective reached through an object it does not follow).
"""

from __future__ import annotations

import dis
import inspect
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from mindspore import nn

from .._hooks import CallPart, CheckpointCallView, Stage
from .._region import active_region
from .._state import get_recompute_state
from .._wrapping import FirstLooks
from ..errors import CollectiveReplayedWarning
from . import collectives
from ._backend import BACKEND
from ._compat import function_base

# How many calls deep the search follows functions named by a cell's construct.
_SEARCH_DEPTH = 4

_LOADS = {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_FAST"}
_ATTRS = {"LOAD_ATTR", "LOAD_METHOD"}

# Checkpointed cells already warned about (once each) or already watched once.
_warned = FirstLooks()
_watched = FirstLooks()


class _Search:
    """What counts as communication, and the functions already looked at."""

    def __init__(self) -> None:
        self.primitives = tuple(collectives.primitive_classes())
        self.functions = collectives.collective_functions()
        self.function_type = function_base()
        self.seen: dict[tuple[int, int], str | None] = {}

    def of_object(self, obj: Any, depth: int) -> str | None:
        """The collective ``obj`` is or issues when called, if any."""
        if isinstance(obj, self.primitives):
            return type(obj).__name__
        if isinstance(obj, type):
            if issubclass(obj, self.primitives):
                return obj.__name__
            if issubclass(obj, self.function_type) and obj is not self.function_type:
                found = self.of_function(inspect.getattr_static(obj, "forward", None), None, depth)
                return f"{obj.__name__}.forward: {found}" if found else None
            return None
        if callable(obj) and id(obj) in self.functions:
            return self.functions[id(obj)]
        if isinstance(obj, types.MethodType) and not isinstance(obj.__self__, type):
            return self.of_function(obj.__func__, obj.__self__, depth)
        if isinstance(obj, types.FunctionType):
            return self.of_function(obj, None, depth)
        return None

    def of_function(self, fn: Any, owner: Any, depth: int) -> str | None:
        """The collective that code of ``fn`` (run with ``self`` = ``owner``) names, if any."""
        if isinstance(fn, staticmethod):
            fn = fn.__func__
        if not isinstance(fn, types.FunctionType) or depth <= 0:
            return None
        if fn.__module__ and fn.__module__.split(".")[0] == "mindspore":
            return None  # MindSpore's own code: its collectives are known by identity
        key = (id(fn.__code__), id(owner))
        if key in self.seen:
            return self.seen[key]
        self.seen[key] = None  # recursion ends here
        found = self._of_code(fn, fn.__code__, owner, depth)
        self.seen[key] = found
        return found

    def _of_code(self, fn: Any, code: types.CodeType, owner: Any, depth: int) -> str | None:
        names = _free_values(fn) if code is fn.__code__ else {}
        self_name = code.co_varnames[0] if code.co_argcount and owner is not None else None
        for obj in _named_objects(code, fn.__globals__, names, self_name, owner):
            found = self.of_object(obj, depth - 1)
            if found:
                return found
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found = self._of_code(fn, const, None, depth)
                if found:
                    return found
        return None

    def of_attributes(self, cell: Any) -> str | None:
        """A communication primitive the cell holds, directly or one level down."""
        held = vars(cell)
        for name, value in held.items():
            if isinstance(value, self.primitives):
                return f"{type(value).__name__} held as .{name}"
        for name, value in held.items():
            for inner in _values_one_level_down(value):
                if isinstance(inner, self.primitives):
                    return f"{type(inner).__name__} held in .{name}"
        return None

    def issued_by(self, cell: Any) -> str | None:
        """How ``cell`` issues a collective in its own code (not its sub-cells'), if it does."""
        found = self.of_attributes(cell)
        if found:
            return found
        construct = _own_construct(cell)
        found = self.of_function(construct, cell, _SEARCH_DEPTH)
        return f"its construct calls {found}" if found else None


def _free_values(fn: Any) -> dict[str, Any]:
    values = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            values[name] = cell.cell_contents
        except ValueError:  # not bound yet
            continue
    return values


def _named_objects(
    code: types.CodeType,
    globals_: dict[str, Any],
    free: dict[str, Any],
    self_name: str | None,
    owner: Any,
) -> Iterator[Any]:
    """The objects the code loads by name, and the attributes it reads from them
    (``ops.AllReduce``, ``Reduce.apply``, ``self.helper``), as far as they resolve
    without running anything: attributes of modules, classes and ``owner`` only."""
    builtins = globals_.get("__builtins__", {})
    current: Any = None
    for ins in dis.get_instructions(code):
        if ins.opname in _LOADS:
            name = ins.argval
            if ins.opname == "LOAD_FAST":
                current = owner if name == self_name else None
            elif name in free:
                current = free[name]
            elif name in globals_:
                current = globals_[name]
            elif isinstance(builtins, dict):
                current = builtins.get(name)
            else:
                current = getattr(builtins, name, None)
        elif ins.opname in _ATTRS and current is not None:
            current = _read_attribute(current, ins.argval, owner)
        else:
            current = None
            continue
        if current is not None:
            yield current


def _read_attribute(obj: Any, name: str, owner: Any) -> Any:
    if obj is owner:
        # What the instance or its class holds, without running a property. Sub-cells
        # and parameters live in the Cell's own tables, not found here: sub-cells are
        # looked at apart.
        static = inspect.getattr_static(obj, name, None)
        if isinstance(static, (types.FunctionType, staticmethod)):
            return getattr(obj, name, None)  # a method of the cell
        if isinstance(static, (property, classmethod, nn.Cell)):
            return None
        return static
    if isinstance(obj, (types.ModuleType, type)):
        try:
            return getattr(obj, name)
        except Exception:
            return None
    return None




def _values_one_level_down(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple, set, frozenset)):
        yield from value
    elif isinstance(value, dict):
        yield from value.values()
    elif not isinstance(value, (nn.Cell, type, types.ModuleType)) and hasattr(value, "__dict__"):
        try:
            yield from vars(value).values()
        except TypeError:
            return


def _own_construct(cell: Any) -> Any:
    moved = cell.__dict__.get("_recomp_instance_method") or cell.__dict__.get("construct")
    if moved is not None:
        return getattr(moved, "__func__", moved)
    base = getattr(type(cell), "_recomp_base", type(cell))
    return inspect.getattr_static(base, "construct", None)


def issues_collectives() -> Callable[[Any], bool]:
    """A test of whether a cell issues a collective in its own code (not its sub-cells')."""
    search = _Search()
    return lambda cell: bool(search.issued_by(cell))


def communicating_cells(
    cell: Any, skip: Callable[[Any], bool], can_exclude: Callable[[Any], bool]
) -> tuple[str | None, list[tuple[str, Any, str]]]:
    """How ``cell`` itself issues collectives (None if it does not), and the innermost
    sub-cells below it that do: ``(path, sub-cell, how)`` each. Sub-cells for which
    ``skip`` holds (already excluded) are passed over; those that communicate but
    cannot be excluded (a nested checkpoint) are looked into instead."""
    search = _Search()
    found: list[tuple[str, Any, str]] = []
    seen = {id(cell)}

    def visit(parent: Any, prefix: str) -> None:
        for name, child in parent.name_cells().items():
            if child is None or id(child) in seen or skip(child):
                continue
            seen.add(id(child))
            path = f"{prefix}.{name}" if prefix else name
            how = search.issued_by(child)
            if how and can_exclude(child):
                found.append((path, child, how))
            else:
                visit(child, path)

    visit(cell, "")
    return search.issued_by(cell), found


def warn_own_collective(cell: Any, how: str, api: str) -> None:
    """Warn once that ``cell``'s own code communicates, which its checkpoint replays."""
    if not _warned.first(cell):
        return
    name = type(cell).__name__
    warnings.warn(
        f"recomp.mindspore.{api}: {name} issues a collective in its own code ({how}), "
        f"which its checkpoint replays: recomp excludes the sub-cells that communicate, "
        f"and a cell cannot be excluded from its own checkpoint. Move the collective into "
        f"a sub-cell of {name}, or checkpoint the parts of {name} around it, or pass "
        f"exclude_collectives=False to communicate again in the replay without this warning.",
        CollectiveReplayedWarning,
        stacklevel=4,
    )


class _WatchFirstForward:
    """The forward context of a checkpoint's first call (of a cell or a function): a
    collective that runs in its recomputed code, outside every excluded region, warns
    (see the NOTE)."""

    def __init__(self, target: Any) -> None:
        self.target = weakref.ref(target)
        self._contexts: list[Any] = []

    def __enter__(self) -> None:
        context = collectives.watch_collectives(self._seen)
        context.__enter__()
        self._contexts.append(context)

    def __exit__(self, *exc_info: Any) -> None:
        self._contexts.pop().__exit__(*exc_info)

    def _seen(self, op: str) -> None:
        target = self.target()
        state = get_recompute_state()
        if target is None or target in _warned or state is None or state.is_recomputing:
            return
        if active_region() is not None:
            return  # inside an excluded region: runs once
        _warned.first(target)
        running = BACKEND.modules.running_module(inspect.currentframe())
        if not isinstance(target, nn.Cell):
            name = f"function {getattr(target, '__qualname__', type(target).__name__)}"
            where = "in the checkpointed function" + (
                f", in {type(running).__name__}" if running is not None else ""
            )
            fix = (
                "wrap the code that communicates in checkpoint_exclude_wrapper (it takes "
                "Cells and functions)"
            )
        elif running is None or running is target:
            name = type(target).__name__
            where = f"in {name}'s own construct"
            fix = (
                f"move the collective into a sub-cell of {name} (recomp then excludes it), "
                f"or checkpoint the parts of {name} around it"
            )
        else:
            name = type(target).__name__
            path = next((p for p, c in target.cells_and_names() if c is running), None)
            where = f"in its sub-cell {path or type(running).__name__!r} ({type(running).__name__})"
            fix = (
                "exclude that sub-cell by hand (checkpoint_exclude_wrapper, or exclude_fn of "
                "apply_activation_checkpointing); recomp did not find the collective in its code"
            )
        warnings.warn(
            f"A collective ({op}) ran in the code that the checkpoint of {name} recomputes, "
            f"{where}, outside every excluded region: its replay communicates again. To keep "
            f"it to one run, {fix}; or pass exclude_collectives=False to the checkpoint to "
            f"communicate again in the replay without this warning.",
            CollectiveReplayedWarning,
            stacklevel=2,
        )


class FirstForwardWatch(CallPart):
    """The part of a checkpoint call that watches its first forward (of a Cell, or of a
    function checkpointed on its own) for collectives in recomputed code."""

    stage = Stage.FIRST_FORWARD_WATCH

    def __init__(self, target: Any) -> None:
        self.target = target

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        return _WatchFirstForward(self.target), None


def watch_first_forward(cell: Any) -> FirstForwardWatch | None:
    """The watch for this first call of ``cell`` (a Cell, or a function checkpointed on
    its own); None for every later call, and for a callable that cannot be referred to
    weakly."""
    try:
        if cell is None or not _watched.first(cell):
            return None
    except TypeError:  # no weak reference to it (a builtin)
        return None
    return FirstForwardWatch(cell)
