"""What users pass to choose modules, read one way for every argument that takes it.

``apply_activation_checkpointing``'s ``checkpoint_fn``, ``exclude_fn``, ``offload_fn``
and ``copy_output_fn`` (both frameworks), ``hf_activation_checkpointing``'s, and the
``exclude`` of the trainer installs (``recomp.torch.megatron``, ``recomp.torch.deepspeed``)
all accept the same forms, and mean the same by them:

* a module class: the modules that are instances of it (``isinstance``);
* a module path, a string: the modules whose dotted path ends with it, at a dot
  (``"self_attn"`` selects ``layers.0.self_attn``), with ``fnmatch`` wildcards
  (``"layers.*.self_attn"``; a ``*`` spans dots too);
* a function of a module: the modules for which it returns true;
* a list, tuple or set of these: the modules any of them selects.

``Selection.parse`` turns one of these into a ``Selection``, or refuses it with a
``SelectionError`` naming the argument and what to pass (a number, a module instance
where a class or a path was meant, a class of something other than modules is left to
the warnings of what selects nothing). ``Selection.check_paths`` refuses module paths
that match no module of a model. Both run before the caller changes anything.

Where a path is measured from is the caller's to say: the model for
``apply_activation_checkpointing``, each checkpointed piece for a trainer install.

A selection can also be held to some of a model's layers (:meth:`Selection.within`):
``apply_activation_checkpointing(..., layers=range(16))`` and HyperParallel's
``layer_count``/``layer_indices`` choose layers by position (:class:`LayerChoice`), among
the layers :func:`find_layers` finds (NOTE [ A model's layers ]).
"""

from __future__ import annotations

import difflib
import fnmatch
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .errors import SelectionError

# The forms, as messages list them.
FORMS = (
    "a module class, a module path (a string such as 'layers.*.self_attn'), a function of a "
    "module, or a list or tuple of these"
)


