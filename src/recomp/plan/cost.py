"""A cost model of the target accelerator: the times of a simulated profile.

``simulate(..., hardware=...)`` runs the model on fake tensors, where nothing can be
timed; each op's time then comes from this module, as a roofline:

* a compute or memory op: ``max(FLOPs / peak FLOP/s, bytes moved / memory bandwidth)``,
  with FLOPs by ``torch.utils.flop_counter``'s formulas (matrix products, convolutions,
  attention; every other op counts none) and the peak of the op's dtype; bytes moved are
  the bytes of the op's tensor inputs read and outputs written (a view, an alias and a
  query such as a tensor's device move none);
* a collective: the bytes a rank sends over its link, at the link's bandwidth per
  direction: ``(n - 1) / n`` of the gathered (all-gather) or scattered (reduce-scatter)
  tensor or of the exchanged one (all-to-all), twice that for an all-reduce (reduce-
  scatter then all-gather), the whole tensor for a broadcast or point-to-point send;
  waiting on a collective costs nothing more.

What it leaves out, so that its times are a lower bound of a real step: kernel launch
and framework overheads, achieved against peak throughput (large matrix products reach
60 to 80 % of it on these parts), caches (an op whose inputs stay in L2 moves less),
overlap of communication with compute, and fused kernels (each ATen op is costed alone).
The optimizer's update is not part of the step either.

The named accelerators (``ACCELERATORS``) carry the dense (not 2:4 sparse) peak figures
of their makers' public data sheets, each cited next to its numbers; ``Hardware`` or a
dict (or a JSON file) with the same keys describes any other.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ACCELERATORS", "Hardware", "OpCostModel", "resolve_hardware"]

T = 1e12
G = 1e9


@dataclass(frozen=True)
class Hardware:
    """One accelerator, as the cost model sees it.

    ``peak_flops``: dense peak FLOP/s per dtype name (``"bfloat16"``, ``"float16"``,
    ``"float32"``, ``"float8"``, ``"float64"``); a dtype without an entry takes
    ``"float32"``'s, or where that is missing too the lowest given (a lower bound). ``float32`` is the plain FP32 rate: PyTorch does not use TF32 for
    matrix products unless told (``torch.backends.cuda.matmul.allow_tf32``); give the
    TF32 rate as ``"float32"`` to model that. ``memory_bandwidth``: bytes/s of the
    device memory. ``link_bandwidth``: bytes/s one device sends to its peers (one
    direction) inside a node. ``host_bandwidth``: bytes/s between the device and the
    host's memory (one direction; the PCIe link), or None where the device has no host
    link to swap activations over: the planner offers its swap options only with it.
    ``source``: where the figures come from."""

    name: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    link_bandwidth: float
    source: str = ""
    memory_bytes: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    host_bandwidth: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("hardware needs a name")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise ValueError(f"hardware {self.name!r}: peak_flops must map dtype names to FLOP/s")
        for key, value in {
            **{f"peak_flops[{k!r}]": v for k, v in self.peak_flops.items()},
            "memory_bandwidth": self.memory_bandwidth,
            "link_bandwidth": self.link_bandwidth,
            **({} if self.host_bandwidth is None else {"host_bandwidth": self.host_bandwidth}),
        }.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"hardware {self.name!r}: {key} must be a positive number")

    def peak(self, dtype: str) -> float:
        if dtype in self.peak_flops:
            return float(self.peak_flops[dtype])
        if "float32" in self.peak_flops:
            return float(self.peak_flops["float32"])
        return float(min(self.peak_flops.values()))

    def describe(self) -> str:
        """One line: the figures the modelled times rest on."""
        flops = ", ".join(f"{k} {v / T:g} TFLOP/s" for k, v in self.peak_flops.items())
        text = (
            f"roofline of {self.name} ({flops} dense; memory {self.memory_bandwidth / T:g} "
            f"TB/s; link {self.link_bandwidth / G:g} GB/s per direction"
            + (
                ""
                if self.host_bandwidth is None
                else f"; host {self.host_bandwidth / G:g} GB/s per direction"
            )
            + ")"
        )
        if self.source:
            text += f", from {self.source}"
        return text + "; lower bounds: no launch overheads, peak throughput, no overlap"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Hardware:
        known = {"name", "peak_flops", "memory_bandwidth", "link_bandwidth", "source",
                 "memory_bytes", "notes", "host_bandwidth"}  # fmt: skip
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"hardware table: unknown keys {sorted(unknown)} (known: {sorted(known)})"
            )
        missing = {"name", "peak_flops", "memory_bandwidth", "link_bandwidth"} - set(data)
        if missing:
            raise ValueError(f"hardware table: missing keys {sorted(missing)}")
        values = dict(data)
        values["peak_flops"] = dict(values["peak_flops"])
        values["notes"] = tuple(values.get("notes", ()))
        return cls(**values)


# Each figure is the data sheet's dense peak (a sheet that quotes "with sparsity" figures
# is halved, as its footnote says). Link bandwidth: the sheet's total NVLink / Infinity
# Fabric bandwidth per device is both directions; one direction is half of it. Host
# bandwidth: the device's PCIe link to the host, one direction (a sheet's "PCIe Gen5:
# 128 GB/s" is both directions of a x16 link: 64 GB/s each way; Gen4 x16: 32 GB/s).
GEN5_X16 = 64 * G
GEN4_X16 = 32 * G
ACCELERATORS: dict[str, Hardware] = {
    "H100 SXM": Hardware(
        # NVIDIA H100 Tensor Core GPU datasheet (nvidia.com, H100 SXM column): FP64 34
        # TFLOPS, FP32 67 TFLOPS, BF16/FP16 Tensor Core 1,979 TFLOPS and FP8 3,958
        # TFLOPS "with sparsity" (dense: half), GPU memory 80 GB, bandwidth 3.35 TB/s,
        # NVLink 900 GB/s.
        name="H100 SXM",
        peak_flops={
            "bfloat16": 989.5 * T,
            "float16": 989.5 * T,
            "float8": 1979 * T,
            "float32": 67 * T,
            "float64": 34 * T,
        },
        memory_bandwidth=3.35 * T,
        link_bandwidth=450 * G,
        memory_bytes=80 * 10**9,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM)",
        # The same datasheet: "PCIe Gen5: 128GB/s" (x16, both directions).
        host_bandwidth=GEN5_X16,
    ),
    "H200": Hardware(
        # NVIDIA H200 Tensor Core GPU datasheet (nvidia.com, H200 SXM column): the
        # H100 SXM's compute (BF16/FP16 1,979, FP8 3,958 TFLOPS with sparsity; FP32 67,
        # FP64 34 TFLOPS), GPU memory 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
        name="H200",
        peak_flops={
            "bfloat16": 989.5 * T,
            "float16": 989.5 * T,
            "float8": 1979 * T,
            "float32": 67 * T,
            "float64": 34 * T,
        },
        memory_bandwidth=4.8 * T,
        link_bandwidth=450 * G,
        memory_bytes=141 * 10**9,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM)",
        # The same datasheet: "PCIe Gen5: 128GB/s" (x16, both directions).
        host_bandwidth=GEN5_X16,
    ),
    "B200": Hardware(
        # NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/hgx, 8-GPU board,
        # divided by 8): FP16/BF16 Tensor Core 36 PFLOPS, FP8 72 PFLOPS and TF32 18
        # PFLOPS "with sparsity" (dense: half), FP32 600 TFLOPS, FP64 296 TFLOPS; HBM3e
        # 1.4 TB at 64 TB/s; NVLink 5 at 1.8 TB/s per GPU.
        name="B200",
        peak_flops={
            "bfloat16": 2250 * T,
            "float16": 2250 * T,
            "float8": 4500 * T,
            "float32": 75 * T,
            "float64": 37 * T,
        },
        memory_bandwidth=8 * T,
        link_bandwidth=900 * G,
        memory_bytes=180 * 10**9,
        source="NVIDIA HGX B200 specifications (per GPU)",
        # Each B200 of an HGX board has a PCIe Gen5 x16 link to the host (NVIDIA DGX
        # B200 user guide: PCIe Gen5 switches between the GPUs and the CPUs).
        host_bandwidth=GEN5_X16,
    ),
    "A100 80GB": Hardware(
        # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column): FP64 9.7, FP32
        # 19.5, BF16/FP16 Tensor Core 312 TFLOPS (624 with sparsity), GPU memory bandwidth
        # 2,039 GB/s, NVLink 600 GB/s.
        name="A100 80GB",
        peak_flops={"bfloat16": 312 * T, "float16": 312 * T, "float32": 19.5 * T, "float64": 9.7 * T},
        memory_bandwidth=2.039 * T,
        link_bandwidth=300 * G,
        memory_bytes=80 * 10**9,
        source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)",
        # The same datasheet: "PCIe Gen4: 64GB/s" (x16, both directions).
        host_bandwidth=GEN4_X16,
    ),
    "MI300X": Hardware(
        # AMD Instinct MI300X accelerator data sheet (amd.com): peak FP16/BF16 1,307.4
        # TFLOPS and FP8 2,614.9 TFLOPS (dense; twice with sparsity), FP32 matrix 163.4
        # TFLOPS, FP64 matrix 163.4 TFLOPS; 192 GB HBM3 at 5.3 TB/s; peak Infinity Fabric
        # link bandwidth 128 GB/s per link, 7 links (896 GB/s both directions).
        name="MI300X",
        peak_flops={
            "bfloat16": 1307.4 * T,
            "float16": 1307.4 * T,
            "float8": 2614.9 * T,
            "float32": 163.4 * T,
            "float64": 163.4 * T,
        },
        memory_bandwidth=5.3 * T,
        link_bandwidth=448 * G,
        memory_bytes=192 * 10**9,
        source="AMD Instinct MI300X data sheet",
        # The same data sheet: bus type PCIe Gen 5 x16 (128 GB/s both directions).
        host_bandwidth=GEN5_X16,
    ),
    "Ascend 910B": Hardware(
        # Huawei publishes no per-chip data sheet of the 910B with these figures (its
        # Ascend 910 announcement gives FP16 256 TFLOPS for the 910). Figures reported
        # for the 910B (910B3) by third parties, which disagree with each other: FP16/BF16
        # about 313 TFLOPS, 64 GB HBM2e at about 1.6 TB/s, HCCS 7 links of 56 GB/s
        # (392 GB/s both directions). No FP32 figure: FP32 ops take the FP16 rate (a
        # lower bound of their time). Estimates: give your own table (Hardware or a
        # dict) for a measured or vendor-confirmed part.
        name="Ascend 910B",
        peak_flops={"bfloat16": 313 * T, "float16": 313 * T},
        memory_bandwidth=1.6 * T,
        link_bandwidth=196 * G,
        memory_bytes=64 * 10**9,
        source="figures reported for the Ascend 910B3 (no Huawei data sheet; estimates)",
        # Reported for the 910B: a PCIe 4.0 x16 host interface (an estimate, as above).
        host_bandwidth=GEN4_X16,
        notes=("estimated figures",),
    ),
}


def resolve_hardware(hardware: Any) -> Hardware:
    """A ``Hardware`` from a name in ``ACCELERATORS`` (case and spaces ignored), a dict,
    a ``Hardware``, or the path of a JSON file holding such a dict."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, Mapping):
        return Hardware.from_dict(hardware)
    if isinstance(hardware, (str, Path)):
        text = str(hardware)
        wanted = _plain(text)
        for name, spec in ACCELERATORS.items():
            if _plain(name) == wanted:
                return spec
        path = Path(text)
        if path.suffix == ".json" and path.is_file():
            with path.open() as f:
                return Hardware.from_dict(json.load(f))
        raise ValueError(
            f"unknown hardware {text!r}: name one of {sorted(ACCELERATORS)}, or give a table "
            "(a dict or a JSON file with name, peak_flops, memory_bandwidth, link_bandwidth)"
        )
    raise TypeError(
        f"hardware must be a name, a dict, a Hardware or a JSON path, got {type(hardware).__name__}"
    )


