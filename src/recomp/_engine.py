"""The exclusion engine, shared by every framework backend.

NOTE [ How an excluded region is kept out of the replay ]

A recomp checkpoint is the framework's own non-reentrant checkpoint: in the
forward, a saved-tensors hook replaces every tensor that autograd saves by a
placeholder; in backward, the first unpack replays the forward and takes the
tensors from the replay, position by position. recomp adds a recompute state
(``_state``) that tells code which invocation it belongs to and whether it is
the forward or a replay.

An excluded region, in the forward of an invocation:
  1. runs under an inner saved-tensors hook, which takes precedence over the
     checkpoint's, so the tensors its autograd nodes save are kept for real
     (``_Kept``) instead of being dropped and replayed;
  2. appends a ``CacheEntry`` to the invocation holding its outputs, detached
     (the region's own graph is kept alive by the caller's graph, not by us);
  3. passes its differentiable outputs through an autograd *boundary*
     (see NOTE [ Deferred inputs ]).
In a replay, the region is not called: the entry at the replay cursor gives
the outputs back, with the same ``requires_grad`` so that the recomputed code
after it saves exactly what it saved in the forward (the checkpoint matches
saved tensors by position, so the replay must save the same sequence).

Invariants the code relies on:
  * Entries are consumed in call order and never removed; each replay starts
    from the first entry (``PhaseContext``), so ``retain_graph`` and repeated
    backwards see the same cache. The cache belongs to the invocation, which the
    checkpoint frame holds through the replay context: it dies with the graph.
  * Nothing the cache or a saved-tensor handle holds refers back to the
    autograd graph once the forward is over (outputs and kept saved tensors are
    aliases without history, inputs are bound detached; a cached output's
    original is held only until the end of the forward, see ``_Snapshot``), so
    no reference cycle that the garbage collector cannot see keeps a graph alive.
  * In-place changes are caught by version counters, of the original and of the
    kept alias: at the end of the forward, in each replay, and on unpack.
  * A region that fails leaves nothing behind: the entry is appended only after
    the region returned, and the context variables are reset in ``finally``.
  * With early stop, entries recorded after the checkpoint's last saved tensor
    lose their cached outputs at the end of the forward (``CacheEntry.drop_cache``):
    the replay stops before, or in the boundary of, such a region. Not for
    checkpoints nested in another recomp checkpoint, whose replay re-runs them whole.

NOTE [ Deferred inputs ]

A region input that was computed inside the checkpoint by recomputed code
(say ``norm(h)`` fed to an excluded matmul) is reproduced by the replay anyway.
Keeping it in the region's saved tensors would hold a second copy of an
activation the checkpoint deliberately dropped. So the inner pack hook saves a
``_Deferred`` handle for any saved tensor whose storage is the storage of such
an input (storage, not identity: ``linear`` saves a 2-D view of a 3-D input),
recording how to rebuild the view from the input. When the replay reaches the
region, the engine binds each handle's ``_InputSlot`` to the replay's tensor at
the same input path.

For that binding to happen before the region's own backward unpacks the
handles, the region's outputs go through the boundary: an autograd function
that saves the deferred inputs *under the checkpoint's hook* and reads them in
its backward. Gradients reach the region's nodes only through the boundary, so
the boundary's backward runs first, its unpack triggers the replay, the replay
binds the slots, and only then do the region's nodes unpack their handles. The
replay applies the boundary again to keep the sequence of saved tensors equal.

Not deferred: parameters; tensors whose storage is a checkpoint input (the
checkpoint keeps those); outputs of earlier excluded regions in the same
invocation (cached already, or deliberately not cached with
``save_output=False``, in which case the consumer's saved tensors are the one
copy). Saving those as they are costs no memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol

from . import _pytree
from ._state import UNSET, Invocation, PhaseContext, get_recompute_state
from .errors import (
    CachedValueMutatedError,
    ForeignCheckpointWarning,
    NestedExclusionError,
    ReplayMismatchError,
)


class Backend(Protocol):
    """The questions the engine asks a framework. One small object per framework."""

    name: str

    def is_tensor(self, x: Any) -> bool: ...
    def is_parameter(self, x: Any) -> bool: ...
    def requires_grad(self, t: Any) -> bool: ...
    def grad_enabled(self) -> bool: ...
    def in_backward(self) -> bool:
        """True while the framework's autograd engine is running a backward."""

    def storage_key(self, t: Any) -> Hashable | None:
        """Identity of the memory behind ``t``, equal for all views of it; None if unknown."""

    def parameters_of(self, fn: Any) -> list[Any]:
        """The parameters of a module (empty for a plain function)."""

    def storage_nbytes(self, t: Any) -> int:
        """Size of the memory behind ``t`` (all of it, for a view)."""

    def version(self, t: Any) -> int | None:
        """In-place modification counter of ``t``, or None if the framework has none."""

    def saved_tensors_hooks(
        self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]
    ) -> Any: ...
    def region_context(self) -> Any:
        """Context entered around a region's forward (hides op-level checkpoint caches)."""

    def detach(self, t: Any) -> Any:
        """An alias of ``t`` without autograd history, sharing memory and version counter."""

    def keep_saved(self, t: Any) -> Any:
        """What a region keeps for a tensor its autograd saved: an alias without
        autograd history, so that an op saving its own output (``tanh``) forms no
        reference cycle node -> saved tensor -> node that only a backward breaks."""

    def replay_alias(self, t: Any, requires_grad: bool) -> Any:
        """A fresh alias of cached ``t`` to hand to the replay."""

    def stub(self, requires_grad: bool) -> Any:
        """A zero-element tensor standing in for an output that was not saved."""

    def placeholder(self, t: Any, region_name: str) -> Any:
        """Turn ``t`` into a stand-in that raises ``OutputNotSavedError`` when used."""

    def layout(self, t: Any) -> Hashable:
        """What must match between a forward input and its replay (shape, strides, dtype)."""

    def view_spec(self, t: Any, base: Any) -> Any:
        """How to rebuild ``t`` from ``base`` (same storage); ``NOT_A_VIEW`` if impossible."""

    def apply_view(self, spec: Any, base: Any) -> Any: ...
    def boundary(self, saved: list[Any], outputs: list[Any]) -> list[Any]:
        """Apply the boundary function: aliases of ``outputs`` whose backward first
        unpacks ``saved`` (packed by the enclosing checkpoint's hook)."""

    def get_rng_state(self) -> Any: ...
    def set_rng_state(self, state: Any) -> None: ...
    def save_counter(self) -> Callable[[], int] | None:
        """If the innermost checkpoint's replay stops after its last saved tensor: a
        function returning how many tensors it has saved so far. Otherwise None."""


