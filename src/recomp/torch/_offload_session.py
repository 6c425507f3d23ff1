"""The offload session on PyTorch: every tensor a step saves for backward, kept on the
device up to a budget and moved to the host beyond it, first online, then by a plan.

NOTE [ Offload sessions ]

``with session:`` pushes one pair of saved-tensors hooks for the step (forward and
backward) and makes itself the place where recomp's checkpoints keep what they keep:
a checkpoint's saved inputs and what its excluded regions keep pass through the same
pack and unpack (``active_placer``, read by ``recomp.torch.checkpoint`` when the call
names no place of its own). What a checkpoint drops and replays is not saved at all.

1. Pack: each save of a tensor on a storage is one event of the step's trace
   (``recomp._offload_plan``). Saves of one storage share one record, which holds a
   detached alias of it (the device memory) until it moves. Parameters and tensors
   without a storage of their own pass through unrecorded; what cannot move (under
   ``min_offload_bytes``, not on a device the offloader serves) is recorded and stays.
2. Moving a record is the offloader's copy to the host (``recomp.torch._offload``: a
   side stream on CUDA, the host-copy mode on CPU), into a block of the session's
   bounded pinned pool; the record drops its alias and the copy in flight holds the
   device storage until it completes.
3. The first entry traces: whenever the bytes the session holds pass the budget, the
   oldest movable records move (the last ones backward reads). When the step's
   backward has read what it saved, the planner builds a plan from the trace; later
   entries replay it: a record moves after the save the plan names, and comes back
   at the event the plan names (a copy back started ahead). The budget check stays
   on in a replay, for what the plan did not foresee.
4. Unpack rebuilds the saved view on the record's storage, on the device: the alias,
   or the bytes brought back (waiting for the copy, or copying back then). A tensor
   changed in place after its save raises, as autograd does without hooks.
5. A replay compares each save with the traced one (shape, dtype, device). At the
   first difference, or a different number of saves, it warns
   (``OffloadTraceWarning``), leaves the plan for the rest of the step (the budget
   check still moves tensors) and the next entry traces again. The plan only decides
   when bytes move; each handle reads its own record, so no difference can hand
   backward a wrong tensor.
6. An exception inside the block waits for every copy, drops the step's host blocks
   (a later read of them raises), frees the pool's idle blocks and pops the hooks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._offload_plan import BudgetPlanner, OffloadPlan, OffloadTrace
from .._offload_session import (
    ACTIVE,
    MIB,
    MIN_OFFLOAD_BYTES,
    OPAQUE,
    OffloadConfig,
    OffloadStepStats,
    refuse_nesting,
)
from .._offload_session import skip_offload as skip_offload
from ..errors import format_bytes
from ._offload import Offloader, _quiet
from ._offload_step import SCOPED_PLACER, HookPlacer, _Step, unpack_saved
from ._swap.pool import PinnedMemoryPool


class OffloadSession:
    """HyperParallel's ``OffloadSession``: a context manager around a training step
    (forward and backward) that keeps the tensors saved for backward on the device up
    to ``config.max_resident_activation_mb`` and moves the rest to pinned host memory.

    The first entry traces the step and moves the oldest saved tensors whenever the
    session holds more than the budget; when its backward has run, a planner turns the
    trace into a plan (``session.plan``, readable with ``print(session.plan)``). Later
    entries replay the plan: chosen tensors are copied to the host after their last
    save and brought back ahead of their first read, on a side stream (CUDA). A step
    that saves other shapes or in another order warns (``OffloadTraceWarning``), runs
    without the plan, and the next step is traced again; an exception inside the
    block waits for every copy and releases the step's host memory.

    What recomp's checkpoints keep (their saved inputs, what their excluded regions
    keep) goes through the session like any saved tensor. ``last_step`` holds the
    counters of the latest step (an ``OffloadStepStats``). On a machine without CUDA
    nothing moves unless the ``RECOMP_OFFLOAD_HOST_COPY=1`` test mode is on; the trace
    and the plan are made all the same. Sessions do not nest."""

    def __init__(self, config: OffloadConfig | None = None) -> None:
        if config is None:
            config = OffloadConfig()
        if not isinstance(config, OffloadConfig):
            raise TypeError(
                f"OffloadSession takes an OffloadConfig, got {config!r}: write "
                "OffloadSession(OffloadConfig(max_resident_activation_mb=...)), or use "
                "recomp.torch.offload_session(budget_bytes)."
            )
        config.check()
        self.config = config
        self.planner = config.planner if config.planner is not None else BudgetPlanner()
        self.pool = PinnedMemoryPool(max(1, config.host_limit_bytes))
        self.offloader = Offloader(min_bytes=config.min_offload_bytes)
        self.plan: OffloadPlan | None = None
        self.trace: OffloadTrace | None = None
        self.last_step: OffloadStepStats | None = None
        self.steps = 0
        self.placer = HookPlacer(_session_pack(self))
        self._step: _Step | None = None
        self._pending: _Step | None = None  # a traced step whose backward is not done yet
        self.retrace = False  # a replay left the plan: the next entry traces again
        self._hooks: Any = None
        self._token: Any = None

    @property
    def mode(self) -> str:
        """``"warmup"`` while the next entry traces, ``"replay"`` once a plan is made."""
        return "replay" if self.plan is not None and not self.retrace else "warmup"

    @staticmethod
    def get_active() -> OffloadSession | None:
        """The session whose block is running in this context, or None."""
        return ACTIVE.get()

    def __enter__(self) -> OffloadSession:
        refuse_nesting(self)
        if self._pending is not None:
            self._make_plan(self._pending)
        self.steps += 1
        step = _Step(self, self.steps, None if self.mode == "warmup" else self.plan)
        group = self.offloader.open_group(f"offload step {self.steps}")
        if group is not None:
            group.pool = self.pool
            group.chain = False
            if step.plan is None and not self.offloader.host_mode:
                step.timing = []
        step.group = group
        self._step = step
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, unpack_saved)
        hooks.__enter__()
        self._hooks = hooks
        self._token = ACTIVE.set(self)
        self.last_step = step.stats
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        step = self._step
        try:
            if self._hooks is not None:
                self._hooks.__exit__(exc_type, exc, tb)
        finally:
            self._hooks = None
            if self._token is not None:
                ACTIVE.reset(self._token)
            self._token = None
            self._step = None
        if step is None:
            return
        if exc_type is not None:
            step.abort()
            self.pool.clear()
            return
        self.offloader.poll()
        traced = step.plan.trace.marks if step.plan is not None else None
        if step.following and step.marks != len(traced):  # type: ignore[arg-type]
            step.leave_plan(f"it saved {step.marks} tensors, the traced step {len(traced)}")  # type: ignore[arg-type]
        if step.plan is None:
            if step.settled():
                self._make_plan(step)
            else:
                self._pending = step  # planned at the next entry, once backward has run

    def _make_plan(self, step: _Step) -> None:
        self._pending = None
        recorder = step.recorder
        if recorder is None:
            return
        trace = recorder.trace
        step.recorder = None
        trace.budget_bytes = self.config.budget_bytes
        trace.host_limit_bytes = self.config.host_limit_bytes
        trace.host_bandwidth = self.config.host_bandwidth
        if step.timing:
            trace.seconds = _seconds(step.timing)
            if trace.host_bandwidth is None:
                trace.host_bandwidth = _measured_bandwidth()
        step.timing = None
        plan = self.planner.build(trace)
        if step.host_full:
            plan.notes.append(
                f"The host pool ({format_bytes(self.config.host_limit_bytes)}) was full in the "
                "traced step: raise max_offload_activation_mb to move more."
            )
        self.trace, self.plan = trace, plan
        self.retrace = False

    # -- hooks -------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor, where: str | None = None) -> Any:
        step = self._step
        if step is None or OPAQUE.get():
            return t.detach()
        return step.save(t, where)

    def run_opaque(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``skip_offload``'s region: one event, its saves kept as they are."""
        if OPAQUE.get() or self._step is None:
            return fn(*args, **kwargs)
        self._step.region(name)
        token = OPAQUE.set(True)
        try:
            with torch.autograd.graph.saved_tensors_hooks(_detached, unpack_saved):
                return fn(*args, **kwargs)
        finally:
            OPAQUE.reset(token)


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _session_pack(session: OffloadSession) -> Callable[[torch.Tensor, str], Any]:
    """The session's pack for what a checkpoint keeps, holding the session weakly."""
    ref = weakref.ref(session)

    def pack(t: torch.Tensor, where: str) -> Any:
        held = ref()
        return t.detach() if held is None else held._pack(t, where)

    return pack


