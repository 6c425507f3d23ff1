"""HyperParallel's checkpoint policy values, shared by both frameworks.

The enum and the reading of what a policy function returned are framework-free:
``recomp.torch`` and ``recomp.mindspore`` import them from here.
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

from .errors import SwapPolicyError


class CheckpointPolicy(enum.IntEnum):
    """HyperParallel's policy values: PyTorch's four and ``MUST_SWAP`` (the op's output
    is kept like a save, moved to the host after the layer's forward and brought back
    for its backward; never recomputed). A policy function may also return a bool
    (True: ``MUST_SAVE``, False: ``PREFER_RECOMPUTE``) or a framework's own enum
    member of the same name (PyTorch's ``torch.utils.checkpoint.CheckpointPolicy``).
    PyTorch's ``MUST_CPU_OFFLOAD`` and ``PREFER_CPU_OFFLOAD`` (the output saved, moved to
    the host and brought back for the backward) mean ``MUST_SWAP``; ``PREFER_CPU_OFFLOAD``
    is saved instead where no swap can run (see :func:`swap_or_save`)."""

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3
    MUST_SWAP = 4


def as_policy(value: Any, where: str) -> CheckpointPolicy:
    """``value`` (what a policy function returned) as a :class:`CheckpointPolicy`."""
    if isinstance(value, bool):
        return CheckpointPolicy.MUST_SAVE if value else CheckpointPolicy.PREFER_RECOMPUTE
    if isinstance(value, CheckpointPolicy):
        return value
    # Another enum of the same values (PyTorch's), read by name; its offload members
    # are HyperParallel's swap under PyTorch's name.
    if isinstance(value, enum.Enum):
        if value.name in CheckpointPolicy.__members__:
            return CheckpointPolicy[value.name]
        if value.name in _OFFLOAD:
            return CheckpointPolicy.MUST_SWAP
    raise SwapPolicyError(
        f"{where} returned {value!r} ({type(value).__name__}), which is not a policy: "
        f"return a CheckpointPolicy ({', '.join(CheckpointPolicy.__members__)}) or a bool."
    )


#: PyTorch's offload members (``torch.utils.checkpoint.CheckpointPolicy``, 2.14 on).
_OFFLOAD = ("MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD")


def is_offload_member(value: Any) -> bool:
    """Whether a policy function returned one of PyTorch's own offload members."""
    return isinstance(value, enum.Enum) and not isinstance(value, CheckpointPolicy) and (
        value.name in _OFFLOAD
    )


_FALLBACKS_SAID: set[str] = set()


def swap_or_save(value: Any, op: Any, no_swap: str) -> CheckpointPolicy | None:
    """Where a swap cannot run (``no_swap`` says why): ``PREFER_SAVE`` for PyTorch's
    ``PREFER_CPU_OFFLOAD`` (said once per reason, in a warning), None for a policy that
    must swap (the caller refuses it)."""
    if not (is_offload_member(value) and value.name == "PREFER_CPU_OFFLOAD"):
        return None
    if no_swap not in _FALLBACKS_SAID:
        _FALLBACKS_SAID.add(no_swap)
        warnings.warn(
            f"CheckpointPolicy.PREFER_CPU_OFFLOAD (first for {op}) is saved on the device "
            f"instead: {no_swap}. Return MUST_SAVE for it there to silence this, or "
            f"MUST_CPU_OFFLOAD to make it an error.",
            UserWarning,
            stacklevel=2,
        )
    return CheckpointPolicy.PREFER_SAVE


def tensor_swapped(value: Any) -> bool:
    """What a per-tensor swap policy (``swap``, ``swap_wrapper``, ``async_save_on_cpu``)
    returned for one saved tensor: True to move it to the host (``MUST_SWAP``), False
    to keep it on the device (``MUST_SAVE``); anything else is refused."""
    policy = as_policy(value, "the swap policy_fn")
    if policy is CheckpointPolicy.MUST_SAVE:
        return False
    if policy is not CheckpointPolicy.MUST_SWAP:
        raise SwapPolicyError(
            f"The swap policy_fn returned {policy.name} for a saved tensor: a swap "
            f"policy is per tensor and returns MUST_SAVE or MUST_SWAP."
        )
    return True
