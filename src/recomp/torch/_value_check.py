"""``determinism_check="values"``: the replay must save the values the forward saved.

PyTorch's checkpoint compares only the shape, dtype and device of what its replay saves
with what the forward saved. Code that reads state outside its inputs (a Python float on
the module, a buffer changed in place between forward and backward, a random generator
of its own) replays the same ops on the same shapes with other values, and the gradient
is silently wrong. This part of a checkpoint call keeps, for each tensor the forward
saves under the checkpoint's hook, a small fingerprint: four numbers (the sum, the
Euclidean norm, the first and the last element). Each replay computes the
fingerprint of its n-th saved tensor and compares it with the forward's n-th; the first
that differs raises :class:`recomp.errors.ReplayMismatchError`, naming the saved tensor,
the op that computed it, the line of code that saved it (on CPU) and by how much it
differs.

Exactness. A replay runs the forward's ops on the same inputs: on CPU and wherever
``torch.use_deterministic_algorithms(True)`` is on, its values are bit-identical, and
the fingerprints must be equal. On an accelerator with nondeterministic kernels allowed
(atomics: ``index_add``, ``scatter_add``, some attention backends) the forward itself is
not bit-reproducible, so there each number may differ by what it can move when every
element moves by a fraction ``_RTOL`` of the elements' root mean square (1e-2 for 16-bit
floats, 1e-4 otherwise).

Where the check sits. Its pack hook replaces the checkpoint's on top of the
saved-tensors hook stack, inside the kept-replay handle and the recompute state (which
read the checkpoint's frame from the hook, see NOTE [ The parts of a checkpoint call ]):
every tensor the checkpoint saves passes it, in the order PyTorch files them. What
excluded regions save goes through their own hooks and is not replayed; what the code
after a region saves is computed from its cached outputs, the forward's, in the replay.
A replay that stops early compares as far as it goes. On CPU the comparison runs at the
replay's pack (the error's traceback then shows the line that saved the tensor); on
other devices the replay's fingerprints are compared together at its end, with one
synchronisation. Tensors of other types (subclasses such as DTensor, sparse, nested,
meta) are not fingerprinted (module state the forward updated, BatchNorm's running
statistics among them, is handed to the replay as the forward saw it, so it compares
equal: ``recomp._module_state``); nor are positions after one whose shape or dtype changed
(PyTorch's own check reports that) or where the replay saves through an excluded
region's boundary and the forward did not, or the other way round (the replay took
another branch around its regions, which recomp's region checks report).
"""

from __future__ import annotations

import array
import contextlib
import itertools
import linecache
import math
import os
import re
from typing import Any

import torch

from .._hooks import CallPart, CheckpointCallView, RegionCallView, RegionObserver, Stage, observing
from .._record import invocation_of
from .._state import get_recompute_state
from ..errors import ReplayMismatchError
from . import _compat
from ._debug import caller_frame
from ._foreign import checkpointed_name

__all__ = ["value_check_option"]

_F64 = torch.float64
_HALF_TYPES = (torch.float16, torch.bfloat16)
_RTOL = {True: 1e-2, False: 1e-4}  # 16-bit float or not; used where kernels may vary
# Devices where reading a fingerprint costs no synchronisation: compared at the replay's
# pack. Devices whose kernels are bit-reproducible: compared exactly.
_SYNC_FREE = frozenset({"cpu"})
_BIT_EXACT = frozenset({"cpu"})
_NAMES = ("sum", "norm", "first element", "last element")


def value_check_option(
    kwargs: dict[str, Any], *, debug: bool, function: Any = None, compiled: bool = False
) -> CallPart | None:
    """Take ``determinism_check="values"`` out of the checkpoint options (PyTorch's
    checkpoint then runs its own ``"default"`` check) and give the part that compares
    values, also when ``debug`` is on and the check was not turned off (``"none"``).
    In a compiled program (``compiled``) the option is only taken out: compiled code
    saves no tensor through hooks, so there is nothing to compare."""
    check = kwargs.get("determinism_check", "default")
    if check == "values":
        kwargs["determinism_check"] = "default"
    elif not (debug and check == "default"):
        return None
    return None if compiled else ValueCheck(checkpointed_name(function))