class Selection:
    """Modules chosen by classes, module paths and predicates (a module any of them
    selects). Built by :meth:`parse`; asked with :meth:`matches`."""

    __slots__ = ("argument", "classes", "patterns", "predicates", "scope")

    def __init__(
        self,
        argument: str,
        classes: tuple[type, ...] = (),
        patterns: tuple[str, ...] = (),
        predicates: tuple[Callable[[Any], Any], ...] = (),
        scope: tuple[str, ...] | None = None,
    ) -> None:
        self.argument = argument
        self.classes = classes
        self.patterns = patterns
        self.predicates = predicates
        # The paths of the layers the selection is held to (None: anywhere; empty: none).
        self.scope = scope

    @classmethod
    def every_module(cls, argument: str) -> Selection:
        """A selection of every module (held to some layers with :meth:`within`, the
        layers themselves: outermost matches)."""
        return cls(argument, predicates=(_any_module,))

    def within(self, layers: Iterable[tuple[str, Any]]) -> Selection:
        """This selection held to the modules at or below ``layers`` ((path, module)
        pairs, paths measured as this selection's are)."""
        return Selection(
            self.argument,
            self.classes,
            self.patterns,
            self.predicates,
            scope=tuple(path for path, _ in layers),
        )

    def in_scope(self, path: str) -> bool:
        """Whether ``path`` is at or below one of the layers the selection is held to
        (always, for a selection held to none)."""
        if self.scope is None:
            return True
        return any(path == layer or path.startswith(layer + ".") for layer in self.scope)

    @classmethod
    def parse(
        cls,
        value: Any,
        argument: str,
        api: str,
        module_type: type,
        *,
        required: bool = False,
        none_ok: bool = True,
        locate: Callable[[Any], str | None] | None = None,
    ) -> Selection | None:
        """``value`` (one of the forms above) as a Selection; None for None where
        ``none_ok`` and not ``required``. ``required``: it must select something (not
        None, not empty). ``module_type``: the framework's module class, whose instances
        are refused (a selection names modules, it is not one). ``locate``: the path of a
        module in the model, for the hint when one is passed. Anything else raises
        ``SelectionError`` naming ``api`` and ``argument``."""
        if value is None and none_ok and not required:
            return None
        classes: list[type] = []
        patterns: list[str] = []
        predicates: list[Callable[[Any], Any]] = []
        stack = [value]
        while stack:
            entry = stack.pop(0)
            if isinstance(entry, type):
                classes.append(entry)
            elif isinstance(entry, str):
                if not entry.strip():
                    raise SelectionError(
                        f"{api}: {argument} got an empty module path ({entry!r}). A path names "
                        f"modules below the model, such as 'layers.0.self_attn' or "
                        f"'layers.*.self_attn'."
                    )
                patterns.append(entry)
            elif isinstance(entry, module_type):
                raise SelectionError(_instance_message(entry, argument, api, locate))
            elif isinstance(entry, (list, tuple, set, frozenset)):
                members = list(entry)
                if isinstance(entry, (set, frozenset)):
                    members.sort(key=repr)  # one order, whatever the hashes
                stack[:0] = members
            elif callable(entry):
                predicates.append(entry)
            else:
                raise SelectionError(_bad_message(value, entry, argument, api))
        selection = cls(argument, tuple(classes), tuple(patterns), tuple(predicates))
        if required and not selection:
            raise SelectionError(
                f"{api}: {argument} selects nothing (got {value!r}); pass {FORMS}, for example "
                f"{argument}=DecoderLayer."
            )
        return selection

    def __bool__(self) -> bool:
        return bool(self.classes or self.patterns or self.predicates)

    def matches(self, path: str, module: Any) -> bool:
        """Whether ``module``, at ``path`` (dotted, from where the caller measures), is
        selected."""
        if not self.in_scope(path):
            return False
        if self.classes and isinstance(module, self.classes):
            return True
        if any(path_matches(path, pattern) for pattern in self.patterns):
            return True
        return any(predicate(module) for predicate in self.predicates)

    def check_paths(self, api: str, named: list[tuple[str, Any]], model_name: str) -> None:
        """Refuse module paths that match none of ``named`` ((path, module) of every
        module of the model, the model itself at ``""``): a path that matches nothing
        is a typo or a path of another model, never a choice."""
        if not self.patterns:
            return
        paths = [path for path, _ in named if path]
        unmatched = [p for p in self.patterns if not any(path_matches(q, p) for q in paths)]
        if not unmatched:
            return
        classes = {type(m).__name__ for _, m in named}
        hints = []
        for pattern in unmatched:
            if pattern in classes:
                hints.append(
                    f"{pattern!r} is the name of a module class of the model, and a string is "
                    f"a module path: pass the class itself ({self.argument}={pattern})."
                )
                continue
            close = _close_paths(pattern, paths)
            if close:
                hints.append(f"For {pattern!r}, did you mean {' or '.join(map(repr, close))}?")
        examples = ", ".join(repr(p) for p in _examples(paths))
        shown = ", ".join(repr(p) for p in unmatched)
        raise SelectionError(
            f"{api}: {self.argument} has module path(s) {shown} that match no module of "
            f"{model_name}, so nothing was wrapped. A path is matched against the end of each "
            f"module's dotted path, at a dot, with fnmatch wildcards ('self_attn', "
            f"'layers.*.self_attn'); the model's paths include {examples}."
            + "".join(f" {hint}" for hint in hints)
        )

    def __repr__(self) -> str:
        parts = [c.__name__ for c in self.classes] + [repr(p) for p in self.patterns]
        parts += [getattr(f, "__name__", repr(f)) for f in self.predicates]
        held = "" if self.scope is None else f" in {len(self.scope)} layer(s)"
        return f"{self.argument}=[{', '.join(parts)}]{held}"


def _any_module(module: Any) -> bool:
    return True


# NOTE [ A model's layers ]
# Layers are chosen by position, so "a model's layers" must be one list, the same for
# every caller, in the model's order. find_layers takes the first of these that finds any:
#   1. Hugging Face's: the modules with a ``gradient_checkpointing`` attribute own the
#      layers; each of their children that is a list or dict container (ModuleList,
#      Sequential, ModuleDict; CellList, SequentialCell, CellDict) holds layers, its own
#      children. Owners are visited depth first, in registration order, and a module
#      found as a layer is not searched for more (HF's layers carry the attribute too).
#      This is HyperParallel's rule, so that positions mean the same layers there and
#      here (several towers are numbered one after the other), except that it counts
#      only containers, where HyperParallel takes any child that has children.
#   2. The children of every container whose attribute name is ``layers`` (outermost
#      ones, depth first): ``model.layers`` of torchtitan's and Megatron's models,
#      ``model.model.layers``, MindSpore zoos' ``CellList`` named ``layers``.
#   3. The children of the model itself, where it is a container (``nn.Sequential``
#      of blocks).
# Anything else is refused with a SelectionError naming the way out: select the layers
# by path (``checkpoint_fn=['blocks.0', 'blocks.4']``).


