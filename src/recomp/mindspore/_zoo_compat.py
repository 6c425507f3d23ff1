"""MindSpore private API used by the model-zoo handling (``_early_stop``, ``_graph_mode``).

Kept apart, in the style of a compat module: each entry says why it is needed,
what happens if MindSpore changes it, and what public API would retire it.
Nothing private is imported at module load. Checked on MindSpore 2.10.0.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from ..errors import RecompError


def _lookup(module: str, name: str, why: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise RecompError(
            f"recomp.mindspore needs {module}.{name} ({why}), which this MindSpore version "
            "does not have. recomp.mindspore was checked on MindSpore 2.10; please report the "
            "version you use."
        ) from exc


@functools.cache
def stop_recomputation_error() -> type:
    """The exception ``mindspore.recompute`` raises to end an early-stopping replay.

    Why: recognise an early stop inside a dropout, which MindSpore 2.10 cannot
    recover from, and raise an error naming the fix instead.
    If it changes: the lookup fails with a RecompError when early_stop=True is used.
    Retired by: MindSpore recovering from an early stop inside any op.
    """
    error: type = _lookup(
        "mindspore.common.recompute", "_StopRecomputationError", "recognising an early stop"
    )
    return error


@functools.cache
def graph_parser_lookups() -> frozenset[Any]:
    """Code objects of the Python functions through which MindSpore's graph compiler
    looks up a Cell's ``construct``: the parser's attribute lookup (every Cell it
    meets, GRAPH_MODE and ``jit``) and the GRAPH_MODE entry (the Cell called first).

    Why: a recomp wrapper raises its PyNative error when the compiler looks it up,
    the one point where Python runs during compilation.
    If it changes: an empty set, and compilation fails with MindSpore's own message.
    Retired by: a public "is the graph compiler running" query.
    """
    codes = set()
    for module, owner, name in (
        ("mindspore.graph._parse.parser", None, "get_attr_from_object"),
        ("mindspore.graph.api", "_CellGraphExecutor", "compile"),
    ):
        try:
            target = importlib.import_module(module)
            if owner is not None:
                target = getattr(target, owner)
            codes.add(getattr(target, name).__code__)
        except (ImportError, AttributeError):
            continue
    return frozenset(codes)
