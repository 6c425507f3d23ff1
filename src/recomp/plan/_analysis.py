"""What each option of a layer keeps and replays, derived from the record of one
forward (``_recording``) by the rules recomp and ``torch.utils.checkpoint`` apply (the
list is in ``recomp.plan.profiler``'s docstring), and how the kept storages are split
between layers, adjacent pairs of layers and what is shared."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from torch import nn

from ._recording import LayerRecord, RecordedOp, RegionSpan
from .planfile import (
    FULL_SWAP_INPUTS,
    NO_CHECKPOINT,
    OFFLOAD,
    PARTITION_INPUTS,
    SWAP,
    exclude_offload_option,
    exclude_option,
    parse_option,
)
from .planner import ON_INPUT, ON_OUTPUT


@dataclass
class RegionHeld:
    """What one call of an excluded region holds until backward: its saved tensors
    (``saved``) and its outputs not among them (``outputs``), whether a replay can reach
    past it (``reachable``: else its outputs are dropped when the forward ends), and the
    storages held only as tensor subclasses (DTensor: the offloader leaves them)."""

    saved: dict[Hashable, int]
    outputs: dict[Hashable, int]
    reachable: bool
    wrapped: set[Hashable]


@dataclass
class OptionAnalysis:
    """What one option of a layer keeps and what its replay runs."""

    name: str
    kept: dict[Hashable, int]  # activation storages the layer keeps
    replay_ops: list[RecordedOp]
    region_saved_bytes: dict[str, int]  # per excluded candidate path, as recomp counts
    excluded_calls: int
    hooked_saves: int = 0  # saved tensors that go through a Python hook (checkpointed)
    policy_ops: int = 0  # ops that pass a selective policy's dispatch modes (forward, replay)
    collective_bytes: int = 0  # part of kept: results of collectives the replay reads
    swap_bytes: int = 0  # copied to the host in the forward
    host_bytes: int = 0  # of those, held on the host until backward and copied back
    # Per input the checkpoint keeps split over the tensor-parallel group, the bytes of
    # this rank's slice: one all-gather of each in the replay.
    gathered: list[int] = field(default_factory=list)
    # Per excluded region call, what it holds (the exclusion options).
    regions: list[RegionHeld] = field(default_factory=list)
    # Of ``kept``, the storages held outside saved-tensor hooks: the results of
    # collectives a checkpoint keeps for its replay, the outputs a selective policy
    # caches, the slices of partitioned inputs (no saved-tensors hook can move them).
    unhooked: set[Hashable] = field(default_factory=set)


def analyse_swap_options(
    record: LayerRecord,
    full: OptionAnalysis,
    preexisting: set[Hashable],
    parameters: set[Hashable],
    min_bytes: int,
) -> list[OptionAnalysis]:
    """The layer's swap options and its ``offload`` option, by the rules of
    ``recomp.torch``'s swap (NOTE [ Swap scopes ]): when the layer returns, each saved
    storage that is not a parameter's and does not share storage with the layer's output
    is copied to the host (once per storage) and brought back for backward; what is
    moved stays on the device only where something else holds it (the user's inputs,
    another layer's saved tensors: counted there).

    ``full+swap-inputs`` (``full``: the layer's full checkpoint): the checkpoint's saved
    inputs are moved (the tensors among its positional arguments: PyTorch's checkpoint
    holds keyword arguments and tensors nested in containers itself); it keeps the rest of what the full checkpoint keeps (the kept
    results of collectives) and replays the same ops. ``swap``: no checkpoint; every
    storage the layer's forward saves is moved, except parameters and the output's.
    ``offload``: the same, of the storages of at least ``min_bytes`` only (the offload
    session's rule: smaller ones stay on the device); offered where it moves something.
    Tensor subclasses that wrap a local tensor (DTensor) are not moved: recomp's
    offloader copies plain tensors only."""
    stays = parameters | set(record.output_keys)

    def moved(keys: dict[Hashable, int]) -> dict[Hashable, int]:
        return {k: n for k, n in keys.items() if k not in stays}

    inputs_moved = moved(
        {
            k: n
            for k, n in record.input_keys.items()
            if k in record.positional_keys and k not in record.wrapped_inputs
        }
    )
    # Keyword and nested inputs the checkpoint holds itself: on the device, even where a
    # positional argument shares their storage (which is then copied all the same).
    swap_inputs = OptionAnalysis(
        FULL_SWAP_INPUTS,
        {k: n for k, n in full.kept.items() if k not in inputs_moved or k in record.held_keys},
        full.replay_ops,
        {},
        0,
        full.hooked_saves,
        0,
        full.collective_bytes,
        sum(inputs_moved.values()),
        sum(inputs_moved.values()),
        unhooked=set(full.unhooked),
    )
    saved = moved(
        {s.key: s.nbytes for s in record.saves if not s.is_parameter and not s.wrapped}
    )

    def unchecked(name: str, chosen: dict[Hashable, int]) -> OptionAnalysis:
        kept = {
            s.key: s.nbytes
            for s in record.saves
            if not s.is_parameter and s.key not in chosen and s.key not in preexisting
        }
        total = sum(chosen.values())
        return OptionAnalysis(name, kept, [], {}, 0, len(record.saves), 0, 0, total, total)

    options = [swap_inputs, unchecked(SWAP, saved)]
    large = {k: n for k, n in saved.items() if n >= min_bytes}
    if large:
        options.append(unchecked(OFFLOAD, large))
    return options


def analyse_region_offload(
    record: LayerRecord, exclusion: OptionAnalysis, min_bytes: int
) -> OptionAnalysis | None:
    """``exclude-offload:A+B``: the exclusion ``exclusion`` whose regions keep what they
    keep on the host, by the rules of the offloader (``recomp.torch._offload``): per
    region call, each storage it saves or returns (its cached output) is copied to the
    host once, if it is a plain tensor of at least ``min_bytes``, but the checkpoint's own
    inputs (which the checkpoint keeps on the device anyway) and parameters. What comes
    back for backward: its saved tensors, and its outputs where a replay reaches past the
    call (the others are copied out, then dropped with the cached output). The device
    keeps the exclusion's bytes less what is held on the host; replay as the exclusion.
    None where nothing would move."""
    out = back = 0
    on_host: set[Hashable] = set()
    for call in exclusion.regions:
        group: dict[Hashable, int] = {}
        for key, nbytes in [*call.saved.items(), *call.outputs.items()]:
            if (
                key not in group
                and key not in record.input_keys
                and key not in call.wrapped
                and nbytes >= min_bytes
            ):
                group[key] = nbytes
        out += sum(group.values())
        returned = {k: n for k, n in group.items() if k in call.saved or call.reachable}
        back += sum(returned.values())
        on_host.update(returned)
    if not out:
        return None
    kind, regions = parse_option(exclusion.name)
    assert kind == "exclude", exclusion.name
    return OptionAnalysis(
        exclude_offload_option(regions),
        {k: n for k, n in exclusion.kept.items() if k not in on_host},
        exclusion.replay_ops,
        exclusion.region_saved_bytes,
        exclusion.excluded_calls,
        exclusion.hooked_saves,
        exclusion.policy_ops,
        exclusion.collective_bytes,
        out,
        back,
        unhooked=set(exclusion.unhooked),
    )


def analyse_partition(record: LayerRecord, full: OptionAnalysis, size: int) -> OptionAnalysis | None:
    """``full+partition-inputs`` over a group of ``size`` ranks, by the rules of
    ``partition_inputs`` (NOTE [ Partitioned checkpoint inputs ]): each floating-point
    tensor among the checkpoint's positional inputs (which it saves; the keyword ones it
    holds itself) with at least ``size`` elements is kept as this rank's slice of
    ``ceil(elements / size)`` elements, and gathered whole in the replay by one
    all-gather; its storage is released unless a keyword input holds it too (or it
    existed before the forward: not an activation). Tensor subclasses (DTensor) are not
    split. The rest as the full checkpoint. None where nothing would be split."""
    slices: dict[Hashable, int] = {}
    split: dict[Hashable, int] = {}  # storage -> positional tensors of it split
    whole: set[Hashable] = set()
    for index, (key, numel, itemsize) in enumerate(record.float_positional):
        if numel < size:
            whole.add(key)
            continue
        slices[("partition", key, index)] = -(-numel // size) * itemsize
        split[key] = split.get(key, 0) + 1
    if not slices:
        return None
    released = {k for k in split if k not in whole and k not in record.held_keys}
    kept = {k: n for k, n in full.kept.items() if k not in released}
    kept.update(slices)
    return OptionAnalysis(
        PARTITION_INPUTS,
        kept,
        full.replay_ops,
        {},
        0,
        full.hooked_saves,
        0,
        full.collective_bytes,
        gathered=list(slices.values()),
        unhooked=set(full.unhooked) | set(slices),
    )


def analyse_option(
    record: LayerRecord,
    candidates: list[tuple[str, nn.Module]],
    excluded: tuple[int, ...] | None,
    preexisting: set[Hashable],
    selective: bool = False,
    keep_collectives: bool = True,
) -> OptionAnalysis:
    """What one layer keeps and replays with ``excluded`` candidates (None: no checkpoint);
    ``selective``: the checkpoint also keeps the outputs of the expensive ops outside
    the excluded regions (which its policy does not see) and so does not replay them;
    ``keep_collectives`` (a checkpoint's ``exclude_collectives``): it keeps the results of
    the collectives outside the excluded regions that its replay reaches (those before
    its last saved tensor: early stop drops the others), and the replay does not run them."""

    def activations(keys: dict[Hashable, int]) -> dict[Hashable, int]:
        return {k: n for k, n in keys.items() if k not in preexisting}

    if excluded is None:
        assert not selective, "a selective option is a checkpoint"
        saved = {s.key: s.nbytes for s in record.saves if not s.is_parameter}
        return OptionAnalysis(NO_CHECKPOINT, activations(saved), [], {}, 0)

    chosen = set(excluded)
    kept: dict[Hashable, int] = dict(record.input_keys)
    checkpoint_saves = [
        s.seq
        for s in record.saves
        if s.span is None or record.spans[s.span].candidate not in chosen
    ]
    excluded_outputs: set[Hashable] = set()
    # Per excluded call: saved tensors kept, cached outputs, checkpoint saves before its end.
    entries: list[tuple[int, RegionSpan, dict[Hashable, int], dict[Hashable, int], int]] = []
    spans = [(i, span) for i, span in enumerate(record.spans) if span.candidate in chosen]
    for index, span in spans:
        deferrable = {
            key
            for key, is_parameter in span.inputs
            if not is_parameter and key not in excluded_outputs and key not in record.input_keys
        }
        region_kept: dict[Hashable, int] = {}
        deferred = False
        for s in record.saves:
            if s.span != index:
                continue
            if s.key in deferrable:
                deferred = True
            elif not s.is_parameter and s.key not in span.parameter_keys:
                region_kept[s.key] = s.nbytes
        outputs: dict[Hashable, int] = {}
        for key, nbytes, _ in span.outputs:
            excluded_outputs.add(key)
            if key not in region_kept:
                outputs[key] = nbytes
        if deferred and any(grad for _, _, grad in span.outputs):
            checkpoint_saves.append(span.end)  # the boundary saves the deferred inputs
        saves_after = sum(1 for seq in checkpoint_saves if seq <= span.end)
        entries.append((index, span, region_kept, outputs, saves_after))
    total_saves = len(checkpoint_saves)
    saved_bytes: dict[str, int] = {}
    regions: list[RegionHeld] = []
    for index, span, region_kept, outputs, saves_after in entries:
        path = candidates[span.candidate][0]
        # A replay that stops before reaching past the call does not need its outputs.
        reachable = saves_after < total_saves
        held = {**region_kept, **(outputs if reachable else {})}
        kept.update(held)
        saved_bytes[path] = saved_bytes.get(path, 0) + sum(held.values())
        plain = {s.key for s in record.saves if s.span == index and not s.wrapped}
        wrapped = {k for k in region_kept if k not in plain} | span.wrapped_outputs
        regions.append(RegionHeld(region_kept, outputs, reachable, wrapped))
    last = max(checkpoint_saves, default=None)
    excluded_spans = {i for i, _ in spans}
    seen = [op for op in record.ops if op.span not in excluded_spans]
    reached = [] if last is None else [op for op in seen if op.seq < last]
    replay = reached
    collective_bytes = 0
    unhooked: set[Hashable] = set()
    if keep_collectives:
        for op in reached:
            for key, nbytes in op.collective or ():
                if key not in kept and key not in preexisting:
                    kept[key] = nbytes
                    collective_bytes += nbytes
                    unhooked.add(key)
        replay = [op for op in replay if op.collective is None]
    if selective:
        for op in seen:
            for key, nbytes in op.outputs:
                if key not in kept:  # cached by the policy, not saved through hooks
                    kept[key] = nbytes
                    unhooked.add(key)
        replay = [op for op in replay if not op.expensive]
    name = exclude_option([candidates[i][0] for i in excluded], selective)
    return OptionAnalysis(
        name,
        activations(kept),
        replay,
        saved_bytes,
        len(spans),
        len(record.saves),
        len(seen) + len(reached) if selective else 0,
        collective_bytes,
        regions=regions,
        unhooked=unhooked,
    )


def split_storages(
    per_layer: list[list[dict[Hashable, int]]], outside: dict[Hashable, int]
) -> tuple[list[list[int]], list[dict[tuple[int, int], int]], int, int]:
    """Split the storages each layer's options keep (``per_layer[layer][option]``) so that
    each is counted once: one kept by a single layer counts in that layer's options
    (``private[layer][option]``); one kept by two adjacent layers counts once per pair of
    their options (``pairs[layer][(option of the layer before, option)]``); one kept
    outside the layers (``outside``) or by layers further apart is ``shared`` whatever the
    plan (``spread``: the bytes of the latter). Returns (private, pairs, shared, spread)."""
    keepers, size = _keepers(per_layer)
    private = [[0] * len(options) for options in per_layer]
    pairs: list[dict[tuple[int, int], int]] = [{} for _ in per_layer]
    shared = sum(outside.values())
    spread = 0
    for key, layers in keepers.items():
        if key in outside:
            continue
        if len(layers) == 1:
            (i,) = layers
            for o, kept in enumerate(per_layer[i]):
                if key in kept:
                    private[i][o] += size[key]
        elif len(layers) == 2 and max(layers) - min(layers) == 1:
            i = max(layers)
            for a, before in enumerate(per_layer[i - 1]):
                for b, now in enumerate(per_layer[i]):
                    if key in before or key in now:
                        pairs[i][(a, b)] = pairs[i].get((a, b), 0) + size[key]
        else:
            shared += size[key]
            spread += size[key]
    return private, pairs, shared, spread


def _keepers(
    per_layer: list[list[dict[Hashable, int]]],
) -> tuple[dict[Hashable, set[int]], dict[Hashable, int]]:
    """Per storage kept by some option of some layer: the layers that keep it, its bytes."""
    keepers: dict[Hashable, set[int]] = {}
    size: dict[Hashable, int] = {}
    for i, options in enumerate(per_layer):
        for kept in options:
            for key, nbytes in kept.items():
                keepers.setdefault(key, set()).add(i)
                size[key] = nbytes
    return keepers, size


def private_keys(
    per_layer: list[list[dict[Hashable, int]]], outside: dict[Hashable, int]
) -> list[set[Hashable]]:
    """Per layer, the storages counted in its options' own bytes (``split_storages``'s
    ``private``): kept by that layer only, not outside the layers."""
    keepers, _ = _keepers(per_layer)
    private: list[set[Hashable]] = [set() for _ in per_layer]
    for key, layers in keepers.items():
        if len(layers) == 1 and key not in outside:
            private[next(iter(layers))].add(key)
    return private


def swappable_storages(
    record: LayerRecord, option: OptionAnalysis, private: set[Hashable]
) -> list[list[int]]:
    """Of what ``option`` keeps of the layer's own (``private``: its share of the kept
    bytes), the storages a saved-tensors hook around the layer's forward would be handed
    as plain tensors, which pipeline swap (``recomp.torch.pipeline_swap``) may move:
    ``[bytes, place]`` each, largest first, ``place`` the bits :data:`ON_INPUT` and
    :data:`ON_OUTPUT` (the pipeline keeps a stage's inputs and outputs on the device).
    Left out: what a checkpoint holds outside the hooks (its keyword and nested inputs,
    the kept results of collectives, a selective policy's cached outputs, partitioned
    slices) and tensor subclasses (DTensor: the offloader copies plain tensors only)."""
    wrapped = {s.key for s in record.saves if s.wrapped} | set(record.wrapped_inputs)
    for span in record.spans:
        wrapped |= span.wrapped_outputs
    # Inputs a checkpoint holds itself (keyword, nested), unless also saved positionally.
    held = set(record.held_keys) - set(record.positional_keys)
    out = []
    for key, nbytes in option.kept.items():
        if key not in private or key in option.unhooked or key in wrapped:
            continue
        if key in held and option.name != NO_CHECKPOINT:
            continue
        place = (ON_INPUT if key in record.input_keys else 0) | (
            ON_OUTPUT if key in record.output_keys else 0
        )
        out.append([nbytes, place])
    return sorted(out, reverse=True)