def find_layers(
    children: Callable[[Any], Iterable[tuple[str, Any]]],
    model: Any,
    containers: tuple[type, ...],
    api: str,
    argument: str,
) -> list[tuple[str, Any]]:
    """``model``'s layers in order, each with its path from ``model`` (NOTE [ A model's
    layers ]); raises ``SelectionError`` naming ``api`` and ``argument`` where none is
    found."""
    walk = _depth_first(children, model)
    layers: list[tuple[str, Any]] = []
    taken: set[int] = set()
    for path, owner in walk:
        if id(owner) in taken or not _has(owner, "gradient_checkpointing"):
            continue
        for name, container in children(owner):
            if not isinstance(container, containers):
                continue
            prefix = _join(path, name)
            for key, layer in children(container):
                if id(layer) not in taken:
                    taken.add(id(layer))
                    layers.append((_join(prefix, key), layer))
    if layers:
        return layers
    named_layers = [
        (path, module)
        for path, module in walk
        if path.rpartition(".")[2] == "layers" and isinstance(module, containers)
    ]
    outermost = [
        (path, module)
        for path, module in named_layers
        if not any(path.startswith(other + ".") for other, _ in named_layers)
    ]
    for path, container in outermost:
        layers.extend((_join(path, key), layer) for key, layer in children(container))
    if not layers and isinstance(model, containers):
        layers = [(key, layer) for key, layer in children(model)]
    if layers:
        return layers
    examples = ", ".join(repr(p) for p in _examples([p for p, _ in walk if p])) or "none"
    raise SelectionError(
        f"{api}: {argument} chooses layers by position, but recomp found no layers in "
        f"{type(model).__name__}: it takes the blocks of a Hugging Face model (below the "
        f"module with gradient_checkpointing), else those of a container named 'layers', "
        f"else the children of a model that is itself a container. Select the modules by "
        f"path instead (checkpoint_fn=['blocks.0', 'blocks.4'], or 'blocks.*' for all); the "
        f"model's paths include {examples}."
    )


def _depth_first(
    children: Callable[[Any], Iterable[tuple[str, Any]]], root: Any
) -> list[tuple[str, Any]]:
    """``root`` and every module below it, each once, depth first in registration order
    (as PyTorch's ``named_modules``), with its path from ``root``."""
    seen: set[int] = set()
    out: list[tuple[str, Any]] = []
    stack = [("", root)]
    while stack:
        path, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        out.append((path, module))
        stack.extend(reversed([(_join(path, name), child) for name, child in children(module)]))
    return out


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else str(name)


def _has(module: Any, name: str) -> bool:
    try:
        getattr(module, name)
    except AttributeError:
        return False
    return True


