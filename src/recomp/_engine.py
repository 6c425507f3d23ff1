"""The exclusion engine, shared by every framework backend.

Where things live:

* ``_state``   the public recompute state and its context variable (a leaf module);
* ``_record``  what one checkpoint call records: ``Invocation``, ``CacheEntry``, snapshots;
* ``_engine``  (here) excluded regions: what they save, defer, cache and replay; the
  start of a checkpoint call (``begin``) and its ``context_fn``;
* ``_backend`` the framework questions, with shared defaults;
  ``torch/_backend.py`` and ``mindspore/_backend.py`` answer them, and each
  framework's ``_compat.py`` holds every use of that framework's private API.

NOTE [ How an excluded region is kept out of the replay ]

A recomp checkpoint is the framework's own non-reentrant checkpoint: in the
forward, a saved-tensors hook replaces every tensor that autograd saves by a
placeholder; in backward, the first unpack replays the forward and takes the
tensors from the replay, position by position. recomp adds a recompute state
(``_state``) that tells code which call it belongs to and whether it is the
forward or a replay, and carries the call's record (``_record.Invocation``).

An excluded region, in the forward of an invocation:
  1. runs under an inner saved-tensors hook, which takes precedence over the
     checkpoint's, so the tensors its autograd nodes save are kept for real
     (``_Kept``) instead of being dropped and replayed;
  2. appends a ``CacheEntry`` to the invocation holding its outputs, detached
     (the region's own graph is kept alive by the caller's graph, not by us),
     rebuilt in the replay as the same container types (``_pytree``);
  3. passes its differentiable outputs through an autograd *boundary*
     (see NOTE [ Deferred inputs ]).
In a replay, the region is not called: the entry at the replay cursor gives
the outputs back, with the same ``requires_grad`` so that the recomputed code
after it saves exactly what it saved in the forward (the checkpoint matches
saved tensors by position, so the replay must save the same sequence). An
entry matches a replayed call by what is called (``callee_identity``), not by
wrapper object, so a wrapper created anew on each call still matches.

Invariants the code relies on:
  * Entries are consumed in call order and never removed; each replay starts
    from the first entry (``Invocation.on_replay_start``), so ``retain_graph``
    and repeated backwards see the same cache. The invocation is held by the
    recompute state that the checkpoint frame keeps: it dies with the graph.
  * Nothing the cache or a saved-tensor handle holds refers back to the
    autograd graph once the forward is over (outputs and kept saved tensors are
    aliases without history, inputs are bound detached; a cached output's
    original is held only until the end of the forward, see ``Snapshot``), so
    no reference cycle that the garbage collector cannot see keeps a graph alive.
  * Storage keys are compared only while the tensors they came from are held
    (``StorageRegistry``, the region's own inputs), so a freed address that a
    new tensor reuses is never taken for the old storage.
  * In-place changes are caught by version counters, of the original and of the
    kept alias: at the end of the forward, in each replay, and on unpack. Where
    reading counters needs the framework's queue drained (``Backend.sync``),
    it is drained once per region call, per forward and per replayed entry.
  * A region that changes one of its inputs in place: a saved tensor taken after
    the change is kept, not deferred (the replay's input holds the old values),
    and the replay repeats the change on its own input (``MutatedInput``), so
    the code after the region sees what the forward saw.
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
region, the engine binds each handle's ``InputSlot`` to the replay's tensor at
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
copy); inputs the region had changed in place when it saved them. Saving those
as they are costs no memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from ._backend import IDENTITY, NOT_A_VIEW, Backend
from ._pytree import TreeSpec
from ._record import CachedOutput, CacheEntry, Invocation, MutatedInput, Snapshot
from ._state import CallIdentity, PhaseContext, RecomputeState, get_recompute_state
from .errors import (
    CachedValueMutatedError,
    ForeignCheckpointWarning,
    NestedExclusionError,
    RecompError,
    ReplayMismatchError,
)

# The excluded region whose forward is running in this context, if any.
ACTIVE_REGION: contextvars.ContextVar[ExcludedRegion | None] = contextvars.ContextVar(
    "recomp_active_region", default=None
)


# Told ("enter" | "exit" | "skip", region name) when an excluded region starts or ends its
# forward or is skipped by a replay. Set only while a debug checkpoint runs (its op log).
REGION_LISTENER: contextvars.ContextVar[Callable[[str, str], None] | None] = contextvars.ContextVar(
    "recomp_region_listener", default=None
)


class _Observers:
    """Callbacks the test seam (``recomp._testing``) installs; all None in normal use."""

    __slots__ = ("boundary", "deferred", "kept", "rewind", "rng_alignment")

    def __init__(self) -> None:
        self.kept: Callable[[Any, Any], None] | None = None  # (original, kept value)
        self.deferred: Callable[[bool], None] | None = None  # (is a view)
        self.boundary: Callable[[list[Any], list[Any]], None] | None = None  # forward only
        self.rng_alignment = True
        self.rewind = True


OBSERVERS = _Observers()


# --------------------------------------------------------------------------- saved tensors


class _Kept:
    """A tensor a region saved, kept for real, with the mutation check on unpack."""

    __slots__ = ("region", "snapshot")

    def __init__(self, tensor: Any, region: ExcludedRegion, offload: Any = None) -> None:
        self.snapshot = Snapshot(tensor, region.backend.keep_saved(tensor), offload=offload)
        self.region = region

    def unpack(self) -> Any:
        backend = self.region.backend
        if backend.versions_need_sync:
            backend.sync()
        if self.snapshot.changed(backend):
            raise CachedValueMutatedError(
                f"A tensor saved by excluded region {self.region.name!r} was modified in place "
                "after the region ran. Its backward would use the changed value. Make the "
                "in-place operation out-of-place (e.g. `y = y + 1` instead of `y.add_(1)`), or "
                "clone the region's output before changing it."
            )
        return self.snapshot.get()


class InputSlot:
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

    def __init__(self, slot: InputSlot, view: Any) -> None:
        self.slot = slot
        self.view = view

    def unpack(self) -> Any:
        slot = self.slot
        if slot.bound is None:
            raise ReplayMismatchError(
                f"Excluded region {slot.region.name!r} needs its input {slot.path} from the "
                "checkpoint's replay, but the replay has not reached the region. This happens "
                "when the region's output is used outside the autograd graph of its checkpoint "
                "(for example through .detach() and re-attached), or when it is kept inside an "
                "object recomp does not look into. Pass the output on unchanged, or exclude the "
                "region from a recomp checkpoint only."
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
        in_spec: TreeSpec,
        offload: Any = None,
    ) -> None:
        backend = region.backend
        self.region = region
        self.fn: Callable[..., Any] | None = fn
        # Offload group of this call (None: keep on the device); not for checkpoint inputs.
        self.offload = offload
        self.checkpoint_inputs = inv.checkpoint_inputs
        self._parameter_keys: set[Hashable] | None = None
        self.leaves: list[Any] = leaves
        self.in_spec = in_spec
        self.slots: dict[int, InputSlot] = {}
        self.snapshots: list[Snapshot] = []  # of kept tensors, versions read at close()
        # Storages kept for real (parameters aside) -> bytes, for ExcludedRegion.saved_bytes.
        self.kept: dict[Hashable, int] = {}
        # Storage of each input the replay will reproduce -> its leaf index.
        self.deferrable: dict[Hashable, int] = {}
        # Version of each tensor input at entry, and per deferred handle the version of
        # its input when it was deferred: to tell when the region changes an input.
        self.entry_versions: dict[int, int | None] = {}
        self.deferred_versions: list[tuple[int, int | None]] = []
        needs_sync = backend.versions_need_sync
        if needs_sync:
            backend.sync()
        for i, leaf in enumerate(leaves):
            if not backend.is_tensor(leaf) or backend.is_parameter(leaf):
                continue
            self.entry_versions[i] = backend.version(leaf)
            key = backend.storage_key(leaf)
            if key is None:
                continue
            if key in inv.excluded_outputs:
                inv.consumed.add(key)
            elif key not in inv.checkpoint_inputs:
                self.deferrable.setdefault(key, i)

    def pack(self, t: Any) -> Any:
        region = self.region
        backend = region.backend
        key = backend.storage_key(t)
        index = self.deferrable.get(key) if self.deferrable else None
        if index is not None:
            base = self.leaves[index]
            # An input changed in place by the region before this save holds values
            # the replay's input will not have: keep it for real (the version read
            # here may lag on asynchronous frameworks; close() checks again).
            version = backend.version(base)
            view = backend.view_spec(t, base)
            if view is not NOT_A_VIEW and version == self.entry_versions.get(index):
                slot = self.slots.get(index)
                if slot is None:
                    path = _input_path(self.region.backend.leaf_paths(self.in_spec)[index])
                    slot = self.slots[index] = InputSlot(region, index, path, backend.layout(base))
                self.deferred_versions.append((index, version))
                if OBSERVERS.deferred is not None:
                    OBSERVERS.deferred(view is not IDENTITY)
                return _Deferred(slot, view)
        if backend.is_parameter(t) or key in self.parameter_keys():
            kept = _Kept(t, region)
        else:
            self.kept[key] = backend.storage_nbytes(t)
            offload = self.offload if key not in self.checkpoint_inputs else None
            kept = _Kept(t, region, offload)
            if OBSERVERS.kept is not None:
                OBSERVERS.kept(t, kept.snapshot.value)
        self.snapshots.append(kept.snapshot)
        return kept

    def parameter_keys(self) -> set[Hashable]:
        """Storages of the wrapped module's parameters. A parameter may be saved through
        an alias (a transpose, a cast view): recognised by storage, it is not counted
        in saved_bytes, which is about activations. Computed on first need."""
        if self._parameter_keys is None:
            backend = self.region.backend
            params = backend.parameters_of(self.fn)
            self._parameter_keys = {backend.storage_key(p) for p in params}
        return self._parameter_keys

    def mutated_inputs(self) -> list[int]:
        """Input leaves the region changed in place (the backend synced by the caller);
        raises if a deferred handle's input changed after it was saved."""
        backend = self.region.backend
        mutated = [
            i
            for i, before in self.entry_versions.items()
            if before is not None and backend.version(self.leaves[i]) != before
        ]
        for index, version in self.deferred_versions:
            if index in mutated and backend.version(self.leaves[index]) != version:
                raise CachedValueMutatedError(
                    f"Excluded region {self.region.name!r} changed its input "
                    f"{self.slots[index].path} in place after an operation inside it had saved "
                    "that input for backward, which would then see the changed value. Make the "
                    "in-place operation out-of-place (e.g. `x = x.relu()` instead of "
                    "`x.relu_()`)."
                )
        return mutated

    def close(self) -> dict[int, InputSlot]:
        """Forget the inputs (see the class docstring); return the slots that were created."""
        slots = self.slots
        self.leaves = []
        self.deferrable = {}
        self.slots = {}
        self.snapshots = []
        self.fn = None
        self._parameter_keys = None
        self.offload = None
        return slots