_FOREIGN_CHECKPOINT = {"torch": "torch.utils.checkpoint", "mindspore": "mindspore.recompute"}

NOT_A_VIEW = object()
IDENTITY = None  # a view_spec meaning "the input itself"

# The excluded region whose forward is running in this context, if any.
_active_region: contextvars.ContextVar[ExcludedRegion | None] = contextvars.ContextVar(
    "recomp_active_region", default=None
)


# --------------------------------------------------------------------------- saved tensors


class _Snapshot:
    """A tensor kept by recomp, and a way to tell whether it was changed in place since.

    ``value`` is what is kept: an alias without autograd history where the
    framework allows it (see ``Backend.keep_saved``). The version counters of
    the original and of ``value`` are both checked: some frameworks give an
    alias a counter of its own. The original is referenced weakly, except that
    a cached output holds it (``hold=True``) until the end of its checkpoint's
    forward, when the first check runs (``release``): holding it longer would
    tie the cache to the autograd graph in a cycle the collector cannot see.
    """

    __slots__ = ("held", "offloaded", "origin", "origin_version", "value", "value_version")

    def __init__(
        self, backend: Backend, tensor: Any, value: Any, hold: bool = False, offload: Any = None
    ) -> None:
        # With ``offload`` (an offload group, see recomp.torch._offload), a host copy
        # is kept instead of ``value`` where the group takes the tensor.
        self.offloaded = offload.put(tensor) if offload is not None else None
        self.value = value if self.offloaded is None else None
        self.value_version = backend.version(value)
        self.origin_version = backend.version(tensor)
        self.origin = weakref.ref(tensor) if self.origin_version is not None else None
        self.held = tensor if hold else None

    def changed(self, backend: Backend) -> bool:
        origin = self.held if self.held is not None else self.origin and self.origin()
        if origin is not None and backend.version(origin) != self.origin_version:
            return True
        if self.offloaded is not None:
            return bool(self.offloaded.changed())
        return backend.version(self.value) != self.value_version

    def get(self) -> Any:
        """The kept tensor (brought back from the host if it was offloaded)."""
        return self.value if self.offloaded is None else self.offloaded.get()

    def release(self) -> None:
        self.held = None


