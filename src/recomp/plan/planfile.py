"""The plan file: readable, versioned JSON (no framework imports).

::

    {"version": 2, "budget": "50%", "budget_bytes": 23068672, "exclude_collectives": true,
     "layers": [{"path": "layers.0", "option": "exclude:attn", "kept_bytes": 2621440,
                 "predicted_ms": 4.1, "replay_flops": 369098752, "reason": "..."}, ...],
     "near_ties": [{"path": "layers.3", "chosen": "none",
                    "alternatives": [{"option": "selective", "replay_flops": 0}]}],
     "predicted": {...}}

``option`` is ``none`` (not checkpointed), ``full`` (checkpointed),
``exclude:A+B`` (checkpointed, with the sub-modules at paths ``A`` and ``B`` inside the
layer excluded from the replay), ``selective`` (checkpointed, the outputs of its
expensive ops kept: ``recomp.plan.policy``), ``selective+exclude:A+B`` (both),
``full+swap-inputs`` (checkpointed, its saved inputs on the host until the replay),
``swap`` (not checkpointed, what it saves on the host until backward), ``offload`` (not
checkpointed, what it saves of at least 1 MiB per storage on the host until backward),
``exclude-offload:A+B`` (``exclude:A+B`` with what ``A`` and ``B`` keep on the host),
``full+partition-inputs`` (checkpointed, its saved inputs kept split over the
tensor-parallel group until the replay gathers them), or
``full+replay-collectives`` and ``full+replay-collectives+exclude:A+B`` (``full`` and
``exclude:A+B`` whose replay runs the collectives again instead of keeping their
results: ``exclude_collectives=False`` for that layer). The names are those of
``recomp bench``'s strategies (``recomp.cli.strategies``).
``predicted_ms`` is the replay time of the layer. ``near_ties``: per layer, the options
it could have taken in a plan that fits and is predicted as fast within the tolerance
(the choice a tie-break made). ``exclude_collectives``: the option every checkpoint
of the plan gets but those whose option replays the collectives (true unless profiled
with ``exclude_collectives=False``; absent in older files: true). Version 1 files (no selective options, no near ties)
are read as well.

Version 3 is a plan for a compiled model (``recomp.plan.compiled``): a ``"compiled"``
section (``backend``, ``activation_memory_budget``: PyTorch's partitioner setting that
lands on the budget) and per layer the option ``partitioner`` (the partitioner decides)
or ``partitioner+exclude:A+B`` (``A`` and ``B`` kept whole, never recomputed). Plans
for eager models stay version 2.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from .._offload_session import MIN_OFFLOAD_BYTES
from ..errors import PlanFormatError

PLAN_VERSION = 2
COMPILED_PLAN_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
# The option names: a layer not checkpointed, checkpointed whole, or with exclusions;
# "selective" and "selective+exclude:..." keep the outputs of expensive ops as well.
NO_CHECKPOINT = "none"
FULL_CHECKPOINT = "full"
EXCLUDE_PREFIX = "exclude:"
SELECTIVE = "selective"
SELECTIVE_PREFIX = "selective+"
# Swap options (offered where the device has a host link): a full checkpoint whose saved
# inputs wait on the host until the replay (``checkpoint_wrapper(..., swap_inputs=True)``),
# and no checkpoint with what autograd saves in the layer on the host until backward
# (``swap_wrapper``).
FULL_SWAP_INPUTS = "full+swap-inputs"
SWAP = "swap"
# Offload options (offered where the device has a host link), which move what the
# offloader and offload sessions move: storages of at least ``OFFLOAD_MIN_BYTES``
# (``recomp.torch``'s ``Offloader(min_bytes=...)`` and ``offload_session(min_bytes=...)``
# default). ``offload``: no checkpoint, what autograd saves in the layer of that size on
# the host until backward (``swap_wrapper`` with that size as its policy);
# ``exclude-offload:A+B``: ``exclude:A+B`` whose regions keep what they keep on the host
# (``checkpoint_exclude_wrapper(..., offload=True)``).
OFFLOAD = "offload"
EXCLUDE_OFFLOAD_PREFIX = "exclude-offload:"
OFFLOAD_MIN_BYTES = MIN_OFFLOAD_BYTES
# A full checkpoint whose saved inputs are kept as this rank's slice over the
# tensor-parallel group and gathered in the replay (``checkpoint_wrapper(...,
# partition_inputs=group)``; offered where the layout has tensor parallelism).
PARTITION_INPUTS = "full+partition-inputs"
# A checkpoint whose replay runs its collectives again instead of keeping their results
# (``exclude_collectives=False`` for that layer alone): ``full+replay-collectives`` and
# ``full+replay-collectives+exclude:A+B``.
REPLAY_COLLECTIVES = "full+replay-collectives"
# A profile's ``exclude_collectives`` that offers both, for the plan to choose per layer.
PER_LAYER = "per-layer"
# Compiled plans: PyTorch's partitioner decides, the named regions kept whole.
PARTITIONER = "partitioner"
PARTITIONER_PREFIX = "partitioner+"


@dataclass
class LayerPlan:
    """The plan of one layer: its module path, the option chosen (``"none"``,
    ``"full"``, ``"selective"``, a checkpoint with regions excluded, ``"exclude:attn+mlp"``), what
    the profile predicts it keeps (``kept_bytes``) and replays (``predicted_ms``,
    ``replay_flops``), its class name and why it was chosen."""

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
        """Whether the layer gets a checkpoint wrapper (a compiled plan's layer only when
        it keeps regions whole: the wrapper carries their mark)."""
        kind, regions = parse_option(self.option)
        return checkpointed(self.option) and (kind != PARTITIONER or bool(regions))

    @property
    def partitioner(self) -> bool:
        """Whether the layer is left to PyTorch's partitioner (a compiled plan)."""
        return parse_option(self.option)[0] == PARTITIONER

    @property
    def swap_inputs(self) -> bool:
        """Whether the layer's checkpoint keeps its inputs on the host (``full+swap-inputs``)."""
        return self.option == FULL_SWAP_INPUTS

    @property
    def swapped(self) -> bool:
        """Whether the layer is not checkpointed and swaps what it saves (``swap``)."""
        return self.option == SWAP

    @property
    def offloaded(self) -> bool:
        """Whether the layer is not checkpointed and offloads what it saves (``offload``)."""
        return self.option == OFFLOAD

    @property
    def offloads_regions(self) -> bool:
        """Whether the excluded regions keep what they keep on the host
        (``exclude-offload:A+B``)."""
        return self.option.startswith(EXCLUDE_OFFLOAD_PREFIX)

    @property
    def partition_inputs(self) -> bool:
        """Whether the checkpoint keeps its saved inputs split over the tensor-parallel
        group (``full+partition-inputs``)."""
        return self.option == PARTITION_INPUTS

    @property
    def selective(self) -> bool:
        """Whether the checkpoint keeps the outputs of the layer's expensive ops."""
        return is_selective(self.option)

    @property
    def replays_collectives(self) -> bool:
        """Whether the checkpoint's replay runs the collectives again instead of keeping
        their results (``full+replay-collectives``, ``...+exclude:A``)."""
        return replays_collectives(self.option)