@dataclass(frozen=True)
class LayerChoice:
    """Which of a model's layers (:func:`find_layers`), by position from 0: the value of
    ``apply_activation_checkpointing``'s ``layers=`` (``range(16)``, ``[0, 4, 8]``), or
    HyperParallel's ``layer_count`` (``range(layer_count)``) and ``layer_indices``."""

    positions: tuple[int, ...]
    argument: str = "layers"

    @classmethod
    def parse(cls, value: Any, argument: str, api: str) -> LayerChoice | None:
        """``value`` (None, or a range, list or tuple of distinct non-negative integers)
        as a LayerChoice; anything else raises ``SelectionError`` naming ``api`` and
        ``argument`` and what to pass."""
        if value is None:
            return None
        if isinstance(value, bool) or _as_int(value) is not None:
            raise SelectionError(
                f"{api}: {argument}={value!r} is a number, and {argument} takes layer "
                f"positions (counted from 0): {argument}=range({value!r}) for the first "
                f"{value!r} layers, {argument}=[{value!r}] for the layer at position {value!r}."
            )
        if isinstance(value, (str, bytes)) or not isinstance(value, (range, list, tuple)):
            raise SelectionError(
                f"{api}: {argument} must be a range, list or tuple of layer positions "
                f"(counted from 0), such as range(16) or [0, 4, 8]; got "
                f"{type(value).__name__} ({value!r})."
            )
        positions = [_as_int(p) for p in value]
        bad = [p for p, i in zip(value, positions, strict=True) if i is None or i < 0]
        if bad:
            raise SelectionError(
                f"{api}: {argument} takes non-negative integers (layer positions counted "
                f"from 0); got {', '.join(repr(p) for p in bad[:3])}."
            )
        checked = [p for p in positions if p is not None]
        twice = sorted({p for p in checked if checked.count(p) > 1})
        if twice:
            raise SelectionError(
                f"{api}: {argument} names layer position(s) {', '.join(map(str, twice))} more "
                f"than once; name each layer once."
            )
        return cls(tuple(checked), argument)

    def resolve(
        self, layers: list[tuple[str, Any]], api: str, model_name: str
    ) -> list[tuple[str, Any]]:
        """The chosen layers (path, module), in the model's order; a position past the
        last layer raises ``SelectionError`` naming the layers there are."""
        past = [p for p in self.positions if p >= len(layers)]
        if past:
            last = len(layers) - 1
            raise SelectionError(
                f"{api}: {self.argument} has position(s) {', '.join(map(str, past[:3]))}"
                f"{' ...' if len(past) > 3 else ''}, past the last of the {len(layers)} "
                f"layer(s) of {model_name} (positions 0 to {last}: {layers[0][0]!r} to "
                f"{layers[last][0]!r})."
            )
        return [layers[p] for p in sorted(self.positions)]


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def walk_named(
    children: Callable[[Any], Iterable[tuple[str, Any]]], root: Any
) -> list[tuple[str, Any]]:
    """``root`` and every module below it, each once, with its path from ``root`` (``""``
    for ``root``; ``children``: a module's named children, as the framework lists them),
    in breadth-first order: the paths selections are matched against."""
    seen = {id(root)}
    out = [("", root)]
    for path, module in out:
        for name, child in children(module):
            if id(child) not in seen:
                seen.add(id(child))
                out.append((f"{path}.{name}" if path else name, child))
    return out


def path_matches(path: str, pattern: str) -> bool:
    """Whether the dotted ``path`` ends with ``pattern`` at a dot (fnmatch wildcards)."""
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, "*." + pattern)


def _close_paths(pattern: str, paths: list[str]) -> list[str]:
    # Compared with the ends of the model's paths of as many parts; with a wildcard in
    # the pattern, in their shapes (indices as ``*``).
    depth = pattern.count(".") + 1
    tails = {".".join(p.split(".")[-depth:]) for p in paths if p.count(".") + 1 >= depth}
    if any(c in pattern for c in "*?["):
        tails = {_shape(t) for t in tails}
    return difflib.get_close_matches(pattern, sorted(tails), n=2, cutoff=0.6)


def _shape(path: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def _examples(paths: Iterable[str], limit: int = 5) -> list[str]:
    """A few of the model's paths, one per shape (indices as ``*``), in the model's order,
    those below the top level first where there are such."""
    shapes: dict[str, str] = {}
    for path in paths:
        shapes.setdefault(_shape(path), path)
    found = list(shapes.values())
    deeper = [p for p in found if "." in p]
    return (deeper or found)[:limit]


def _instance_message(
    module: Any, argument: str, api: str, locate: Callable[[Any], str | None] | None
) -> str:
    name = type(module).__name__
    path = locate(module) if locate is not None else None
    where = f", its path ({argument}={path!r})" if path else ", its module path"
    return (
        f"{api}: {argument} got an instance of {name}, where a class or a module path was "
        f"meant: a selection names modules, it is not one. Pass its class ({argument}={name})"
        f"{where}, or a function ({argument}=lambda m: m is that_module)."
    )


def _bad_message(value: Any, entry: Any, argument: str, api: str) -> str:
    inside = "" if entry is value else f" in the {type(value).__name__}"
    return (
        f"{api}: {argument} must be {FORMS}; got {type(entry).__name__} ({entry!r}){inside}. "
        f"For example {argument}=DecoderLayer, {argument}='layers.*.self_attn' or "
        f"{argument}=lambda m: isinstance(m, DecoderLayer)."
    )
