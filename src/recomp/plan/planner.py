"""What a profile holds, and the plan made from it (no framework imports).

A :class:`Profile` lists, per checkpointable layer, its options (no checkpoint, full
checkpoint, each set of excluded candidate regions) with the bytes each keeps and the
replay each costs. :func:`make_plan` picks one option per layer with the exact solver
(``solver.solve``) and explains each choice.

The model behind the numbers:

* predicted activation memory = ``shared_bytes`` (kept whatever the plan: tensors saved
  outside the layers, the loss, storages that several non-adjacent layers keep)
  + per layer the bytes its option keeps (+ bytes two adjacent layers may both keep,
  counted once);
* predicted step time = the measured step time without checkpointing + per layer the
  time of what its option replays in backward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any

from .budget import Budget, format_bytes, parse_budget
from .planfile import (
    FULL_CHECKPOINT,
    FULL_SWAP_INPUTS,
    NO_CHECKPOINT,
    OFFLOAD,
    PARTITION_INPUTS,
    SWAP,
    LayerPlan,
    Plan,
    is_selective,
    moves_to_host,
    parse_option,
    replays_collectives,
)
from .solver import Choice, LayerOptions, Option, evaluate, minimum_bytes, solve_with_ties

MiB = float(1 << 20)

# The host options' time model (the swap and offload options): the copy of a layer's
# tensors to the host runs beside the next layer's forward, the copy back beside the next
# layer's backward (its gradient reads bring the layer before back ahead: the swap
# manager's default pairing, and the offloader's for excluded regions), taken as this
# many of its forwards. Only what a copy takes beyond that compute shows in the step.
BACKWARD_PER_FORWARD = 2.0


def host_copy_seconds(
    out_bytes: int, back_bytes: int, host_bandwidth: float, next_forward_s: float
) -> float:
    """Seconds of the step a layer's copies of ``out_bytes`` to the host and
    ``back_bytes`` back add, the next layer's forward taking ``next_forward_s`` (0 for
    the last layer): ``max(0, out / bandwidth - next forward) + max(0, back / bandwidth
    - BACKWARD_PER_FORWARD x next forward)``."""
    return max(0.0, out_bytes / host_bandwidth - next_forward_s) + max(
        0.0, back_bytes / host_bandwidth - BACKWARD_PER_FORWARD * next_forward_s
    )


class OptionSlot(IntEnum):
    """Where the options sit in every ``LayerProfile.options`` list, and so in the
    solver's choices and in ``pair_bytes``: no checkpoint first, then full checkpoint,
    then the exclusions (from ``EXCLUSIONS`` on), then the selective options (the
    checkpoint keeps its expensive ops' outputs: ``selective``, then
    ``selective+exclude:...`` in the order of the exclusions); then, where the layout
    has tensor parallelism, ``full+partition-inputs``; where the device has a host link,
    ``offload`` and ``exclude-offload:...`` (in the order of the exclusions; each where
    it moves something), then the swap options (``full+swap-inputs``, then ``swap``);
    last, where the layers issue collectives and the plan chooses per layer, the
    checkpoints that run them again (``full+replay-collectives``, ...)."""

    NONE = 0
    FULL = 1
    EXCLUSIONS = 2


@dataclass
class RegionProfile:
    """A candidate region of a layer: a sub-module that an exclusion can keep out of the
    replay. ``exclusion_bytes`` is what excluding it alone keeps (saved tensors and
    cached output, what recomp's ``region_saved_bytes`` reports), summed over its calls."""

    path: str
    type: str
    calls: int
    forward_s: float
    forward_flops: int
    exclusion_bytes: int


# Where a storage in ``OptionProfile.swappable`` lies, as bits: one of the layer's own
# inputs, one of its outputs.
ON_INPUT, ON_OUTPUT = 1, 2


@dataclass
class OptionProfile:
    """One option of one layer. ``kept_bytes``: what the layer keeps under it, without
    the bytes it may share with its neighbour (``LayerProfile.pair_bytes``).
    ``region_saved_bytes``: per excluded region, what recomp's counter will report.
    ``collective_bytes``: the part of ``kept_bytes`` that holds results of collectives,
    which the checkpoint keeps so that its replay does not communicate. ``swap_bytes``:
    what a swap or offload option copies to the host, ``host_bytes`` what it holds there
    until backward and copies back (``replay_s`` includes ``swap_s``, the part of those
    copies the compute around them does not hide). ``gather_bytes``: this rank's slices
    of the inputs a partitioned checkpoint gathers in its replay (``replay_s`` includes
    ``gather_s``, their all-gathers over the link)."""

    name: str
    kept_bytes: int
    replay_s: float
    replay_flops: int
    region_saved_bytes: dict[str, int] = field(default_factory=dict)
    collective_bytes: int = 0
    # The swap and offload options: bytes copied to the host in the forward
    # (``swap_bytes``), of which ``host_bytes`` are held there until backward and copied
    # back (an excluded region's output that no replay reads is dropped instead), and the
    # seconds of ``replay_s`` the copies add (what compute does not hide).
    swap_bytes: int = 0
    swap_s: float = 0.0
    host_bytes: int = 0
    # ``full+partition-inputs``: the bytes of this rank's slices of the inputs its replay
    # all-gathers, and the seconds of ``replay_s`` the gathers take.
    gather_bytes: int = 0
    gather_s: float = 0.0
    # Of ``kept_bytes``, the storages pipeline swap (``recomp.torch.pipeline_swap``) may
    # move to the host: ``[bytes, place]`` each, ``place`` the bits ``ON_INPUT`` (one of
    # the layer's own inputs) and ``ON_OUTPUT`` (one of its outputs) (a pipeline keeps
    # a stage's inputs and outputs on the device). The rest is held outside saved-tensor
    # hooks, in tensor subclasses, or by the option's own copies. None: not recorded (a
    # compiled profile, a profile written before it was).
    swappable: list[list[int]] | None = None


@dataclass
class LayerProfile:
    path: str
    type: str
    forward_s: float
    forward_flops: int
    no_checkpoint_bytes: int  # every storage its forward saves (activations only)
    checkpoint_input_bytes: int  # the storages of its inputs, which a checkpoint keeps
    regions: list[RegionProfile]
    options: list[OptionProfile]
    # [previous layer's option index, this layer's option index, bytes]
    pair_bytes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        names = [o.name for o in self.options[: OptionSlot.EXCLUSIONS]]
        if self.options and names != [NO_CHECKPOINT, FULL_CHECKPOINT]:
            raise ValueError(
                f"layer {self.path!r}: the options start with {names}, not "
                f"{[NO_CHECKPOINT, FULL_CHECKPOINT]} (see OptionSlot)"
            )

    def option(self, name: str) -> OptionProfile:
        for option in self.options:
            if option.name == name:
                return option
        known = ", ".join(o.name for o in self.options)
        raise KeyError(f"layer {self.path!r} has no option {name!r} (options: {known})")


@dataclass
class Profile:
    """Everything the planner needs about one model on one input, on one device."""

    device: str
    baseline_step_s: float
    shared_bytes: int
    layers: list[LayerProfile]
    spread_bytes: int = 0  # part of shared_bytes kept by several non-adjacent layers
    bookkeeping_bytes: int = 0  # per checkpoint and per excluded call (saved RNG state)
    per_save_s: float = 0.0  # a checkpoint's hook time per saved tensor (in replay_s)
    per_policy_op_s: float = 0.0  # a selective policy's time per op passing it (in replay_s)
    notes: list[str] = field(default_factory=list)
    # The checkpoints keep the results of collectives (their exclude_collectives option):
    # True, False, or "per-layer" (each checkpoint option offered both ways).
    exclude_collectives: bool | str = True
    # What the times rest on: "" measured on ``device`` (``profile``); else the cost
    # model's figures (``simulate``), which the plan repeats.
    timing: str = ""
    # Where the bytes outside the layers are kept (parts of ``shared_bytes``): saved
    # before the first layer (the embeddings': a pipeline's first stage holds them) and
    # after the last (the head, its logits, the loss: the last stage's). The rest of
    # ``shared_bytes`` is ``spread_bytes`` (every stage with layers holds it), and in a
    # profile written before the split, what it does not place.
    before_layers_bytes: int = 0
    after_layers_bytes: int = 0
    # The loss's backward, beyond every saved byte: the outputs the caller holds (the
    # logits beside the loss) and the gradients one op after the layers holds at once
    # (a cross-entropy's: two fp32 logits-sized tensors). A transient of the step's
    # peak, on the rank that computes the loss; not part of the budget's activations.
    loss_backward_bytes: int = 0
    # The parallel layout the profile was made under, where known (a simulated published
    # model's: tp, sp, cp, loss_parallel); ``recomp.plan.job`` checks it against the job's.
    layout: dict[str, Any] = field(default_factory=dict)
    # The host link the swap and offload options' copies were priced at (bytes/s each
    # way), None where they are not offered.
    host_bandwidth: float | None = None

    def retime_host_copies(self) -> None:
        """Price every swap and offload option's copies (``swap_s``, part of
        ``replay_s``) at ``host_bandwidth`` against the next layer's forward
        (:func:`host_copy_seconds`): after the layers are known, and again when they
        change (a simulated profile scaled to the model's depth)."""
        if self.host_bandwidth is None:
            return
        for index, layer in enumerate(self.layers):
            after = self.layers[index + 1].forward_s if index + 1 < len(self.layers) else 0.0
            for option in layer.options:
                if option.swap_bytes:
                    seconds = host_copy_seconds(
                        option.swap_bytes, option.host_bytes, self.host_bandwidth, after
                    )
                    option.replay_s += seconds - option.swap_s
                    option.swap_s = seconds

    # -- the solver's view ----------------------------------------------------

    def layer_options(self) -> list[LayerOptions]:
        return [
            LayerOptions(
                layer.path,
                [Option(o.name, o.kept_bytes, o.replay_s, o.replay_flops) for o in layer.options],
                {(a, b): n for a, b, n in layer.pair_bytes},
            )
            for layer in self.layers
        ]

    def uniform_bytes(self, option: str) -> int:
        """Predicted activation memory with ``option`` on every layer."""
        choice = [[o.name for o in layer.options].index(option) for layer in self.layers]
        return evaluate(self.layer_options(), choice, self.shared_bytes).kept_bytes

    def uniform_slot_bytes(self, slot: OptionSlot) -> int:
        """Predicted activation memory with the option at ``slot`` on every layer."""
        choice = [int(slot)] * len(self.layers)
        return evaluate(self.layer_options(), choice, self.shared_bytes).kept_bytes

    def predict(self, options: list[str]) -> dict[str, Any]:
        """Predicted memory, replay and step time of one option name per layer."""
        names = [[o.name for o in layer.options] for layer in self.layers]
        try:
            choice = [n.index(o) for n, o in zip(names, options, strict=True)]
        except ValueError as exc:
            raise ValueError(f"an option is not among the profiled ones: {exc}") from exc
        got = evaluate(self.layer_options(), choice, self.shared_bytes)
        return {
            "activation_bytes": got.kept_bytes,
            "replay_s": got.replay_s,
            "replay_flops": got.replay_flops,
            "step_s": self.baseline_step_s + got.replay_s,
        }

    # -- JSON -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        layers = []
        for layer in data["layers"]:
            layer = dict(layer)
            layer["regions"] = [RegionProfile(**r) for r in layer["regions"]]
            # Profiles written before host_bytes: a swap option held what it moved.
            layer["options"] = [
                OptionProfile(**{"host_bytes": o.get("swap_bytes", 0), **o})
                for o in layer["options"]
            ]
            layers.append(LayerProfile(**layer))
        return cls(**{**data, "layers": layers})


def resolve_budget(profile: Profile, budget: str | int | float | Budget) -> tuple[Budget, int]:
    """The budget as given and in bytes (a percentage lies between full checkpointing of
    every layer, 0%, and no checkpointing, 100%)."""
    parsed = parse_budget(budget)
    return parsed, parsed.resolve(
        profile.uniform_slot_bytes(OptionSlot.FULL), profile.uniform_slot_bytes(OptionSlot.NONE)
    )


# Plans whose predicted step times differ by less than this share of the step are ties.
TIE_TOLERANCE = 0.01


def _without_checkpointing(
    layer_options: list[LayerOptions], budget_bytes: int, shared_bytes: int
) -> Choice | None:
    """The plan that checkpoints no layer, when it fits: it replays nothing, so no
    option can beat it, and a tie within the tolerance (an option whose replay the
    profile prices at nothing, such as a selective one without hardware figures) must
    not turn a model that fits into a checkpointed one. None when it does not fit or
    some layer cannot run unchecked."""
    choice = []
    for layer in layer_options:
        names = [option.name for option in layer.options]
        if NO_CHECKPOINT not in names:
            return None
        choice.append(names.index(NO_CHECKPOINT))
    solution = evaluate(layer_options, choice, shared_bytes)
    if solution.kept_bytes > budget_bytes:
        return None
    return Choice(solution, solution.replay_s, ())


def make_plan(
    profile: Profile, budget: str | int | float | Budget, *, tie_tolerance: float = TIE_TOLERANCE
) -> Plan:
    """The fastest plan whose predicted activation memory fits ``budget`` (exact).

    Plans whose predicted replay times differ by less than ``tie_tolerance`` of the
    measured step time are ties (the times are measurements): among them the plan with
    the fewest replay FLOPs is taken, then the fewest bytes, then the first in option
    order, so that profiles of the same model in two processes give the same plan. The
    plan lists the choices that were such ties (``Plan.near_ties``).

    Raises ``BudgetTooSmallError`` (a ``ValueError``) stating the least memory any plan
    keeps when the budget is below it.

    Given a compiled profile (``profile(torch.compile(model), ...)``), the plan is the
    partitioner's memory budget that lands on ``budget`` (``recomp.plan.compiled``)."""
    if getattr(profile, "is_compiled", False):
        from .compiled import make_compiled_plan

        return make_compiled_plan(profile, budget)  # type: ignore[arg-type]
    if not 0.0 <= tie_tolerance < 1.0:
        raise ValueError(
            f"tie_tolerance is a share of the step time in [0, 1), got {tie_tolerance}"
        )
    parsed, budget_bytes = resolve_budget(profile, budget)
    layer_options = profile.layer_options()
    tolerance_s = tie_tolerance * profile.baseline_step_s
    chosen = _without_checkpointing(layer_options, budget_bytes, profile.shared_bytes)
    if chosen is None:
        chosen = solve_with_ties(layer_options, budget_bytes, profile.shared_bytes, tolerance_s)
    solution = chosen.solution
    least = minimum_bytes(layer_options, profile.shared_bytes)
    layers: list[LayerPlan] = []
    previous: int | None = None
    for layer, options, index in zip(profile.layers, layer_options, solution.choice):
        option = layer.options[index]
        kept = option.kept_bytes + options.pair(previous, index)
        layers.append(
            LayerPlan(
                path=layer.path,
                option=option.name,
                kept_bytes=kept,
                predicted_ms=option.replay_s * 1e3,
                replay_flops=option.replay_flops,
                type=layer.type,
                reason=explain(layer, option),
            )
        )
        previous = index
    ties: dict[int, list[dict[str, Any]]] = {}
    for tie in chosen.near_ties:
        option = profile.layers[tie.layer].options[tie.option]
        ties.setdefault(tie.layer, []).append(
            {"option": option.name, "replay_flops": option.replay_flops}
        )
    predicted = {
        "activation_bytes": solution.kept_bytes,
        "shared_bytes": profile.shared_bytes,
        "replay_ms": solution.replay_s * 1e3,
        "replay_flops": solution.replay_flops,
        "baseline_step_ms": profile.baseline_step_s * 1e3,
        "step_ms": (profile.baseline_step_s + solution.replay_s) * 1e3,
        "fastest_replay_ms": chosen.fastest_s * 1e3,
        "tie_tolerance_ms": tolerance_s * 1e3,
        "full_bytes": profile.uniform_slot_bytes(OptionSlot.FULL),
        "none_bytes": profile.uniform_slot_bytes(OptionSlot.NONE),
        "minimum_bytes": least.kept_bytes,
        "device": profile.device,
    }
    if profile.timing:
        predicted["timing"] = profile.timing
    return Plan(
        budget_bytes=budget_bytes,
        layers=layers,
        exclude_collectives=profile.exclude_collectives is not False,
        budget=parsed.text,
        predicted=predicted,
        near_ties=[
            {"path": profile.layers[i].path, "chosen": layers[i].option, "alternatives": alts}
            for i, alts in sorted(ties.items())
        ],
    )


def explain(layer: LayerProfile, option: OptionProfile) -> str:
    """One line: what the option buys against full checkpointing of the layer."""
    full = layer.options[OptionSlot.FULL]
    more = format_bytes(option.kept_bytes - full.kept_bytes)
    saved_ms = (full.replay_s - option.replay_s) * 1e3
    kind, regions = parse_option(option.name)
    if moves_to_host(option.name):
        what = {
            SWAP: "swap, no checkpoint",
            FULL_SWAP_INPUTS: "checkpoint, inputs on the host",
            OFFLOAD: "offload, no checkpoint",
        }.get(option.name, f"exclude {'+'.join(regions)}, what it keeps on the host")
        moved = f"moves {format_bytes(option.swap_bytes)} to the host"
        moved += (
            " and back"
            if option.host_bytes == option.swap_bytes
            else f", {format_bytes(option.host_bytes)} back"
        )
        return (
            f"{what}: {moved} ({option.swap_s * 1e3:.1f} ms of it not hidden by compute), "
            f"keeps {format_bytes(option.kept_bytes)}, replays "
            f"{(option.replay_s - option.swap_s) * 1e3:.1f} ms"
        )
    if option.name == PARTITION_INPUTS:
        return (
            f"checkpoint, inputs split over the tensor-parallel ranks: keeps "
            f"{format_bytes(option.kept_bytes)} ({format_bytes(full.kept_bytes - option.kept_bytes)}"
            f" less than full), gathers {format_bytes(option.gather_bytes)} of slices in the "
            f"replay ({option.gather_s * 1e3:.1f} ms), replays {option.replay_s * 1e3:.1f} ms"
        )
    if replays_collectives(option.name):
        what = "checkpoint" + (f", exclude {'+'.join(regions)}" if regions else "")
        return (
            f"{what}, its collectives run again in the replay: keeps "
            f"{format_bytes(option.kept_bytes)} ({format_bytes(full.kept_bytes - option.kept_bytes)}"
            f" less than full), replays {option.replay_s * 1e3:.1f} ms"
        )
    if is_selective(option.name):
        what = "keep expensive ops' outputs" + (f", exclude {'+'.join(regions)}" if regions else "")
        return f"{what}: saves {saved_ms:.1f} ms of replay for {more} more than full"
    if kind == FULL_CHECKPOINT:
        return f"checkpoint: keeps only its input, replays {full.replay_s * 1e3:.1f} ms"
    if kind == NO_CHECKPOINT:
        return f"no checkpoint: no replay (saves {saved_ms:.1f} ms) for {more} more than full"
    return (
        f"exclude {'+'.join(regions)}: saves {saved_ms:.1f} ms of replay for {more} more than full"
    )


def _columns(header: list[str], rows: list[list[str]], right: tuple[int, ...]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(out).rstrip()

    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]


def _compiled_plan_table(plan: Plan) -> str:
    """A compiled plan: per layer its option and the bytes the partitioner saves in it."""
    assert plan.compiled is not None
    rows = [
        [layer.path, layer.option, f"{layer.kept_bytes / MiB:.2f}", layer.reason]
        for layer in plan.layers
    ]
    lines = _columns(["layer", "option", "saved MiB", "why"], rows, (2,))
    p = plan.predicted
    flops = p.get("replay_flops")
    lines.append(
        f"budget {plan.budget or format_bytes(plan.budget_bytes)} = "
        f"{format_bytes(plan.budget_bytes)}; compiled with {plan.compiled['backend']} and "
        f"torch._functorch.config.activation_memory_budget = "
        f"{plan.compiled['activation_memory_budget']:.6g}: predicted activation memory "
        f"{format_bytes(p['activation_bytes'])} (the partitioner's least "
        f"{format_bytes(p['least_bytes'])}, its default {format_bytes(p['default_bytes'])}); "
        f"recomputes {'?' if flops is None else f'{flops / 1e9:.3f}'} GFLOP more than the "
        "default"
    )
    return "\n".join(lines)


def plan_table(plan: Plan) -> str:
    """The plan as a text table: layer, option, kept MiB, predicted replay ms, reason."""
    if plan.compiled is not None:
        return _compiled_plan_table(plan)
    header = ["layer", "option", "kept MiB", "replay ms", "why"]
    rows = [
        [
            layer.path,
            layer.option,
            f"{layer.kept_bytes / MiB:.2f}",
            f"{layer.predicted_ms:.1f}",
            layer.reason,
        ]
        for layer in plan.layers
    ]
    p = plan.predicted
    if p:
        rows.append(["(shared)", "", f"{p['shared_bytes'] / MiB:.2f}", "", "outside the layers"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        out = [
            c.rjust(w) if i in (2, 3) else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(out).rstrip()

    lines = [line(header), line(["-" * w for w in widths]), *map(line, rows)]
    if p:
        lines.append(
            f"budget {plan.budget or format_bytes(plan.budget_bytes)} = "
            f"{format_bytes(plan.budget_bytes)}; predicted activation memory "
            f"{format_bytes(p['activation_bytes'])} (full checkpointing "
            f"{format_bytes(p['full_bytes'])}, none {format_bytes(p['none_bytes'])}); "
            f"predicted step {p['step_ms']:.1f} ms = {p['baseline_step_ms']:.1f} ms without "
            f"checkpointing + {p['replay_ms']:.1f} ms replay"
        )
    if p.get("timing"):
        lines.append(f"times: {p['timing']}")
    if plan.near_ties:
        within = p.get("tie_tolerance_ms")
        ties = ", ".join(
            f"{tie['path']} ({len(tie['alternatives'])} other option"
            f"{'s' if len(tie['alternatives']) != 1 else ''})"
            for tie in plan.near_ties
        )
        lines.append(
            "near ties, decided by fewer replay FLOPs, then bytes, then order"
            + (f" (plans within {within:.1f} ms)" if within is not None else "")
            + f": {ties}; the plan file lists them"
        )
    return "\n".join(lines)


def profile_table(profile: Profile) -> str:
    """Per layer: what it keeps without checkpointing, its checkpoint input, and per
    candidate region what excluding it keeps, its forward time and FLOPs."""
    # The first column fits the longest name (Hugging Face's region and class names).
    width = max(
        [28]
        + [len(layer.path) + 2 for layer in profile.layers]
        + [len(f"  {r.path} ({r.type})") + 2 for layer in profile.layers for r in layer.regions]
    )
    lines = [
        f"{'layer / region':{width}}{'kept MiB':>10}{'input MiB':>11}{'fwd ms':>9}"
        f"{'fwd GFLOP':>11}",
    ]
    for layer in profile.layers:
        lines.append(
            f"{layer.path:{width}}{layer.no_checkpoint_bytes / MiB:10.2f}"
            f"{layer.checkpoint_input_bytes / MiB:11.2f}{layer.forward_s * 1e3:9.1f}"
            f"{layer.forward_flops / 1e9:11.3f}"
        )
        for region in layer.regions:
            lines.append(
                f"  {region.path + ' (' + region.type + ')':{width - 2}}"
                f"{region.exclusion_bytes / MiB:10.2f}{'':11}{region.forward_s * 1e3:9.1f}"
                f"{region.forward_flops / 1e9:11.3f}"
            )
    lines.append(
        f"kept: by the layer without checkpointing, or by the region when excluded; shared "
        f"outside the layers: {profile.shared_bytes / MiB:.2f} MiB; step without "
        f"checkpointing: {profile.baseline_step_s * 1e3:.1f} ms"
    )
    if profile.timing:
        lines.append(f"times: {profile.timing}")
    lines.extend(f"note: {note}" for note in profile.notes)
    return "\n".join(lines)