class ValueCheck(CallPart):
    """Fingerprints of what one checkpoint call's forward saved, and their comparison
    with each replay's (see the module docstring)."""

    stage = Stage.VALUE_CHECK

    def __init__(self, name: str) -> None:
        self.name = name
        self.invocation: Any = None
        # While the forward runs: a fingerprint per saved tensor (None: not compared).
        self.forward: list[torch.Tensor | None] = []
        # After it: the fingerprints as one table, and each saved tensor's row (-1: none).
        self.table: torch.Tensor | None = None
        self.rows = array.array("q")
        self.meta = array.array("q")  # hash of each saved tensor's shape and dtype
        # Positions the forward saved through an excluded region's boundary.
        self.boundary: set[int] = set()

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        self.invocation = call.invocation
        return _RecordForward(self), _CompareReplay(self)

    def forward_ended(self, ok: bool) -> None:
        if not ok:
            self.forward.clear()
            del self.meta[:]
            self.boundary.clear()
            return
        present = [f for f in self.forward if f is not None]
        if not present or len({f.device for f in present}) != 1:
            return  # nothing to compact, or devices mixed: the list stays
        with torch.no_grad(), _compat.no_dispatch_modes():
            self.table = torch.stack(present)  # one tensor instead of one per saved tensor
        rows = itertools.count()
        self.rows = array.array("q", (-1 if f is None else next(rows) for f in self.forward))
        self.forward = []

    def saved_count(self) -> int:
        return len(self.meta)

    def expected(self, i: int) -> torch.Tensor | None:
        """The forward's fingerprint of its ``i``-th saved tensor."""
        if self.table is None:
            return self.forward[i]
        row = self.rows[i]
        if row < 0:
            return None
        with _compat.no_dispatch_modes():  # bookkeeping: no mode of the replay sees it
            return self.table[row]

    def owns(self, call: RegionCallView) -> bool:
        """Whether a region call belongs to this checkpoint call (not a nested one)."""
        state = get_recompute_state()
        return state is not None and invocation_of(state) is self.invocation


class _BoundaryWatch(RegionObserver):
    """Counts the tensors an excluded region's boundary is about to save under the
    checkpoint's hook: in the forward after ``boundary_applied``, in a replay between
    ``region_skipped`` and ``region_outputs_returned``."""

    def __init__(self, check: ValueCheck) -> None:
        self.check = check
        self.pending = 0  # forward: boundary saves still to come
        self.inside = False  # replay: inside a skipped region's hand-back

    def boundary_applied(self, call: RegionCallView, saved: list[Any], outputs: list[Any]) -> None:
        if self.check.owns(call):
            self.pending = len(saved)

    def region_skipped(self, call: RegionCallView) -> None:
        if self.check.owns(call):
            self.inside = True

    def region_outputs_returned(self, call: RegionCallView) -> None:
        if self.check.owns(call):
            self.inside = False


def _metadata(t: torch.Tensor) -> int:
    return hash((tuple(t.shape), t.dtype))


def _fingerprint(t: Any) -> torch.Tensor | None:
    """Four numbers that change when ``t``'s values do, as float64: the sum, the square
    root of the sum of squares, the first and the last element; None for tensors recomp
    does not read (subclasses, other layouts, meta). Reduced in the tensor's own
    precision (float32 for 16-bit floats), which the vectorised kernels keep fast: a
    float64 accumulation of float32 data is an order of magnitude slower on CPU."""
    if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_meta:
        return None
    with torch.no_grad(), _compat.no_dispatch_modes():
        x = torch.view_as_real(t) if t.is_complex() else t
        if x.numel() == 0:
            return torch.zeros(4, dtype=_F64, device=x.device)
        if x.is_floating_point():
            if x.dtype in _HALF_TYPES:
                x = x.float()
            total = x.sum()
            magnitude = torch.linalg.vector_norm(x)
        else:
            total = x.sum()
            magnitude = total if x.dtype == torch.bool else x.abs().sum()
        # The first and the last element, as one view of any layout (no copy).
        last = sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))
        ends = x.as_strided((2,), (last,), x.storage_offset())
        return torch.cat((torch.stack((total, magnitude)).to(_F64), ends.to(_F64)))


