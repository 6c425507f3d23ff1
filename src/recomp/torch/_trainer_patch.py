"""What recomp does to plug itself into a trainer's own checkpoint function.

Trainers decide *what* to checkpoint with their own settings (Megatron-Core's
``recompute_granularity``, DeepSpeed's ``checkpointing.checkpoint`` calls in model code)
and all end in one function of theirs. ``install()`` in ``recomp.torch.megatron`` and
``recomp.torch.deepspeed`` puts a recomp checkpoint in that function's place, so that the
trainer keeps choosing and recomp does the checkpointing: collectives run once, excluded
regions are not replayed, random state is restored (``recomp._rng_trackers``).

Exclusions are declared once, at install time, as classes, module paths or a predicate.
The trainer hands its checkpoint function a closure or a bound method, not a module:
recomp finds the modules it runs through (the bound method's module, a partial's
arguments, the closure's cells) and, the first time it sees each, wraps the matching
modules below it in ``checkpoint_exclude_wrapper``. The trainer's packages are never
imported here: their modules are looked up in ``sys.modules`` by the caller.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

from .._wrapping import FirstLooks, recomp_wrapper_of
from ..errors import RecompError

__all__ = ["Exclusions", "Installation", "replace_attributes"]


class Exclusions:
    """The modules to exclude inside each checkpointed piece: classes (``isinstance``),
    module paths (strings matched, with ``fnmatch`` wildcards, against the end of a
    module's dotted name below the piece: ``"self_attention"``, ``"mlp.router"``,
    ``"layers.*.mlp"``) and predicates (functions of the module)."""

    def __init__(self, exclude: Any, api: str) -> None:
        entries = [exclude] if isinstance(exclude, (str, type)) or callable(exclude) else exclude
        try:
            entries = list(entries)
        except TypeError:
            raise TypeError(_bad_entry(api, exclude)) from None
        self.classes = tuple(e for e in entries if isinstance(e, type))
        self.patterns = tuple(e for e in entries if isinstance(e, str))
        self.predicates = tuple(e for e in entries if callable(e) and not isinstance(e, type))
        for entry in entries:
            if not isinstance(entry, (str, type)) and not callable(entry):
                raise TypeError(_bad_entry(api, entry))
        self._seen = FirstLooks()
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self.classes or self.patterns or self.predicates)

    def matches(self, path: str, module: nn.Module) -> bool:
        if self.classes and isinstance(module, self.classes):
            return True
        if any(_path_matches(path, pattern) for pattern in self.patterns):
            return True
        return any(predicate(module) for predicate in self.predicates)

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
                skip.append(path + ".")


def _path_matches(path: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, "*." + pattern)


def _bad_entry(api: str, entry: Any) -> str:
    return (
        f"{api}: exclude must hold classes, module paths (strings such as 'self_attention' "
        f"or 'mlp.router') or functions of a module, got {type(entry).__name__} ({entry!r})."
    )


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

    def __init__(self, name: str, replaced: list[tuple[Any, str, Any, Any]]) -> None:
        self._name = name
        self._replaced = replaced

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
        """Put the trainer's own functions back (once; later calls do nothing)."""
        replaced, self._replaced = self._replaced, []
        for owner, attribute, original, replacement in reversed(replaced):
            if getattr(owner, attribute, None) is replacement:
                setattr(owner, attribute, original)
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
    name: str, targets: Iterable[tuple[str, str]], replacement: Callable[..., Any]
) -> Installation:
    """Set ``replacement`` as each ``module.attribute`` of ``targets`` (module names, imported
    here: the trainer is installed, the caller checked) and return the handle that puts
    the originals back. Targets a trainer version lacks are skipped; none at all is an
    error naming what was looked for."""
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
    if not replaced:
        looked_for = ", ".join(f"{m}.{a}" for m, a in targets)
        raise RecompError(
            f"recomp.torch.{name}.install(): none of {looked_for} exists in the installed "
            "version; recomp cannot plug into it."
        )
    installation = Installation(name, replaced)
    _INSTALLED[name] = installation
    return installation
