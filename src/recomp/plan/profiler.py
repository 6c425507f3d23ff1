"""Profile a PyTorch model for planning: what each layer option keeps and replays.

``profile(model, inputs)`` works on a deep copy of the model and restores the random
number generators afterwards, so the model, its parameters, buffers and gradients and
the random stream the training run sees are left as they were. On the copy it runs:

1. a warm-up step and ``steps`` timed steps (forward, loss, backward) without
   checkpointing: the baseline step time, and forward times of each layer and each
   candidate region (module hooks);
2. one instrumented forward, under a saved-tensors hook that records every tensor
   autograd saves (its storage and size) and a dispatch mode that records every ATen op
   (its FLOPs, by ``FlopCounterMode``'s formulas, and its time), each tagged with the
   layer and candidate region it ran in, in one sequence.

From that one sequence it derives, for every option, what the option keeps and what its
replay runs, following the rules recomp and ``torch.utils.checkpoint`` apply:

* no checkpoint: every activation storage the layer's forward saves;
* checkpoint: the storages of the layer's inputs (the checkpoint holds them);
* checkpoint with regions excluded: the inputs, plus per excluded call its saved tensors
  except its deferred inputs (inputs computed inside the checkpoint by recomputed code),
  plus its output, dropped again when the checkpoint saves nothing after the call;
* a checkpoint that keeps collectives' results (``exclude_collectives=True``, under a
  process group): also the results of the collectives outside excluded regions that
  come before its last saved tensor, which its replay reads instead of communicating;
* where the device has a host link (``host_link``: CUDA; ``simulate``: a hardware
  table with ``host_bandwidth``), the swap options: ``full+swap-inputs`` keeps what
  the full checkpoint keeps less its positional tensor inputs, ``swap`` what the layer
  saves less what moves; what moves is every saved plain-tensor storage that is
  neither a parameter's nor the layer output's (``_analysis.analyse_swap_options``),
  and its copies cost what the next layer's compute does not hide; the offload
  options, by the offloader's rule (storages of at least 1 MiB): ``offload`` as
  ``swap``, ``exclude-offload:...`` an exclusion whose regions keep what they keep on
  the host (``_analysis.analyse_region_offload``);
* under tensor parallelism (``simulate(..., partition_inputs=tp)``),
  ``full+partition-inputs``: the full checkpoint keeping this rank's slice of each
  floating-point positional input, its replay paying one all-gather per input
  (``_analysis.analyse_partition``);
* the replay runs the layer's ops that come before the checkpoint's last saved tensor
  (early stop), except those inside excluded regions; its time is the ops' share of the
  layer's measured forward time.

Storages are counted once: one kept by two adjacent layers (a layer output the next one
saves) enters the plan as a pair term; one kept outside the layers, or by layers further
apart, is shared. Parameters, buffers and the inputs exist before the forward and are
not activations.

The parts live in their own modules: the candidates and options (``_options``), the
record of the instrumented forward (``_recording``), the analysis of each option from
it (``_analysis``) and the times (``_timing``); this module runs them in order. The
recorded forward (``record_forward``) and the profile built from it (``build_profile``)
are the same for ``recomp.plan.simulate``, which runs them on fake tensors: every count
is made once, here, for both.
"""

from __future__ import annotations

import copy
import gc
import itertools
import statistics
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._rng_trackers import capture_tracker_states
from ..torch import _compat
from ..torch._backend import BACKEND
from ._analysis import (
    OptionAnalysis,
    analyse_option,
    analyse_partition,
    analyse_region_offload,
    analyse_swap_options,
    private_keys,
    split_storages,
    swappable_storages,
)
from ._layers import LayerSpec, find_layers
from ._options import find_candidates, layer_option_sets
from ._recording import LayerRecord, OpCost, Recorder, storage_of
from ._timing import ModuleTimer, average_alike_layers, checkpoint_overheads, retime_ops, sync
from .cost import sent_bytes
from .modelcall import call_model, default_loss, fresh_inputs, tensors_of
from .planfile import (
    EXCLUDE_PREFIX,
    OFFLOAD_MIN_BYTES,
    PARTITION_INPUTS,
    PER_LAYER,
    checkpointed,
    exclude_option,
    moves_to_host,
    replay_collectives_option,
)
from .planner import LayerProfile, OptionProfile, OptionSlot, Profile, RegionProfile