class _Kept:
    """A tensor a region saved, kept for real, with the mutation check on unpack."""

    __slots__ = ("region", "snapshot")

    def __init__(self, tensor: Any, region: ExcludedRegion, offload: Any = None) -> None:
        backend = region.backend
        self.snapshot = _Snapshot(backend, tensor, backend.keep_saved(tensor), offload=offload)
        self.region = region

    def unpack(self) -> Any:
        if self.snapshot.changed(self.region.backend):
            raise CachedValueMutatedError(
                f"A tensor saved by excluded region {self.region.name!r} was modified in place "
                "after the region ran. Its backward would use the changed value. Make the "
                "in-place operation out-of-place (e.g. `y = y + 1` instead of `y.add_(1)`), or "
                "clone the region's output before changing it."
            )
        return self.snapshot.get()


class _InputSlot:
    """One region input that the replay will supply; bound when the replay reaches the region."""

    __slots__ = ("__weakref__", "bound", "index", "layout", "path", "region")

    def __init__(self, region: ExcludedRegion, index: int, path: str, layout: Hashable) -> None:
        self.region = region
        self.index = index
        self.path = path
        self.layout = layout
        self.bound: Any = None

    def bind(self, replayed: Any) -> None:
        backend = self.region.backend
        if not backend.is_tensor(replayed) or backend.layout(replayed) != self.layout:
            got = (
                backend.layout(replayed) if backend.is_tensor(replayed) else type(replayed).__name__
            )
            raise ReplayMismatchError(
                f"The replay passed excluded region {self.region.name!r} a different input at "
                f"{self.path}: {got} instead of {self.layout}. The checkpointed code must compute "
                "the same inputs in the replay as in the forward (no data-dependent control flow "
                "that changes between the two)."
            )
        self.bound = backend.detach(replayed)


class _Deferred:
    """Stands in for a saved tensor that is (a view of) a region input the replay reproduces."""

    __slots__ = ("slot", "view")

    def __init__(self, slot: _InputSlot, view: Any) -> None:
        self.slot = slot
        self.view = view

    def unpack(self) -> Any:
        slot = self.slot
        if slot.bound is None:
            raise ReplayMismatchError(
                f"Excluded region {slot.region.name!r} needs its input {slot.path} from the "
                "checkpoint's replay, but the replay has not reached the region. This happens "
                "when the region's output is used outside the autograd graph of its checkpoint "
                "(for example through .detach() and re-attached). Pass the output on unchanged, "
                "or exclude the region from a recomp checkpoint only."
            )
        if self.view is IDENTITY:
            return slot.bound
        return slot.region.backend.apply_view(self.view, slot.bound)


def _unpack(packed: Any) -> Any:
    return packed.unpack()