@dataclass
class Plan:
    """What :func:`make_plan` chose for each layer, with its budget and predictions.

    ``layers`` holds one :class:`LayerPlan` per layer in the model's order;
    ``budget_bytes`` is the activation-memory budget it fits (``budget`` the budget as
    given, ``"50%"`` or ``"6GiB"``); ``predicted`` the profile's prediction for the
    whole plan (kept bytes, replay time and FLOPs); ``near_ties`` the other choices that
    came within the tie tolerance. :func:`save_plan` writes it as versioned JSON,
    :func:`load_plan` reads it back, :func:`apply_plan` wraps a model as it says.
    ``compiled`` is set for a plan made for ``torch.compile`` (its backend and
    PyTorch's ``activation_memory_budget``), None otherwise.
    """

    budget_bytes: int
    layers: list[LayerPlan]
    budget: str = ""
    predicted: dict[str, Any] = field(default_factory=dict)
    near_ties: list[dict[str, Any]] = field(default_factory=list)
    version: int = PLAN_VERSION
    # A compiled plan: {"backend": ..., "activation_memory_budget": ...}; None otherwise.
    compiled: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.compiled is not None:
            self.version = COMPILED_PLAN_VERSION
    # The checkpoints' exclude_collectives option, as the profile predicted for it.
    exclude_collectives: bool = True

    def to_dict(self) -> dict[str, Any]:
        extra = {} if self.compiled is None else {"compiled": self.compiled}
        return {
            "version": self.version,
            **extra,
            "budget": self.budget,
            "budget_bytes": self.budget_bytes,
            "exclude_collectives": self.exclude_collectives,
            "layers": [
                {k: v for k, v in asdict(layer).items() if v is not None} for layer in self.layers
            ],
            "near_ties": self.near_ties,
            "predicted": self.predicted,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict):
            raise PlanFormatError(f"a plan is a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version not in READABLE_VERSIONS:
            raise PlanFormatError(
                f"plan version {version!r} is not supported: this recomp reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}. Make the plan again with "
                "`recomp plan` (or recomp.plan.make_plan)."
            )
        try:
            layers = [LayerPlan(**layer) for layer in data["layers"]]
            budget_bytes = int(data["budget_bytes"])
        except (KeyError, TypeError) as exc:
            raise PlanFormatError(
                f"malformed plan ({exc}): a plan has budget_bytes and layers, each "
                "layer with path and option"
            ) from exc
        exclude_collectives = data.get("exclude_collectives", True)
        if not isinstance(exclude_collectives, bool):
            raise PlanFormatError(
                f"exclude_collectives is true or false, got {exclude_collectives!r}"
            )
        compiled = data.get("compiled")
        if (version == COMPILED_PLAN_VERSION) != isinstance(compiled, dict):
            raise PlanFormatError(
                "a version-3 plan (for a compiled model) has a 'compiled' section, and only it"
            )
        for layer in layers:
            kind = parse_option(layer.option)[0]
            if version == 1 and is_selective(layer.option):
                raise PlanFormatError(
                    f"layer {layer.path!r}: option {layer.option!r} needs a version-2 plan"
                )
            if (kind == PARTITIONER) != (compiled is not None):
                raise PlanFormatError(
                    f"layer {layer.path!r}: option {layer.option!r} "
                    + (
                        "belongs in a plan for a compiled model (version 3)"
                        if compiled is None
                        else "cannot be part of a plan for a compiled model: use partitioner or "
                        "partitioner+exclude:PATH"
                    )
                )
        if compiled is not None:
            try:
                compiled = {
                    **compiled,
                    "activation_memory_budget": float(compiled["activation_memory_budget"]),
                }
            except (KeyError, TypeError, ValueError) as exc:
                raise PlanFormatError(
                    "the 'compiled' section of a plan needs activation_memory_budget (a number)"
                ) from exc
        return cls(
            budget_bytes=budget_bytes,
            layers=layers,
            budget=str(data.get("budget", "")),
            predicted=dict(data.get("predicted") or {}),
            near_ties=list(data.get("near_ties") or []),
            version=PLAN_VERSION,
            compiled=compiled,
            exclude_collectives=exclude_collectives,
        )


def parse_option(option: str) -> tuple[str, tuple[str, ...]]:
    """``"none"`` -> ``("none", ())``; ``"exclude:attn+mlp"`` -> ``("exclude", ("attn",
    "mlp"))``; ``"selective"`` -> ``("full", ())`` and ``"selective+exclude:attn"`` ->
    ``("exclude", ("attn",))``: the checkpoint and its exclusions (``is_selective`` tells
    whether expensive ops' outputs are kept too)."""
    rest = option
    if option in (SELECTIVE, FULL_SWAP_INPUTS, REPLAY_COLLECTIVES, PARTITION_INPUTS):
        return FULL_CHECKPOINT, ()
    if option == OFFLOAD:
        return OFFLOAD, ()
    if option.startswith(EXCLUDE_OFFLOAD_PREFIX):
        offloaded = parse_option(EXCLUDE_PREFIX + option[len(EXCLUDE_OFFLOAD_PREFIX) :])
        if offloaded[0] == "exclude":
            return offloaded
    if option.startswith(REPLAY_COLLECTIVES + "+"):
        replayed = parse_option(option[len(REPLAY_COLLECTIVES) + 1 :])
        if replayed[0] == "exclude" and not is_selective(option[len(REPLAY_COLLECTIVES) + 1 :]):
            return replayed
    if option == SWAP:
        return SWAP, ()
    if option == PARTITIONER:
        return PARTITIONER, ()
    if option.startswith(PARTITIONER_PREFIX):
        kept = parse_option(option[len(PARTITIONER_PREFIX) :])
        if kept[0] == "exclude":
            return PARTITIONER, kept[1]
    if option.startswith(SELECTIVE_PREFIX):
        rest = option[len(SELECTIVE_PREFIX) :]
    if rest is option and option in (NO_CHECKPOINT, FULL_CHECKPOINT):
        return option, ()
    if rest.startswith(EXCLUDE_PREFIX):
        regions = tuple(r for r in rest[len(EXCLUDE_PREFIX) :].split("+") if r)
        if regions:
            return "exclude", regions
    raise PlanFormatError(
        f"unknown layer option {option!r}: use none, full, exclude:PATH[+PATH...] "
        "(sub-module paths inside the layer), selective or selective+exclude:PATH[+PATH...], "
        f"{FULL_SWAP_INPUTS}, {SWAP}, {OFFLOAD}, exclude-offload:PATH[+PATH...], "
        f"{PARTITION_INPUTS}, {REPLAY_COLLECTIVES} or "
        f"{REPLAY_COLLECTIVES}+exclude:PATH[+PATH...]; "
        "in a plan for a compiled model partitioner or partitioner+exclude:PATH[+PATH...]"
    )


def checkpointed(option: str) -> bool:
    """Whether ``option`` puts a checkpoint around the layer (all but ``none``, ``swap``
    and ``offload``; a compiled plan's ``partitioner`` too, which leaves the choice to
    PyTorch's partitioner)."""
    return parse_option(option)[0] not in (NO_CHECKPOINT, SWAP, OFFLOAD)


def moves_to_host(option: str) -> bool:
    """Whether ``option`` holds some of what the layer keeps on the host between its
    forward and its backward (the swap and offload options)."""
    return option in (SWAP, FULL_SWAP_INPUTS, OFFLOAD) or option.startswith(
        EXCLUDE_OFFLOAD_PREFIX
    )


def exclude_offload_option(regions: tuple[str, ...] | list[str]) -> str:
    """The option that excludes ``regions`` with what they keep on the host."""
    if not regions:
        raise ValueError("exclude-offload names at least one region")
    return EXCLUDE_OFFLOAD_PREFIX + "+".join(regions)


def is_selective(option: str) -> bool:
    return option == SELECTIVE or option.startswith(SELECTIVE_PREFIX)


def replays_collectives(option: str) -> bool:
    """Whether ``option`` is a checkpoint whose replay runs the collectives again."""
    return option == REPLAY_COLLECTIVES or option.startswith(REPLAY_COLLECTIVES + "+")


def replay_collectives_option(option: str) -> str:
    """The option that checkpoints as ``option`` (``full`` or ``exclude:A+B``) with its
    collectives run again in the replay."""
    kind, regions = parse_option(option)
    if kind not in (FULL_CHECKPOINT, "exclude") or option != exclude_option(regions):
        raise ValueError(f"{option!r} has no variant that replays the collectives")
    return REPLAY_COLLECTIVES + ("+" + option if regions else "")


def exclude_option(regions: tuple[str, ...] | list[str], selective: bool = False) -> str:
    if selective:
        return SELECTIVE_PREFIX + exclude_option(regions) if regions else SELECTIVE
    return EXCLUDE_PREFIX + "+".join(regions) if regions else FULL_CHECKPOINT


def partitioner_option(kept: tuple[str, ...] | list[str]) -> str:
    """The option of a compiled plan's layer that keeps regions ``kept`` whole."""
    return PARTITIONER_PREFIX + exclude_option(kept) if kept else PARTITIONER


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write ``plan`` as indented, versioned JSON (the directory is created). Read it
    back with :func:`load_plan`; ``recomp plan --json`` writes the same format."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(plan.to_dict(), f, indent=2)
        f.write("\n")


def load_plan(source: str | os.PathLike[str] | dict[str, Any] | Plan) -> Plan:
    """A plan from a JSON file path, a dict, or a :class:`Plan` (returned as is).

    Raises :class:`recomp.errors.PlanFormatError` for a file of a version this recomp cannot read."""
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