class _RecordForward:
    """Forward context: the checkpoint's pack hook fingerprints each tensor first."""

    def __init__(self, check: ValueCheck) -> None:
        self.check = check
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        self._stacks.append(stack)
        hooks = _compat.top_checkpoint_hooks()
        if hooks is None:
            return
        checkpoint_pack, unpack = hooks
        check = self.check
        check.forward.clear()
        check.table = None
        del check.meta[:]
        check.boundary.clear()
        watch = _BoundaryWatch(check)

        def pack(t: Any) -> Any:
            if watch.pending:
                watch.pending -= 1
                check.boundary.add(len(check.forward))
            check.forward.append(_fingerprint(t))
            check.meta.append(_metadata(t) if isinstance(t, torch.Tensor) else 0)
            return checkpoint_pack(t)

        _compat.mark_as_checkpoint_hook(pack, checkpoint_pack)
        stack.enter_context(_compat.replace_top_hooks(pack, unpack, hooks))
        stack.enter_context(observing(watch))

    def __exit__(self, *exc_info: Any) -> None:
        self._stacks.pop().close()


class _CompareReplay:
    """Replay context: each saved tensor's fingerprint against the forward's."""

    def __init__(self, check: ValueCheck) -> None:
        self.check = check
        self._runs: list[_ReplayRun] = []

    def __enter__(self) -> None:
        run = _ReplayRun(self.check)
        self._runs.append(run)
        run.start()

    def __exit__(self, *exc_info: Any) -> None:
        run = self._runs.pop()
        run.stop()
        if exc_info[0] is None or _compat.is_early_stop(exc_info[1]):
            run.compare_deferred()


