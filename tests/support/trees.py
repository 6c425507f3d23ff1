"""Comparing nested containers type by type: ``==`` alone holds between a namedtuple and
the plain tuple it became, or an ``OrderedDict`` and a ``dict``."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any


def assert_same_tree(actual: Any, expected: Any, path: str = "") -> None:
    """Assert that ``actual`` equals ``expected`` and has the same type at every node
    (containers and leaves), with mapping keys in the same order."""
    where = path or "the root"
    assert type(actual) is type(expected), (
        f"{where}: {type(actual).__name__} where {type(expected).__name__} was expected"
    )
    if isinstance(expected, defaultdict):
        assert actual.default_factory is expected.default_factory, f"{where}: default_factory"
    if isinstance(expected, Mapping):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same_tree(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_tree(a, e, f"{path}[{i}]")
    elif dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        for field in dataclasses.fields(expected):
            name = field.name
            assert_same_tree(getattr(actual, name), getattr(expected, name), f"{path}.{name}")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"
