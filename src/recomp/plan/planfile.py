"""The plan file: readable, versioned JSON (no framework imports).

::

    {"version": 1, "budget": "50%", "budget_bytes": 23068672,
     "layers": [{"path": "layers.0", "option": "exclude:attn", "kept_bytes": 2621440,
                 "predicted_ms": 4.1, "replay_flops": 369098752, "reason": "..."}, ...],
     "predicted": {...}}

``option`` is ``none`` (not checkpointed), ``full`` (checkpointed) or
``exclude:A+B`` (checkpointed, with the sub-modules at paths ``A`` and ``B`` inside the
layer excluded from the replay). ``predicted_ms`` is the replay time of the layer.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

PLAN_VERSION = 1
# The option names: a layer not checkpointed, checkpointed whole, or with exclusions.
NO_CHECKPOINT = "none"
FULL_CHECKPOINT = "full"
EXCLUDE_PREFIX = "exclude:"


class PlanFormatError(ValueError):
    """A plan file that this version of recomp cannot read."""


@dataclass
class LayerPlan:
    path: str
    option: str
    kept_bytes: int = 0
    predicted_ms: float = 0.0
    replay_flops: int = 0
    type: str | None = None
    reason: str = ""

    @property
    def excluded(self) -> tuple[str, ...]:
        """Paths (inside the layer) of the excluded sub-modules."""
        return parse_option(self.option)[1]

    @property
    def checkpointed(self) -> bool:
        return parse_option(self.option)[0] != NO_CHECKPOINT


@dataclass
class Plan:
    budget_bytes: int
    layers: list[LayerPlan]
    budget: str = ""
    predicted: dict[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "budget": self.budget,
            "budget_bytes": self.budget_bytes,
            "layers": [
                {k: v for k, v in asdict(layer).items() if v is not None} for layer in self.layers
            ],
            "predicted": self.predicted,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict):
            raise PlanFormatError(f"a plan is a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise PlanFormatError(
                f"plan version {version!r} is not supported: this recomp reads version "
                f"{PLAN_VERSION}. Make the plan again with `recomp plan` (or recomp.plan.make_plan)."
            )
        try:
            layers = [LayerPlan(**layer) for layer in data["layers"]]
            budget_bytes = int(data["budget_bytes"])
        except (KeyError, TypeError) as exc:
            raise PlanFormatError(
                f"malformed plan ({exc}): a version-1 plan has budget_bytes and layers, each "
                "layer with path and option"
            ) from exc
        for layer in layers:
            parse_option(layer.option)
        return cls(
            budget_bytes=budget_bytes,
            layers=layers,
            budget=str(data.get("budget", "")),
            predicted=dict(data.get("predicted") or {}),
            version=version,
        )


def parse_option(option: str) -> tuple[str, tuple[str, ...]]:
    """``"none"`` -> ``("none", ())``; ``"exclude:attn+mlp"`` -> ``("exclude", ("attn", "mlp"))``."""
    if option in (NO_CHECKPOINT, FULL_CHECKPOINT):
        return option, ()
    if option.startswith(EXCLUDE_PREFIX):
        regions = tuple(r for r in option[len(EXCLUDE_PREFIX) :].split("+") if r)
        if regions:
            return "exclude", regions
    raise PlanFormatError(
        f"unknown layer option {option!r}: use none, full or exclude:PATH[+PATH...] "
        "(sub-module paths inside the layer)"
    )


def exclude_option(regions: tuple[str, ...] | list[str]) -> str:
    return EXCLUDE_PREFIX + "+".join(regions) if regions else FULL_CHECKPOINT


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write ``plan`` as indented JSON."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(plan.to_dict(), f, indent=2)
        f.write("\n")


def load_plan(source: str | os.PathLike[str] | dict[str, Any] | Plan) -> Plan:
    """A plan from a JSON file path, a dict, or a :class:`Plan` (returned as is)."""
    if isinstance(source, Plan):
        return source
    if isinstance(source, dict):
        return Plan.from_dict(source)
    with open(source) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise PlanFormatError(f"{os.fspath(source)} is not JSON: {exc}") from exc
    return Plan.from_dict(data)