class _ReplayRun:
    """One replay's comparison."""

    def __init__(self, check: ValueCheck) -> None:
        self.check = check
        self.position = 0
        self.diverged = False
        self.deferred: list[tuple[int, torch.Tensor, torch.Tensor, str, tuple[bool, int]]] = []
        self.watch = _BoundaryWatch(check)
        self._stack = contextlib.ExitStack()

    def start(self) -> None:
        hooks = _compat.top_checkpoint_hooks()
        if hooks is None:
            return
        replay_pack, unpack = hooks

        def pack(t: Any) -> Any:
            self.saved(t)
            return replay_pack(t)

        _compat.mark_as_checkpoint_hook(pack, replay_pack)
        self._stack.enter_context(_compat.replace_top_hooks(pack, unpack, hooks))
        self._stack.enter_context(observing(self.watch))

    def stop(self) -> None:
        self._stack.close()

    def saved(self, t: Any) -> None:
        i = self.position
        self.position += 1
        check = self.check
        if self.diverged or i >= check.saved_count():
            return
        expected = check.expected(i)
        meta = _metadata(t) if isinstance(t, torch.Tensor) else 0
        if meta != check.meta[i] or self.watch.inside != (i in check.boundary):
            # Another op sequence (PyTorch's metadata check says so), or excluded regions
            # called elsewhere than in the forward (recomp's region checks say so).
            self.diverged = True
            return
        if expected is None:
            return
        got = _fingerprint(t)
        if got is None:
            return
        kind = (t.dtype in _HALF_TYPES, t.numel())
        if got.device.type in _SYNC_FREE:
            if not _agrees(expected, got, kind):
                raise self.error(i, expected, got, _op_of(t), _where())
        else:
            self.deferred.append((i, expected, got, _op_of(t), kind))

    def compare_deferred(self) -> None:
        """The replay's fingerprints on other devices, compared together at its end."""
        deferred, self.deferred = self.deferred, []
        if not deferred:
            return
        with torch.no_grad(), _compat.no_dispatch_modes():
            expected = torch.stack([e for _, e, _, _, _ in deferred])
            got = torch.stack([g for _, _, g, _, _ in deferred])
            if bool(_equal(expected, got).all()):  # the one synchronisation
                return
        for i, expected_row, got_row, op, kind in deferred:
            if not _agrees(expected_row, got_row, kind):
                raise self.error(i, expected_row, got_row, op, "")

    def error(
        self, i: int, expected: torch.Tensor, got: torch.Tensor, op: str, where: str
    ) -> ReplayMismatchError:
        f = expected.tolist()
        r = got.tolist()
        diffs = [abs(a - b) for a, b in zip(f, r)]
        parts = ", ".join(
            f"{name} {a:.6g} -> {b:.6g}" for name, a, b in zip(_NAMES, f, r) if a != b
        )
        located = f", saved at {where}" if where else ""
        return ReplayMismatchError(
            f"recomp checkpoint of {self.check.name}: the replay saved a different value "
            f"than the forward: saved tensor {i + 1} of the checkpoint (counting in the "
            f"order they were saved), {op}{located}, has the same shape and dtype but other "
            f"values (forward -> replay: {parts}; max abs difference at least "
            f"{max(diffs[2:]):.6g} at the sampled elements, {max(diffs[:2]):.6g} in the "
            "sums). The gradient would be wrong. The forward read state that changed "
            "between forward and backward: a Python attribute or global (a float on the "
            "module, a flag), a buffer or parameter changed in place, or a random generator "
            "other than torch's. Pass it to the checkpointed function as a tensor input, "
            "keep it unchanged until backward has run, or move the code that reads it into "
            "an excluded region (checkpoint_exclude_wrapper), which runs once. "
            '(determinism_check="values"; debug=True turns it on too.)'
        )


def _equal(expected: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    return (expected == got) | (expected.isnan() & got.isnan())


def _agrees(expected: torch.Tensor, got: torch.Tensor, kind: tuple[bool, int]) -> bool:
    """Equal fingerprints (NaN equal to NaN); within ``_RTOL`` where kernels may vary:
    relative to what each number can move when every element moves by that fraction
    (``kind``: 16-bit float, element count)."""
    with torch.no_grad(), _compat.no_dispatch_modes():
        if torch.equal(expected, got) or bool(_equal(expected, got).all()):
            return True
        if expected.device.type in _BIT_EXACT or torch.are_deterministic_algorithms_enabled():
            return False
        half, numel = kind
        norm = expected[1].abs()
        mean = norm / math.sqrt(numel)  # the root mean square of the elements
        scale = torch.stack((norm * math.sqrt(numel), norm, *(expected[2:].abs() + mean)))
        return bool(((expected - got).abs() <= _RTOL[half] * scale).all())


_BACKWARD_SUFFIX = re.compile(r"Backward\d*$")


def _op_of(t: Any) -> str:
    """The op that computed ``t``, from its autograd node (the saving op itself for a
    saved output, the producer for a saved input)."""
    node = getattr(t, "grad_fn", None)
    if node is None:
        return "a tensor no recorded op computed (an input or a constant)"
    name = type(node).__name__
    op = _BACKWARD_SUFFIX.sub("", name).lower() or name
    return f"computed by {op} ({name})"


def _where() -> str:
    frame = caller_frame()
    if frame is None:
        return ""
    filename, lineno, function = frame
    source = linecache.getline(filename, lineno).strip()
    where = f"{os.path.basename(filename)}:{lineno} in {function}"
    return f"{where}: `{source}`" if source else where
