"""A plain function as a module (for the wrappers, which take modules)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from .._wrapping import default_name


class PlainFunction(nn.Module):
    """A plain function as a module, so that it can be an excluded region."""

    def __init__(self, function: Callable[..., Any]) -> None:
        super().__init__()
        self._recomp_function = function

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._recomp_function(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"function={default_name(self._recomp_function)}"