__all__ = ["find_candidates", "find_layers", "profile"]


def profile(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    layers: LayerSpec = None,
    exclude: Callable[[nn.Module], bool] | None = None,
    steps: int = 3,
    clock: str = "wall",
    optimizer: Callable[[list[nn.Parameter]], Any] | None = None,
    exclude_collectives: bool | str = PER_LAYER,
    keep: Callable[[nn.Module], bool] | None = None,
    backend: str | None = None,
    swap: bool = True,
) -> Any:
    """Profile ``model`` on ``inputs`` for :func:`recomp.plan.make_plan`.

    ``inputs``: a tensor, a tuple (positional arguments) or a dict (keyword arguments).
    ``loss_fn(output)``: the loss (default: the ``loss`` of a Hugging Face ``ModelOutput``
    or mapping, which the model computes when given ``labels``, else the mean square of
    the output).
    ``layers``: the checkpointable layers (default ``model.layers``; a predicate or a list
    of sub-module paths). ``exclude``: predicate choosing candidate regions inside each
    layer (default: the layer's direct children that hold parameters).
    ``steps``: timed steps without checkpointing, after one warm-up step.
    ``clock``: ``"wall"`` (``time.perf_counter``, after a device synchronization) or
    ``"cpu"`` (the process's CPU time: steadier on a shared CPU machine, and equal to wall
    time for one intra-op thread on an idle one; not for GPUs).
    ``optimizer``: a factory ``optimizer(parameters)`` (say ``lambda ps:
    torch.optim.AdamW(ps)``), so that the timed steps include the update as training does.
    ``exclude_collectives``: what the plan's checkpoints will be given (as
    ``checkpoint_wrapper``'s option of that name; ``apply_plan`` passes it on). True:
    a checkpointed option also keeps the results of the collectives its replay would
    reach (DTensor's all-gathers and reduce-scatters, ...), and does not replay them;
    False: every checkpoint runs them again; ``"per-layer"`` (the default): where the
    layers issue collectives, each checkpoint option (``full``, ``exclude:...``) is
    offered both ways, the second as ``full+replay-collectives`` (``...+exclude:...``),
    whose kept bytes leave out the collectives' results and whose replay time counts
    the collectives run again: the plan chooses per layer.
    Collectives run only under a process group: in a distributed job call ``profile`` on
    every rank, where the model runs parallelised; each rank profiles its own share.
    ``swap``: offer the options that hold activations on the host (``offload``,
    ``exclude-offload:...``, ``full+swap-inputs``, ``swap``) where the device has a host
    link: on CUDA, whose host bandwidth one timed pinned copy each way measures; on the
    CPU there is no host to swap to and the profile notes it. False: never.

    The model is not changed: the profile runs on a deep copy, and the random number
    generators are restored afterwards.

    Given ``torch.compile(model)``, the profile is a compiled one
    (:class:`recomp.plan.compiled.CompiledProfile`): what PyTorch's partitioner keeps at
    each memory budget, for the wrapper's backend (or ``backend``: ``"inductor"`` or
    ``"aot_eager"``); ``keep`` then chooses sub-modules of the layers to keep whole
    (never recomputed), and ``exclude``, ``steps``, ``clock`` and ``optimizer`` do not
    apply. For the eager plan of a compiled model, profile the module itself.
    """
    if _compat.compiled_original(model) is not None:
        if exclude is not None or optimizer is not None:
            raise ValueError(
                "exclude= and optimizer= are for eager profiles; a compiled model's plan leaves "
                "the choice to PyTorch's partitioner: pass keep= for regions to keep whole, or "
                "profile the module itself (not torch.compile(module)) for an eager plan"
            )
        from .compiled import profile_compiled

        return profile_compiled(model, inputs, loss_fn, layers=layers, keep=keep, backend=backend)
    if keep is not None or backend is not None:
        raise ValueError(
            "keep= and backend= are for compiled models (profile(torch.compile(model), ...)); "
            "an eager profile offers exclusions itself (exclude= chooses the candidates)"
        )
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if not isinstance(swap, bool):
        raise ValueError(f"swap must be True or False, got {swap!r}")
    check_exclude_collectives(exclude_collectives)
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}
    if clock not in clocks:
        raise ValueError(f"clock is 'wall' or 'cpu', got {clock!r}")
    loss_fn = loss_fn or default_loss
    rng = BACKEND.get_rng_state()
    trackers = capture_tracker_states()  # Megatron's tracker is global: not in the copy
    try:
        prof = _profile(
            copy.deepcopy(model),
            inputs,
            loss_fn,
            layers,
            exclude,
            steps,
            clocks[clock],
            optimizer,
            exclude_collectives,
            swap,
        )
    finally:
        BACKEND.set_rng_state(rng)
        if trackers is not None:
            trackers.restore()
    return prof


