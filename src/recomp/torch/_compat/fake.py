"""Fake tensors and a fake process group: running a model without memory or peers.

Consumer: the planner's simulation (``recomp.plan.simulate``), which runs the user's
model at full size under ``FakeTensorMode`` (tensors with shapes, dtypes, devices and
storages but no data) and, for several ranks, under torch.distributed's fake process
group (one process plays rank 0 of ``world_size``; collectives return tensors of the
right shapes without communicating). Tested by ``tests/torch/compat/test_fake.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def fake_tensor_mode() -> Any:
    """A new ``FakeTensorMode`` that also takes real tensors created outside it (they
    become fake constants), to enter as a context manager.

    Why: the simulation builds and runs the model with no memory behind its tensors.
    ``torch._subclasses.fake_tensor`` is private (the mode is what ``torch.compile``
    and ``torch.export`` trace with); checked on 2.13.0 and 2.14.1.
    If it changes: ImportError or TypeError here, which ``simulate`` reports; nothing
    else in recomp uses it.
    Retired by: a public fake-tensor mode.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


SIMULATION_MIN_TORCH = (2, 13)


def simulation_unsupported() -> str | None:
    """Why this PyTorch cannot run the planner's simulation, or None where it can.

    Why: the simulation runs fused attention kernels and the fake process group on fake
    CUDA tensors without a driver; on PyTorch 2.9.1 the flash-attention op aborts the
    process there (a C++ abort no Python code can catch), so it is refused up front.
    Checked on 2.13.0 and 2.14.1; 2.10 to 2.12 are not tested and refused.
    If it changes: raise the bound here when an older release is checked.
    Retired by: dropping support for PyTorch before 2.13.
    """
    parts = torch.__version__.split("+")[0].split(".")
    try:
        version = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return None
    if version >= SIMULATION_MIN_TORCH:
        return None
    want = ".".join(map(str, SIMULATION_MIN_TORCH))
    return (
        f"recomp.plan.simulate needs PyTorch {want} or newer (this is {torch.__version__}): "
        "on older releases fused attention on fake CUDA tensors aborts the process. "
        f"Upgrade PyTorch to run the simulation, or plan on the real model with "
        "recomp.plan.profile"
    )


def is_fake(t: Any) -> bool:
    """Whether ``t`` is a fake tensor (a tensor without data)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """The default process group, for the time of the block, is a fake one of
    ``world_size`` ranks in which this process is rank 0; destroyed on leaving (errors
    included), with the DTensor random-number tracker it may have made.

    Why: DTensor and ``DeviceMesh`` need a default group; the fake one answers every
    collective with tensors of the right shape without peers.
    How: importing ``torch.testing._internal.distributed.fake_pg`` registers the
    ``"fake"`` backend (torch 2.14: not registered by ``torch.distributed`` itself);
    ``FakeStore`` is its no-op store. ``torch.distributed.tensor._random._rng_tracker``
    is DTensor's global tracker, made on the first random op on a DTensor: reset so
    that a later real job makes its own.
    If it changes: ImportError here, which ``simulate`` reports for world sizes above 1.
    Retired by: a public fake backend.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already initialised in this process; simulate() makes its "
            "own fake one: call it in a process without torch.distributed set up"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        try:
            dist.destroy_process_group()
        finally:
            reset_dtensor_random()


def reset_dtensor_random() -> None:
    """Drop DTensor's global random-number tracker (see ``fake_process_group``)."""
    try:
        from torch.distributed.tensor import _random
    except ImportError:
        return
    if getattr(_random, "_rng_tracker", None) is not None:
        _random._rng_tracker = None


