"""A plain function as a Cell (for the wrappers, which take Cells)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mindspore import nn

from .._wrapping import default_name


class PlainFunction(nn.Cell):
    """A plain function (or a Primitive) as a Cell, so that it can be an excluded region."""

    def __init__(self, function: Callable[..., Any]) -> None:
        super().__init__(auto_prefix=False)
        object.__setattr__(self, "_recomp_function", function)

    def construct(self, *args: Any, **kwargs: Any) -> Any:
        return self._recomp_function(*args, **kwargs)

    def extend_repr(self) -> str:
        return f"function={default_name(self._recomp_function)}"