def _profile(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    layer_spec: LayerSpec,
    exclude: Callable[[nn.Module], bool] | None,
    steps: int,
    clock: Callable[[], float],
    optimizer: Callable[[list[nn.Parameter]], Any] | None,
    exclude_collectives: bool | str = PER_LAYER,
    swap: bool = True,
) -> Profile:
    """The profile of ``model`` (the caller's copy, which this trains)."""
    device = _device_of(model, inputs)
    host_bandwidth, swap_note = host_link(device) if swap else (None, "")
    layers = find_layers(model, layer_spec)
    candidates = [find_candidates(layer, exclude) for _, layer in layers]
    inputs = fresh_inputs(inputs)
    model.zero_grad(set_to_none=True)

    def forward() -> torch.Tensor:
        return loss_fn(call_model(model, inputs))

    # 1. Baseline step time, and forward times of layers and candidate regions.
    baseline = _time_steps(model, forward, optimizer, layers, candidates, device, steps, clock)
    # 2. One instrumented forward, its ops then timed again over ``steps`` forwards.
    recording = record_forward(model, inputs, forward, layers, candidates, clock)
    retime_ops(recording.recorder, forward, steps, clock)
    average_alike_layers(layers, candidates, recording.recorder.layers, baseline.forward_s)
    overheads = Overheads.measure(device, clock)
    # 3. What every option keeps and replays, each storage counted once.
    prof = build_profile(
        layers,
        candidates,
        recording,
        baseline,
        overheads,
        device,
        exclude_collectives,
        [swap_note] if swap_note else None,
        host_bandwidth=host_bandwidth,
    )
    del recording
    gc.collect()
    return prof


# One timed copy each way of this many bytes measures the host link.
HOST_COPY_BYTES = 64 << 20