def active_placer() -> HookPlacer | None:
    """Where a recomp checkpoint called now keeps what it keeps, or None: the innermost
    of a pipeline micro-batch's swap group (``recomp.torch._pipeline_swap``, while a
    stage's forward runs) and the running session."""
    if OPAQUE.get():
        return None
    scoped = SCOPED_PLACER.get()
    if scoped is not None:
        return scoped
    session = ACTIVE.get()
    return None if session is None else session.placer  # type: ignore[no-any-return]


def _seconds(events: list[Any]) -> list[float]:
    events[-1].synchronize()
    first = events[0]
    return [first.elapsed_time(e) / 1e3 for e in events]


_BANDWIDTH: dict[int, float] = {}


def _measured_bandwidth() -> float:
    """The host link of the current CUDA device, bytes/s, the slower way of two 64 MiB
    copies between pinned host memory and the device (measured once per device)."""
    device = torch.cuda.current_device()
    if device not in _BANDWIDTH:
        size = 64 * MIB
        with _quiet():
            src = torch.empty(size, dtype=torch.uint8, device="cuda")
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            host.copy_(src)  # warm up
            torch.cuda.synchronize()
            times = []
            for dst, source in ((host, src), (src, host)):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(source, non_blocking=True)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        _BANDWIDTH[device] = size / max(max(times), 1e-9)
    return _BANDWIDTH[device]


