"""Memory budgets: ``"6GiB"``, ``"512MiB"``, a plain byte count, or ``"50%"`` of the range
between full checkpointing (0%) and no checkpointing (100%). No framework imports."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}

_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*|%)\s*$")

MiB = float(1 << 20)


class BudgetTooSmallError(ValueError):
    """The budget is below the least activation memory any plan keeps."""

    def __init__(self, budget_bytes: int, minimum_bytes: int, detail: str = "") -> None:
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        super().__init__(
            f"memory budget {format_bytes(budget_bytes)} is below {format_bytes(minimum_bytes)}, "
            f"the least activation memory any plan keeps{detail}. Give a budget of at least "
            f"{format_bytes(minimum_bytes)} (or 0%), or make the layers smaller (batch, sequence)."
        )


@dataclass(frozen=True)
class Budget:
    """A budget as given: absolute bytes, or a percentage of the checkpointing range."""

    text: str
    nbytes: int | None = None
    percent: float | None = None

    def resolve(self, full_bytes: int, none_bytes: int) -> int:
        """Bytes of this budget, given the activation memory of full checkpointing of every
        layer (``full_bytes``, 0%) and of no checkpointing (``none_bytes``, 100%)."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.percent is not None
        return int(full_bytes + self.percent / 100.0 * (none_bytes - full_bytes))


def parse_budget(value: str | int | float | Budget) -> Budget:
    """``"6GiB"``, ``"512 MiB"``, ``"1.5GB"``, ``"123456"`` (bytes) or ``"50%"``."""
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool):
        raise ValueError(f"a memory budget is bytes or a percentage, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a memory budget cannot be negative, got {value!r}")
        return Budget(text=str(value), nbytes=int(value))
    match = _PATTERN.match(str(value))
    if match is None:
        raise ValueError(
            f"cannot read memory budget {value!r}: give bytes with a unit (6GiB, 512MiB, 1.5GB, "
            "123456) or a percentage between full checkpointing (0%) and none (100%), e.g. 50%"
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if not 0.0 <= number <= 100.0:
            raise ValueError(
                f"a budget percentage lies between 0% (full checkpointing) and 100% "
                f"(no checkpointing), got {value!r}"
            )
        return Budget(text=str(value).strip(), percent=number)
    if unit not in _UNITS:
        raise ValueError(
            f"unknown unit {match.group(2)!r} in memory budget {value!r}: use B, KiB, MiB, "
            "GiB, TiB (powers of 1024), KB, MB, GB, TB (powers of 1000) or %"
        )
    return Budget(text=str(value).strip(), nbytes=int(number * _UNITS[unit]))


def format_bytes(n: float) -> str:
    """Bytes as MiB (or GiB above 1 GiB), for messages."""
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / MiB:.2f} MiB"