def host_link(device: torch.device) -> tuple[float | None, str]:
    """The bytes/s one direction of ``device``'s link to the host carries (the slower of
    one timed pinned copy each way, after a warm-up copy), or None where the device has
    none to swap over; and a note for the profile."""
    if device.type != "cuda":
        return None, (
            f"no swap options: the {device.type} device has no host link to swap over "
            "(its activations already live in host memory)"
        )
    host = torch.empty(HOST_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(HOST_COPY_BYTES, dtype=torch.uint8, device=device)
    seconds = []
    with torch.cuda.device(device):
        for target, source in ((host, on_device), (on_device, host), (host, on_device)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
    bandwidth = HOST_COPY_BYTES / max(seconds[1:])
    del host, on_device
    return bandwidth, (
        f"swap options: host link measured at {bandwidth / 1e9:.1f} GB/s per direction "
        f"(one pinned copy of {HOST_COPY_BYTES >> 20} MiB each way)"
    )


@dataclass
class Recording:
    """One instrumented forward: its record, its loss (alive, so that no storage of the
    record is freed and its address reused), the storages that existed before it
    (parameters, buffers, inputs) and those kept outside the layers whatever the plan."""

    recorder: Recorder
    loss: torch.Tensor
    preexisting: set[Hashable]
    outside: dict[Hashable, int]
    parameters: set[Hashable] = field(default_factory=set)  # the parameters' storages
    # The model's outputs the caller holds until the backward and nothing saved (the
    # logits beside the loss): (storage, bytes).
    held_outputs: dict[Hashable, int] = field(default_factory=dict)


def record_forward(
    model: nn.Module,
    inputs: Any,
    forward: Callable[[], torch.Tensor],
    layers: list[tuple[str, nn.Module]],
    candidates: list[list[tuple[str, nn.Module]]],
    clock: Callable[[], float],
    cost: OpCost | None = None,
) -> Recording:
    """Run ``forward`` (the model on ``inputs`` and the loss) once under the recorder:
    the one record every count of a profile comes from, measured (``profile``) or
    simulated on fake tensors (``simulate``, whose ``cost`` gives the ops' seconds)."""
    preexisting = _storages_before_the_forward(model, inputs)
    outputs: list[torch.Tensor] = []
    handle = model.register_forward_hook(
        lambda module, args, out: outputs.extend(tensors_of(out)), always_call=True
    )
    try:
        recorder, loss = _record_forward(forward, layers, candidates, clock, cost)
    finally:
        handle.remove()
    outside = _kept_outside_layers(recorder, loss, preexisting)
    parameters = {
        found[0] for p in model.parameters() if (found := storage_of(p)) is not None
    }
    saved = {s.key for record in recorder.layers for s in record.saves}
    held: dict[Hashable, int] = {}
    for t in outputs:
        found = storage_of(t)
        if (
            found is not None
            and t.is_floating_point()
            and found[0] not in outside
            and found[0] not in preexisting
            and found[0] not in saved
        ):
            held[found[0]] = found[1]
    recorder.pinned.extend(outputs)
    return Recording(recorder, loss, preexisting, outside, parameters, held)


def build_profile(
    layers: list[tuple[str, nn.Module]],
    candidates: list[list[tuple[str, nn.Module]]],
    recording: Recording,
    times: StepTimes,
    overheads: Overheads,
    device: torch.device,
    exclude_collectives: bool | str,
    notes: list[str] | None = None,
    timing: str = "",
    host_bandwidth: float | None = None,
    partition: tuple[int, float] | None = None,
) -> Profile:
    """The profile from one recorded forward: what every option of every layer keeps
    and replays, each storage counted once, with the times in ``times``. After those
    options, where they apply: with ``partition`` (the tensor-parallel group's size and
    the link's bytes/s each way) ``full+partition-inputs``; with ``host_bandwidth``
    (bytes/s each way between the device and the host) ``offload``, the
    ``exclude-offload:...`` options and the swap options (``full+swap-inputs``,
    ``swap``)."""
    recorder = recording.recorder
    keep = exclude_collectives is not False
    analysed = [
        [
            analyse_option(
                record, candidates[index], excluded, recording.preexisting, selective, keep
            )
            for excluded, selective in layer_option_sets(len(candidates[index]))
        ]
        for index, record in enumerate(recorder.layers)
    ]
    for options, record in zip(analysed, recorder.layers):
        full = options[OptionSlot.FULL]
        more: list[OptionAnalysis | None] = []
        if partition is not None:
            more.append(analyse_partition(record, full, partition[0]))
        if host_bandwidth is not None:
            full_swap_inputs, swap, *offload = analyse_swap_options(
                record, full, recording.preexisting, recording.parameters, OFFLOAD_MIN_BYTES
            )
            more.extend(offload)
            more.extend(
                analyse_region_offload(record, o, OFFLOAD_MIN_BYTES)
                for o in options
                if o.name.startswith(EXCLUDE_PREFIX)
            )
            more.extend([full_swap_inputs, swap])
        options.extend(o for o in more if o is not None)
    if exclude_collectives == PER_LAYER and _collectives(recorder.layers):
        # The same checkpoints with their collectives run again in the replay.
        for index, (options, record) in enumerate(zip(analysed, recorder.layers)):
            for excluded, selective in layer_option_sets(len(candidates[index])):
                if excluded is None or selective:
                    continue
                replayed = analyse_option(
                    record, candidates[index], excluded, recording.preexisting, False, False
                )
                replayed.name = replay_collectives_option(replayed.name)
                options.append(replayed)
    kept_sets = [[o.kept for o in options] for options in analysed]
    private, pairs, shared, spread = split_storages(kept_sets, recording.outside)
    own = private_keys(kept_sets, recording.outside)
    layer_profiles = [
        LayerProfile(
            path=path,
            type=type(layer).__name__,
            forward_s=times.forward_s[path],
            forward_flops=sum(op.flops for op in record.ops),
            no_checkpoint_bytes=sum(analysed[index][OptionSlot.NONE].kept.values()),
            checkpoint_input_bytes=sum(analysed[index][OptionSlot.FULL].kept.values()),
            regions=_region_profiles(path, record, candidates[index], analysed[index], times),
            options=_option_profiles(
                analysed[index],
                private[index],
                _replay_scale(record, times.forward_s[path]),
                overheads,
                _gathers(partition),
                [_swappable(record, o, own[index]) for o in analysed[index]],
            ),
            pair_bytes=[[a, b, n] for (a, b), n in sorted(pairs[index].items()) if n],
        )
        for index, ((path, layer), record) in enumerate(zip(layers, recorder.layers))
    ]
    all_notes = _notes(recorder.layers, spread, exclude_collectives) + list(notes or [])
    before, after = _outside_before_and_after(recording)
    prof = Profile(
        device=str(device),
        baseline_step_s=times.step_s,
        shared_bytes=shared,
        layers=layer_profiles,
        spread_bytes=spread,
        bookkeeping_bytes=overheads.bookkeeping_bytes,
        per_save_s=overheads.per_save_s,
        per_policy_op_s=overheads.per_policy_op_s,
        notes=all_notes,
        exclude_collectives=exclude_collectives,
        timing=timing,
        before_layers_bytes=before,
        after_layers_bytes=after,
        loss_backward_bytes=_loss_backward_bytes(recording),
        host_bandwidth=host_bandwidth,
    )
    prof.retime_host_copies()
    return prof


def _outside_before_and_after(recording: Recording) -> tuple[int, int]:
    """The bytes kept outside the layers, split: saved only before the first layer
    starts (the embeddings' part, the first pipeline stage's) and the rest, saved after
    the last layer (the head, the loss: the last stage's)."""
    records = [r for r in recording.recorder.layers if r.start >= 0]
    first = min((r.start for r in records), default=0)
    late = {s.key for s in recording.recorder.outside.saves if s.seq > first}
    for t in tensors_of(recording.loss):
        found = storage_of(t)
        if found is not None:
            late.add(found[0])
    before = sum(n for key, n in recording.outside.items() if key not in late)
    return before, sum(recording.outside.values()) - before


def _loss_backward_bytes(recording: Recording) -> int:
    """What the loss's backward holds beyond the saved tensors: the outputs the caller
    holds (the logits beside the loss) and, of the ops after the last layer, the most
    gradient bytes one op's backward holds at once (its output's and its inputs'
    gradients; parameters' gradients are the optimizer's: not counted). For a
    cross-entropy over a vocabulary: two fp32 logits-sized tensors."""
    last = max((r.end for r in recording.recorder.layers), default=0)
    skip = recording.parameters | recording.preexisting
    gradients = 0
    for op in recording.recorder.outside.ops:
        if op.seq <= last:
            continue
        inputs = {key: n for key, n in op.float_inputs if key not in skip}
        gradients = max(gradients, op.float_output_bytes + sum(inputs.values()))
    return sum(recording.held_outputs.values()) + gradients


def _device_of(model: nn.Module, inputs: Any) -> torch.device:
    for p in model.parameters():
        return p.device
    tensors = tensors_of(inputs)
    return tensors[0].device if tensors else torch.device("cpu")


# --------------------------------------------------------------------------- the steps


@dataclass
class StepTimes:
    """The training step without checkpointing, timed (or modelled)."""

    step_s: float  # median step time (forward, loss, backward, update)
    forward_s: dict[str, float]  # median forward time per step, per layer and region path


def _time_steps(
    model: nn.Module,
    forward: Callable[[], torch.Tensor],
    optimizer: Callable[[list[nn.Parameter]], Any] | None,
    layers: list[tuple[str, nn.Module]],
    candidates: list[list[tuple[str, nn.Module]]],
    device: torch.device,
    steps: int,
    clock: Callable[[], float],
) -> StepTimes:
    """A warm-up step and ``steps`` timed ones, with the layers' and candidate regions'
    forward times (module hooks)."""
    update = optimizer([p for p in model.parameters() if p.requires_grad]) if optimizer else None

    def step() -> None:
        forward().backward()
        if update is not None:
            update.step()
            update.zero_grad(set_to_none=False)

    timer = ModuleTimer(device, clock)
    for path, layer in layers:
        timer.track(path, layer)
    for (path, _), regions in zip(layers, candidates):
        for name, region in regions:
            timer.track(f"{path}.{name}", region)
    step_times: list[float] = []
    forward_times: dict[str, list[float]] = {k: [] for k in timer.times}
    try:
        for i in range(steps + 1):
            for samples in timer.times.values():
                samples.clear()
            sync(device)
            start = clock()
            step()
            sync(device)
            if i > 0:  # the first step is a warm-up
                step_times.append(clock() - start)
                for k, v in timer.times.items():
                    forward_times[k].append(sum(v))
    finally:
        timer.remove()
    return StepTimes(
        step_s=statistics.median(step_times),
        forward_s={k: statistics.median(v) if v else 0.0 for k, v in forward_times.items()},
    )


def _storages_before_the_forward(model: nn.Module, inputs: Any) -> set[Hashable]:
    """The storages of the parameters, buffers and inputs: not activations."""
    return {
        found[0]
        for t in itertools.chain(model.parameters(), model.buffers(), tensors_of(inputs))
        if (found := storage_of(t)) is not None
    }


def _record_forward(
    forward: Callable[[], torch.Tensor],
    layers: list[tuple[str, nn.Module]],
    candidates: list[list[tuple[str, nn.Module]]],
    clock: Callable[[], float],
    cost: OpCost | None = None,
) -> tuple[Recorder, torch.Tensor]:
    """One forward (and loss) under the recorder; its record and the loss."""
    recorder = Recorder(clock, cost)
    handles = recorder.attach(layers, candidates)
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), recorder:
            loss = forward()
    finally:
        for handle in handles:
            handle.remove()
    for index, (path, _) in enumerate(layers):
        if recorder.layers[index].calls_seen == 0:
            raise ValueError(f"layer {path!r} was not called in the forward")
    return recorder, loss


def _kept_outside_layers(
    recorder: Recorder, loss: torch.Tensor, preexisting: set[Hashable]
) -> dict[Hashable, int]:
    """Activation storages kept whatever the plan: saved outside the layers, and the loss."""
    outside = {s.key: s.nbytes for s in recorder.outside.saves if not s.is_parameter}
    for t in tensors_of(loss):
        found = storage_of(t)
        if found is not None:
            outside[found[0]] = found[1]
    return {k: n for k, n in outside.items() if k not in preexisting}


@dataclass
class Overheads:
    """What a checkpoint costs besides the memory it keeps and the ops it replays."""

    bookkeeping_bytes: int  # per checkpoint and per excluded call: a saved CPU RNG state
    per_save_s: float  # CPU time per saved tensor through its Python hooks
    per_policy_op_s: float  # CPU time per op through a selective policy's dispatch modes

    @staticmethod
    def measure(device: torch.device, clock: Callable[[], float]) -> Overheads:
        # On a GPU the hooks' CPU time overlaps with the kernels: not added there.
        if device.type != "cpu":
            return Overheads(bookkeeping_bytes(device), 0.0, 0.0)
        per_save, per_policy_op = checkpoint_overheads(clock)
        return Overheads(bookkeeping_bytes(device), per_save, per_policy_op)


def bookkeeping_bytes(device: torch.device) -> int:
    """The bytes of ``device``'s memory a checkpoint (and an excluded call) keeps for its
    replay besides tensors: the CPU random-number state it saves, which lies in the
    device's memory only when the device is the CPU (a GPU's own state is saved on the
    CPU as well)."""
    if device.type != "cpu":
        return 0
    with _compat.no_dispatch_modes():
        return int(torch.get_rng_state().nbytes)


def _replay_scale(record: LayerRecord, forward_s: float) -> float:
    """Seconds of the layer's measured forward per second of its recorded ops: the
    replay's time is its ops' share of the forward time."""
    op_seconds = sum(op.seconds for op in record.ops)
    return forward_s / op_seconds if op_seconds > 0 else 0.0


def _region_profiles(
    path: str,
    record: LayerRecord,
    candidates: list[tuple[str, nn.Module]],
    options: list[OptionAnalysis],
    baseline: StepTimes,
) -> list[RegionProfile]:
    """The candidate regions of the layer at ``path``, each with what excluding it alone
    keeps."""
    by_name = {o.name: o for o in options}
    profiles = []
    for c, (name, region) in enumerate(candidates):
        ops = [
            op for op in record.ops if op.span is not None and record.spans[op.span].candidate == c
        ]
        alone = by_name[exclude_option([name])]
        profiles.append(
            RegionProfile(
                path=name,
                type=type(region).__name__,
                calls=sum(1 for span in record.spans if span.candidate == c),
                forward_s=baseline.forward_s[f"{path}.{name}"],
                forward_flops=sum(op.flops for op in ops),
                exclusion_bytes=alone.region_saved_bytes.get(name, 0),
            )
        )
    return profiles


def _gathers(partition: tuple[int, float] | None) -> Callable[[list[int]], float] | None:
    """Seconds the replay of a partitioned checkpoint waits for its all-gathers: per
    input, what one rank sends to gather ``size`` slices of that many bytes
    (``recomp.plan.cost.sent_bytes``) over the link; not overlapped (the replay reads
    the input first)."""
    if partition is None:
        return None
    size, link_bandwidth = partition

    def seconds(slices: list[int]) -> float:
        return sum(sent_bytes("gather", size, n, n * size) for n in slices) / link_bandwidth

    return seconds


def _option_profiles(
    options: list[OptionAnalysis],
    private: list[int],
    scale: float,
    overheads: Overheads,
    gather: Callable[[list[int]], float] | None = None,
    swappable: list[list[list[int]]] | None = None,
) -> list[OptionProfile]:
    """The layer's options with their bytes (``private``: the layer's own share of what
    each keeps) and replay costs (``scale``: seconds of forward per recorded op second;
    ``gather``: the seconds of the all-gathers of a partitioned checkpoint's inputs;
    ``swappable``: per option, what pipeline swap may move of its own bytes).
    The host copies' seconds are added once the layers are known
    (``Profile.retime_host_copies``)."""
    profiles = []
    for o, result in enumerate(options):
        checkpoints = 1 if checkpointed(result.name) else 0
        gather_s = gather(result.gathered) if gather is not None and result.gathered else 0.0
        profiles.append(
            OptionProfile(
                name=result.name,
                kept_bytes=private[o]
                + overheads.bookkeeping_bytes * (checkpoints + result.excluded_calls),
                replay_s=scale * sum(op.seconds for op in result.replay_ops)
                + overheads.per_save_s * result.hooked_saves
                + overheads.per_policy_op_s * result.policy_ops
                + gather_s,
                replay_flops=sum(op.flops for op in result.replay_ops),
                region_saved_bytes=result.region_saved_bytes,
                collective_bytes=result.collective_bytes,
                swap_bytes=result.swap_bytes,
                host_bytes=result.host_bytes,
                gather_bytes=sum(result.gathered),
                gather_s=gather_s,
                swappable=None if swappable is None else swappable[o],
            )
        )
    return profiles


def _swappable(record: LayerRecord, option: OptionAnalysis, own: set[Hashable]) -> list[list[int]]:
    """What pipeline swap may move of ``option``'s own bytes
    (``_analysis.swappable_storages``): nothing of an option that keeps activations its
    own way (on the host: the swap and offload options; split over the tensor-parallel
    ranks: ``full+partition-inputs``), whose hooks or placement come first."""
    if moves_to_host(option.name) or option.name == PARTITION_INPUTS:
        return []
    return swappable_storages(record, option, own)


def check_exclude_collectives(value: Any) -> None:
    """``exclude_collectives`` of a profile: True, False or ``"per-layer"``."""
    if not (isinstance(value, bool) or value == PER_LAYER):
        raise ValueError(
            f"exclude_collectives must be True, False or {PER_LAYER!r} (the plan chooses per "
            f"layer), got {value!r}"
        )


def _collectives(records: list[LayerRecord]) -> int:
    """The collectives the layers' forward issued."""
    return sum(1 for record in records for op in record.ops if op.collective is not None)


def _notes(records: list[LayerRecord], spread: int, exclude_collectives: bool | str) -> list[str]:
    """What the profile's reader should know: collectives in the layers, storages that
    count as shared because layers further apart keep them."""
    notes = []
    collectives = _collectives(records)
    if collectives:
        done = {
            True: "keeps the results of those its replay reaches (in the kept bytes) and "
            "does not run them again",
            False: "made with exclude_collectives=False runs them again in its replay",
            PER_LAYER: "keeps the results of those its replay reaches (in the kept bytes), "
            "or runs them again (the +replay-collectives options): the plan chooses per "
            "layer, the time of the collectives run again against the bytes kept",
        }[exclude_collectives]
        notes.append(f"the layers' forward issued {collectives} collective(s): a checkpoint {done}")
    if spread:
        notes.append(
            f"{spread} bytes are kept by several non-adjacent layers (inputs every layer "
            "receives, say) and are counted as shared whatever the plan"
        )
    return notes