class _Packer:
    """The inner pack hook of one region call: keeps saved tensors, or defers region inputs.

    The autograd graph keeps a reference to the pack hook of every tensor it
    saved (not only to the unpack hook), so ``close()`` drops the references to
    the region's inputs once the region has returned; otherwise the graph would
    pin exactly the inputs that deferral is meant to release.
    """

    def __init__(
        self,
        region: ExcludedRegion,
        inv: Invocation,
        fn: Callable[..., Any],
        leaves: list[Any],
        in_spec: _pytree.TreeSpec,
        offload: Any = None,
    ) -> None:
        backend = region.backend
        self.region = region
        self.fn: Callable[..., Any] | None = fn
        # Offload group of this call (None: keep on the device); not for checkpoint inputs.
        self.offload = offload
        self.checkpoint_input_keys = inv.checkpoint_input_keys
        self._parameter_keys: set[Hashable] | None = None
        self.leaves: list[Any] = leaves
        self.in_spec = in_spec
        self.slots: dict[int, _InputSlot] = {}
        # Storages kept for real (parameters aside) -> bytes, for ExcludedRegion.saved_bytes.
        self.kept: dict[Hashable, int] = {}
        # Storage of each input the replay will reproduce -> its leaf index.
        self.deferrable: dict[Hashable, int] = {}
        for i, leaf in enumerate(leaves):
            if not backend.is_tensor(leaf) or backend.is_parameter(leaf):
                continue
            key = backend.storage_key(leaf)
            if key is None:
                continue
            if key in inv.excluded_output_keys:
                inv.consumed_keys.add(key)
            elif key not in inv.checkpoint_input_keys:
                self.deferrable.setdefault(key, i)

    def pack(self, t: Any) -> Any:
        region = self.region
        backend = region.backend
        index = self.deferrable.get(backend.storage_key(t)) if self.deferrable else None
        if index is not None:
            base = self.leaves[index]
            view = backend.view_spec(t, base)
            if view is not NOT_A_VIEW:
                slot = self.slots.get(index)
                if slot is None:
                    path = _input_path(_pytree.leaf_paths(self.in_spec)[index])
                    slot = self.slots[index] = _InputSlot(region, index, path, backend.layout(base))
                return _Deferred(slot, view)
        key = backend.storage_key(t)
        if backend.is_parameter(t) or key in self.parameter_keys():
            return _Kept(t, region)
        self.kept[key] = backend.storage_nbytes(t)
        offload = self.offload if key not in self.checkpoint_input_keys else None
        return _Kept(t, region, offload)

    def parameter_keys(self) -> set[Hashable]:
        """Storages of the wrapped module's parameters. A parameter may be saved through
        an alias (a transpose, a cast view): recognised by storage, it is not counted
        in saved_bytes, which is about activations. Computed on first need."""
        if self._parameter_keys is None:
            backend = self.region.backend
            params = backend.parameters_of(self.fn)
            self._parameter_keys = {backend.storage_key(p) for p in params}
        return self._parameter_keys

    def close(self) -> dict[int, _InputSlot]:
        """Forget the inputs (see the class docstring); return the slots that were created."""
        slots = self.slots
        self.leaves = []
        self.deferrable = {}
        self.slots = {}
        self.fn = None
        self._parameter_keys = None
        self.offload = None
        return slots


# --------------------------------------------------------------------------- cache


class _CachedOutput:
    __slots__ = ("nbytes", "requires_grad", "snapshot")

    def __init__(self, snapshot: _Snapshot | None, requires_grad: bool, nbytes: int) -> None:
        self.snapshot = snapshot  # None when save_output=False or dropped
        self.requires_grad = requires_grad
        self.nbytes = nbytes


class CacheEntry:
    """One call of an excluded region in one invocation."""

    __slots__ = (
        "boundary_inputs",
        "in_spec",
        "offload",
        "out_leaves",
        "out_spec",
        "outputs",
        "region",
        "rng_state",
        "saves_after",
        "slots",
        "unreachable",
    )

    def __init__(self, region: ExcludedRegion, in_spec: _pytree.TreeSpec) -> None:
        self.region = region
        self.in_spec = in_spec
        self.out_spec: _pytree.TreeSpec | None = None
        # Output leaves with each tensor replaced by an index into ``outputs``.
        self.out_leaves: list[Any] = []
        self.outputs: list[_CachedOutput] = []
        # Input leaf indices saved by the boundary (empty: no boundary).
        self.boundary_inputs: list[int] = []
        # Weak: a slot lives as long as some saved handle of the region needs it.
        self.slots: list[weakref.ref[_InputSlot]] = []
        self.rng_state: Any = None
        # Tensors the checkpoint had saved when this call returned (None: unknown).
        self.saves_after: int | None = None
        self.unreachable = False
        self.offload: Any = None  # offload group of this call, prefetched by the replay

    def check_outputs_unchanged(self) -> None:
        """Raise if a cached output was changed in place since the region returned.

        Checked at the end of the forward (the original may be gone by the replay,
        and some frameworks give the cached alias a version counter of its own) and
        again in each replay."""
        backend = self.region.backend
        for cached in self.outputs:
            if cached.snapshot is not None and cached.snapshot.changed(backend):
                raise CachedValueMutatedError(
                    f"The output of excluded region {self.region.name!r} was modified in place "
                    "after the region returned. The replay would hand the changed value to the "
                    "code after the region. Make the in-place operation out-of-place (e.g. "
                    "`y = y * 2` instead of `y.mul_(2)`), or clone the output before changing it."
                )

    def release(self) -> None:
        """The forward is over (or failed): stop holding the original outputs."""
        for cached in self.outputs:
            if cached.snapshot is not None:
                cached.snapshot.release()

    def drop_cache(self) -> None:
        """Called when the checkpoint saved nothing after this call: an early-stopping
        replay ends before the code after it runs (at the latest in the boundary,
        which still binds the deferred inputs), so its outputs need not be kept."""
        self.unreachable = True
        for cached in self.outputs:
            if cached.snapshot is not None:
                self.region.saved_bytes -= cached.nbytes
                cached.snapshot = None


