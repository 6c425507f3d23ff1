"""Flatten nested containers of a region's inputs and outputs into leaves.

Only the containers that appear in model code are walked: tuples, lists,
dicts and namedtuples. Anything else is a leaf, tensors and non-tensors alike,
so unknown objects pass through a region untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class TreeSpec:
    """How to put leaves back into the original nesting.

    ``kind`` is one of "leaf", "tuple", "list", "dict", "namedtuple";
    ``context`` is the dict keys or the namedtuple type.
    """

    __slots__ = ("children", "context", "kind", "num_leaves")

    def __init__(self, kind: str, context: Any = None, children: tuple[TreeSpec, ...] = ()) -> None:
        self.kind = kind
        self.context = context
        self.children = children
        if kind == "leaf":
            self.num_leaves = 1
        else:
            n = 0
            for child in children:
                n += child.num_leaves
            self.num_leaves = n

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TreeSpec)
            and self.kind == other.kind
            and self.context == other.context
            and self.children == other.children
        )

    def __hash__(self) -> int:  # pragma: no cover - specs are compared, not hashed
        return hash((self.kind, self.num_leaves))

    def __repr__(self) -> str:
        if self.kind == "leaf":
            return "*"
        inner = ", ".join(map(repr, self.children))
        if self.kind == "dict":
            inner = ", ".join(f"{k!r}: {c!r}" for k, c in zip(self.context, self.children))
            return "{" + inner + "}"
        if self.kind == "namedtuple":
            return f"{self.context.__name__}({inner})"
        return f"[{inner}]" if self.kind == "list" else f"({inner})"


_LEAF = TreeSpec("leaf")


def flatten(tree: Any) -> tuple[list[Any], TreeSpec]:
    """Return the leaves of ``tree`` in a fixed order and the spec to rebuild it."""
    leaves: list[Any] = []
    spec = _flatten_into(tree, leaves)
    return leaves, spec


def _flatten_into(tree: Any, leaves: list[Any]) -> TreeSpec:
    kind = type(tree)
    # Exact types first: this runs on every excluded call, twice.
    if kind is tuple:
        return TreeSpec("tuple", None, tuple([_flatten_into(v, leaves) for v in tree]))
    if kind is dict:
        keys = tuple(tree)
        return TreeSpec("dict", keys, tuple([_flatten_into(tree[k], leaves) for k in keys]))
    if kind is list:
        return TreeSpec("list", None, tuple([_flatten_into(v, leaves) for v in tree]))
    if isinstance(tree, tuple):
        if hasattr(kind, "_fields"):
            return TreeSpec("namedtuple", kind, tuple([_flatten_into(v, leaves) for v in tree]))
        return TreeSpec("tuple", None, tuple([_flatten_into(v, leaves) for v in tree]))
    if isinstance(tree, list):
        return TreeSpec("list", None, tuple([_flatten_into(v, leaves) for v in tree]))
    if isinstance(tree, dict):
        keys = tuple(tree)
        return TreeSpec("dict", keys, tuple([_flatten_into(tree[k], leaves) for k in keys]))
    leaves.append(tree)
    return _LEAF


def unflatten(leaves: list[Any], spec: TreeSpec) -> Any:
    """Inverse of :func:`flatten`."""
    if len(leaves) != spec.num_leaves:
        raise ValueError(f"expected {spec.num_leaves} leaves for {spec!r}, got {len(leaves)}")
    it = iter(leaves)
    return _build(it, spec)


def _build(it: Iterator[Any], spec: TreeSpec) -> Any:
    if spec.kind == "leaf":
        return next(it)
    values = [_build(it, child) for child in spec.children]
    if spec.kind == "tuple":
        return tuple(values)
    if spec.kind == "list":
        return values
    if spec.kind == "namedtuple":
        return spec.context(*values)
    return dict(zip(spec.context, values))


def leaf_paths(spec: TreeSpec, root: str = "") -> list[str]:
    """Readable paths of the leaves, in flatten order (for error messages)."""
    paths: list[str] = []
    _paths_into(spec, root, paths)
    return paths


def _paths_into(spec: TreeSpec, prefix: str, out: list[str]) -> None:
    if spec.kind == "leaf":
        out.append(prefix or "<value>")
        return
    if spec.kind == "dict":
        for key, child in zip(spec.context, spec.children):
            _paths_into(child, f"{prefix}[{key!r}]", out)
    elif spec.kind == "namedtuple":
        for field, child in zip(spec.context._fields, spec.children):
            _paths_into(child, f"{prefix}.{field}", out)
    else:
        for i, child in enumerate(spec.children):
            _paths_into(child, f"{prefix}[{i}]", out)
