"""Count the Python functions a step calls: what tests assert instead of a time."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any


def calls_of(step: Callable[[], Any]) -> Counter[tuple[str, str]]:
    """(file with ``/`` separators, qualified name) of every Python function ``step()``
    calls, with counts."""
    calls: Counter[tuple[str, str]] = Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls[(frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_qualname)] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls
