"""Whole-job memory per rank: parameters, gradients, optimizer states and activations.

A framework-free estimate (PyTorch is imported only to count a module's parameters, to
measure a layer's weight inputs, and to read a pipeline schedule's action lists)::

    from recomp.plan.job import Parallel, job_memory

    result = job_memory(
        model,                                  # a torch module (meta or fake is fine),
                                                # or model_params(...) / ModelParams
        parallel=Parallel(dp=8, tp=8, pp=4, zero=1),
        precision="bf16-adam",                  # or Precision(param="bf16", ...)
        activations=prof,                       # a recomp.plan Profile of one micro-batch
        plan=plan,                              # or option="full", or neither: "none"
        schedule="Interleaved1F1B", microbatches=16,
        budget="80GiB",
    )
    print(result.table())

What each row rests on:

* **parameters, gradients, optimizer states**: per parameter tensor, its elements on this
  rank: tensors of two or more dimensions divide by the tensor-parallel size (1-D ones,
  norms and biases, stay whole), expert tensors (paths with an ``experts`` part) by the
  expert-parallel and expert-tensor-parallel sizes, and each pipeline rank holds the
  tensors of its stages' layers (what comes before the first layer on the first stage,
  what comes after the last on the last). ZeRO / FSDP then shard parameters (stage 3),
  gradients (stage 2 and 3) and optimizer states (stage 1 and up) over the shard group
  (``Parallel.shard``; default the data- and context-parallel ranks), per tensor and
  padded along dimension 0 as FSDP2 does (``padding="dim0"``) or as one flat buffer
  (``padding="flat"``: DeepSpeed, Megatron's distributed optimizer). Bytes per element
  come from :class:`Precision`.
* **activations**: per micro-batch and layer, the bytes kept from a micro-batch's
  forward to its backward (a profile's ``kept_bytes`` under the plan's option), and
  with a split backward the bytes kept from its input-gradient pass to its
  weight-gradient pass; per pipeline rank, the schedule's own action list walked step
  by step (:func:`walk_schedule`), the peak of the live bytes and the step where it
  occurs.
* **pipeline swap** (``pipeline_swap=PipelineSwap(...)``): per rank, the runtime's own
  plan (``recomp._pipeline_swap.plan_rank_swap``) says which (stage, micro-batch)
  groups go to the host and at which steps they are away; what goes is what the
  profile says a saved-tensors hook may move of each layer's kept bytes
  (``OptionProfile.swappable``), less the stage's input and output.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._pipeline_swap import MIN_SWAP_GAP, check_min_gap, plan_rank_swap
from .budget import Budget, format_bytes, parse_budget
from .planfile import OFFLOAD_MIN_BYTES
from .planner import ON_INPUT, ON_OUTPUT

GiB = float(1 << 30)

DTYPE_BYTES = {
    "fp64": 8,
    "float64": 8,
    "fp32": 4,
    "float32": 4,
    "tf32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "fp8": 1,
    "float8": 1,
    "int8": 1,
}


def dtype_bytes(dtype: int | str | None) -> int:
    """Bytes per element: a number as given, a dtype name (``"bf16"``, ``"float32"``,
    ``torch.bfloat16``'s name), or 0 for None."""
    if dtype is None:
        return 0
    if isinstance(dtype, int):
        if dtype < 0:
            raise ValueError(f"bytes per element cannot be negative, got {dtype}")
        return dtype
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


# ----------------------------------------------------------------------------- sharding


@dataclass(frozen=True)
class Parallel:
    """The parallel layout of the job.

    ``dp``: data-parallel degree (replicas, or shards under ZeRO/FSDP); ``tp``: tensor
    parallel; ``pp``: pipeline ranks; ``cp``: context parallel; ``ep``: expert parallel
    and ``etp``: tensor parallel inside each expert (the expert ranks re-split the
    ``tp * dp * cp`` ranks of one pipeline stage, as Megatron-Core does: the expert
    data-parallel degree is ``tp * dp * cp / (ep * etp)``). ``zero``: 0 (replicated), 1
    (optimizer states sharded), 2 (and gradients), 3 (and parameters: FSDP, FSDP2's
    ``fully_shard``). ``shard``: the ranks each dense tensor is sharded over under
    ZeRO/FSDP (default ``dp * cp``; less for hybrid sharding). ``stages_per_rank``:
    pipeline stages per rank (default: the schedule's, 1 or 2). ``etp`` defaults to 1;
    Megatron-Core's own default is ``etp = tp``: give it when that is your setting.
    ``sp``: sequence parallelism over the tensor-parallel ranks (the norms and the
    residual stream split along the sequence); ``loss_parallel``: the head's logits and
    the loss stay the tensor-parallel ranks' vocabulary shards (each rank holds its
    shard of the logits and of the loss's fp32 buffers); ``cp``: each rank holds
    ``seq / cp`` tokens of each sequence. What these change in the activations is in
    the profile, made under the same layout (a simulated one: ``recomp.plan.models``,
    whose ``Profile.layout`` :func:`job_memory` checks against this one)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    zero: int = 0
    shard: int | None = None
    stages_per_rank: int | None = None
    sp: bool = False
    loss_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Parallel.{name} is a positive integer, got {value!r}")
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Parallel.{name} is True or False, got {getattr(self, name)!r}")
        if self.sp and self.tp == 1:
            raise ValueError(
                "Parallel.sp splits the sequence over the tensor-parallel ranks: give tp > 1"
            )
        if self.loss_parallel and self.tp == 1:
            raise ValueError(
                "Parallel.loss_parallel shards the vocabulary over the tensor-parallel ranks: "
                "give tp > 1"
            )
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Parallel.zero is 0, 1, 2 or 3, got {self.zero!r}")
        if self.shard is not None and (self.shard < 1 or (self.dp * self.cp) % self.shard):
            raise ValueError(
                f"Parallel.shard ({self.shard}) divides the data- and context-parallel ranks "
                f"(dp * cp = {self.dp * self.cp})"
            )
        if (self.tp * self.dp * self.cp) % (self.ep * self.etp):
            raise ValueError(
                f"expert parallel ep={self.ep} x etp={self.etp} does not divide the "
                f"tp * dp * cp = {self.tp * self.dp * self.cp} ranks of a pipeline stage"
            )

    @classmethod
    def parse(cls, text: str) -> Parallel:
        """``"dp=8,tp=8,pp=4,zero=1,sp=1"`` (commas or spaces; the field names above; the
        switches as 1/0, true/false), for command lines."""
        fields: dict[str, int | bool] = {}
        for part in re.split(r"[,\s]+", text.strip()):
            if not part:
                continue
            name, sep, value = part.partition("=")
            value = value.strip().lower()
            if name in _FLAGS and value in ("1", "0", "true", "false"):
                fields[name] = value in ("1", "true")
                continue
            if not sep or name not in cls.__dataclass_fields__ or not value.isdigit():
                raise ValueError(
                    f"cannot read {part!r} in parallel layout {text!r}: give name=integer with "
                    f"names {', '.join(cls.__dataclass_fields__)} (the switches "
                    f"{', '.join(_FLAGS)} as 1 or 0)"
                )
            fields[name] = int(value)
        return cls(**fields)  # type: ignore[arg-type]

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dense_shard(self) -> int:
        """Ranks a dense tensor's ZeRO/FSDP shards spread over (1 without ZeRO)."""
        return (self.shard or self.dp * self.cp) if self.zero else 1

    @property
    def expert_shard(self) -> int:
        """Ranks an expert tensor's ZeRO/FSDP shards spread over (its data-parallel
        ranks: ``tp * dp * cp / (ep * etp)``, scaled by ``shard / (dp * cp)``)."""
        if not self.zero:
            return 1
        edp = self.tp * self.dp * self.cp // (self.ep * self.etp)
        return max(1, edp * self.dense_shard // (self.dp * self.cp))

    def describe(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("dp", "tp", "pp", "cp", "ep", "etp")]
        parts.append(f"zero={self.zero}")
        if self.zero:
            parts.append(f"shard={self.dense_shard}")
        parts.extend(name for name in _FLAGS if getattr(self, name))
        return " ".join(parts) + f" (world {self.world})"


# The layout's switches (``Parallel`` fields that are True or False).
_FLAGS = ("sp", "loss_parallel")


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what each parameter costs: the parameter itself, its
    gradient, a master copy kept by the optimizer (None: none), ``optimizer_states``
    states of ``state`` each (Adam: 2), and under ZeRO-3/FSDP the all-gathered copy the
    forward and backward compute with (``gathered``, default the parameter's dtype)."""

    param: int | str = "bf16"
    grad: int | str = "fp32"
    master: int | str | None = "fp32"
    optimizer_states: int = 2
    state: int | str = "fp32"
    gathered: int | str | None = None
    name: str = ""

    def per_element(self) -> dict[str, int]:
        return {
            "param": dtype_bytes(self.param),
            "grad": dtype_bytes(self.grad),
            "optimizer": dtype_bytes(self.master) + self.optimizer_states * dtype_bytes(self.state),
            "gathered": dtype_bytes(self.gathered if self.gathered is not None else self.param),
        }

    def describe(self) -> str:
        b = self.per_element()
        master = f" + {self.master} master" if self.master is not None else ""
        return (
            f"{self.name + ': ' if self.name else ''}{self.param} params, {self.grad} grads, "
            f"optimizer {self.optimizer_states} x {self.state}{master} = {b['optimizer']} B/param"
        )


PRECISIONS = {
    # Mixed precision with fp32 master weights and fp32 gradient buffers (Megatron-Core's
    # main_grad, DeepSpeed bf16 with fp32 grad accumulation): 2 + 4 + 4 + 8 = 18 B/param.
    "bf16-adam": Precision("bf16", "fp32", "fp32", 2, "fp32", name="bf16-adam"),
    # bf16 gradients (no fp32 accumulation buffer): 2 + 2 + 4 + 8 = 16 B/param.
    "bf16-adam-bf16-grads": Precision("bf16", "bf16", "fp32", 2, "fp32", name="bf16-adam-bf16-grads"),
    # Everything in fp32: 4 + 4 + 8 = 16 B/param.
    "fp32-adam": Precision("fp32", "fp32", None, 2, "fp32", name="fp32-adam"),
    # FSDP2 with MixedPrecisionPolicy(param_dtype=bf16): fp32 sharded parameters (they
    # are the master weights), fp32 sharded gradients, bf16 all-gathered copies.
    "fsdp2-bf16-adam": Precision("fp32", "fp32", None, 2, "fp32", "bf16", name="fsdp2-bf16-adam"),
    # SGD with momentum in fp32.
    "fp32-sgd": Precision("fp32", "fp32", None, 1, "fp32", name="fp32-sgd"),
}


def resolve_precision(precision: str | Precision) -> Precision:
    if isinstance(precision, Precision):
        return precision
    if precision not in PRECISIONS:
        raise ValueError(
            f"unknown precision preset {precision!r}: use {', '.join(PRECISIONS)} or a Precision"
        )
    return PRECISIONS[precision]


@dataclass(frozen=True)
class PipelineSwap:
    """Pipeline swap (``recomp.torch.pipeline_swap``) in the count, with the runtime's
    own arguments: a (stage, micro-batch) whose backward starts at least ``min_gap``
    compute slots after its forward moves what its stage keeps for it to the host
    (storages of at least ``min_bytes``; not the stage's input and output, which the
    pipeline holds), by the rule NOTE [ Pipeline swap ] in ``recomp._pipeline_swap``
    gives (:func:`recomp._pipeline_swap.plan_rank_swap`)."""

    min_gap: int = MIN_SWAP_GAP
    min_bytes: int = OFFLOAD_MIN_BYTES

    def __post_init__(self) -> None:
        check_min_gap(self.min_gap)
        value = self.min_bytes
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"PipelineSwap(min_bytes={value!r}): bytes, an int >= 0")

    def describe(self) -> str:
        return f"pipeline swap (min_gap={self.min_gap}, min_bytes={format_bytes(self.min_bytes)})"


# --------------------------------------------------------------------------- parameters

FIRST, LAST = "first", "last"
DEFAULT_EXPERT_PATTERN = r"(^|\.)experts(\.|$)"


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor: its elements, its rows (dimension 0; a flat count where only
    numbers are known), where it lives (a layer index, or ``"first"`` / ``"last"`` for
    what comes before / after the layers), its kind: ``"sharded"`` (divided by the
    tensor-parallel size), ``"replicated"`` or ``"expert"``, and for a sharded one the
    dimension tensor parallelism splits (0: column-parallel, 1: row-parallel)."""

    name: str
    numel: int
    rows: int
    where: int | str
    kind: str
    tp_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("sharded", "replicated", "expert"):
            raise ValueError(f"parameter {self.name!r}: unknown kind {self.kind!r}")
        if self.numel < 0 or (self.rows < 1 and self.numel):
            raise ValueError(f"parameter {self.name!r}: bad size {self.numel} / {self.rows} rows")


@dataclass
class ModelParams:
    """The parameters of a model, per layer: what :func:`job_memory` divides among the
    ranks. ``layers``: the layer paths, in order (their count is what the pipeline
    stages split)."""

    layers: list[str]
    tensors: list[ParamTensor]
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(t.numel for t in self.tensors)

    @classmethod
    def from_counts(
        cls,
        layer: Mapping[str, int],
        num_layers: int,
        first: Mapping[str, int] | None = None,
        last: Mapping[str, int] | None = None,
    ) -> ModelParams:
        """Numbers given directly: per layer (the same for each) and before / after the
        layers, element counts by kind: ``{"sharded": ..., "replicated": ...,
        "expert": ...}``. Shards are then computed from the flat counts (no per-tensor
        padding is known)."""
        tensors: list[ParamTensor] = []
        for where, counts in [(FIRST, first or {})] + [(i, layer) for i in range(num_layers)] + [
            (LAST, last or {})
        ]:
            for kind, n in counts.items():
                if n:
                    tensors.append(ParamTensor(f"{where}.{kind}", int(n), int(n), where, kind))
        return cls([str(i) for i in range(num_layers)], tensors, ["parameter counts given as numbers"])


def model_params(
    model: Any,
    *,
    layers: Any = None,
    expert: str | Callable[[str], bool] = DEFAULT_EXPERT_PATTERN,
    tp_sharded: Callable[[str, Any], bool | int] | None = None,
) -> ModelParams:
    """Per-tensor parameter counts of a torch module (real, on the meta device or fake:
    only shapes are read). ``layers`` as for :func:`recomp.plan.profile` (default
    ``model.layers`` or the model's one ``layers`` list); ``expert``: a regular
    expression on the parameter's path, or a predicate; ``tp_sharded(path, param)``:
    whether tensor parallelism divides a tensor (default: two or more dimensions, along
    dimension 0); it may return the dimension instead (0 or 1; ``True`` is 0).
    Tied parameters count once, where they first appear."""
    from ._layers import find_layers

    found = find_layers(model, layers)
    paths = [p for p, _ in found]
    owner: dict[int, int] = {}
    for index, (_, module) in enumerate(found):
        for p in module.parameters():
            owner.setdefault(id(p), index)
    is_expert = (
        expert if callable(expert) else (lambda name, rx=re.compile(expert): bool(rx.search(name)))
    )
    tensors = []
    seen_layer = False
    for name, p in model.named_parameters():
        where: int | str
        if id(p) in owner:
            seen_layer = True
            where = owner[id(p)]
        else:
            where = LAST if seen_layer else FIRST
        tp_dim = 0
        if is_expert(name):
            kind = "expert"
        else:
            split = tp_sharded(name, p) if tp_sharded is not None else p.dim() >= 2
            kind = "replicated" if split is False else "sharded"
            if split is not True and split is not False:
                tp_dim = int(split)
        numel = int(p.numel())
        rows = int(p.shape[0]) if p.dim() >= 1 else 1
        tensors.append(ParamTensor(name, numel, max(rows, 1), where, kind, tp_dim))
    return ModelParams(paths, tensors, [f"parameters of {type(model).__name__} (shapes read)"])


def _local(t: ParamTensor, parallel: Parallel) -> tuple[int, int]:
    """(elements, rows) of ``t`` on one rank after tensor and expert parallelism (the
    largest rank's share where a division is not exact). Tensor parallelism splits
    dimension ``t.tp_dim`` (0: rows, column-parallel; 1: within rows, row-parallel);
    expert parallelism splits the experts (dimension 0 of a stacked expert tensor, the
    elements of a per-expert one), then ``etp`` splits within rows."""
    rows = t.rows
    row = t.numel // t.rows if t.rows else 0
    if t.numel == 0 or (rows == t.numel and t.kind != "replicated"):
        # A flat count (numbers given) or a 1-D tensor: divide the elements.
        div = {"sharded": parallel.tp, "expert": parallel.ep * parallel.etp}.get(t.kind, 1)
        n = math.ceil(t.numel / div)
        return n, n
    if t.kind == "sharded":
        if t.tp_dim == 0:
            rows = math.ceil(rows / parallel.tp)
        else:
            row = math.ceil(row / parallel.tp)
    elif t.kind == "expert":
        rows = math.ceil(rows / parallel.ep)
        row = math.ceil(row / parallel.etp)
    return rows * row, rows


def _sharded(elements: int, rows: int, shard: int, padding: str) -> int:
    """Elements of one ZeRO/FSDP shard (rank 0's, the largest)."""
    if shard == 1:
        return elements
    if padding == "dim0" and rows and elements:
        return math.ceil(rows / shard) * (elements // rows)
    return math.ceil(elements / shard)


# ---------------------------------------------------------------------------- schedules

Step = tuple[str, int, int]  # (kind F/B/I/W, stage, micro-batch)


@dataclass(frozen=True)
class StagePeak:
    """The peak of one pipeline rank's activations over the schedule.

    ``peak_bytes`` (in the units of the bytes given: 1 per micro-batch and stage
    counts micro-batches), reached after step ``step`` (an index into the rank's compute
    steps), ``action`` (``"4F6"``: stage 4, forward, micro-batch 6); ``held``: the
    ``(stage, micro-batch, since)`` held then (``since`` ``"F"``: from the forward;
    ``"I"``: only the part kept for the weight gradients); ``in_flight``: per stage, the
    most micro-batches it held at once."""

    rank: int
    peak_bytes: int
    step: int
    action: str
    held: tuple[tuple[int, int, str], ...]
    in_flight: dict[int, int]
    # The part of ``peak_bytes`` that lives only during the step ``action`` (a backward's
    # transient: the loss's gradient buffers, a layer's replay), over the bytes held.
    transient: int = 0

    @property
    def microbatches(self) -> int:
        """Micro-batch x stage pairs held at the peak."""
        return len(self.held)


Chunk = tuple[int, int]  # (stage, micro-batch)


def walk_schedule(
    actions: Mapping[int, Sequence[Step]],
    stage_bytes: Mapping[int, tuple[int, int]] | None = None,
    transient: Mapping[int, tuple[int, int]] | None = None,
    off_device: Mapping[int, Mapping[Chunk, tuple[range, int]]] | None = None,
) -> dict[int, StagePeak]:
    """Walk each rank's compute steps and find its activation peak.

    ``stage_bytes[stage] = (kept, weight_kept)``: what one micro-batch keeps on that
    stage from its forward (``F``) to its backward (``B``), and from its input-gradient
    pass (``I``) to its weight-gradient pass (``W``). Default ``(1, 1)``: the peak then
    counts micro-batches. On stage 0 an ``I`` frees nothing: its inputs need no gradient,
    so ``torch.distributed.pipelining`` runs the whole backward in the ``W`` step. The
    peak is taken after each step (a forward's activations all live at its end) and,
    with ``transient[stage] = (backward, weight)``, during each backward step of that
    stage: the bytes held before it frees anything plus what the step itself holds for
    a while (``backward`` in ``B`` and ``I``, ``weight`` in ``W``; on stage 0 under a
    split backward, the larger of the two in ``W``).

    ``off_device[rank][(stage, micro-batch)] = (steps, n)``: pipeline swap's groups
    (:class:`PipelineSwap`): during those step indices ``n`` of the bytes kept from the
    forward are on the host (``RankSwapPlan.steps_off_device``), in the peak after each
    step and during each backward step alike."""
    out: dict[int, StagePeak] = {}
    for rank, steps in actions.items():
        live: dict[tuple[int, int], str] = {}
        in_flight: dict[int, int] = {}
        best: tuple[int, int, str, tuple[tuple[int, int, str], ...], int] = (-1, -1, "", (), 0)
        away = off_device.get(rank, {}) if off_device is not None else {}

        def nbytes(
            held: Mapping[tuple[int, int], str],
            index: int,
            away: Mapping[Chunk, tuple[range, int]] = away,
        ) -> int:
            total = 0
            for key, since in held.items():
                kept, weight = stage_bytes[key[0]] if stage_bytes is not None else (1, 1)
                total += kept if since == "F" else weight
                if since == "F" and key in away and index in away[key][0]:
                    total -= away[key][1]
            return total

        for index, (kind, stage, mb) in enumerate(steps):
            key = (stage, mb)
            if kind in ("B", "I", "W") and key in live:
                backward, weight = transient.get(stage, (0, 0)) if transient else (0, 0)
                during = {"B": backward, "I": backward, "W": weight}[kind]
                if kind == "W" and stage == 0:
                    during = max(backward, weight)
                if kind == "I" and stage == 0:
                    during = 0  # its backward runs in the W step
                total = nbytes(live, index) + during
                # Before the step frees anything: higher than after the step before only
                # by its transient, or where a group came back for this slot.
                if total > best[0]:
                    held = tuple(sorted((s, m, since) for (s, m), since in live.items()))
                    best = (total, index, f"{stage}{kind}{mb}", held, during)
            if kind == "F":
                if key in live:
                    raise ValueError(f"rank {rank}: forward of {stage}F{mb} runs twice")
                live[key] = "F"
            elif key not in live:
                raise ValueError(f"rank {rank}: step {stage}{kind}{mb} before its forward")
            elif kind == "B":
                del live[key]
            elif kind == "I":
                if stage != 0:
                    live[key] = "I"
            elif kind == "W":
                del live[key]
            else:
                raise ValueError(f"rank {rank}: unknown step kind {kind!r}")
            count = sum(1 for s, _ in live if s == stage)
            in_flight[stage] = max(in_flight.get(stage, 0), count)
            total = nbytes(live, index)
            if total > best[0]:
                held = tuple(sorted((s, m, since) for (s, m), since in live.items()))
                best = (total, index, f"{stage}{kind}{mb}", held, 0)
        out[rank] = StagePeak(
            rank, max(best[0], 0), best[1], best[2], best[3], in_flight, best[4]
        )
    return out


def schedule_names() -> list[str]:
    """The ``torch.distributed.pipelining`` schedules this PyTorch has that
    :func:`job_memory` reads by name (imports PyTorch)."""
    from ..torch._compat import schedule_names as names

    return names()


def schedule_actions(
    schedule: str | Mapping[int, Sequence[Step]],
    pp: int,
    microbatches: int,
    stages_per_rank: int | None = None,
) -> dict[int, list[Step]]:
    """Per pipeline rank, the compute steps of a ``torch.distributed.pipelining``
    schedule (by name: ``"1F1B"``, ``"Interleaved1F1B"``, ``"ZBVZeroBubble"``, ...),
    read from the schedule built on stand-in stages; or your own action lists as given."""
    slots = schedule_slots(schedule, pp, microbatches, stages_per_rank)
    return {rank: [step for slot in rank_slots for step in slot] for rank, rank_slots in slots.items()}


def schedule_slots(
    schedule: str | Mapping[int, Sequence[Step]],
    pp: int,
    microbatches: int,
    stages_per_rank: int | None = None,
) -> dict[int, list[tuple[Step, ...]]]:
    """Per pipeline rank, the compute slots of a schedule (:func:`schedule_actions`'s
    steps, grouped as the rank runs them: one step each, but the two of an overlapped
    forward-backward step of DualPipeV); your own action lists one step per slot."""
    if not isinstance(schedule, str):
        return {
            int(r): [((str(k), int(s), int(m)),) for k, s, m in a] for r, a in schedule.items()
        }
    if pp == 1 and schedule in ("1F1B", "GPipe", "none"):
        # No pipeline: every micro-batch's forward and backward in turn.
        return {0: [((kind, 0, m),) for m in range(microbatches) for kind in ("F", "B")]}
    from ..torch._compat import pipeline_slots

    return pipeline_slots(schedule, pp, microbatches, stages_per_rank)


def host_peaks(
    actions: Mapping[int, Sequence[Step]],
    stage_host: Mapping[int, int],
    swapped: Mapping[int, Mapping[Chunk, tuple[int, int, int]]] | None = None,
) -> dict[int, int]:
    """Per rank, the most host memory its activations take after any step:
    ``stage_host[stage]`` per micro-batch from its forward to its backward (the layers'
    own swap and offload options; on stage 0 of a split backward to its ``W`` step, on
    the others to its ``I`` step), and pipeline swap's copies,
    ``swapped[rank][(stage, micro-batch)] = (forward step, last backward step, bytes)``:
    held from the forward (the copy starts as it returns) until the last backward step
    frees the graph (the pinned blocks go back to the pool then)."""
    out: dict[int, int] = {}
    for rank, steps in actions.items():
        live: dict[Chunk, int] = {}
        moved = swapped.get(rank, {}) if swapped is not None else {}
        best = 0
        for index, (kind, stage, mb) in enumerate(steps):
            key = (stage, mb)
            if kind == "F":
                live[key] = stage_host.get(stage, 0)
            elif kind in ("B", "W") or (kind == "I" and stage != 0):
                live.pop(key, None)
            pipeline = sum(n for first, last, n in moved.values() if first <= index < last)
            best = max(best, sum(live.values()) + pipeline)
        out[rank] = best
    return out


# -------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class LayerActivation:
    """What one micro-batch keeps of one layer: from its forward to its backward
    (``kept_bytes``) and, with a split backward, from its input-gradient to its
    weight-gradient pass (``weight_bytes``)."""

    path: str
    option: str
    kept_bytes: int
    weight_bytes: int
    # What its replay re-creates for a while during its own backward, beyond what it
    # keeps (a checkpointed layer's saved tensors, recomputed: 0 without checkpoint).
    replay_bytes: int = 0
    # What it holds in the host's memory from its forward to its backward (the swap and
    # offload options), beside ``kept_bytes`` on the device.
    host_bytes: int = 0
    # Of ``kept_bytes``, the storages pipeline swap may move: ``(bytes, place)`` each,
    # ``place`` the bits ``ON_INPUT`` / ``ON_OUTPUT`` of ``recomp.plan.planner`` (one of
    # the layer's inputs / outputs: on the device where the layer starts / ends a
    # stage); None: not known (:class:`PipelineSwap` then refuses the count).
    swappable: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True)
class OutsideLayers:
    """The bytes a profile keeps outside its layers, by where a pipeline holds them:
    ``before`` the first layer (embeddings: the first stage), ``after`` the last (head,
    logits, loss: the last stage), ``spread`` (kept by several layers: every stage),
    ``unsplit`` (a profile that does not say where: counted on the first and the last
    stage, at most), and the loss's backward transient (the last stage's)."""

    before: int = 0
    after: int = 0
    spread: int = 0
    unsplit: int = 0
    loss_backward: int = 0

    @classmethod
    def of(cls, profile: Any) -> OutsideLayers:
        shared = int(profile.shared_bytes)
        before = int(getattr(profile, "before_layers_bytes", 0) or 0)
        after = int(getattr(profile, "after_layers_bytes", 0) or 0)
        spread = min(int(getattr(profile, "spread_bytes", 0) or 0), shared)
        unsplit = max(0, shared - before - after - spread)
        loss = int(getattr(profile, "loss_backward_bytes", 0) or 0)
        return cls(before, after, spread, unsplit, loss)

    def on_stage(self, stage: int, last: int) -> int:
        """Bytes one micro-batch keeps on ``stage`` of ``0..last`` outside the layers."""
        nbytes = self.spread
        if stage == 0:
            nbytes += self.before
        if stage == last:
            nbytes += self.after
        if stage in (0, last):
            nbytes += self.unsplit
        return nbytes

    def notes(self) -> list[str]:
        notes = []
        if self.before or self.after or self.spread:
            notes.append(
                f"activations outside the layers, per micro-batch: {format_bytes(self.before)} "
                f"before them (embeddings) on the first stage, {format_bytes(self.after)} after "
                f"them (head, logits, loss) on the last"
                + (f", {format_bytes(self.spread)} kept by several layers on every stage"
                   if self.spread else "")
            )
        if self.unsplit:
            notes.append(
                f"{format_bytes(self.unsplit)} per micro-batch outside the layers that the "
                "profile does not place before or after them: counted on the first and the "
                "last stage"
            )
        if self.loss_backward:
            notes.append(
                f"the loss's backward holds {format_bytes(self.loss_backward)} more for a while "
                "on the last stage (the outputs the caller holds, the loss's gradient buffers)"
            )
        return notes


def layer_activations(
    profile: Any,
    *,
    plan: Any = None,
    option: str | None = None,
    weight_input_bytes: Mapping[str, int] | None = None,
) -> tuple[list[LayerActivation], list[str]]:
    """Per layer of a ``recomp.plan`` profile, the bytes it keeps under ``plan``'s choice
    (or ``option`` on every layer; neither: ``"none"``), and the notes saying what the
    weight-gradient figures rest on.

    Between a micro-batch's input-gradient and weight-gradient passes the graph is
    retained: a layer without checkpoint keeps everything it saved
    (``no_checkpoint_bytes``); a recomp checkpoint keeps what its option keeps plus, of
    what the input pass recomputed, the saved tensors of the nodes that still owe
    weight gradients (the inputs of linears and norms: ``weight_input_bytes[path]``,
    measured by :func:`weight_input_bytes`), at most ``no_checkpoint_bytes``. Without
    that figure the bound ``no_checkpoint_bytes`` is used."""
    from .planfile import NO_CHECKPOINT

    chosen: dict[str, tuple[str, int]] = {}
    if plan is not None:
        chosen = {lp.path: (lp.option, lp.kept_bytes) for lp in plan.layers}
    names = [[o.name for o in layer.options] for layer in profile.layers]
    out: list[LayerActivation] = []
    notes: list[str] = []
    bounded: list[str] = []
    previous: int | None = None
    for layer, layer_names in zip(profile.layers, names):
        kept_given: int | None = None
        if plan is not None:
            if layer.path not in chosen:
                raise ValueError(f"the plan has no layer {layer.path!r} of the profile")
            name, kept_given = chosen[layer.path]
        else:
            name = option or NO_CHECKPOINT
        if name not in layer_names:
            raise ValueError(f"layer {layer.path!r} has no option {name!r} (has {layer_names})")
        index = layer_names.index(name)
        pair = {(a, b): n for a, b, n in layer.pair_bytes}
        kept = layer.options[index].kept_bytes + (
            pair.get((previous, index), 0) if previous is not None else 0
        )
        if kept_given is not None:
            kept = kept_given
        previous = index
        if name == NO_CHECKPOINT:
            weight = max(kept, layer.no_checkpoint_bytes)
        elif weight_input_bytes is not None and layer.path in weight_input_bytes:
            weight = min(max(kept, layer.no_checkpoint_bytes), kept + weight_input_bytes[layer.path])
        else:
            weight = max(kept, layer.no_checkpoint_bytes)
            bounded.append(layer.path)
        replay = 0 if name == NO_CHECKPOINT else replay_bytes(layer, kept)
        host = int(getattr(layer.options[index], "host_bytes", 0) or 0)
        found = getattr(layer.options[index], "swappable", None)
        swappable = None if found is None else tuple((int(n), int(p)) for n, p in found)
        out.append(LayerActivation(layer.path, name, kept, weight, replay, host, swappable))
    if bounded:
        notes.append(
            f"{len(bounded)} checkpointed layer(s) without a weight-input figure: between "
            "input- and weight-gradient passes they are counted at their no-checkpoint bytes "
            "(an upper bound; weight_input_bytes= gives the exact figure)"
        )
    return out, notes


def replay_bytes(layer: Any, kept: int) -> int:
    """What a checkpointed layer's replay re-creates for a while during its own backward,
    beyond the ``kept`` bytes its option keeps: the rest of what it saves without a
    checkpoint (``layer``: a profile's ``LayerProfile``)."""
    return max(0, int(layer.no_checkpoint_bytes) - kept)


def weight_input_bytes(layer: Any, *args: Any, **kwargs: Any) -> int:
    """Bytes of the tensors that a split backward keeps for one layer's weight gradients
    when the layer is checkpointed, beyond the layer's own inputs (which the checkpoint
    keeps anyway): the floating-point inputs of its sub-modules that own parameters
    needing gradients (linears, norms, convolutions), counted once per storage. A
    norm's saved statistics (two floats per normalised row) are not counted. Runs the
    layer's forward once on ``args`` (real, meta or fake tensors)."""
    import torch

    from ..torch import _compat

    seen: dict[Any, int] = {}

    def key_of(t: Any) -> Any:
        return _compat.storage_key(t) or ("tensor", id(t))

    # The layer's own inputs: the checkpoint keeps them anyway (its kept bytes).
    own = {key_of(t) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}

    def pre_hook(module: Any, inputs: Any) -> None:
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                key = key_of(t)
                if key in own:
                    continue
                try:
                    size = t.untyped_storage().nbytes()
                except (RuntimeError, NotImplementedError):
                    size = t.numel() * t.element_size()
                seen.setdefault(key, size if size else t.numel() * t.element_size())

    handles = [
        m.register_forward_pre_hook(pre_hook)
        for m in layer.modules()
        if any(p.requires_grad for p in m.parameters(recurse=False))
    ]
    try:
        with torch.enable_grad():
            layer(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return sum(seen.values())


def check_layout(profile: Any, parallel: Parallel) -> None:
    """Refuse activations profiled under another layout than the job's: each of tp,
    sp, cp and loss_parallel the profile states (``Profile.layout``; a simulated
    published model's) must be the ``Parallel``'s."""
    layout = getattr(profile, "layout", None) or {}
    wrong = [
        f"{name}={layout[name]!r} (the job: {getattr(parallel, name)!r})"
        for name in ("tp", "sp", "cp", "loss_parallel")
        if name in layout and layout[name] != getattr(parallel, name)
    ]
    if wrong:
        raise ValueError(
            "the activations were profiled under another layout: " + ", ".join(wrong)
            + "; profile (simulate) the model under the job's layout, or give the job's "
            "Parallel the profile's"
        )


def split_layers(num_layers: int, num_stages: int, counts: Sequence[int] | None = None) -> list[int]:
    """The stage of each layer: ``counts`` layers per stage, or as even as possible (the
    first ``num_layers % num_stages`` stages one more)."""
    if counts is None:
        if num_layers < num_stages:
            raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 0:
        raise ValueError(
            f"stage_layers={list(counts)} does not split {num_layers} layers into {num_stages} stages"
        )
    return [s for s, n in enumerate(counts) for _ in range(n)]


# ------------------------------------------------------------------------------ result


@dataclass
class RankMemory:
    """One pipeline rank's memory (every data-, tensor- and expert-parallel rank of it
    alike; rank 0 of a group where shares differ). Bytes."""

    rank: int
    stages: tuple[int, ...]
    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int
    peak: StagePeak | None
    param_elements: int
    # Host memory the swapped and offloaded activations take at the step's highest point
    # for them (the micro-batches in flight then): beside ``total``, not in it.
    host: int = 0
    # Pipeline swap (:class:`PipelineSwap`): the bytes it copies to the host per step,
    # and back; the (stage, micro-batch) groups that swap, of those the rank runs.
    swapped_bytes: int = 0
    swap_groups: tuple[int, int] | None = None

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered + self.activations

    @property
    def saved(self) -> int:
        """Of ``activations`` (the step's peak), the bytes saved for backward then; the
        rest (``transient``) lives only during the backward step the peak falls in."""
        return self.activations - self.transient

    @property
    def transient(self) -> int:
        return 0 if self.peak is None else self.peak.transient


@dataclass
class JobMemory:
    """What :func:`job_memory` found: per pipeline rank, the memory and what it rests on."""

    ranks: list[RankMemory]
    parallel: Parallel
    precision: Precision
    schedule: str
    microbatches: int
    budget_bytes: int | None
    notes: list[str]
    pipeline_swap: PipelineSwap | None = None

    @property
    def peak_bytes(self) -> int:
        return max(r.total for r in self.ranks)

    @property
    def fits(self) -> bool | None:
        if self.budget_bytes is None:
            return None
        return self.peak_bytes <= self.budget_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "parallel": self.parallel.describe(),
            "precision": self.precision.describe(),
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "pipeline_swap": None if self.pipeline_swap is None else self.pipeline_swap.describe(),
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "ranks": [
                {
                    "rank": r.rank,
                    "stages": list(r.stages),
                    "params": r.params,
                    "grads": r.grads,
                    "optimizer": r.optimizer,
                    "gathered": r.gathered,
                    "activations": r.activations,
                    "saved": r.saved,
                    "transient": r.transient,
                    "total": r.total,
                    "host": r.host,
                    "swapped_bytes": r.swapped_bytes,
                    "swap_groups": None if r.swap_groups is None else list(r.swap_groups),
                    "param_elements": r.param_elements,
                    "peak_step": None if r.peak is None else r.peak.action,
                    "peak_microbatches": None if r.peak is None else r.peak.microbatches,
                    "in_flight": None if r.peak is None else r.peak.in_flight,
                }
                for r in self.ranks
            ],
            "notes": self.notes,
        }

    def table(self) -> str:
        """Per pipeline rank: GiB (MiB below 1 GiB) of parameters, gradients, optimizer states, gathered
        parameters (ZeRO-3), activations at the peak, the total, and whether it fits."""
        unit, scale = ("GiB", GiB) if self.peak_bytes >= GiB else ("MiB", float(1 << 20))
        host = any(r.host for r in self.ranks)
        swap = self.pipeline_swap is not None
        extra = (["host"] if host else []) + (["swapped"] if swap else [])
        header = ["pp rank", "stages", "params", "grads", "optimizer", "gathered",
                  "activations", f"total {unit}", *extra, "peak at", "fits"]
        rows = []
        for r in self.ranks:
            fits = "" if self.budget_bytes is None else ("yes" if r.total <= self.budget_bytes else "NO")
            at = "" if r.peak is None else f"{r.peak.action} ({r.peak.microbatches} held)"
            more = ([r.host] if host else []) + ([r.swapped_bytes] if swap else [])
            rows.append(
                [str(r.rank), ",".join(map(str, r.stages))]
                + [f"{v / scale:.2f}" for v in (r.params, r.grads, r.optimizer, r.gathered,
                                                r.activations, r.total, *more)]
                + [at, fits]
            )
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
        numbers = 7 + len(extra)

        def line(cells: list[str]) -> str:
            return "  ".join(
                c.rjust(w) if 2 <= i <= numbers else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths))
            ).rstrip()

        lines = [line(header), line(["-" * w for w in widths]), *map(line, rows)]
        budget = (
            "" if self.budget_bytes is None
            else f"; budget {format_bytes(self.budget_bytes)} per device: "
            + ("fits" if self.fits else f"does NOT fit (peak {format_bytes(self.peak_bytes)})")
        )
        lines.append(
            f"{self.parallel.describe()}; {self.precision.describe()}; schedule "
            f"{self.schedule}, {self.microbatches} micro-batches{budget}"
        )
        if host:
            lines.append(
                "host: the host memory the swapped and offloaded activations take at that "
                "rank's highest point for them, beside the device's total"
            )
        if swap:
            lines.append(
                "swapped: what pipeline swap copies to the host per step on that rank (and "
                "back); activations: the peak with those bytes away while the schedule "
                "leaves them there"
            )
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _basis(parallel: Parallel, prec: Precision, padding: str, experts: bool) -> list[str]:
    """One line per row of the table: what it rests on."""
    per = prec.per_element()
    split = (
        f"elements on the rank: the layers of its stages (+ embeddings on the first, head on "
        f"the last); 2-D+ tensors / tp={parallel.tp}, 1-D whole"
        + (f", experts / ep={parallel.ep} x etp={parallel.etp}" if experts else "")
    )

    def sharded(stage: int) -> str:
        if parallel.zero < stage:
            return "not sharded"
        more = f" (experts {parallel.expert_shard})" if experts else ""
        return f"ZeRO-{parallel.zero}: sharded over {parallel.dense_shard} ranks{more}, padding {padding}"

    master = f"{prec.master} master + " if prec.master is not None else ""
    return [
        f"params: {split}; x {per['param']} B ({prec.param}); {sharded(3)}",
        f"grads: the same elements x {per['grad']} B ({prec.grad}); {sharded(2)}",
        f"optimizer: the same elements x {per['optimizer']} B ({master}"
        f"{prec.optimizer_states} x {prec.state}); {sharded(1)}",
    ]


def job_memory(
    params: Any,
    parallel: Parallel | None = None,
    *,
    precision: str | Precision = "bf16-adam",
    activations: Any = None,
    plan: Any = None,
    option: str | None = None,
    weight_input_bytes: Mapping[str, int] | None = None,
    schedule: str | Mapping[int, Sequence[Step]] = "1F1B",
    microbatches: int | None = None,
    stage_layers: Sequence[int] | None = None,
    padding: str = "dim0",
    gathered_layers: int = 2,
    budget: str | int | Budget | None = None,
    layers: Any = None,
    pipeline_swap: PipelineSwap | None = None,
) -> JobMemory:
    """Memory per pipeline rank of a training job.

    ``params``: a torch module (real, meta or fake), or a :class:`ModelParams`
    (:func:`model_params`, :meth:`ModelParams.from_counts`). ``activations``: a
    ``recomp.plan`` Profile of one micro-batch on one rank (its layers in the order of
    the model's), with ``plan`` (a Plan of it) or ``option`` choosing what each layer
    keeps; or a list of :class:`LayerActivation`; or None (parameters and optimizer
    only). ``schedule``: a ``torch.distributed.pipelining`` schedule name or your own
    action lists (``{rank: [(kind, stage, micro-batch), ...]}``). ``stage_layers``:
    layers per stage (default: even). ``padding``: ZeRO/FSDP shards per tensor along
    dimension 0 (``"dim0"``, FSDP2) or of one flat buffer (``"flat"``).
    ``gathered_layers``: under ZeRO-3, the layers whose parameters are all-gathered at
    once (the running one and the one prefetched). ``budget``: bytes per device
    (``"80GiB"``). ``pipeline_swap``: count ``recomp.torch.pipeline_swap`` on the
    schedule (a :class:`PipelineSwap` with its ``min_gap`` and ``min_bytes``): what it
    moves is on the host while the schedule leaves it there, in each rank's ``host``."""
    parallel = parallel or Parallel()
    if pipeline_swap is not None and not isinstance(pipeline_swap, PipelineSwap):
        raise ValueError(
            f"pipeline_swap is a PipelineSwap(min_gap=..., min_bytes=...) or None, got "
            f"{pipeline_swap!r}"
        )
    if pipeline_swap is not None and activations is None:
        raise ValueError(
            "pipeline_swap moves activations: give activations= (a recomp.plan profile, or "
            "LayerActivation rows with their swappable storages)"
        )
    prec = resolve_precision(precision)
    if padding not in ("dim0", "flat"):
        raise ValueError(f"padding is 'dim0' (FSDP2) or 'flat' (ZeRO), got {padding!r}")
    if microbatches is None:
        if activations is not None:
            raise ValueError("give microbatches= (per step and pipeline) with activations=")
        # Only the stages' places are read from the schedule: any count it accepts.
        microbatches = 2 * parallel.pp
    if microbatches < 1:
        raise ValueError(f"microbatches is positive, got {microbatches}")
    model = params if isinstance(params, ModelParams) else model_params(params, layers=layers)
    notes = list(model.notes)
    slots = schedule_slots(schedule, parallel.pp, microbatches, parallel.stages_per_rank)
    actions = {rank: [step for slot in one for step in slot] for rank, one in slots.items()}
    stage_rank: dict[int, int] = {}
    for rank, steps in actions.items():
        for _, stage, _ in steps:
            stage_rank.setdefault(stage, rank)
    num_stages = len(stage_rank)
    if set(actions) != set(range(parallel.pp)):
        raise ValueError(
            f"the schedule has ranks {sorted(actions)}, the layout pp={parallel.pp}"
        )
    layer_stage = split_layers(len(model.layers), num_stages, stage_layers)

    # Activations per stage and micro-batch.
    per_layer: list[LayerActivation] | None = None
    outside = OutsideLayers()
    if activations is not None:
        if isinstance(activations, list):
            per_layer = activations
        else:
            check_layout(activations, parallel)
            per_layer, more = layer_activations(
                activations, plan=plan, option=option, weight_input_bytes=weight_input_bytes
            )
            split = any(kind in ("I", "W") for steps in actions.values() for kind, _, _ in steps)
            if split:  # the weight-gradient figures matter only to a split backward
                notes.extend(more)
            outside = OutsideLayers.of(activations)
        if len(per_layer) != len(model.layers):
            raise ValueError(
                f"the activations cover {len(per_layer)} layers, the model has "
                f"{len(model.layers)}"
            )
    stage_bytes: dict[int, tuple[int, int]] = {s: (0, 0) for s in range(num_stages)}
    transient: dict[int, tuple[int, int]] = {s: (0, 0) for s in range(num_stages)}
    # On the host, per stage and micro-batch: from the forward to the backward (the copies
    # are back on the device by a split backward's input-gradient pass).
    stage_host: dict[int, tuple[int, int]] = {s: (0, 0) for s in range(num_stages)}
    if per_layer is not None:
        last = num_stages - 1
        for act, stage in zip(per_layer, layer_stage):
            kept, weight = stage_bytes[stage]
            stage_bytes[stage] = (kept + act.kept_bytes, weight + act.weight_bytes)
            stage_host[stage] = (stage_host[stage][0] + act.host_bytes, 0)
            replay = max(transient[stage][1], act.replay_bytes)
            transient[stage] = (replay, replay)
        for stage in range(num_stages):
            extra = outside.on_stage(stage, last)
            kept, weight = stage_bytes[stage]
            stage_bytes[stage] = (kept + extra, weight + extra)
        # The loss's backward runs before any layer's of its micro-batch: the larger of
        # the two transients is the step's.
        replay = transient[last][1]
        transient[last] = (max(replay, outside.loss_backward), replay)
        notes.extend(outside.notes())
    swap: _SwapCount | None = None
    if pipeline_swap is not None and per_layer is not None:
        movable = _swappable_per_stage(
            per_layer, layer_stage, num_stages, model, pipeline_swap.min_bytes
        )
        # A plan's own kept bytes may be less than the profile's: never more away than kept.
        movable = {stage: min(n, stage_bytes[stage][0]) for stage, n in movable.items()}
        swap = _SwapCount.of(slots, movable, pipeline_swap.min_gap)
        notes.append(_swap_note(pipeline_swap))
    peaks = (
        walk_schedule(actions, stage_bytes, transient, None if swap is None else swap.off_device)
        if per_layer is not None
        else {}
    )
    host_figures: dict[int, int] = {}
    if per_layer is not None and (swap is not None or any(a.host_bytes for a in per_layer)):
        host_figures = host_peaks(
            actions,
            {stage: nbytes for stage, (nbytes, _) in stage_host.items()},
            None if swap is None else swap.host,
        )

    # Parameters per pipeline rank.
    per = prec.per_element()
    zero = parallel.zero
    ranks: list[RankMemory] = []
    for rank in range(parallel.pp):
        stages = tuple(sorted(s for s, r in stage_rank.items() if r == rank))
        own_layers = {i for i, s in enumerate(layer_stage) if s in stages}
        params_b = grads_b = opt_b = elements = 0
        layer_gathered: dict[Any, int] = {}
        for t in model.tensors:
            if isinstance(t.where, int):
                if t.where not in own_layers:
                    continue
            elif (t.where == FIRST and 0 not in stages) or (
                t.where == LAST and num_stages - 1 not in stages
            ):
                continue
            local, rows = _local(t, parallel)
            shard = parallel.expert_shard if t.kind == "expert" else parallel.dense_shard
            piece = _sharded(local, rows, shard, padding)
            elements += local
            params_b += (piece if zero >= 3 else local) * per["param"]
            grads_b += (piece if zero >= 2 else local) * per["grad"]
            opt_b += (piece if zero >= 1 else local) * per["optimizer"]
            layer_gathered[t.where] = layer_gathered.get(t.where, 0) + local
        gathered = 0
        if zero >= 3 and layer_gathered:
            biggest = sorted(layer_gathered.values(), reverse=True)[:gathered_layers]
            gathered = sum(biggest) * per["gathered"]
        peak = peaks.get(rank)
        ranks.append(
            RankMemory(
                rank, stages, params_b, grads_b, opt_b, gathered,
                0 if peak is None else peak.peak_bytes, peak, elements,
                host_figures.get(rank, 0),
                0 if swap is None else swap.moved.get(rank, 0),
                None if swap is None else swap.groups.get(rank),
            )
        )
    notes[:0] = _basis(parallel, prec, padding, any(t.kind == "expert" for t in model.tensors))
    if zero >= 3:
        notes.append(
            f"gathered: under ZeRO-3/FSDP the unsharded parameters of the {gathered_layers} "
            "largest layers (or embeddings/head) of the rank, all-gathered at once"
        )
    if per_layer is None:
        notes.append("no activations given: parameters, gradients and optimizer states only")
    else:
        notes.append(
            "activations: the step's peak: per micro-batch, what each layer keeps for backward "
            "under its option (the profile's kept bytes), summed over the micro-batches the "
            "schedule holds, plus what a backward step holds for a while (on the last stage the "
            "loss's backward: the outputs the caller holds and its gradient buffers; a "
            "checkpointed layer's replay during its own backward), whichever step is highest"
        )
    budget_bytes = None
    if budget is not None:
        parsed = parse_budget(budget)
        if parsed.nbytes is None:
            raise ValueError(f"a device budget is bytes with a unit (80GiB), got {budget!r}")
        budget_bytes = parsed.nbytes
    return JobMemory(
        ranks,
        parallel,
        prec,
        schedule if isinstance(schedule, str) else "given actions",
        microbatches,
        budget_bytes,
        notes,
        pipeline_swap,
    )


def _swappable_per_stage(
    per_layer: Sequence[LayerActivation],
    layer_stage: Sequence[int],
    num_stages: int,
    model: ModelParams,
    min_bytes: int,
) -> dict[int, int]:
    """Per stage, the bytes pipeline swap moves of one micro-batch: of what the stage's
    layers keep, their swappable storages of at least ``min_bytes``, but the stage's
    input (what its first layer keeps of its own inputs, unless the model computes that
    input on the stage: embeddings before the layers on the first) and its output (what
    its last layer keeps of its outputs, unless a head after the layers on the last
    stage takes it). Pair terms and the bytes outside the layers stay (the profile does
    not place them storage by storage)."""
    unknown = [act.path for act in per_layer if act.swappable is None]
    if unknown:
        raise ValueError(
            f"the activations do not say what pipeline swap may move of layer {unknown[0]!r} "
            f"({len(unknown)} layer(s)): give a profile made by recomp.plan.profile or "
            "simulate (a compiled profile, or one written before they were recorded, has no "
            "such figures), or LayerActivation(..., swappable=((bytes, place), ...))"
        )
    moved = dict.fromkeys(range(num_stages), 0)
    for i, stage in enumerate(layer_stage):
        moved[stage] += layer_swapped(
            per_layer[i].swappable or (), stage_ends(model, layer_stage, i), min_bytes
        )
    return moved


def stage_ends(model: ModelParams, layer_stage: Sequence[int], index: int) -> tuple[bool, bool]:
    """Whether layer ``index``'s input is its stage's input and its output the stage's
    output, as the pipeline holds them: the first / last layer of its stage, but on the
    first stage of a model with parameters before its layers (embeddings: the layer's
    input is made on the stage) and on the last of one with parameters after them (a
    head takes the layer's output)."""
    stage = layer_stage[index]
    last_stage = max(layer_stage)
    starts = index == 0 or layer_stage[index - 1] != stage
    ends = index == len(layer_stage) - 1 or layer_stage[index + 1] != stage
    if starts and stage == 0 and any(t.where == FIRST for t in model.tensors):
        starts = False
    if ends and stage == last_stage and any(t.where == LAST for t in model.tensors):
        ends = False
    return starts, ends


def layer_swapped(
    storages: Sequence[Sequence[int]], ends: tuple[bool, bool], min_bytes: int
) -> int:
    """The bytes pipeline swap moves of one layer's swappable ``storages`` (``(bytes,
    place)`` each): those of at least ``min_bytes``, but its input where it is its
    stage's and its output where it is its stage's (``ends``: :func:`stage_ends`)."""
    starts, finishes = ends
    moved = 0
    for nbytes, place in storages:
        if nbytes < min_bytes:
            continue
        if (place & ON_INPUT and starts) or (place & ON_OUTPUT and finishes):
            continue
        moved += nbytes
    return moved


@dataclass
class _SwapCount:
    """Pipeline swap on every rank: per rank and swapped (stage, micro-batch), the steps
    its bytes are off the device and their number (``off_device``, for
    :func:`walk_schedule`), its host interval (``host``: forward step, last backward
    step, bytes, for :func:`host_peaks`), and per rank the bytes moved each way per step
    and the groups that swap (of those that run)."""

    off_device: dict[int, dict[Chunk, tuple[range, int]]]
    host: dict[int, dict[Chunk, tuple[int, int, int]]]
    moved: dict[int, int]
    groups: dict[int, tuple[int, int]]

    @classmethod
    def of(
        cls, slots: Mapping[int, Sequence[tuple[Step, ...]]], movable: Mapping[int, int], min_gap: int
    ) -> _SwapCount:
        count = cls({}, {}, {}, {})
        for rank, rank_slots in slots.items():
            plan = plan_rank_swap(rank_slots, min_gap, rank)
            flat = {step: i for i, step in enumerate(s for slot in rank_slots for s in slot)}
            off: dict[Chunk, tuple[range, int]] = {}
            host: dict[Chunk, tuple[int, int, int]] = {}
            for chunk in plan.swapped:
                key = (chunk.stage, chunk.microbatch)
                nbytes = movable.get(chunk.stage, 0)
                if not nbytes:
                    continue
                off[key] = (plan.steps_off_device(key), nbytes)
                stage, mb = key
                last = max(flat[(k, stage, mb)] for k in ("B", "I", "W") if (k, stage, mb) in flat)
                host[key] = (flat[("F", stage, mb)], last, nbytes)
            count.off_device[rank] = off
            count.host[rank] = host
            count.moved[rank] = sum(n for _, _, n in host.values())
            count.groups[rank] = (len(plan.swapped), len(plan.chunks))
        return count


def _swap_note(swap: PipelineSwap) -> str:
    return (
        f"{swap.describe()}: a (stage, micro-batch) whose backward starts at least "
        f"{swap.min_gap} compute slots after its forward moves what its stage keeps to the "
        "host (storages of at least min_bytes), but the stage's input and output (the "
        "pipeline holds them), what a checkpoint holds outside saved-tensor hooks, tensor "
        "subclasses and what layers keep on the host themselves; off the device from the "
        "second slot after its forward to the second before its backward, its host copy "
        "held from its forward to the end of its backward"
    )