def _plain(name: str) -> str:
    return "".join(name.lower().split()).replace("-", "").replace("_", "")


# Collectives by operator name: (kind, the argument holding the group size or None).
_COLLECTIVE_SUFFIXES = {
    "all_gather_into_tensor": "gather",
    "all_gather_into_tensor_coalesced": "gather",
    "allgather_": "gather",
    "_allgather_base_": "gather",
    "allgather_into_tensor_coalesced_": "gather",
    "reduce_scatter_tensor": "scatter",
    "reduce_scatter_tensor_coalesced": "scatter",
    "reduce_scatter_": "scatter",
    "_reduce_scatter_base_": "scatter",
    "all_reduce": "reduce",
    "all_reduce_coalesced": "reduce",
    "allreduce_": "reduce",
    "allreduce_coalesced_": "reduce",
    "all_to_all_single": "exchange",
    "alltoall_": "exchange",
    "alltoall_base_": "exchange",
    "broadcast": "whole",
    "broadcast_": "whole",
    "send": "whole",
    "recv_": "none",
    "send_": "whole",
    "wait_tensor": "none",
    "barrier": "none",
}
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d", "_c10d_functional_autograd")


class OpCostModel:
    """Modelled seconds per ATen op on one ``Hardware`` (see the module docstring)."""

    def __init__(self, hardware: Hardware) -> None:
        self.hardware = hardware

    def op_seconds(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, flops: int
    ) -> float:
        from ..torch import _compat

        name = _compat.op_name(func)
        namespace, _, short = name.partition("::")
        if namespace in _COLLECTIVE_NAMESPACES:
            kind = _COLLECTIVE_SUFFIXES.get(short)
            if kind is not None:
                return self.collective_seconds(kind, func, args, kwargs, out)
        if _compat.is_view_op(func):
            return 0.0
        results = _tensors(out)
        if not results:
            return 0.0  # a query (a tensor's device, size, ...): no kernel
        inputs = _tensors((args, kwargs))
        read = {_compat.storage_key(t) for t in inputs}
        outputs = [t for t in results if _compat.storage_key(t) not in read]
        writes = any(written for _, written in _compat.op_arguments(func))
        if not outputs and not writes:
            return 0.0  # an alias of an input (``_unsafe_view``): metadata only
        moved = sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs)
        dtype = _dtype_name(inputs or outputs)
        compute = flops / self.hardware.peak(dtype) if flops else 0.0
        return max(compute, moved / self.hardware.memory_bandwidth)

    def collective_seconds(
        self, kind: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> float:
        if kind == "none":
            return 0.0
        size = _group_size(func, args, kwargs)
        inputs = sum(_nbytes(t) for t in _tensors((args, kwargs)))
        outputs = sum(_nbytes(t) for t in _tensors(out))
        return sent_bytes(kind, size, inputs, outputs) / self.hardware.link_bandwidth


def sent_bytes(kind: str, size: int, inputs: int, outputs: int) -> float:
    """The bytes one rank of a group of ``size`` sends in a collective of ``kind``
    (``"gather"``, ``"scatter"``, ``"reduce"``, ``"exchange"``, ``"whole"``; see the
    module docstring) of ``inputs`` bytes in and ``outputs`` out: what the cost model
    prices at the link's bandwidth, for the collectives a forward runs and for the
    all-gathers of a partitioned checkpoint's inputs (``recomp.plan.profiler``)."""
    share = (size - 1) / size if size > 1 else 0.0
    return {
        "gather": share * max(outputs, inputs * size),
        "scatter": share * inputs,
        "reduce": 2 * share * inputs,
        "exchange": share * inputs,
        "whole": float(inputs),
    }[kind]


def _tensors(tree: Any) -> list[Any]:
    from .modelcall import tensors_of

    return tensors_of(tree)


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def _dtype_name(tensors: list[Any]) -> str:
    for t in tensors:
        if t.dtype.is_floating_point:
            name = str(t.dtype).removeprefix("torch.")
            return "float8" if name.startswith("float8") else name
    return "float32"


def _group_size(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The size of the group a functional collective names in its arguments (its
    ``group_size``, or the group its ``group_name`` names), else the default group's."""
    from ..torch import _compat

    names = [name for name, _ in _compat.op_arguments(func)]
    for argument in ("group_size", "group_name"):
        if argument not in names:
            continue
        index = names.index(argument)
        value = kwargs.get(argument, args[index] if index < len(args) else None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            size = _compat.group_size(value)
            if size is not None:
                return size
    try:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except (RuntimeError, ValueError):
        return 1
