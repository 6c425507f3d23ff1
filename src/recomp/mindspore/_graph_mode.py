"""Telling a user who compiles a recomp wrapper (GRAPH_MODE, ``@mindspore.jit``) to use PyNative.

A check inside ``construct`` cannot do it: MindSpore does not run ``construct``
when it compiles, it parses it, and it turns any ``raise`` of an exception
type of its own choosing into "Unsupported exception type". What does run as
Python is the compiler's lookup of the ``construct`` method of every Cell it
meets. So the wrappers' ``construct`` is a descriptor that raises
``RecompError`` when the compiler looks it up; MindSpore passes a Python
exception raised there on unchanged. A wrapper called directly in GRAPH_MODE
is caught before compilation starts (MindSpore writes no
``rank_0/om/analyze_fail.ir`` then); one nested in a compiled model or function
is caught while MindSpore analyses the graph, which writes that file.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..errors import RecompError
from ._compat import graph_parser_lookups


def pynative_error(api: str) -> RecompError:
    return RecompError(
        f"recomp.mindspore.{api} needs PyNative mode: excluded regions and recompute are "
        "driven from Python while the model runs, which a compiled graph (GRAPH_MODE or "
        "@mindspore.jit) does not do. Call mindspore.set_context(mode=mindspore.PYNATIVE_MODE) "
        "and run the model without @mindspore.jit."
    )


class PyNativeOnly:
    """A ``construct`` method that MindSpore's graph compiler cannot take."""

    def __init__(self, function: Callable[..., Any], api: str) -> None:
        self.function = function
        self.api = api
        self.__doc__ = function.__doc__

    def __get__(self, cell: Any, owner: type | None = None) -> Any:
        if cell is None:
            return self.function
        frame = inspect.currentframe()
        try:
            caller = frame.f_back if frame is not None else None
            if caller is not None and caller.f_code in graph_parser_lookups():
                raise pynative_error(self.api)
        finally:
            # A frame kept in a local of its own refers to itself: a reference cycle
            # that would hold the caller's locals (a step's tensors) until the
            # garbage collector runs.
            del frame
            caller = None
        return self.function.__get__(cell, owner)


def pynative_only(api: str) -> Callable[[Callable[..., Any]], PyNativeOnly]:
    """Decorate a wrapper's ``construct`` (see the module docstring)."""
    return lambda function: PyNativeOnly(function, api)