def offload_session(
    budget: int,
    *,
    host_limit: int = 64 << 30,
    min_bytes: int = MIN_OFFLOAD_BYTES,
    host_bandwidth: float | None = None,
    planner: Any = None,
) -> OffloadSession:
    """An offload session that keeps at most ``budget`` bytes of saved activations on the
    device (HyperParallel's ``OffloadSession`` with recomp's units)::

        session = recomp.torch.offload_session(8 << 30)
        for batch in loader:
            with session:
                loss = model(batch).loss
                loss.backward()
            optimizer.step()
        print(session.plan)            # what moves and why
        print(session.last_step)       # bytes moved, peak resident bytes

    ``host_limit``: pinned host memory the session may use, bytes. ``min_bytes``:
    smaller storages stay on the device. ``host_bandwidth``: the host link, bytes/s
    each way (None: measured once on CUDA). ``planner``: see ``OffloadConfig``.
    Everything a step saves for backward takes part, recomp's checkpoints' inputs and
    excluded regions' kept tensors included; gradients are those without the session,
    bit for bit."""
    for name, value in (("budget", budget), ("host_limit", host_limit)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(
                f"offload_session({name}={value!r}): bytes, an int >= 0 (e.g. {name}=8 << 30 "
                "for 8 GiB)."
            )
    config = OffloadConfig(
        max_resident_activation_mb=budget / MIB,
        max_offload_activation_mb=max(host_limit, 1) / MIB,
        planner=planner,
        min_offload_bytes=min_bytes,
        host_bandwidth=host_bandwidth,
    )
    return OffloadSession(config)