class _OutputIndex(int):
    """Marks a tensor's position in ``CacheEntry.out_leaves``."""


# --------------------------------------------------------------------------- the region


class ExcludedRegion:
    """The engine behind ``checkpoint_exclude_wrapper``: one per wrapper.

    ``runs`` counts executions of the wrapped callable, ``skips`` the replays
    that returned the cached output instead.
    """

    def __init__(
        self, backend: Backend, name: str, save_output: bool, offloader: Any = None
    ) -> None:
        self.backend = backend
        self.name = name
        self.save_output = save_output
        # Copies what the region keeps to host memory (recomp.torch._offload); None: keep.
        self.offloader = offloader
        self.runs = 0
        self.skips = 0
        # Activation bytes the last call inside a checkpoint keeps until backward: saved
        # tensors kept for real and the cached output, each storage once, parameters aside.
        self.saved_bytes = 0
        self._warned_foreign = False

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``fn`` (the wrapped module) as this region; see NOTE [ How an excluded region... ]."""
        state = get_recompute_state()
        if state is not None and state.is_recomputing:
            return self._replay(state._invocation, args, kwargs)
        grad = self.backend.grad_enabled()
        if grad and not self._warned_foreign and self.backend.in_backward():
            # Running during backward, but not in a recomp replay: a checkpoint that
            # recomp does not control is replaying this region (or a recomp checkpoint
            # around it), so the exclusion cannot take effect.
            self._warn_foreign_replay()
        if state is None or not grad:
            out = fn(*args, **kwargs)
            self.runs += 1
            return out
        return self._record(state._invocation, fn, args, kwargs)

    def _warn_foreign_replay(self) -> None:
        self._warned_foreign = True
        framework = self.backend.name
        warnings.warn(
            f"Excluded region {self.name!r} is being executed again during backward by a "
            f"checkpoint that recomp does not control (for example a plain "
            f"{_FOREIGN_CHECKPOINT.get(framework, 'checkpoint')} or a reentrant checkpoint), so "
            "its exclusion is not in effect and it is replayed. Checkpoint the enclosing block "
            f"with recomp.{framework}.checkpoint or recomp.{framework}.checkpoint_wrapper instead.",
            ForeignCheckpointWarning,
            stacklevel=4,
        )

    # -- forward -------------------------------------------------------------

    def _record(
        self,
        inv: Invocation,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        outer = _active_region.get()
        if outer is not None:
            raise NestedExclusionError(
                f"Excluded region {self.name!r} was called inside excluded region {outer.name!r}. "
                f"Excluding {outer.name!r} already keeps everything inside it out of the replay: "
                f"remove the inner checkpoint_exclude_wrapper (around {self.name!r})."
            )
        backend = self.backend
        leaves, in_spec = _pytree.flatten((args, kwargs))
        entry = CacheEntry(self, in_spec)

        offload = self.offloader.open_group(self.name) if self.offloader is not None else None
        packer = _Packer(self, inv, fn, leaves, in_spec, offload)
        token = _active_region.set(self)
        try:
            with backend.saved_tensors_hooks(packer.pack, _unpack), backend.region_context():
                out = fn(*args, **kwargs)
        except BaseException:
            if offload is not None:
                offload.abort()
            raise
        finally:
            _active_region.reset(token)
            kept = packer.kept
            slots = packer.close()
        self.runs += 1

        if inv.align_rng:
            entry.rng_state = backend.get_rng_state()
        out_leaves, entry.out_spec = _pytree.flatten(out)
        differentiable: list[int] = []  # positions in out_leaves
        for pos, leaf in enumerate(out_leaves):
            if not backend.is_tensor(leaf):
                entry.out_leaves.append(leaf)
                continue
            requires_grad = backend.requires_grad(leaf)
            cached = (
                _Snapshot(backend, leaf, backend.detach(leaf), hold=True, offload=offload)
                if self.save_output
                else None
            )
            key = backend.storage_key(leaf)
            new_bytes = 0
            if key is not None:
                inv.excluded_output_keys.add(key)
                if not self.save_output:
                    inv.unsaved_outputs[key] = self.name
                elif key not in kept:
                    new_bytes = kept[key] = backend.storage_nbytes(leaf)
            entry.outputs.append(_CachedOutput(cached, requires_grad, new_bytes))
            entry.out_leaves.append(_OutputIndex(len(entry.outputs) - 1))
            if requires_grad:
                differentiable.append(pos)

        if slots and differentiable:
            entry.boundary_inputs = sorted(slots)
            passed = backend.boundary(
                [leaves[i] for i in entry.boundary_inputs], [out_leaves[p] for p in differentiable]
            )
            for pos, alias in zip(differentiable, passed):
                out_leaves[pos] = alias
        entry.slots = [weakref.ref(slot) for slot in slots.values()]
        if inv.save_counter is UNSET:
            inv.save_counter = backend.save_counter()
        if callable(inv.save_counter):
            entry.saves_after = inv.save_counter()
        if offload is not None:
            offload.close()
            entry.offload = offload
        inv.entries.append(entry)
        self.saved_bytes = sum(kept.values())
        return _pytree.unflatten(out_leaves, entry.out_spec)

    # -- replay --------------------------------------------------------------

    def _replay(self, inv: Invocation, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        backend = self.backend
        cursor = inv.replay_cursor
        if cursor >= len(inv.entries):
            raise ReplayMismatchError(
                f"The checkpoint's replay called excluded region {self.name!r}, but its forward "
                f"recorded only {len(inv.entries)} excluded call(s), all already replayed. The "
                "checkpointed function must call its excluded regions in the same order and "
                "number in the forward and in the replay (no control flow that depends on "
                "is_recomputing() or on values that change between the two)."
            )
        entry = inv.entries[cursor]
        if entry.region is not self:
            raise ReplayMismatchError(
                f"The checkpoint's replay called excluded region {self.name!r} where its forward "
                f"called {entry.region.name!r} (excluded call #{cursor + 1}). The checkpointed "
                "function must call its excluded regions in the same order in the forward and in "
                "the replay."
            )
        inv.replay_cursor = cursor + 1
        leaves, in_spec = _pytree.flatten((args, kwargs))
        if in_spec != entry.in_spec:
            raise ReplayMismatchError(
                f"The replay called excluded region {self.name!r} with arguments shaped "
                f"{in_spec!r}, the forward with {entry.in_spec!r}. The checkpointed code must pass "
                "the same structure of arguments in both."
            )
        for ref in entry.slots:
            slot = ref()
            if slot is not None:  # None: the region's backward no longer needs it
                slot.bind(leaves[slot.index])
        entry.check_outputs_unchanged()
        if entry.offload is not None:
            entry.offload.prefetch()  # the region's backward comes later in this pass
        if entry.rng_state is not None:
            backend.set_rng_state(entry.rng_state)

        self.skips += 1
        values = [
            backend.replay_alias(c.snapshot.get(), c.requires_grad)
            if c.snapshot is not None
            else backend.stub(c.requires_grad)
            for c in entry.outputs
        ]
        if entry.boundary_inputs:
            grad_idx = [i for i, c in enumerate(entry.outputs) if c.requires_grad]
            passed = backend.boundary(
                [leaves[i] for i in entry.boundary_inputs], [values[i] for i in grad_idx]
            )
            for i, alias in zip(grad_idx, passed):
                values[i] = alias
        if entry.unreachable:  # the replay should have stopped in the boundary or before
            raise ReplayMismatchError(
                f"The checkpoint's replay went past excluded region {self.name!r}, although "
                "its forward saved no tensor after the region, so an early-stopping replay "
                "ends there. The replay must run the same code as the forward."
            )
        if not self.save_output:
            values = [backend.placeholder(v, self.name) for v in values]
        out_leaves = [
            values[leaf] if isinstance(leaf, _OutputIndex) else leaf for leaf in entry.out_leaves
        ]
        assert entry.out_spec is not None
        return _pytree.unflatten(out_leaves, entry.out_spec)


def _input_path(path: str) -> str:
    """'[0][1]' of the flattened (args, kwargs) pair -> 'args[1]'; '[1]['x']' -> "kwargs['x']"."""
    if path.startswith("[0]"):
        return "args" + path[3:]
    if path.startswith("[1]"):
        return "kwargs" + path[3:]
    return path


# --------------------------------------------------------------------------- checkpoint


class _ComposedContext:
    """Enter several contexts in order, exit in reverse; re-enterable like ``PhaseContext``."""

    def __init__(self, *contexts: Any) -> None:
        self.contexts = contexts
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            for context in self.contexts:
                stack.enter_context(context)
            self._stacks.append(stack.pop_all())

    def __exit__(self, *exc_info: Any) -> bool:
        return bool(self._stacks.pop().__exit__(*exc_info))


class _ReplayRng:
    """For frameworks whose checkpoint does not restore the RNG fully: the replay starts
    from the random state the forward started from, and leaves it as it found it."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.forward_state = backend.get_rng_state()
        self._saved: list[Any] = []

    def __enter__(self) -> None:
        self._saved.append(self.backend.get_rng_state())
        self.backend.set_rng_state(self.forward_state)

    def __exit__(self, *exc_info: Any) -> None:
        self.backend.set_rng_state(self._saved.pop())


