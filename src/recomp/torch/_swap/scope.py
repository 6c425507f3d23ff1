"""Swap scopes: one layer's chosen tensors, moved to the host when the layer returns.

NOTE [ Swap scopes ]

A **swap scope** is one layer's worth of tensors chosen to live on the host between the
forward and the backward: a recomp checkpoint call with ``policy_fn=`` or
``swap_inputs=True`` (or any ``context_fn``), a ``swap`` / ``swap_wrapper`` call, or an
``async_save_on_cpu`` block. Tensors are chosen in two ways:

* per op, inside a checkpoint (``create_selective_checkpoint_contexts``): an op whose
  policy is ``MUST_SWAP`` has its output kept like a save, but by recomp rather than by
  PyTorch's selective-checkpoint cache (PyTorch is told ``MUST_RECOMPUTE``). A dispatch
  mode below PyTorch's (:class:`_SwapTap`) sees the op's output in the forward, and in
  the replay hands the kept output back instead of running the op: it is never
  recomputed. The other four policies are PyTorch's own selective checkpointing.
* per tensor (``async_save_on_cpu``, ``swap``, ``swap_wrapper``, ``swap_inputs=True``):
  a saved-tensors hook; parameters, views of parameters and empty tensors stay on the
  device.
* tensors the layer keeps itself (``swap_tensor_wrapper``): their storages are emptied
  in place once copied and refilled when the gradient of the layer's output is
  computed.

Nothing moves while the layer's forward runs (its later ops may still read what was
chosen). When the layer returns (:meth:`SwapScope.finish`) every chosen tensor that does
not share storage with the layer's output is handed to one ``OffloadGroup`` of the
offloader (``recomp.torch._offload``, NOTE [ Offload ordering and lifetime ]): copied
to the host on its side stream, its device storage released once copied, brought back
when the backward (or the replay) reads it, and the layer recorded before it prefetched
at that moment. Where the offloader does nothing (no CUDA, no host-copy test mode) the
chosen tensors stay on the device.

``group_swap`` packs a layer's small whole-storage tensors of one dtype into one buffer
(one copy each way); ``cpu_pool`` (:class:`PinnedMemoryPool`) supplies the host memory
and gets it back when the graph is freed. :class:`SwapManager` names the groups per
layer and tells the offloader which group a layer's backward brings back ahead (its
``set_forward_prefetch_layer`` pair, else the group recorded before).

The rest of the package builds on the scope: ``hooks`` (the per-tensor saved-tensors
hooks and ``swap_tensor_wrapper``), ``selective`` (``MUST_SWAP`` per op), ``checkpoint``
(the scope of a recomp checkpoint call), ``buckets`` (``group_swap``), ``pool``
(``cpu_pool``), ``manager`` (``SwapManager``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..._swap_pairs import ScopeSlot
from ...errors import RecompError
from .. import _compat
from .._offload import Offloader, OffloadHandle, default_offloader
from .buckets import _bucket, _InBucket
from .manager import SwapManager, _tensors_in


def is_compiling() -> bool:
    """Whether the caller runs inside a ``torch.compile`` capture (swap scopes are eager only)."""
    return bool(torch.compiler.is_compiling())


class _Kept:
    """A tensor a swap scope chose: the tensor until the layer's forward ends, then its
    host copy (or still the tensor, where it stays on the device)."""

    __slots__ = ("allow_mutation", "group", "held", "mutated", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, allow_mutation: bool) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.held: OffloadHandle | _InBucket | None = None
        # The offload group, alive as long as what it moved (the offloader holds it
        # weakly, and finds through it the layer to bring back next).
        self.group: Any = None
        self.version = _compat.version(tensor)
        self.allow_mutation = allow_mutation
        self.mutated = False

    def get(self) -> torch.Tensor:
        held = self.held
        if self.mutated or (held is not None and held.changed() and not self.allow_mutation):
            raise RecompError(
                "A tensor chosen for swapping (CheckpointPolicy.MUST_SWAP or a swap "
                "policy) was changed in place after it was saved, before it was copied "
                "to the host. Change a copy instead, or return MUST_SAVE for it with "
                "allow_cache_entry_mutation=True."
            )
        if held is not None:
            return held.get()
        if self.tensor is None:
            raise RecompError("A swapped tensor was read after its scope was aborted.")
        return self.tensor


class SwapScope:
    """One layer's chosen tensors; see NOTE [ Swap scopes ]. ``layer``: the module whose
    call this is (for the swap manager's pairs), or None; ``function``: what it calls.
    Without a ``name``, the group is named by the swap manager when it first moves
    something."""

    __slots__ = (
        "cpu_pool",
        "function",
        "group_swap",
        "in_place",
        "layer",
        "name",
        "offloader",
        "pending",
    )

    def __init__(
        self,
        name: str | None = None,
        *,
        group_swap: bool = False,
        cpu_pool: Any = None,
        offloader: Offloader | None = None,
        layer: nn.Module | None = None,
        function: Any = None,
    ) -> None:
        self.name = name
        self.function = function
        self.group_swap = group_swap
        self.cpu_pool = cpu_pool
        self.offloader = offloader
        self.layer = layer
        self.pending: list[_Kept] = []
        # Tensors the caller keeps (``swap_tensor_wrapper``), with their tags: emptied
        # and refilled in place.
        self.in_place: list[tuple[torch.Tensor, str | None]] = []

    def keep(self, tensor: torch.Tensor, allow_mutation: bool = False) -> _Kept:
        kept = _Kept(tensor, allow_mutation)
        self.pending.append(kept)
        return kept

    def finish(self, outputs: Any) -> None:
        """The layer returned ``outputs``: move every chosen tensor that does not share
        storage with them to the host, in one offload group."""
        pending, self.pending = self.pending, []
        in_place, self.in_place = self.in_place, []
        if not pending and not in_place:
            return
        offloader = self.offloader or default_offloader()
        manager = SwapManager()
        name = self.name or manager.group_name(self.layer, self.function)
        group = offloader.open_group(name)
        if group is None:
            return
        group.pool = self.cpu_pool
        manager.group_recorded(self.layer, group)
        if manager.is_last_layer(self.layer):
            # Its backward comes next: moving it out and back gains nothing. Its
            # backward's start (the gradient of its output) brings its pair back.
            manager.prefetch_on_backward(self.layer, outputs)
            return
        protected = {_compat.storage_key(t) for t in _tensors_in(outputs)}
        moving: list[_Kept] = []
        for kept in pending:
            t = kept.tensor
            if t is None or _compat.storage_key(t) in protected:
                continue
            if _compat.version(t) != kept.version and not kept.allow_mutation:
                kept.mutated = True
                continue
            kept.group = group
            moving.append(kept)
        try:
            if self.group_swap:
                moving = _bucket(group, moving)
            for kept in moving:
                handle = group.put(kept.tensor, force=True)  # type: ignore[arg-type]
                if handle is not None:
                    kept.held, kept.tensor = handle, None
            _put_in_place(group, in_place, outputs, protected)
        except BaseException:
            group.abort()
            raise
        group.close()

    def abort(self) -> None:
        self.pending = []
        self.in_place = []


def _put_in_place(
    group: Any, tensors: list[tuple[torch.Tensor, str | None]], outputs: Any, protected: set[Any]
) -> None:
    """Empty the storages of ``tensors`` once copied; refill them when the gradient of the
    layer's output is computed (the start of its backward). With no output that needs a
    gradient there is no such moment: they stay."""
    anchor = next((t for t in _tensors_in(outputs) if t.requires_grad), None)
    if anchor is None:
        return
    handles = []
    for t, tag in tensors:
        if _compat.storage_key(t) in protected:
            continue
        handle = group.put(t, force=True, in_place=True, label=tag)
        if handle is not None:
            handles.append(handle)
    if not handles:
        return

    def refill(grad: torch.Tensor) -> None:
        del grad
        if handles:
            group.bring_back_in_place()

    anchor.register_hook(refill)


_SCOPES = ScopeSlot("recomp_swap_scope")
current_scope = _SCOPES.current


def _read(x: Any) -> Any:
    """What a swap scope kept, as a tensor again (the host copy brought back); anything
    else as it is."""
    return x.get() if isinstance(x, _Kept) else x
