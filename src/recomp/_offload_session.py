"""What an offload session is, whatever the framework: its configuration
(HyperParallel's ``OffloadConfig``), the session active in this context,
``skip_offload``, and the counters of a step. The PyTorch session is
``recomp.torch._offload_session``; NOTE [ Offload sessions ] there says how it runs."""

from __future__ import annotations

import contextvars
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from ._offload_plan import Planner
from .errors import RecompError

MIB = 1 << 20
# Storages smaller than this stay on the device (a copy costs more than it frees): the
# default of the offloader (``offload=True``), of offload sessions, and the size the
# planner's offload options move from (``recomp.plan.planfile``).
MIN_OFFLOAD_BYTES = MIB


def _number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


@dataclass
class OffloadConfig:
    """HyperParallel's configuration of an :class:`OffloadSession`.

    ``max_resident_activation_mb``: the device budget for the tensors saved for
    backward, in MiB (a fraction is fine; 0 moves everything that can move).
    ``max_offload_activation_mb``: the pinned host memory the session may use, in MiB.
    ``planner``: what turns the traced step into a plan, an object with
    ``build(trace) -> OffloadPlan`` (default: the budget planner of
    ``recomp._offload_plan``). recomp's own fields: ``min_offload_bytes``, storages
    smaller than this stay on the device (a copy costs more than it frees);
    ``host_bandwidth``, the host link in bytes/s each way (the planner's ``Hardware``
    tables have it; None: measured once on a CUDA device, untimed on CPU).
    """

    max_resident_activation_mb: float = 1024
    max_offload_activation_mb: float = 65536
    planner: Planner | None = None
    min_offload_bytes: int = MIN_OFFLOAD_BYTES
    host_bandwidth: float | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the field to change."""
        if not _number(self.max_resident_activation_mb) or self.max_resident_activation_mb < 0:
            raise ValueError(
                f"OffloadConfig(max_resident_activation_mb={self.max_resident_activation_mb!r}): "
                "the device budget for saved activations is a number of MiB >= 0, e.g. "
                "max_resident_activation_mb=1024 (0 moves everything that can move)."
            )
        if not _number(self.max_offload_activation_mb) or self.max_offload_activation_mb <= 0:
            raise ValueError(
                f"OffloadConfig(max_offload_activation_mb={self.max_offload_activation_mb!r}): "
                "the host memory for offloaded activations is a number of MiB > 0, e.g. "
                "max_offload_activation_mb=65536."
            )
        if self.planner is not None and not callable(getattr(self.planner, "build", None)):
            raise TypeError(
                f"OffloadConfig(planner={self.planner!r}): a planner is an object with a "
                "build(trace) method returning an OffloadPlan; pass planner=None for the "
                "default one."
            )
        if (
            not isinstance(self.min_offload_bytes, int)
            or isinstance(self.min_offload_bytes, bool)
            or self.min_offload_bytes < 0
        ):
            raise ValueError(
                f"OffloadConfig(min_offload_bytes={self.min_offload_bytes!r}): the size below "
                "which a storage stays on the device is an int of bytes >= 0, e.g. "
                "min_offload_bytes=1 << 20."
            )
        if self.host_bandwidth is not None and (
            not _number(self.host_bandwidth) or self.host_bandwidth <= 0
        ):
            raise ValueError(
                f"OffloadConfig(host_bandwidth={self.host_bandwidth!r}): the host link is a "
                "number of bytes/s > 0 (e.g. 50e9 for PCIe 5 x16), or None to measure it."
            )

    @property
    def budget_bytes(self) -> int:
        return int(self.max_resident_activation_mb * MIB)

    @property
    def host_limit_bytes(self) -> int:
        return int(self.max_offload_activation_mb * MIB)


@dataclass
class OffloadStepStats:
    """The counters of one step under an offload session (``session.last_step``).

    Bytes are storage bytes, each storage once per copy. ``peak_resident_bytes``: the
    most the session held on the device at once (saved tensors not moved, copies to
    the host still in flight, tensors brought back and not yet read). ``on_demand_bytes``
    and ``unhidden_copies``: copies back that backward waited for (not brought back
    ahead, or, on a device, brought back but not complete when read).
    ``unplanned_evictions``: tensors moved because the budget was passed (every move
    of a traced step; in a replay, what the plan did not foresee). ``mismatch``: why the
    step did not follow the plan (None if it did, or was traced)."""

    step: int = 0
    mode: str = "warmup"  # "warmup" (traced), "replay", or "online" (left the plan)
    saved_bytes: int = 0
    peak_resident_bytes: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0
    prefetched_bytes: int = 0
    on_demand_bytes: int = 0
    unhidden_copies: int = 0
    unplanned_evictions: int = 0
    over_budget_bytes: int = 0  # the most the session held above the budget
    mismatch: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# The session active in this context (``OffloadSession.get_active()``), and whether the
# code running is inside a ``skip_offload`` region.
ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("recomp_offload_session", default=None)
OPAQUE: contextvars.ContextVar[bool] = contextvars.ContextVar("recomp_skip_offload", default=False)


def refuse_nesting(session: Any) -> None:
    active = ACTIVE.get()
    if active is not None:
        same = "this session" if active is session else "another OffloadSession"
        raise RecompError(
            f"OffloadSession cannot be nested: {same} is already active here. Enter one "
            "session around the whole step (forward and backward); its budget covers "
            "everything saved inside."
        )


F = TypeVar("F", bound=Callable[..., Any])


def skip_offload(fn: F) -> F:
    """Mark ``fn`` as an opaque region for the offload session: what autograd saves
    inside it stays on the device, is not traced, and counts as one event of the
    trace (so that dynamic control flow or foreign kernels inside it do not make
    a step differ from the traced one). Outside a session, ``fn`` runs as it is.
    Usable as a decorator; the wrapper keeps ``fn``'s name (``__wrapped__`` is
    ``fn``)."""
    if not callable(fn):
        raise TypeError(
            f"skip_offload decorates a function or module, got {fn!r}: write "
            "@skip_offload above the def, or skip_offload(fn)."
        )

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        session = ACTIVE.get()
        if session is None:
            return fn(*args, **kwargs)
        return session.run_opaque(getattr(fn, "__name__", type(fn).__name__), fn, args, kwargs)

    return wrapper  # type: ignore[return-value]