def make_context_fn(
    invocation: Invocation,
    user_context_fn: Callable[[], tuple[Any, Any]] | None,
    *,
    forward_replays: bool = False,
    rng_backend: Backend | None = None,
) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` handed to the framework's checkpoint: recomp's state outermost.

    ``forward_replays``: this checkpoint call re-runs, inside the replay of an
    enclosing checkpoint, a call whose forward already ran (see ``begin``);
    its excluded regions must then return their cached outputs.
    ``rng_backend``: restore the RNG for the replay here (see ``_ReplayRng``).
    """

    def context_fn() -> tuple[Any, Any]:
        forward: list[Any] = [PhaseContext(invocation, is_recomputing=forward_replays)]
        replay: list[Any] = [PhaseContext(invocation, is_recomputing=True)]
        if rng_backend is not None:
            replay.append(_ReplayRng(rng_backend))
        if user_context_fn is not None:
            user_forward, user_replay = user_context_fn()
            forward.append(user_forward)
            replay.append(user_replay)
        return (
            forward[0] if len(forward) == 1 else _ComposedContext(*forward),
            replay[0] if len(replay) == 1 else _ComposedContext(*replay),
        )

    return context_fn


def begin(
    backend: Backend,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    user_context_fn: Callable[[], tuple[Any, Any]] | None,
    *,
    align_rng: bool,
    restore_rng: bool = False,
) -> Callable[[], tuple[Any, Any]]:
    """Start one checkpoint call; return the ``context_fn`` for the framework's checkpoint.

    A checkpoint called inside the replay of another recomp checkpoint is a
    re-run of a call that already ran in that checkpoint's forward: it gets
    the same invocation back, so its excluded regions are not executed again.
    """
    parent = get_recompute_state()
    if parent is not None and parent.is_recomputing:
        invocation = parent._invocation.next_child()
        replaying = True
    else:
        invocation = Invocation(align_rng=align_rng)
        for leaf in _iter_tensors(backend, (args, kwargs)):
            key = backend.storage_key(leaf)
            if key is not None:
                invocation.checkpoint_input_keys.add(key)
        if parent is not None:
            parent._invocation.children.append(invocation)
            # The parent's replay re-runs this call in full (see above) and needs
            # every cached output then, even those this checkpoint's own replay skips.
            invocation.save_counter = None
        replaying = False
    return make_context_fn(
        invocation,
        user_context_fn,
        forward_replays=replaying,
        rng_backend=backend if restore_rng else None,
    )


def _iter_tensors(backend: Backend, tree: Any) -> Iterator[Any]:
    leaves, _ = _pytree.flatten(tree)
    return (leaf for leaf in leaves if backend.is_tensor(leaf))


def check_use_reentrant(use_reentrant: Any, framework: str) -> None:
    if use_reentrant:
        raise ValueError(
            "recomp checkpoints are non-reentrant: excluded regions rely on saved-tensor hooks, "
            "which a reentrant checkpoint bypasses. Drop use_reentrant=True (or pass "
            f"use_reentrant=False) when calling recomp.{framework}.checkpoint."
        )


def check_save_output(save_output: Any) -> None:
    if not isinstance(save_output, bool):
        raise ValueError(
            f"save_output must be True or False, got {save_output!r} "
            f"({type(save_output).__name__})."
        )
