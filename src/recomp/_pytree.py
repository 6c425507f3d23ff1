"""Flatten what a region or checkpoint takes and returns into leaves, and rebuild it exactly.

A region's output is handed back by the replay, so whatever container held
its tensors must come back as the same type: a named tuple, a ``topk`` result,
an ``OrderedDict``, a ``defaultdict`` with its factory, a ``ModelOutput``, a
tuple, list or dict subclass, a dataclass. Walked here:

* types a framework's own registry knows (``registry``: PyTorch passes its
  pytree registry, where transformers registers ``ModelOutput``), flattened
  and rebuilt by that registry's functions;
* tuples, lists and dicts, and their subclasses (rebuilt as the same type);
  named tuples and struct sequences;
* dataclass instances (rebuilt with every field, the others copied).

Anything else is a leaf and passes through untouched. A leaf that hides
tensors in its attributes is reported by :func:`opaque_tensors`, so that the
engine can refuse to cache what it cannot see.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from .errors import internal_error

#: (flatten: obj -> (children, context), unflatten: (children, context) -> obj)
Node = tuple[Callable[[Any], tuple[list[Any], Any]], Callable[[list[Any], Any], Any]]


class Registry:
    """A framework's registry of container types, as the walker consults it, with the
    types it found to be leaves.

    ``lookup(kind)`` gives the (flatten, unflatten) pair of a registered type, or
    None. ``generation()`` changes whenever a type is registered (the registry's
    size will do): the leaf cache is then started anew, so a type walked as a leaf
    and registered later is looked into from then on. Each registry has its own
    cache: a type that is a leaf for one walk may be a node for another.
    """

    __slots__ = ("generation", "last_generation", "leaf_types", "lookup")

    def __init__(
        self, lookup: Callable[[type], Node | None], generation: Callable[[], int] = int
    ) -> None:
        self.lookup = lookup
        # Called on every walk: a builtin (a dict's ``__len__``) costs least.
        self.generation = generation
        self.last_generation = generation()
        #: types found to be leaves under this registry as it is now
        self.leaf_types: set[type] = set()


#: The walk without a framework registry (built-in containers and dataclasses only).
NO_REGISTRY = Registry(lambda kind: None)


class TreeSpec:
    """How to put leaves back into the original nesting.

    ``kind`` is "leaf", "tuple", "list", "dict", "namedtuple", "structseq",
    "sequence" (a tuple or list subclass), "mapping" (a dict subclass),
    "dataclass" or "registered". Two specs are equal when their types,
    keys and children are; how a node is rebuilt takes no part in equality.
    """

    __slots__ = ("children", "context", "kind", "num_leaves", "rebuild", "type")

    def __init__(
        self,
        kind: str,
        type_: type | None = None,
        context: Any = None,
        children: tuple[TreeSpec, ...] = (),
        rebuild: Any = None,
    ) -> None:
        self.kind = kind
        self.type = type_
        self.context = context
        self.children = children
        self.rebuild = rebuild
        if kind == "leaf":
            self.num_leaves = 1
        else:
            n = 0
            for child in children:
                n += child.num_leaves
            self.num_leaves = n

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (
            isinstance(other, TreeSpec)
            and self.kind == other.kind
            and self.type is other.type
            and self.context == other.context
            and self.children == other.children
        )

    def __hash__(self) -> int:  # pragma: no cover - specs are compared, not hashed
        return hash((self.kind, self.num_leaves))

    def __repr__(self) -> str:
        if self.kind == "leaf":
            return "*"
        if self.kind in ("dict", "mapping"):
            inner = ", ".join(f"{k!r}: {c!r}" for k, c in zip(self.context, self.children))
            body = "{" + inner + "}"
        else:
            body = "(" + ", ".join(map(repr, self.children)) + ")"
            if self.kind == "list":
                body = "[" + body[1:-1] + "]"
        if self.kind in ("tuple", "list", "dict") or self.type is None:
            return body
        return f"{self.type.__name__}{body}"


_LEAF = TreeSpec("leaf")
# Specs shared by every walk that builds them (specs are never changed once built).
_EMPTY_DICT = TreeSpec("dict", dict, (), ())
_LEAF_TUPLES: dict[int, TreeSpec] = {}


def flatten(tree: Any, registry: Registry = NO_REGISTRY) -> tuple[list[Any], TreeSpec]:
    """Return the leaves of ``tree`` in a fixed order and the spec to rebuild it."""
    leaves: list[Any] = []
    # Types found to be leaves are remembered per registry: most leaves are tensors,
    # and this runs on every excluded call, twice.
    generation = registry.generation()
    if generation != registry.last_generation:  # a type was registered since the last walk
        registry.last_generation = generation
        registry.leaf_types = set()
    spec = _flatten_into(tree, leaves, registry)
    return leaves, spec


def _flatten_into(tree: Any, leaves: list[Any], registry: Registry) -> TreeSpec:
    kind = type(tree)
    if kind in registry.leaf_types:
        leaves.append(tree)
        return _LEAF
    # Exact built-in containers first.
    if kind is tuple:
        # A tuple of known leaves (a call's tensor arguments): one shared spec per length.
        leaf_types = registry.leaf_types
        for v in tree:
            if type(v) not in leaf_types:
                break
        else:
            leaves.extend(tree)
            spec = _LEAF_TUPLES.get(len(tree))
            if spec is None:
                spec = _LEAF_TUPLES[len(tree)] = TreeSpec("tuple", tuple, None, (_LEAF,) * len(tree))
            return spec
        return TreeSpec(
            "tuple", tuple, None, tuple([_flatten_into(v, leaves, registry) for v in tree])
        )
    if kind is dict:
        if not tree:
            return _EMPTY_DICT
        keys = tuple(tree)
        children = tuple([_flatten_into(tree[k], leaves, registry) for k in keys])
        return TreeSpec("dict", dict, keys, children)
    if kind is list:
        return TreeSpec(
            "list", list, None, tuple([_flatten_into(v, leaves, registry) for v in tree])
        )
    node = registry.lookup(kind)
    if node is not None:
        flatten_node, unflatten_node = node
        children_values, context = flatten_node(tree)
        children = tuple([_flatten_into(v, leaves, registry) for v in children_values])
        return TreeSpec("registered", kind, context, children, unflatten_node)
    if isinstance(tree, tuple):
        children = tuple([_flatten_into(v, leaves, registry) for v in tree])
        if hasattr(kind, "_fields"):
            return TreeSpec("namedtuple", kind, kind._fields, children)
        if hasattr(kind, "n_sequence_fields"):
            return TreeSpec("structseq", kind, None, children)
        return TreeSpec("sequence", kind, None, children)
    template: Any
    if isinstance(tree, list):
        template = copy.copy(tree)
        template[:] = [None] * len(tree)
        children = tuple([_flatten_into(v, leaves, registry) for v in tree])
        return TreeSpec("sequence", kind, None, children, template)
    if isinstance(tree, dict):
        keys = tuple(tree)
        template = copy.copy(tree)
        for key in keys:  # keep the type and its extras (a defaultdict's factory), not the values
            template[key] = None
        children = tuple([_flatten_into(tree[k], leaves, registry) for k in keys])
        return TreeSpec("mapping", kind, keys, children, template)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        names = tuple(f.name for f in dataclasses.fields(tree))
        template = copy.copy(tree)
        for name in names:
            object.__setattr__(template, name, None)
        children = tuple([_flatten_into(getattr(tree, n), leaves, registry) for n in names])
        return TreeSpec("dataclass", kind, names, children, template)
    if not isinstance(tree, type):  # a class object may become a dataclass's instance type
        registry.leaf_types.add(kind)
    leaves.append(tree)
    return _LEAF


def unflatten(leaves: list[Any], spec: TreeSpec) -> Any:
    """Inverse of :func:`flatten`."""
    if len(leaves) != spec.num_leaves:
        raise ValueError(f"expected {spec.num_leaves} leaves for {spec!r}, got {len(leaves)}")
    return _build(iter(leaves), spec)


def _build(it: Iterator[Any], spec: TreeSpec) -> Any:
    kind = spec.kind
    if kind == "leaf":
        return next(it)
    values = [_build(it, child) for child in spec.children]
    if kind == "tuple":
        return tuple(values)
    if kind == "list":
        return values
    if kind == "dict":
        return dict(zip(spec.context, values))
    if spec.type is None:
        raise internal_error(f"a {kind!r} tree spec without its type")
    if kind == "registered":
        return spec.rebuild(values, spec.context)
    if kind == "namedtuple":
        return spec.type(*values)
    if kind == "structseq":
        return spec.type(values)
    if kind == "sequence":
        if spec.rebuild is None:  # a tuple subclass
            return spec.type(values)
        out = copy.copy(spec.rebuild)
        out[:] = values
        return out
    out = copy.copy(spec.rebuild)
    if kind == "mapping":
        for key, value in zip(spec.context, values):
            out[key] = value
    else:  # dataclass
        for name, value in zip(spec.context, values):
            object.__setattr__(out, name, value)
    return out


def leaf_paths(spec: TreeSpec, root: str = "") -> list[str]:
    """Readable paths of the leaves, in flatten order (for error messages)."""
    paths: list[str] = []
    _paths_into(spec, root, paths)
    return paths


def _paths_into(spec: TreeSpec, prefix: str, out: list[str]) -> None:
    if spec.kind == "leaf":
        out.append(prefix or "<value>")
        return
    if spec.kind in ("dict", "mapping"):
        for key, child in zip(spec.context, spec.children):
            _paths_into(child, f"{prefix}[{key!r}]", out)
    elif spec.kind in ("namedtuple", "dataclass"):
        for field, child in zip(spec.context, spec.children):
            _paths_into(child, f"{prefix}.{field}", out)
    else:
        for i, child in enumerate(spec.children):
            _paths_into(child, f"{prefix}[{i}]", out)


def opaque_tensors(leaf: Any, is_tensor: Callable[[Any], bool]) -> list[str]:
    """Attributes of ``leaf`` that hold tensors the flattener did not see (one level
    deep, and inside tuples, lists and dicts there): what a cache of the leaf
    would silently share with the code after the region."""
    if is_tensor(leaf) or isinstance(leaf, type):
        return []
    attributes = getattr(leaf, "__dict__", None)
    if not isinstance(attributes, dict):
        return []
    found = []
    for name, value in attributes.items():
        inner, _ = flatten(value)
        if any(is_tensor(v) for v in inner):
            found.append(name)
    return found
