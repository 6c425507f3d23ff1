"""Simulate the planner's profile of a model at full size, without its memory or devices.

``simulate(build, inputs, ...)`` builds the model and runs one forward under PyTorch's
``FakeTensorMode``: tensors have shapes, dtypes, a device (the faked target, ``"cuda"``
by default) and storages, but no data, so nothing is allocated and no kernel runs. With
``world_size`` above 1 a fake process group of that many ranks is the default group for
the time of the call and ``build(mesh)`` gets a ``DeviceMesh`` over it: the model is
parallelised by the user's own plan (DTensor, ...), this process plays rank 0, and
every collective returns tensors of the right shape without communicating.

The forward is recorded by the same code as ``profile()``'s
(``profiler.record_forward``) and the profile is built from the record by the same code
(``profiler.build_profile``): saved bytes per storage, inputs a checkpoint keeps,
excluded regions' saved tensors and outputs, kept collective results, replay FLOPs and
the random-number state a checkpoint keeps are counted exactly as a measured profile
counts them on the target device. Bytes follow the target's kernels: run on fake
``"cuda"`` tensors, the ops save what CUDA's kernels save (``dropout`` keeps a 1-byte
mask there, and its input's dtype on the CPU).

Times are not measured: with ``hardware`` each op's time is a roofline of the named or
given accelerator (``recomp.plan.cost``) and the step without checkpointing is the
forward's and backward's ops added up; without it every time is zero and the plan is
decided by replay FLOPs. ``Profile.timing`` says which.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..torch import _compat
from ._layers import LayerSpec, find_layers
from ._options import find_candidates
from ._recording import (
    RecordedOp,
    Recorder,
    is_wrapper_subclass,
    local_tensor,
    op_flops,
    run_timed,
)
from .cost import Hardware, OpCostModel, resolve_hardware
from .modelcall import call_model, default_loss, fresh_inputs
from .planfile import PER_LAYER
from .planner import Profile
from .profiler import (
    Overheads,
    StepTimes,
    bookkeeping_bytes,
    build_profile,
    check_exclude_collectives,
    record_forward,
)

__all__ = ["simulate"]

# Where the backward cannot run on fake tensors, its time: this many forwards (a matrix
# product's backward computes two products of its size: the input's and the weight's
# gradients).
BACKWARD_PER_FORWARD = 2.0

NO_HARDWARE = (
    "no hardware given: every time is zero (nothing is measured on fake tensors); plans "
    "are decided by replay FLOPs, then bytes"
)


def simulate(
    build: Callable[[Any], nn.Module],
    inputs: Callable[[Any], Any],
    *,
    world_size: int = 1,
    device: str | torch.device = "cuda",
    dtype: torch.dtype | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    layers: LayerSpec = None,
    exclude: Callable[[nn.Module], bool] | None = None,
    exclude_collectives: bool | str = PER_LAYER,
    hardware: str | dict[str, Any] | Hardware | None = None,
    swap: bool = True,
    partition_inputs: int | None = None,
) -> Profile:
    """The profile ``profile()`` would measure on one rank of the target, simulated on
    fake tensors (see the module docstring); give it to ``make_plan``.

    ``build(mesh)``: builds the model (called under the fake mode, with ``device`` as
    the default device and ``dtype``, if given, as the default floating dtype); ``mesh``
    is a 1-D ``DeviceMesh`` of ``world_size`` ranks over a fake process group, or None at
    world size 1. A model parallelised with DTensor needs ``src_data_rank=None`` in
    ``parallelize_module`` (the default broadcast of the weights asks the device).
    ``inputs(mesh)``: this rank's (rank 0's) inputs, as ``profile()`` takes them.
    ``loss_fn``, ``layers``, ``exclude`` and ``exclude_collectives``: as for
    ``profile()``. ``hardware``: the accelerator the times are modelled for, a name
    (``recomp.plan.cost.ACCELERATORS``: "H100 SXM", "H200", "B200", "A100 80GB",
    "MI300X", "Ascend 910B"), a table (a dict, a ``Hardware``, or the path of a JSON
    file with the same keys), or None: times zero. ``swap``: offer the options that hold
    activations on the host (``offload``, ``exclude-offload:...``, ``full+swap-inputs``,
    ``swap``) where the hardware has a ``host_bandwidth``; False: never.
    ``partition_inputs``: the size of the tensor-parallel group, over whose ranks each
    layer's inputs are the same tensor (no sequence parallelism), to offer
    ``full+partition-inputs`` (a checkpoint keeping its inputs split over that group,
    ``checkpoint(..., partition_inputs=group)``), priced with the hardware's
    ``link_bandwidth``; None (the default) or 1: not offered.

    No process group, mode or default is left behind, errors included. Refused: a
    process group already initialised in this process when ``world_size`` is above 1.
    """
    unsupported = _compat.simulation_unsupported()
    if unsupported is not None:
        raise RuntimeError(unsupported)
    target = _check_arguments(build, inputs, world_size, device, dtype, loss_fn)
    check_exclude_collectives(exclude_collectives)
    if not isinstance(swap, bool):
        raise ValueError(f"swap must be True or False, got {swap!r}")
    if partition_inputs is not None and (
        isinstance(partition_inputs, bool)
        or not isinstance(partition_inputs, int)
        or not 1 <= partition_inputs <= world_size
    ):
        raise ValueError(
            f"partition_inputs is the tensor-parallel group's size, an integer from 1 to "
            f"world_size={world_size}, or None, got {partition_inputs!r}"
        )
    spec = None if hardware is None else resolve_hardware(hardware)
    if world_size > 1:
        import torch.distributed as dist

        if not dist.is_available():
            raise RuntimeError("simulate(world_size > 1) needs torch.distributed")
        if dist.is_initialized():
            raise RuntimeError(
                "a process group is already initialised in this process; simulate() makes "
                "its own fake one of world_size ranks: call it where torch.distributed is "
                "not set up (or with world_size=1)"
            )
    rng = torch.get_rng_state()
    try:
        with contextlib.ExitStack() as stack:
            mesh = None
            if world_size > 1:
                from torch.distributed.device_mesh import init_device_mesh

                stack.enter_context(_compat.fake_process_group(world_size))
                mesh = init_device_mesh(target.type, (world_size,))
            stack.enter_context(_default_dtype(dtype))
            stack.enter_context(_compat.fake_tensor_mode())
            stack.enter_context(target)
            stack.enter_context(_compat.target_attention_kernels(target))
            stack.enter_context(_compat.dtensor_meta_as_on_device())
            model = build(mesh)
            _check_model(model)
            # transformers is imported by now where the model is one of its.
            stack.enter_context(_compat.hf_causal_mask_as_on_device())
            stack.enter_context(_compat.hf_grouped_mm_as_on_device())
            x = inputs(mesh)
            return _simulate(
                model,
                x,
                loss_fn or default_loss,
                layers,
                exclude,
                exclude_collectives,
                target,
                spec,
                world_size,
                swap,
                partition_inputs or 1,
            )
    finally:
        torch.set_rng_state(rng)


def _check_arguments(
    build: Any, inputs: Any, world_size: Any, device: Any, dtype: Any, loss_fn: Any
) -> torch.device:
    if not callable(build):
        raise TypeError(f"build must be a function build(mesh) -> nn.Module, got {build!r}")
    if not callable(inputs):
        raise TypeError(
            f"inputs must be a function inputs(mesh) returning the model's inputs, got {inputs!r}"
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer of at least 1, got {world_size!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function of the model's output, got {loss_fn!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device: {exc}") from exc
    if target.type == "meta":
        raise ValueError("device 'meta' keeps no storages to count: give the target's device")
    return target


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"build(mesh) must return an nn.Module, got {type(model).__name__}")
    if _compat.compiled_original(model) is not None:
        raise ValueError(
            "simulate plans eager models: have build return the module, not torch.compile(module)"
        )
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        local = local_tensor(t)
        if not _compat.is_fake(t if local is None else local):
            raise ValueError(
                f"{name} holds real memory: build(mesh) must create the model (it runs under "
                "fake tensors), not return one made before"
            )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _simulate(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    layer_spec: LayerSpec,
    exclude: Callable[[nn.Module], bool] | None,
    exclude_collectives: bool | str,
    device: torch.device,
    spec: Hardware | None,
    world_size: int,
    swap: bool = True,
    partition_size: int = 1,
) -> Profile:
    layers = find_layers(model, layer_spec)
    candidates = [find_candidates(layer, exclude) for _, layer in layers]
    inputs = fresh_inputs(inputs)

    def forward() -> torch.Tensor:
        return loss_fn(call_model(model, inputs))

    # A warm-up forward, as profile()'s first step: what runs only the first time (DTensor
    # works out each op's sharding once, running ops on fake tensors to do so) is not
    # part of the recorded forward.
    forward()
    costs = None if spec is None else OpCostModel(spec)
    op_cost = costs.op_seconds if costs is not None else _no_time
    recording = record_forward(
        model, inputs, forward, layers, candidates, time.perf_counter, op_cost
    )
    backward_s = 0.0
    backward_note = ""
    if costs is not None:
        if _engine_runs_on(device):
            counter = _BackwardCost(recording.recorder, op_cost)
            with counter:
                recording.loss.backward()
            backward_s = counter.seconds
            backward_note = "; backward: its ops costed"
        else:
            # The autograd engine asks the driver for the device of the gradients: on
            # fake tensors of a device this machine lacks the backward cannot run.
            forward_ops = _every_op(recording.recorder)
            backward_s = BACKWARD_PER_FORWARD * sum(op.seconds for op in forward_ops)
            backward_note = (
                f"; backward: {BACKWARD_PER_FORWARD:g}x the forward (no {device.type} device "
                "here for the autograd engine)"
            )
    times = _modelled_times(layers, candidates, recording.recorder, backward_s)
    notes = [
        f"simulated on fake {device.type} tensors"
        + (f", rank 0 of a fake process group of {world_size}" if world_size > 1 else "")
        + ": bytes and FLOPs are counted as a profile on that device counts them; times "
        + ("come from the cost model" if spec is not None else "are zero")
    ]
    host_bandwidth = spec.host_bandwidth if spec is not None and swap else None
    if swap and host_bandwidth is None:
        notes.append(
            "no swap options: "
            + ("no hardware given" if spec is None else f"{spec.name} has no host_bandwidth")
            + " (the host link's bytes/s per direction, which the swap and offload "
            "options' copies use)"
        )
    partition = None
    if partition_size > 1:
        if spec is None:
            notes.append(
                "no full+partition-inputs: no hardware given (its all-gathers are priced at "
                "the link's bandwidth)"
            )
        else:
            partition = (partition_size, spec.link_bandwidth)
    prof = build_profile(
        layers,
        candidates,
        recording,
        times,
        Overheads(bookkeeping_bytes(device), 0.0, 0.0),
        device,
        exclude_collectives,
        notes,
        timing=NO_HARDWARE if spec is None else spec.describe() + backward_note,
        host_bandwidth=host_bandwidth,
        partition=partition,
    )
    del recording
    return prof


def _engine_runs_on(device: torch.device) -> bool:
    """Whether the autograd engine can run a backward of fake tensors on ``device`` in
    this process (it needs the device's driver, except for the CPU)."""
    if device.type == "cpu":
        return True
    module = getattr(torch, device.type, None)
    available = getattr(module, "is_available", None)
    return bool(available()) if callable(available) else False


def _no_time(func: Any, args: Any, kwargs: Any, out: Any, flops: int) -> float:
    return 0.0


class _BackwardCost(_compat.TorchDispatchMode):
    """The modelled seconds of the backward's ops (decomposed as the recorder does)."""

    def __init__(self, recorder: Recorder, cost: Callable[..., float]) -> None:
        super().__init__()
        self.registry = recorder.registry
        self.clock = time.perf_counter
        self.cost = cost
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if any(is_wrapper_subclass(t) for t in types):
            return NotImplemented
        out, measured = run_timed(self, func, args, kwargs)
        if measured is None:
            return out
        flops = op_flops(self.registry, func, args, kwargs, out)
        self.seconds += self.cost(func, args, kwargs, out, flops)
        return out


def _modelled_times(
    layers: list[tuple[str, nn.Module]],
    candidates: list[list[tuple[str, nn.Module]]],
    recorder: Recorder,
    backward_s: float,
) -> StepTimes:
    """The step's times from the recorded ops' modelled seconds: each layer's and region
    call's forward is the sum of its ops, the step the forward's ops and the backward's."""
    forward_s: dict[str, float] = {}
    for (path, _), names, record in zip(layers, candidates, recorder.layers):
        forward_s[path] = sum(op.seconds for op in record.ops)
        for c, (name, _) in enumerate(names):
            spans = {i for i, span in enumerate(record.spans) if span.candidate == c}
            forward_s[f"{path}.{name}"] = sum(op.seconds for op in record.ops if op.span in spans)
    return StepTimes(
        step_s=sum(op.seconds for op in _every_op(recorder)) + backward_s,
        forward_s=forward_s,
    )


def _every_op(recorder: Recorder) -> list[RecordedOp]:
    return [op for record in [recorder.outside, *recorder.layers] for op in record.ops]