@contextlib.contextmanager
def target_attention_kernels(device: torch.device) -> Iterator[None]:
    """For the time of the block, ``F.scaled_dot_product_attention`` on fake CUDA tensors
    runs the fused kernel a GPU would choose, where this machine has no GPU.

    Why: PyTorch picks the attention kernel from the device's properties; on fake CUDA
    tensors without a driver ``_fused_sdp_choice`` answers "math", which saves the
    whole attention matrix (in fp32 for half-precision inputs) where a GPU's flash
    kernel saves the output and its log-sum-exp. The simulation must count the
    target's saves.
    How: a ``TorchFunctionMode`` that calls ``aten._scaled_dot_product_flash_attention``
    (half precision, no mask, head size a multiple of 8 up to 256, as on the GPU: the
    first choice there), else ``aten._scaled_dot_product_efficient_attention`` (a mask,
    or fp32), else PyTorch's own path. Both ops have fake implementations and autograd
    formulas: the saved tensors are the kernels' own.
    If it changes: the op call raises and PyTorch's own path runs (the math kernel's
    saves: more bytes than on the GPU).
    Retired by: a way to give fake tensors a device's properties.
    """
    if device.type != "cuda" or torch.cuda.is_available():
        yield
        return
    from torch.overrides import TorchFunctionMode

    sdpa = torch.nn.functional.scaled_dot_product_attention

    class TargetKernels(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func is sdpa:
                out = _cuda_attention(*args, **kwargs)
                if out is not None:
                    return out
            return func(*args, **kwargs)

    with TargetKernels():
        yield


def _cuda_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    """The fused kernel's output, or None to leave the call to PyTorch."""
    tensors = (query, key, value)
    if not all(is_fake(t) and t.device.type == "cuda" and t.dim() == 4 for t in tensors):
        return None
    head = query.shape[-1]
    if key.shape[-1] != head or value.shape[-1] != head or head % 8:
        return None
    grouped = key.shape[1] != query.shape[1]
    if grouped and not enable_gqa:
        return None  # PyTorch raises
    half = query.dtype in (torch.float16, torch.bfloat16)
    same = key.dtype == value.dtype == query.dtype
    try:
        if attn_mask is None and half and same and head <= 256:
            flash = torch.ops.aten._scaled_dot_product_flash_attention
            return flash(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if grouped or not same or query.dtype not in (*(torch.float16, torch.bfloat16), torch.float32):
            return None
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=query.dtype).masked_fill(~bias, float("-inf"))
        efficient = torch.ops.aten._scaled_dot_product_efficient_attention
        out = efficient(query, key, value, bias, query.requires_grad, dropout_p, is_causal, scale=scale)
        return out[0]
    except (RuntimeError, NotImplementedError, TypeError):
        return None


@contextlib.contextmanager
def dtensor_meta_as_on_device() -> Iterator[None]:
    """For the time of the block, DTensor works out the shape of an op's global output
    once per kind of call, as it does on real tensors, where every tensor is fake.

    Why: ``loss_parallel()``'s handlers (the vocabulary-parallel log-softmax and loss)
    ask DTensor for the global output's shape; under a fake mode DTensor takes itself
    to be tracing and runs the op on fake global tensors each time, where a real run
    asks its cache. The simulation would record those runs as ops of the step (a
    full-vocabulary log-softmax the run never computes).
    How: ``ShardingPropagator._propagate_tensor_meta`` answers from
    ``_propagate_tensor_meta_cached``, as on real tensors; restored on leaving. Checked
    on torch 2.14.1.
    If it changes: nothing is patched, and the loss's backward is counted with those
    ops (more bytes than on the device).
    Retired by: DTensor caching its shapes under fake tensors.
    """
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:
        yield
        return
    original = ShardingPropagator.__dict__.get("_propagate_tensor_meta")
    if original is None or not hasattr(ShardingPropagator, "_propagate_tensor_meta_cached"):
        yield
        return

    def cached(self: Any, op_schema: Any) -> Any:
        return self._propagate_tensor_meta_cached(op_schema)

    ShardingPropagator._propagate_tensor_meta = cached  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta = original  # type: ignore[method-assign]


def device_mesh_grid(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """``init_device_mesh(device_type, shape, mesh_dim_names=names)`` over the default
    group, also where tensors are fake (a simulated model's ``build`` runs under the
    fake mode).

    Why: a mesh is made of real rank numbers (its constructor reads them back as
    Python ints), which a fake tensor cannot give. ``torch._subclasses.fake_tensor.
    unset_fake_temporarily`` (private) leaves the fake mode for the time of the call, as
    PyTorch's own tracing does for such metadata; checked on torch 2.14.1.
    If it changes: ImportError, and the mesh is made under the fake mode (which fails
    for a simulated model with context parallelism).
    Retired by: a public way to make a mesh inside a fake mode.
    """
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    with unset_fake_temporarily():
        return init_device_mesh(device_type, shape, mesh_dim_names=names)


def group_size(group_name: str) -> int | None:
    """The number of ranks of the process group a functional collective names, or None.

    Why: functional collectives (``_c10d_functional.all_reduce(input, op, group_name)``)
    name their group by a string; the cost model needs its size (a tensor-parallel
    group inside a larger mesh is smaller than the world).
    How: ``torch.distributed.distributed_c10d._resolve_process_group``, which the
    functional collectives use themselves; checked on 2.13.0 and 2.14.1.
    If it changes: None, and the cost model takes the default group's size.
    Retired by: a public lookup of a group by name.
    """
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return int(_resolve_process_group(group_name).size())  # type: ignore[arg-type]
    except (ImportError, RuntimeError, ValueError, KeyError, AttributeError, TypeError):
        return None


def fake_tensor_type() -> type:
    """The class of fake tensors (for ``isinstance`` checks)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


def is_view_op(func: Any) -> bool:
    """Whether the ATen operator ``func`` returns a view of an input (moves no bytes).

    ``OpOverload.is_view`` reads the schema's alias annotations; where it is missing,
    False (the op is then costed as moving its inputs and outputs).
    """
    return bool(getattr(func, "is_view", False))


__all__ = [
    "SIMULATION_MIN_TORCH",
    "fake_process_group",
    "fake_tensor_mode",
    "fake_tensor_type",
    "group_size",
    "is_fake",
    "is_view_op",
    "reset_dtensor_random",
    "simulation_unsupported",
    "target_attention_kernels",
]
