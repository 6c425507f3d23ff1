"""What each option of a layer keeps and replays, derived from the record of one
forward (``_recording``) by the rules recomp and ``torch.utils.checkpoint`` apply (the
list is in ``recomp.plan.profiler``'s docstring), and how the kept storages are split
between layers, adjacent pairs of layers and what is shared."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from torch import nn

from ._recording import LayerRecord, RecordedOp, RegionSpan
from .planfile import FULL_SWAP_INPUTS, NO_CHECKPOINT, SWAP, exclude_option


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
    swap_bytes: int = 0  # moved to the host after the forward and back for backward


def analyse_swap_options(
    record: LayerRecord,
    full: OptionAnalysis,
    preexisting: set[Hashable],
    parameters: set[Hashable],
) -> list[OptionAnalysis]:
    """The layer's two swap options, by the rules of ``recomp.torch``'s swap (NOTE [ Swap
    scopes ]): when the layer returns, each saved storage that is not a parameter's and
    does not share storage with the layer's output is copied to the host (once per
    storage) and brought back for backward; what is moved stays on the device only where
    something else holds it (the user's inputs, another layer's saved tensors: counted
    there).

    ``full+swap-inputs`` (``full``: the layer's full checkpoint): the checkpoint's saved
    inputs are moved (the tensors among its positional arguments: PyTorch's checkpoint
    holds keyword arguments and tensors nested in containers itself); it keeps the rest of what the full checkpoint keeps (the kept
    results of collectives) and replays the same ops. ``swap``: no checkpoint; every
    storage the layer's forward saves is moved, except parameters and the output's.
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
    )
    saved = moved(
        {s.key: s.nbytes for s in record.saves if not s.is_parameter and not s.wrapped}
    )
    kept = {
        s.key: s.nbytes
        for s in record.saves
        if not s.is_parameter and s.key not in saved and s.key not in preexisting
    }
    swap = OptionAnalysis(
        SWAP, kept, [], {}, 0, len(record.saves), 0, 0, sum(saved.values())
    )
    return [swap_inputs, swap]


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
    entries: list[tuple[RegionSpan, dict[Hashable, int], dict[Hashable, int], int]] = []
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
        entries.append((span, region_kept, outputs, saves_after))
    total_saves = len(checkpoint_saves)
    saved_bytes: dict[str, int] = {}
    for span, region_kept, outputs, saves_after in entries:
        path = candidates[span.candidate][0]
        # A replay that stops before reaching past the call does not need its outputs.
        reachable = saves_after < total_saves
        held = {**region_kept, **(outputs if reachable else {})}
        kept.update(held)
        saved_bytes[path] = saved_bytes.get(path, 0) + sum(held.values())
    last = max(checkpoint_saves, default=None)
    excluded_spans = {i for i, _ in spans}
    seen = [op for op in record.ops if op.span not in excluded_spans]
    reached = [] if last is None else [op for op in seen if op.seq < last]
    replay = reached
    collective_bytes = 0
    if keep_collectives:
        for op in reached:
            for key, nbytes in op.collective or ():
                if key not in kept and key not in preexisting:
                    kept[key] = nbytes
                    collective_bytes += nbytes
        replay = [op for op in replay if op.collective is None]
    if selective:
        for op in seen:
            kept.update(op.outputs)
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
    keepers: dict[Hashable, set[int]] = {}
    size: dict[Hashable, int] = {}
    for i, options in enumerate(per_layer):
        for kept in options:
            for key, nbytes in kept.items():
                keepers.setdefault(key, set()).add(i)
                size[key] = nbytes
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