class _OutputIndex(int):
    """Marks a tensor's position in ``CacheEntry.out_leaves``."""


def callee_identity(fn: Any) -> Any:
    """What identifies the code a region runs, across wrapper objects: the module or
    object of a bound method with its function, a function's code, else the callable.
    A module made around a plain function (``_recomp_function``) is that function."""
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", None)
    if owner is not None and func is not None:
        inner = getattr(owner, "_recomp_function", None)
        return callee_identity(inner) if inner is not None else (owner, func)
    return getattr(fn, "__code__", None) or fn


# --------------------------------------------------------------------------- the region


class ExcludedRegion:
    """The engine behind ``checkpoint_exclude_wrapper``: one per wrapper.

    ``runs`` counts executions of the wrapped callable, ``skips`` the replays
    that returned the cached output instead.
    """

    def __init__(
        self,
        backend: Backend,
        name: str,
        save_output: bool,
        copy_output: bool = False,
        offloader: Any = None,
    ) -> None:
        check_flag("save_output", save_output)
        check_flag("copy_output", copy_output)
        if copy_output and not save_output:
            raise ValueError(
                "copy_output=True caches a copy of the output, save_output=False caches none: "
                "pass one of them."
            )
        self.backend = backend
        self.name = name
        self.save_output = save_output
        self.copy_output = copy_output
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
            return self._replay(_invocation(state), fn, args, kwargs)
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
        return self._record(_invocation(state), fn, args, kwargs)

    def _warn_foreign_replay(self) -> None:
        self._warned_foreign = True
        backend = self.backend
        warnings.warn(
            f"Excluded region {self.name!r} is being executed again during backward by a "
            f"checkpoint that recomp does not control (for example a plain "
            f"{backend.foreign_checkpoint} or a reentrant checkpoint), so its exclusion is not "
            "in effect and it is replayed. Checkpoint the enclosing block with "
            f"{backend.package}.checkpoint or {backend.package}.checkpoint_wrapper instead.",
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
        outer = ACTIVE_REGION.get()
        if outer is not None:
            raise NestedExclusionError(
                f"Excluded region {self.name!r} was called inside excluded region {outer.name!r}. "
                f"Excluding {outer.name!r} already keeps everything inside it out of the replay: "
                f"remove the inner checkpoint_exclude_wrapper (around {self.name!r})."
            )
        backend = self.backend
        leaves, in_spec = backend.flatten((args, kwargs))
        entry = CacheEntry(self, callee_identity(fn), in_spec)

        offload = self.offloader.open_group(self.name) if self.offloader is not None else None
        packer = _Packer(self, inv, fn, leaves, in_spec, offload)
        token = ACTIVE_REGION.set(self)
        listener = REGION_LISTENER.get()
        try:
            if listener is not None:
                listener("enter", self.name)
            with backend.saved_tensors_hooks(packer.pack, _unpack), backend.region_context():
                out = fn(*args, **kwargs)
            if backend.versions_need_sync:
                backend.sync()
            mutated = packer.mutated_inputs()
            for snapshot in packer.snapshots:
                snapshot.read_versions(backend)
        except BaseException:
            if offload is not None:
                offload.abort()
            raise
        finally:
            ACTIVE_REGION.reset(token)
            if listener is not None:
                listener("exit", self.name)
            kept = packer.kept
            slots = packer.close()
        self.runs += 1

        if inv.align_rng and OBSERVERS.rng_alignment:
            entry.rng_state = backend.get_rng_state()
        out_leaves, entry.out_spec = backend.flatten(out)
        differentiable: list[int] = []  # positions in out_leaves
        out_leaves_index: dict[int, int] = {}  # position in out_leaves -> in entry.outputs
        for pos, leaf in enumerate(out_leaves):
            if not backend.is_tensor(leaf):
                self._check_not_opaque(leaf, entry.out_spec, pos)
                entry.out_leaves.append(leaf)
                continue
            requires_grad = backend.requires_grad(leaf)
            cached = None
            copied_bytes = 0
            if self.save_output:
                value = backend.copy(leaf) if self.copy_output else backend.detach(leaf)
                copied_bytes = backend.storage_nbytes(value) if self.copy_output else 0
                # A copy is recomp's alone: later changes of the original do not reach it.
                origin = value if self.copy_output else leaf
                cached = Snapshot(origin, value, hold=not self.copy_output, offload=offload)
                cached.read_versions(backend)
            key = backend.storage_key(leaf)
            new_bytes = 0
            if key is not None:
                inv.excluded_outputs.add(key, leaf)
                if not self.save_output:
                    inv.unsaved_outputs[key] = self.name
                elif self.copy_output:
                    new_bytes = copied_bytes
                elif key not in kept:
                    new_bytes = kept[key] = backend.storage_nbytes(leaf)
            out_leaves_index[pos] = len(entry.outputs)
            entry.outputs.append(CachedOutput(cached, requires_grad, new_bytes, self.copy_output))
            entry.out_leaves.append(_OutputIndex(len(entry.outputs) - 1))
            if requires_grad:
                differentiable.append(pos)
        for index in mutated:
            leaf = leaves[index]
            snapshot = Snapshot(leaf, backend.detach(leaf))
            snapshot.read_versions(backend)
            entry.mutated_inputs.append(MutatedInput(index, snapshot))

        if slots and differentiable:
            entry.boundary_inputs = sorted(slots)
            saved = [leaves[i] for i in entry.boundary_inputs]
            outputs = [out_leaves[p] for p in differentiable]
            if OBSERVERS.boundary is not None:
                OBSERVERS.boundary(saved, outputs)
            passed = backend.boundary(saved, outputs)
            for pos, alias in zip(differentiable, passed):
                out_leaves[pos] = alias
                cached = entry.outputs[out_leaves_index[pos]].snapshot
                if cached is not None and not self.copy_output:
                    cached.retarget(alias, backend)
        entry.slots = [weakref.ref(slot) for slot in slots.values()]
        counter = inv.ask_save_counter(backend)
        if counter is not None:
            entry.saves_after = counter()
        if offload is not None:
            offload.close()
            entry.offload = offload
        inv.entries.append(entry)
        self.saved_bytes = sum(kept.values()) + sum(c.nbytes for c in entry.outputs if c.copied)
        return backend.unflatten(out_leaves, entry.out_spec)

    def _check_not_opaque(self, leaf: Any, spec: TreeSpec, pos: int) -> None:
        hidden = self.backend.opaque_tensors(leaf)
        if hidden:
            path = self.backend.leaf_paths(spec)[pos]
            raise RecompError(
                f"Excluded region {self.name!r} returned a {type(leaf).__name__} (at output "
                f"{path}) whose attributes {', '.join(map(repr, hidden))} hold tensors that recomp "
                "cannot see, so it can neither cache them for the replay nor notice changes to "
                "them. Return the tensors in a tuple, list, dict, named tuple or dataclass, or "
                f"{self.backend.register_hint(type(leaf))}."
            )

    # -- replay --------------------------------------------------------------

    def _replay(
        self,
        inv: Invocation,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
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
        if entry.region is not self and entry.callee != callee_identity(fn):
            raise ReplayMismatchError(
                f"The checkpoint's replay called excluded region {self.name!r} "
                f"({_describe(callee_identity(fn))}) where its forward called "
                f"{entry.region.name!r} ({_describe(entry.callee)}) (excluded call "
                f"#{cursor + 1}). The checkpointed function must call its excluded regions in "
                "the same order in the forward and in the replay."
            )
        inv.replay_cursor = cursor + 1
        listener = REGION_LISTENER.get()
        if listener is not None:
            listener("skip", self.name)
        leaves, in_spec = backend.flatten((args, kwargs))
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
        if backend.versions_need_sync:
            backend.sync()
        entry.check_outputs_unchanged()
        if entry.offload is not None:
            entry.offload.prefetch()  # the region's backward comes later in this pass
        for mutated in entry.mutated_inputs:
            backend.copy_into(leaves[mutated.index], mutated.snapshot.value)
        if entry.rng_state is not None:
            backend.set_rng_state(entry.rng_state)

        self.skips += 1
        values = [_replay_value(backend, c) for c in entry.outputs]
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
        return backend.unflatten(out_leaves, entry.out_spec)


def _replay_value(backend: Backend, cached: CachedOutput) -> Any:
    if cached.snapshot is None:
        return backend.stub(cached.requires_grad)
    value = backend.replay_alias(cached.snapshot.get(), cached.requires_grad)
    if cached.copied:  # the code after the region may change it in place again
        value = backend.clone(value)
    return value


def _describe(callee: Any) -> str:
    if isinstance(callee, tuple):
        owner, func = callee
        return (
            f"{type(owner).__name__}.{getattr(func, '__name__', func)} of object at {id(owner):#x}"
        )
    code = getattr(callee, "co_name", None)
    if code is not None:
        return f"function {code} at {callee.co_filename}:{callee.co_firstlineno}"
    return repr(callee)


def _invocation(state: RecomputeState) -> Invocation:
    record = state.record
    assert isinstance(record, Invocation)
    return record


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


class _Replay(PhaseContext):
    """The replay phase; the test seam can make it skip the rewind of the cursors."""

    def __enter__(self) -> RecomputeState:
        if OBSERVERS.rewind:
            return super().__enter__()
        inv = _invocation(self.state)
        cursors = inv.replay_cursor, inv.child_cursor
        state = super().__enter__()
        inv.replay_cursor, inv.child_cursor = cursors
        return state


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

    call = invocation.call

    def context_fn() -> tuple[Any, Any]:
        forward_state = RecomputeState(invocation, call, is_recomputing=forward_replays)
        forward: list[Any] = [
            _Replay(forward_state) if forward_replays else PhaseContext(forward_state)
        ]
        replay: list[Any] = [_Replay(RecomputeState(invocation, call, is_recomputing=True))]
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
        invocation = _invocation(parent).next_child()
        replaying = True
    else:
        invocation = Invocation(CallIdentity(), align_rng=align_rng)
        for leaf in _iter_tensors(backend, (args, kwargs)):
            key = backend.storage_key(leaf)
            if key is not None:
                invocation.checkpoint_inputs.add(key, leaf)
        if parent is not None:
            _invocation(parent).children.append(invocation)
            # The parent's replay re-runs this call in full (see above) and needs
            # every cached output then, even those this checkpoint's own replay skips.
            invocation.disable_pruning()
        replaying = False
    return make_context_fn(
        invocation,
        user_context_fn,
        forward_replays=replaying,
        rng_backend=backend if restore_rng else None,
    )


def _iter_tensors(backend: Backend, tree: Any) -> Iterator[Any]:
    leaves, _ = backend.flatten(tree)
    return (leaf for leaf in leaves if backend.is_tensor(leaf))


def check_use_reentrant(use_reentrant: Any, package: str) -> None:
    if use_reentrant:
        raise ValueError(
            "recomp checkpoints are non-reentrant: excluded regions rely on saved-tensor hooks, "
            "which a reentrant checkpoint bypasses. Drop use_reentrant=True (or pass "
            f"use_reentrant=False) when calling {package}.checkpoint."
        )


def check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__}).")
