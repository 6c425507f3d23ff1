"""Memory budgets a user can type (no framework imports).

* a share of the range between full checkpointing of every layer and no checkpointing:
  ``"50%"``, or a bare number between 0 and 1 (``0.5``, ``"0.5"``);
* bytes, always with a unit: ``"6GiB"``, ``"512 MiB"``, ``"1.5GB"``, ``"123456B"``.

A bare number above 1 (``"50"``, ``4096``) is refused: it could be a percentage or a
byte count, and reading it as either would plan for the wrong memory.

PyTorch's ``torch._functorch.config.activation_memory_budget`` (compiled models) is
also a share between two ends, but other ones: 0 keeps only the compiled graph's
inputs (less than full checkpointing, which keeps each layer's input) and 1 keeps what
the default partitioner saves (less than no checkpointing: compiled, cheap element-wise
ops are already recomputed). The same number therefore lands on different bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The planner's messages give bytes as the errors do (re-exported for its modules).
from ..errors import format_bytes as format_bytes

_UNITS = {
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


# How recomp's percentage relates to PyTorch's activation_memory_budget, for help texts.
TORCH_BUDGET_NOTE = (
    "recomp's percentage runs from full checkpointing of every layer (0%, each layer keeps "
    "its input) to no checkpointing (100%), measured in eager mode. PyTorch's "
    "torch._functorch.config.activation_memory_budget (compiled models) is also a fraction, "
    "but from 0 = only the compiled graph's inputs kept to 1 = what its default partitioner "
    "saves (which already recomputes cheap element-wise ops): the same number lands on "
    "fewer bytes there. Compare plans by bytes, not by the number."
)

_BUDGET_FORMS = (
    "a fraction between 0 and 1 (0.5), a percentage (50%) of the range between full "
    "checkpointing (0%) and none (100%), or bytes with a unit (6GiB, 512MiB, 1.5GB, 123456B)"
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
    """``0.5`` or ``"0.5"`` (a fraction), ``"50%"``, or bytes with a unit: ``"6GiB"``,
    ``"512 MiB"``, ``"1.5GB"``, ``"123456B"``. A bare number above 1 is refused."""
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool):
        raise ValueError(f"a memory budget is {_BUDGET_FORMS}; got {value!r}")
    if isinstance(value, (int, float)):
        return _bare_number(float(value), str(value))
    text = str(value).strip()
    match = _PATTERN.match(text)
    if match is None:
        raise ValueError(f"cannot read memory budget {value!r}: give {_BUDGET_FORMS}")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if not 0.0 <= number <= 100.0:
            raise ValueError(
                f"a budget percentage lies between 0% (full checkpointing) and 100% "
                f"(no checkpointing), got {value!r}"
            )
        return Budget(text=text, percent=number)
    if unit == "":
        return _bare_number(number, text)
    if unit not in _UNITS:
        raise ValueError(
            f"unknown unit {match.group(2)!r} in memory budget {value!r}: use B, KiB, MiB, "
            "GiB, TiB (powers of 1024), KB, MB, GB, TB (powers of 1000) or %"
        )
    return Budget(text=text, nbytes=int(number * _UNITS[unit]))


def _bare_number(number: float, text: str) -> Budget:
    """A number without a unit: a fraction of the range when between 0 and 1."""
    if number != number or number < 0:  # NaN or negative
        raise ValueError(f"a memory budget cannot be negative, got {text!r}")
    if number <= 1.0:
        return Budget(text=text, percent=number * 100.0)
    shown = f"{number:g}"
    raise ValueError(
        f"memory budget {text!r} has no unit: a bare number is a fraction between 0 and 1. "
        f"Write {shown}% for a share of the range between full checkpointing (0%) and none "
        f"(100%), or {shown}B / {shown}MiB / {shown}GiB for bytes"
    )
