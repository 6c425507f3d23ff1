"""What recomp does to plug itself into a trainer's own checkpoint function.

Trainers decide *what* to checkpoint with their own settings (Megatron-Core's
``recompute_granularity``, DeepSpeed's ``checkpointing.checkpoint`` calls in model code)
and all end in one function of theirs. ``install()`` in ``recomp.torch.megatron`` and
``recomp.torch.deepspeed`` puts a recomp checkpoint in that function's place, so that the
trainer keeps choosing and recomp does the checkpointing: collectives run once, excluded
regions are not replayed, random state is restored (``recomp._rng_trackers``).

Exclusions are declared once, at install time, as a selection (``recomp._selection``):
classes, module paths, predicates, or a list of them.
The trainer hands its checkpoint function a closure or a bound method, not a module:
recomp finds the modules it runs through (the bound method's module, a partial's
arguments, the closure's cells) and, the first time it sees each, wraps the matching
modules below it in ``checkpoint_exclude_wrapper``. The trainer's packages are never
imported here: their modules are looked up in ``sys.modules`` by the caller.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

from .._selection import Selection
from .._wrapping import REGION, FirstLooks, recomp_wrapper_of
from ..errors import RecompError

__all__ = ["Exclusions", "Installation", "replace_attributes"]


class Exclusions:
    """The modules to exclude inside each checkpointed piece, a selection: classes
    (``isinstance``), module paths (strings matched, with ``fnmatch`` wildcards, against
    the end of a module's dotted path below the piece: ``"self_attention"``,
    ``"mlp.router"``, ``"layers.*.mlp"``), predicates (functions of the module), or a list
    of them. The trainer's modules are not known at install time, so a path that matches
    nothing is not refused here (it excludes nothing)."""

    def __init__(self, exclude: Any, api: str) -> None:
        selection = Selection.parse(exclude, "exclude", api, nn.Module, none_ok=False)
        assert selection is not None  # none_ok=False
        self.selection = selection
        self._seen = FirstLooks()
        self._lock = threading.Lock()
        self._wrapped: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    @property
    def classes(self) -> tuple[type, ...]:
        return self.selection.classes

    @property
    def patterns(self) -> tuple[str, ...]:
        return self.selection.patterns

    @property
    def predicates(self) -> tuple[Callable[[Any], Any], ...]:
        return self.selection.predicates

    def __bool__(self) -> bool:
        return bool(self.selection)

    def matches(self, path: str, module: nn.Module) -> bool:
        return self.selection.matches(path, module)

    def apply_within(self, function: Any) -> None:
        """Wrap, once per module, the matching modules below each module ``function`` runs."""
        if not self:
            return
        for root in modules_reached(function):
            if root in self._seen:
                continue
            with self._lock:
                if self._seen.first(root):
                    self._wrap_below(root)

    def _wrap_below(self, root: nn.Module) -> None:
        from ._api import checkpoint_exclude_wrapper

        skip: list[str] = []
        for path, module in root.named_modules():
            if not path or any(path.startswith(prefix) for prefix in skip):
                continue
            if recomp_wrapper_of(module) is not None:
                skip.append(path + ".")  # already recomp's: a region or a checkpoint
                continue
            if self.matches(path, module):
                checkpoint_exclude_wrapper(module, name=path)
                self._wrapped.add(module)
                skip.append(path + ".")

    def undo(self) -> None:
        """Unwrap the modules these exclusions wrapped (where they still are excluded
        regions): once recomp is no longer the trainer's checkpoint, the trainer's own
        checkpoint would replay them with a ``ForeignCheckpointWarning``."""
        from ._api import unwrap

        with self._lock:
            wrapped, self._wrapped = list(self._wrapped), weakref.WeakSet()
            self._seen = FirstLooks()
        for module in wrapped:
            if REGION in vars(module):
                unwrap(module)


def modules_reached(function: Any) -> Iterator[nn.Module]:
    """The modules ``function`` runs through: itself, the module of a bound method, a
    partial's function and arguments, the modules and functions in a closure's cells (one
    level of nested closures: trainers build the checkpointed function in a helper)."""
    stack, seen = [function], set()
    depth = {id(function): 0}
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        level = depth.get(id(item), 0)
        if isinstance(item, nn.Module):
            yield item
            continue
        inner: Iterable[Any] = ()
        if isinstance(item, functools.partial):
            inner = (item.func, *item.args, *item.keywords.values())
        elif isinstance(item, types.MethodType):
            inner = (item.__self__,)
        elif isinstance(item, types.FunctionType) and item.__closure__ and level < 2:
            inner = (_cell_value(cell) for cell in item.__closure__)
        for value in inner:
            if isinstance(value, _REACHABLE):
                depth[id(value)] = level + 1
                stack.append(value)


_REACHABLE = (nn.Module, functools.partial, types.MethodType, types.FunctionType)


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name not bound yet)
        return None


class Installation:
    """Returned by ``install()``: recomp is the trainer's checkpoint function until
    :meth:`remove` (or the end of a ``with`` block)."""

    def __init__(
        self,
        name: str,
        replaced: list[tuple[Any, str, Any, Any]],
        exclusions: Exclusions | None = None,
    ) -> None:
        self._name = name
        self._replaced = replaced
        self._exclusions = exclusions

    @property
    def installed(self) -> bool:
        return bool(self._replaced)

    def replace(self, owner: Any, attribute: str, value: Any) -> None:
        """Also set ``owner.attribute`` to ``value`` until :meth:`remove`: for what the
        module attributes of :func:`replace_attributes` do not reach (a default argument
        bound when the trainer's function was defined, its ``__defaults__``)."""
        if not self._replaced:
            raise RecompError(f"recomp.torch.{self._name}: this installation was removed.")
        original = getattr(owner, attribute)
        setattr(owner, attribute, value)
        self._replaced.append((owner, attribute, original, value))

    def remove(self) -> None:
        """Put the trainer's own functions back and unwrap the modules the exclusions
        wrapped (once; later calls do nothing)."""
        replaced, self._replaced = self._replaced, []
        for owner, attribute, original, replacement in reversed(replaced):
            if getattr(owner, attribute, None) is replacement:
                setattr(owner, attribute, original)
        if replaced and self._exclusions is not None:
            self._exclusions.undo()
        if _INSTALLED.get(self._name) is self:
            del _INSTALLED[self._name]

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "installed" if self.installed else "removed"
        return f"<recomp.torch.{self._name} installation, {state}>"


# One installation per trainer at a time: a second would wrap recomp's own function.
_INSTALLED: dict[str, Installation] = {}


def replace_attributes(
    name: str,
    targets: Iterable[tuple[str, str]],
    replacement: Callable[..., Any],
    *,
    rebind_imports: bool = False,
    exclusions: Exclusions | None = None,
) -> Installation:
    """Set ``replacement`` as each ``module.attribute`` of ``targets`` (module names, imported
    here: the trainer is installed, the caller checked) and return the handle that puts
    the originals back. Targets a trainer version lacks are skipped; none at all is an
    error naming what was looked for.

    ``rebind_imports=True`` also replaces the copies other modules took before: a module
    of ``sys.modules`` that did ``from trainer.module import checkpoint`` (under any
    name) holds the original function as a global of its own, which the module
    attribute does not reach. Modules imported later take the replacement.
    ``exclusions`` are undone by the handle's ``remove()``."""
    if name in _INSTALLED:
        raise RecompError(
            f"recomp.torch.{name}.install() is in effect already: call remove() on the handle "
            "it returned (or leave its with block) before installing again."
        )
    replaced: list[tuple[Any, str, Any, Any]] = []
    for module_name, attribute in targets:
        owner = importlib.import_module(module_name)
        original = getattr(owner, attribute, None)
        if original is None:
            continue
        setattr(owner, attribute, replacement)
        replaced.append((owner, attribute, original, replacement))
    if replaced and rebind_imports:
        originals = {id(original): original for _, _, original, _ in replaced}
        for owner, attribute, original in _imported_copies(originals):
            setattr(owner, attribute, replacement)
            replaced.append((owner, attribute, original, replacement))
    if not replaced:
        looked_for = ", ".join(f"{m}.{a}" for m, a in targets)
        raise RecompError(
            f"recomp.torch.{name}.install(): none of {looked_for} exists in the installed "
            "version; recomp cannot plug into it."
        )
    installation = Installation(name, replaced, exclusions)
    _INSTALLED[name] = installation
    return installation


def _imported_copies(originals: dict[int, Any]) -> Iterator[tuple[Any, str, Any]]:
    """(module, global name, original) for each global of a loaded module that is one of
    ``originals`` (by identity): the functions a module imported by name."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attribute, value in list(namespace.items()):
            original = originals.get(id(value))
            if original is not None and original is value:
                yield module, attribute, original
