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
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Iterable
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

    __slots__ = ("argument", "classes", "patterns", "predicates")

    def __init__(
        self,
        argument: str,
        classes: tuple[type, ...] = (),
        patterns: tuple[str, ...] = (),
        predicates: tuple[Callable[[Any], Any], ...] = (),
    ) -> None:
        self.argument = argument
        self.classes = classes
        self.patterns = patterns
        self.predicates = predicates

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
        return f"{self.argument}=[{', '.join(parts)}]"


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
