"""Excluded regions: the region behind each exclude wrapper, and each of its calls, from
the forward that runs it to every replay that skips it.

NOTE [ How an excluded region is kept out of the replay ]

A recomp checkpoint is the framework's own non-reentrant checkpoint: in the
forward, a saved-tensors hook replaces every tensor that autograd saves by a
placeholder; in backward, the first unpack replays the forward and takes the
tensors from the replay, position by position. recomp adds a recompute state
(``_state``) that tells code which checkpoint call it belongs to and whether it
is the forward or a replay, and carries the call's record (``_record.Invocation``).

An excluded region's call is one :class:`RegionCall`. Its life, in the order of
the code below:
  forward  ``RegionCall.run``: the region runs under an inner saved-tensors hook
           (``_SaveHook``), which takes precedence over the checkpoint's, so the
           tensors its autograd nodes save are kept for real (``_Kept``) or
           deferred to the replay (``_Deferred``, see NOTE [ Deferred inputs ]);
           then ``_record_outputs`` caches its outputs, detached and rebuilt in the
           replay as the same container types (``_pytree``), and passes the
           differentiable ones through the boundary; the call is appended to the
           invocation's entries.
  end of the checkpoint's forward (``Invocation.on_forward_end``):
           ``check_outputs_unchanged``, ``drop_cache`` (early stop), ``release``.
  replay   ``RegionCall.replay``: the region is not called; the call binds its
           deferred inputs to the replay's tensors and hands the cached outputs back.
Parties that watch a call (debug report, tests, memory reports) or move what it
keeps (offload) do so through ``recomp._hooks``.

Rules the code relies on (cited by number where it enforces them):
  1. The replay saves the same sequence of tensors as the forward. A skipped
     region creates no placeholders (its ops never ran under the checkpoint's
     hook), its cached outputs come back with the same ``requires_grad``, and
     the boundary is applied again, so the code after it saves what it saved.
  2. Entries are consumed in call order and never removed; each replay starts
     from the first entry of every log (``Invocation.on_replay_start``; region
     calls and ``recomp.torch._collective_cache``'s collectives alike), so
     ``retain_graph`` and repeated backwards see the same cache. An entry matches a replayed call
     by what is called (``callee_identity``), not by wrapper object. The
     invocation is held by the recompute state that the checkpoint frame keeps:
     it dies with the graph.
  3. Nothing the cache or a saved-tensor handle holds refers back to the
     autograd graph once the forward is over (outputs and kept tensors are
     aliases without history, inputs are bound detached, the pack hook forgets
     the call's inputs and the call itself when the region returns, a cached
     output's original is held only until the end of the forward), so no
     reference cycle that the garbage collector cannot see keeps a graph alive.
  4. Storage keys are compared only while the tensors they came from are held
     (``StorageRegistry``, the region's own inputs), so a freed address that a
     new tensor reuses is never taken for the old storage.
  5. In-place changes are caught by version counters, of the original and of
     the kept alias: at the end of the forward, in each replay, and on unpack.
     Where reading counters needs the framework's queue drained
     (``Backend.sync``), it is drained once per region call, per forward, per
     replayed entry and per unpack, never per tensor in the forward.
  6. A region that changes one of its inputs in place: a saved tensor taken
     after the change is kept, not deferred (the replay's input holds the old
     values), and the replay repeats the change on its own input
     (``MutatedInput``), so the code after the region sees what the forward saw.
  7. A region that fails leaves nothing behind: the call is appended to the
     entries only after the region returned and its outputs were recorded, the
     context variables are reset and the hook is closed in ``finally``, and a
     placement is told to abort.
  8. With early stop, calls recorded after the checkpoint's last saved tensor
     lose what they hold at the end of the forward (``drop_cache``, for every
     log of the invocation: region calls, collectives, op outputs kept by a
     per-op policy; the save counter is asked once, when the forward starts):
     the replay stops before, or in the boundary of, such a region, and before
     such an op. Not, in a checkpoint nested in another recomp checkpoint, for
     the logs that the enclosing replay reads back when it re-runs the nested
     call whole (``Invocation.add_child``; region calls and collectives: a
     re-run keeps op outputs of its own).

NOTE [ Deferred inputs ]

A region input that was computed inside the checkpoint by recomputed code
(say ``norm(h)`` fed to an excluded matmul) is reproduced by the replay anyway.
Keeping it in the region's saved tensors would hold a second copy of an
activation the checkpoint deliberately dropped. So the inner pack hook saves a
``_Deferred`` handle for any saved tensor whose storage is the storage of such
an input (storage, not identity: ``linear`` saves a 2-D view of a 3-D input),
recording how to rebuild the view from the input. When the replay reaches the
region, each handle's ``InputSlot`` is bound to the replay's tensor at the
same input path.

  D1. For that binding to happen before the region's own backward unpacks the
      handles, the region's outputs go through the boundary: an autograd
      function that saves the deferred inputs *under the checkpoint's hook* and
      reads them in its backward. Gradients reach the region's nodes only
      through the boundary, so the boundary's backward runs first, its unpack
      triggers the replay, the replay binds the slots, and only then do the
      region's nodes unpack their handles.
  D2. Not deferred: parameters; tensors whose storage is a checkpoint input (the
      checkpoint keeps those); outputs of earlier excluded regions in the same
      invocation (cached already, or deliberately not cached with
      ``save_output=False``, in which case the consumer's saved tensors are the
      one copy); inputs the region had changed in place when it saved them
      (rule 6). Saving those as they are costs no memory.
"""

from __future__ import annotations

import contextvars
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any

from ._backend import IDENTITY, NOT_A_VIEW, Backend, tensor_path
from ._hooks import OBSERVERS, Placement, Placer, RegionObserver
from ._pytree import TreeSpec
from ._record import (
    CachedOutput,
    Invocation,
    MutatedInput,
    Snapshot,
    callee_identity,
    describe_callee,
    invocation_of,
)
from ._rng_trackers import TrackerStates, capture_tracker_states
from ._selection import walk_named
from ._state import get_recompute_state
from .errors import (
    CachedValueMutatedError,
    ForeignCheckpointWarning,
    IneffectiveSelectionWarning,
    NestedExclusionError,
    RecompError,
    ReplayMismatchError,
    changed_before_backward,
    internal_error,
)

# The excluded region whose forward is running in this context, if any. Read through
# ``active_region()`` everywhere but here, so that the test seam
# (``recomp._testing.process_global_state``) can put another variable in its place.
ACTIVE_REGION: contextvars.ContextVar[ExcludedRegion | None] = contextvars.ContextVar(
    "recomp_active_region", default=None
)


def active_region() -> ExcludedRegion | None:
    """The excluded region whose forward is running here, if any."""
    return ACTIVE_REGION.get()


def _no_call() -> RegionCall | None:
    return None


# The instance attribute of a wrapped module that holds its region (``recomp._wrapping``).
REGION_ATTRIBUTE = "_recomp_region"


class ExcludedRegion:
    """The engine behind ``checkpoint_exclude_wrapper``: one per wrapper.

    ``runs`` counts executions of the wrapped callable, ``skips`` the replays
    that returned the cached output instead. ``saved_bytes`` is what the last
    call inside a checkpoint keeps until backward (saved tensors kept for real
    and the cached output, each storage once, parameters aside); the call
    itself keeps it up to date (``RegionCall._publish_saved_bytes``).
    """

    def __init__(
        self,
        backend: Backend,
        name: str,
        save_output: bool,
        copy_output: bool = False,
        placer: Placer | None = None,
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
        # Where what the region keeps lives (offload: recomp.torch._offload); None: on the device.
        self.placer = placer
        self.runs = 0
        self.skips = 0
        self.saved_bytes = 0
        self.last_call: Callable[[], RegionCall | None] = _no_call  # a weak reference
        # The module wrapped (weakly; set by the wrapper), for messages naming its path.
        self.module: Callable[[], Any] = _no_call
        self._warned_foreign = False
        self._warned_bypass = False

    def __getstate__(self) -> dict[str, Any]:
        # A copy (deepcopy, pickle of the model) has made no call yet, and the module it
        # belongs to is found from the checkpointed module when a message needs it.
        return {**self.__dict__, "last_call": _no_call, "module": _no_call}

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``fn`` (the wrapped module) as this region: recorded in a checkpoint's
        forward, skipped in its replay, a plain call elsewhere."""
        state = get_recompute_state()
        if state is not None and state.is_recomputing:
            return invocation_of(state).next_entry(self, fn, self.name).replay(self, args, kwargs)
        grad = self.backend.grad_enabled()
        if grad and not self._warned_foreign and self.backend.in_backward():
            # Running during backward, but not in a recomp replay: a checkpoint that
            # recomp does not control is replaying this region (or a recomp checkpoint
            # around it), so the exclusion cannot take effect.
            self._warn_foreign_replay()
        if state is None:
            out = fn(*args, **kwargs)
            self.runs += 1
            return out
        # Inside a checkpoint's forward, also without gradients (a region under no_grad):
        # the replay runs the same code and must find the call recorded.
        return RegionCall.run(self, invocation_of(state), fn, args, kwargs)

    def check_method_call(self, method: str) -> None:
        """Called by an exclude wrapper's ``forward``/``construct``: warn once if that
        method runs inside a recomp checkpoint without the wrapper's call around it (the
        model calls ``self.attn.forward(x)``), where the exclusion does not take effect."""
        if ACTIVE_REGION.get() is self or get_recompute_state() is None:
            return
        if self._warned_bypass or not self.backend.grad_enabled():
            return
        self._warned_bypass = True
        warnings.warn(
            f"Excluded module {self.name!r} was called as .{method}(...) inside a recomp "
            f"checkpoint. That bypasses the module call that recomp's exclusion wraps: this "
            f"call is not an excluded region (region_runs does not count it) and the replay "
            f"recomputes it like the code around it. Call the module itself (self.attn(x), "
            f"not self.attn.{method}(x)).",
            IneffectiveSelectionWarning,
            stacklevel=4,
        )

    def _warn_foreign_replay(self) -> None:
        self._warned_foreign = True
        backend = self.backend
        warnings.warn(
            f"Excluded region {self.name!r} is being executed again during backward by a "
            f"checkpoint that recomp does not control (for example a plain "
            f"{backend.foreign_checkpoint} or a reentrant checkpoint), so its exclusion is not "
            "in effect and it is replayed. Checkpoint the enclosing block with "
            f"{backend.package}.checkpoint or {backend.package}.checkpoint_wrapper instead."
            + backend.foreign_switch_fix,
            ForeignCheckpointWarning,
            stacklevel=4,
        )


def _nested(inner: ExcludedRegion, outer: ExcludedRegion, inv: Invocation) -> NestedExclusionError:
    """The error for ``inner`` called inside ``outer``: both named by their module paths in
    the checkpointed module where they are modules below it (else the inner one by its
    path in the outer one), their classes, and their region names where those differ."""
    backend = inner.backend
    root, inner_module, outer_module = inv.root(), inner.module(), outer.module()
    inner_path = outer_path = None
    where = ""
    if root is not None:
        named = walk_named(backend.modules.named_children, root)
        for _, module in named:  # regions of a copied model know no module: found here
            region = vars(module).get(REGION_ATTRIBUTE)
            if region is inner and inner_module is None:
                inner_module = module
            elif region is outer and outer_module is None:
                outer_module = module
        paths = {id(m): p for p, m in named}
        inner_path, outer_path = paths.get(id(inner_module)), paths.get(id(outer_module))
        if inner_path and outer_path:
            where = f", both in the checkpointed {type(root).__name__}"
        else:
            inner_path = outer_path = None
    if not where and outer_module is not None and inner_module is not None:
        below = walk_named(backend.modules.named_children, outer_module)
        relative = next((p for p, m in below if m is inner_module), None)
        if relative:
            where = f", as its sub-module {relative!r}"
    inner_text = _region_label(inner, inner_module, inner_path)
    outer_text = _region_label(outer, outer_module, outer_path)
    return NestedExclusionError(
        f"Excluded region {inner_text} was called inside excluded region {outer_text}"
        f"{where}. Excluding {outer_text} already keeps everything inside it out of the "
        f"replay: remove the inner checkpoint_exclude_wrapper (around {inner_text}), or "
        f"exclude only the parts of {outer_text} that should run once."
    )


def _region_label(region: ExcludedRegion, module: Any, path: str | None) -> str:
    """``'layers.0.mlp' (Mlp)``: a region by its path (if known), its module's class and
    its name where that says something else."""
    if module is None or getattr(module, "_recomp_function", None) is not None:
        return repr(region.name)  # a function's region: its name is the function's
    cls = type(module).__name__
    if path is None:
        return repr(region.name) if region.name == cls else f"{region.name!r} ({cls})"
    extra = "" if region.name in (path, cls) else f", region {region.name!r}"
    return f"{path!r} ({cls}{extra})"


class RegionCall:
    """One call of an excluded region in one checkpoint invocation (the entry it records).

    Created and run by :meth:`run` in the forward; afterwards it is the cache
    entry that each replay reads back (:meth:`replay`), an ``_record.LogEntry`` of
    the invocation's log of region calls. See NOTE [ How an excluded region is kept
    out of the replay ].
    """

    __slots__ = (
        "__weakref__",
        "boundary_inputs",
        "cached_bytes",
        "callee",
        "in_spec",
        "kept_bytes",
        "mutated_inputs",
        "out_leaves",
        "out_spec",
        "outputs",
        "placement",
        "region",
        "rng_state",
        "saves_after",
        "slots",
        "tracker_states",
        "unreachable",
    )

    def __init__(self, region: ExcludedRegion, callee: Any, in_spec: TreeSpec) -> None:
        self.region = region
        # What was called (see _record.callee_identity): a replay may come through
        # another wrapper object around the same callable (rule 2).
        self.callee = callee
        self.in_spec = in_spec
        self.out_spec: TreeSpec | None = None
        # Output leaves with each tensor replaced by an index into ``outputs``.
        self.out_leaves: list[Any] = []
        self.outputs: list[CachedOutput] = []
        self.mutated_inputs: list[MutatedInput] = []
        # Input leaf indices saved by the boundary (empty: no boundary).
        self.boundary_inputs: list[int] = []
        # Weak: a slot lives as long as some saved handle of the region needs it.
        self.slots: list[weakref.ref[InputSlot]] = []
        self.rng_state: Any = None
        self.tracker_states: TrackerStates | None = None  # RNG trackers when it returned
        # Tensors the checkpoint had saved when this call returned (None: unknown).
        self.saves_after: int | None = None
        self.unreachable = False
        self.placement: Placement | None = None
        # Bytes of the saved tensors kept for real (each storage once, parameters aside),
        # and what the cached outputs add to them.
        self.kept_bytes = 0
        self.cached_bytes = 0

    @property
    def region_name(self) -> str:
        return self.region.name

    # -- forward ---------------------------------------------------------------------

    @classmethod
    def run(
        cls,
        region: ExcludedRegion,
        inv: Invocation,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run the region in the forward of invocation ``inv`` and record the call."""
        outer = ACTIVE_REGION.get()
        if outer is not None:
            raise _nested(region, outer, inv)
        backend = region.backend
        leaves, in_spec = backend.flatten((args, kwargs))
        call = cls(region, callee_identity(fn), in_spec)
        observers = OBSERVERS.get()
        placer = region.placer if region.placer is not None else inv.placer
        placement = placer.open_group(region.name) if placer is not None else None
        hook = _SaveHook(call, inv, fn, leaves, placement, observers)
        token = ACTIVE_REGION.set(region)
        ok = False
        try:
            for observer in observers:
                observer.region_started(call)
            with (
                backend.saved_tensors_hooks(hook.pack, _unpack),
                backend.region_context(region.name),
            ):
                out = fn(*args, **kwargs)
            if backend.versions_need_sync:
                backend.sync()  # rule 5: once per region call
            mutated = hook.mutated_inputs()
            for snapshot in hook.snapshots:
                snapshot.read_versions(backend)
            ok = True
        finally:
            ACTIVE_REGION.reset(token)
            if not ok and placement is not None:
                placement.abort()  # rule 7
            for observer in observers:
                observer.region_finished(call, ok)
            kept, slots = hook.close()
        region.runs += 1
        call.kept_bytes = sum(kept.values())
        call.placement = placement
        try:
            out = call._record_outputs(inv, out, leaves, kept, mutated, slots, observers)
        except BaseException:
            if placement is not None:
                placement.abort()  # rule 7
            raise
        if placement is not None:
            placement.close()
        inv.record_call(call)  # rule 7: only once everything is recorded
        region.last_call = weakref.ref(call)
        call._publish_saved_bytes()
        return out

    def _record_outputs(
        self,
        inv: Invocation,
        out: Any,
        leaves: list[Any],
        kept: dict[Hashable, int],
        mutated: list[int],
        slots: dict[int, InputSlot],
        observers: tuple[RegionObserver, ...],
    ) -> Any:
        """Cache the outputs, snapshot the changed inputs and apply the boundary; return
        the outputs the caller gets."""
        region = self.region
        backend = region.backend
        if inv.align_rng:
            self.rng_state = backend.get_rng_state()
            self.tracker_states = capture_tracker_states()
        out_leaves, out_spec = backend.flatten(out)
        self.out_spec = out_spec
        differentiable: list[int] = []  # positions in out_leaves
        placement = self.placement
        for pos, leaf in enumerate(out_leaves):
            if not backend.is_tensor(leaf):
                self._check_not_opaque(leaf, out_spec, pos)
                self.out_leaves.append(leaf)
                continue
            requires_grad = backend.requires_grad(leaf)
            cached = None
            nbytes = 0  # what caching the output adds to what the region keeps
            if region.save_output:
                copy = region.copy_output
                value = backend.copy(leaf) if copy else backend.detach(leaf)
                # A copy is recomp's alone: later changes of the original do not reach it.
                origin = value if copy else leaf
                held = placement.put(origin) if placement is not None else None
                cached = Snapshot(origin, value, hold=not copy, held=held)
                cached.read_versions(backend)
                if copy:
                    nbytes = backend.storage_nbytes(value)
            key = backend.storage_key(leaf)
            if key is not None:
                inv.note_output(key, leaf, None if region.save_output else region.name)
                if region.save_output and not region.copy_output and key not in kept:
                    nbytes = kept[key] = backend.storage_nbytes(leaf)
            if cached is not None:
                for observer in observers:
                    observer.output_cached(self, leaf, nbytes)
            self.out_leaves.append(_OutputIndex(len(self.outputs)))
            self.outputs.append(CachedOutput(cached, requires_grad, nbytes, region.copy_output))
            self.cached_bytes += nbytes
            if requires_grad:
                differentiable.append(pos)
        for index in mutated:
            leaf = leaves[index]
            snapshot = Snapshot(leaf, backend.detach(leaf))
            snapshot.read_versions(backend)
            self.mutated_inputs.append(MutatedInput(index, snapshot))

        if slots and differentiable:  # NOTE [ Deferred inputs ], D1
            self.boundary_inputs = sorted(slots)
            saved = [leaves[i] for i in self.boundary_inputs]
            outputs = [out_leaves[p] for p in differentiable]
            for observer in observers:
                observer.boundary_applied(self, saved, outputs)
            passed = backend.boundary(saved, outputs)
            for pos, alias in zip(differentiable, passed):
                out_leaves[pos] = alias
                cached = self.outputs[self.out_leaves[pos]].snapshot
                if cached is not None and not region.copy_output:
                    cached.retarget(alias, backend)
        self.slots = [weakref.ref(slot) for slot in slots.values()]
        return backend.unflatten(out_leaves, out_spec)

    def _check_not_opaque(self, leaf: Any, spec: TreeSpec, pos: int) -> None:
        backend = self.region.backend
        hidden = backend.opaque_tensors(leaf)
        if hidden:
            path = backend.leaf_paths(spec)[pos]
            raise RecompError(
                f"Excluded region {self.region.name!r} returned a {type(leaf).__name__} (at "
                f"output {path}) whose attributes {', '.join(map(repr, hidden))} hold tensors "
                "that recomp cannot see, so it can neither cache them for the replay nor notice "
                "changes to them. Return the tensors in a tuple, list, dict, named tuple or "
                f"dataclass, or {backend.register_hint(type(leaf))}."
            )

    def _publish_saved_bytes(self) -> None:
        """``region_saved_bytes``: what the region's last call keeps until backward."""
        region = self.region
        if region.last_call() is self:
            region.saved_bytes = self.kept_bytes + self.cached_bytes

    # -- replay ----------------------------------------------------------------------

    def replay(self, region: ExcludedRegion, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Hand the cached outputs to a replay that reached this call (not running it)."""
        backend = region.backend
        for observer in OBSERVERS.get():
            observer.region_skipped(self)
        leaves, in_spec = backend.flatten((args, kwargs))
        if in_spec != self.in_spec:
            raise ReplayMismatchError(
                f"The replay called excluded region {region.name!r} with arguments shaped "
                f"{in_spec!r}, the forward with {self.in_spec!r}. The checkpointed code must "
                "pass the same structure of arguments in both."
            )
        for ref in self.slots:
            slot = ref()
            if slot is not None:  # None: the region's backward no longer needs it
                slot.bind(leaves[slot.index])
        if backend.versions_need_sync:
            backend.sync()  # rule 5: once per replayed entry
        self.check_outputs_unchanged()
        if self.placement is not None:
            self.placement.prefetch()  # the region's backward comes later in this pass
        for mutated in self.mutated_inputs:  # rule 6
            backend.copy_into(leaves[mutated.index], mutated.snapshot.value)
        if self.rng_state is not None:
            backend.set_rng_state(self.rng_state)
        if self.tracker_states is not None:  # the region's draws from trackers, skipped too
            self.tracker_states.restore()

        region.skips += 1
        # Out of sight of selective checkpointing's op cache, as the forward call was.
        with backend.region_context(region.name):
            values = [_replay_value(backend, c) for c in self.outputs]
        if self.boundary_inputs:  # rule 1: the replay saves what the forward saved
            grad_idx = [i for i, c in enumerate(self.outputs) if c.requires_grad]
            passed = backend.boundary(
                [leaves[i] for i in self.boundary_inputs], [values[i] for i in grad_idx]
            )
            for i, alias in zip(grad_idx, passed):
                values[i] = alias
        for observer in OBSERVERS.get():
            observer.region_outputs_returned(self)
        if self.unreachable:  # rule 8: the replay should have stopped before
            raise ReplayMismatchError(
                f"The checkpoint's replay went past excluded region {region.name!r}, although "
                "its forward saved no tensor after the region, so an early-stopping replay "
                "ends there. The replay must run the same code as the forward."
            )
        if not region.save_output:
            values = [backend.placeholder(v, region.name) for v in values]
        out_leaves = [
            values[leaf] if isinstance(leaf, _OutputIndex) else leaf for leaf in self.out_leaves
        ]
        if self.out_spec is None:
            raise internal_error("a recorded region call has no output spec")
        return backend.unflatten(out_leaves, self.out_spec)

    # -- entry of the invocation's log ---------------------------------------------------

    def matches(self, region: Any, fn: Any) -> bool:
        return self.region is region or self.callee == callee_identity(fn)

    def describe(self) -> str:
        return f"{self.region.name!r} ({describe_callee(self.callee)})"

    def check_outputs_unchanged(self) -> None:
        """Raise if a cached output was changed in place since the region returned.

        Checked at the end of the forward (the original may be gone by the replay,
        and some frameworks give the cached alias a version counter of its own) and
        again in each replay. The caller has synced the backend."""
        backend = self.region.backend
        for cached in self.outputs:
            if cached.snapshot is not None and cached.snapshot.changed(backend):
                raise CachedValueMutatedError(
                    f"The output of excluded region {self.region.name!r} was modified in place "
                    "after the region returned. The replay would hand the changed value to the "
                    "code after the region. Make the in-place operation out-of-place (e.g. "
                    "`y = y * 2` instead of `y.mul_(2)`); or, where that code cannot be changed "
                    "(a library's `out += identity` or `ReLU(inplace=True)`), wrap the region with "
                    "checkpoint_exclude_wrapper(..., copy_output=True) (with "
                    "apply_activation_checkpointing: copy_output_fn=), which caches a copy of the "
                    "output that later in-place changes do not reach."
                )

    def release(self) -> None:
        """The forward is over (or failed): stop holding the original outputs (rule 3)."""
        for cached in self.outputs:
            if cached.snapshot is not None:
                cached.snapshot.release()
        for mutated in self.mutated_inputs:
            mutated.snapshot.release()

    def drop_cache(self) -> None:
        """Called when the checkpoint saved nothing after this call: an early-stopping
        replay ends before the code after it runs (at the latest in the boundary,
        which still binds the deferred inputs), so its outputs need not be kept (rule 8)."""
        self.unreachable = True
        for cached in self.outputs:
            cached.snapshot = None
        self.cached_bytes = 0
        self._publish_saved_bytes()


class _OutputIndex(int):
    """Marks a tensor's position in ``RegionCall.out_leaves``."""


def _replay_value(backend: Backend, cached: CachedOutput) -> Any:
    if cached.snapshot is None:
        return backend.stub(cached.requires_grad)
    value = backend.replay_alias(cached.snapshot.get(), cached.requires_grad)
    if cached.copied:  # the code after the region may change it in place again
        value = backend.clone(value)
    return value


# --------------------------------------------------------------------------- saved tensors


class _Kept:
    """A tensor a region saved, kept for real, with the mutation check on unpack.

    Holds the region (long-lived), not the call: the autograd graph holds this
    object, and the call holds the region's outputs, whose graph holds it (rule 3)."""

    __slots__ = ("call", "region", "snapshot")

    def __init__(
        self, region: ExcludedRegion, snapshot: Snapshot, call: weakref.ref[RegionCall]
    ) -> None:
        self.region = region
        self.snapshot = snapshot
        # Weak, one reference shared by the call's kept tensors: for memory reports.
        self.call = call

    def unpack(self) -> Any:
        backend = self.region.backend
        if backend.versions_need_sync:
            backend.sync()  # rule 5: once per unpack
        if self.snapshot.changed(backend):
            raise CachedValueMutatedError(
                f"A tensor saved by excluded region {self.region.name!r} was modified in place "
                "after the region ran. Its backward would use the changed value. Make the "
                "in-place operation out-of-place (e.g. `y = y + 1` instead of `y.add_(1)`), or "
                "clone the region's output before changing it."
            )
        return self.snapshot.get()


def _NO_MODULE() -> None:  # a weak reference that is always dead: no module to name
    return None


class _KeptParameter(_Kept):
    """A parameter (or an alias of one) that a region saved: kept as it is, and refused on
    unpack if it changed since the forward, with its name (NOTE [ State changed before
    backward ] in ``recomp._module_state``)."""

    __slots__ = ("module",)

    def __init__(
        self,
        region: ExcludedRegion,
        snapshot: Snapshot,
        call: weakref.ref[RegionCall],
        module: Callable[[], Any],
    ) -> None:
        super().__init__(region, snapshot, call)
        self.module = module  # weak: the region's module, to name the parameter

    def unpack(self) -> Any:
        backend = self.region.backend
        if backend.versions_need_sync:
            backend.sync()  # rule 5: once per unpack
        if self.snapshot.changed(backend):
            module = self.module()
            name = None if module is None else tensor_path(backend, module, self.snapshot.get())
            raise changed_before_backward(
                [("parameter", name)],
                f"excluded region {self.region.name!r}",
                "the region's backward",
            )
        return self.snapshot.get()


class InputSlot:
    """One region input that the replay will supply; bound when the replay reaches the region."""

    __slots__ = (
        "__weakref__",
        "bound",
        "index",
        "invocation",
        "layout",
        "observers",
        "path",
        "region",
    )

    def __init__(
        self,
        region: ExcludedRegion,
        invocation: Invocation,
        index: int,
        path: str,
        layout: Hashable,
        observers: tuple[RegionObserver, ...],
    ) -> None:
        self.region = region
        # Weak: the graph holds the slot, and the invocation must die with its checkpoint.
        self.invocation = weakref.ref(invocation)
        self.index = index
        self.path = path
        self.layout = layout
        # The forward's observers, to explain an error raised later, in backward.
        self.observers = observers
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

    def not_reached_error(self) -> ReplayMismatchError:
        """The region's backward needs this input, and no replay has bound it."""
        name = self.region.name
        invocation = self.invocation()
        if invocation is not None and invocation.replays:
            # The boundary's backward made the checkpoint replay first (NOTE [ Deferred
            # inputs ], D1), so that replay ran and did not call this region.
            message = (
                f"The checkpoint's replay did not reach excluded region {name!r}, whose "
                f"backward needs its input {self.path} from that replay: the replay ran other "
                "code than the forward. A Python branch that depends on state that changed "
                "between the two (a counter, a flag, is_recomputing()) skipped the region or "
                "called other code in its place. Make the checkpointed code take the same path "
                "in the forward and in the replay; checkpoint(..., debug=True) lists the ops "
                "of both."
            )
        else:
            message = (
                f"Excluded region {name!r} needs its input {self.path} from the checkpoint's "
                "replay, but no replay of that checkpoint has run. This happens when the "
                "region's output is used outside the autograd graph of its checkpoint (for "
                "example through .detach() and re-attached), or when it is kept inside an "
                "object recomp does not look into. Pass the output on unchanged, or exclude "
                "the region from a recomp checkpoint only."
            )
        for observer in self.observers:
            message = observer.explain(message)
        return ReplayMismatchError(message)


class _Deferred:
    """Stands in for a saved tensor that is (a view of) a region input the replay reproduces."""

    __slots__ = ("slot", "view")

    def __init__(self, slot: InputSlot, view: Any) -> None:
        self.slot = slot
        self.view = view

    def unpack(self) -> Any:
        slot = self.slot
        if slot.bound is None:
            raise slot.not_reached_error()
        if self.view is IDENTITY:
            return slot.bound
        return slot.region.backend.apply_view(self.view, slot.bound)


def _unpack(packed: Any) -> Any:
    return packed.unpack()


class SavedByRegion:
    """What a memory report may read of a handle that a region's pack hook returned."""

    __slots__ = ("call", "deferred_slot", "region", "snapshot")

    def __init__(
        self,
        region: ExcludedRegion,
        call: RegionCall | None,
        snapshot: Snapshot | None,
        deferred_slot: InputSlot | None,
    ) -> None:
        self.region = region
        self.call = call  # None once the call's record is gone
        self.snapshot = snapshot  # the kept tensor (None: deferred)
        self.deferred_slot = deferred_slot  # the input the replay rebuilds (None: kept)


def saved_by_region(packed: Any) -> SavedByRegion | None:
    """Describe ``packed`` if a region's pack hook made it (kept or deferred), else None."""
    if isinstance(packed, _Kept):
        return SavedByRegion(packed.region, packed.call(), packed.snapshot, None)
    if isinstance(packed, _Deferred):
        return SavedByRegion(packed.slot.region, None, None, packed.slot)
    return None


class _SaveHook:
    """The inner pack hook of one region call: keeps saved tensors, or defers region inputs.

    Separate from :class:`RegionCall` because the autograd graph keeps a
    reference to the pack hook of every tensor it saved (not only to the unpack
    hook): ``close()`` drops the references to the region's inputs and to the
    call once the region has returned; otherwise the graph would pin exactly the
    inputs that deferral is meant to release, and reach the call's cache (rule 3).
    """

    def __init__(
        self,
        call: RegionCall,
        inv: Invocation,
        fn: Callable[..., Any],
        leaves: list[Any],
        placement: Placement | None,
        observers: tuple[RegionObserver, ...],
    ) -> None:
        region = call.region
        backend = region.backend
        self.region = region
        self.call = call
        self.call_ref = weakref.ref(call)
        self.observers = observers
        self.fn: Callable[..., Any] | None = fn
        self.placement = placement
        self.invocation = inv
        self.checkpoint_inputs = inv.checkpoint_inputs
        self._parameter_keys: set[Hashable] | None = None
        self._module_ref: Any = None
        self.leaves: list[Any] = leaves
        self.in_spec = call.in_spec
        self.slots: dict[int, InputSlot] = {}
        self.snapshots: list[Snapshot] = []  # of kept tensors, versions read after the region
        # Storages kept for real (parameters aside) -> bytes.
        self.kept: dict[Hashable, int] = {}
        # Storage of each input the replay will reproduce -> its leaf index (rule 4:
        # ``leaves`` holds those inputs while the key is in here).
        self.deferrable: dict[Hashable, int] = {}
        # Version of each tensor input at entry, and per deferred handle the version of
        # its input when it was deferred: to tell when the region changes an input (rule 6).
        self.entry_versions: dict[int, int | None] = {}
        self.deferred_versions: list[tuple[int, int | None]] = []
        if backend.versions_need_sync:
            backend.sync()
        for i, leaf in enumerate(leaves):
            if not backend.is_tensor(leaf) or backend.is_parameter(leaf):
                continue
            self.entry_versions[i] = backend.version(leaf)
            key = backend.storage_key(leaf)
            if key is not None and inv.note_input(key):  # NOTE [ Deferred inputs ], D2
                self.deferrable.setdefault(key, i)

    def pack(self, t: Any) -> Any:
        region = self.region
        backend = region.backend
        key = backend.storage_key(t)
        index = self.deferrable.get(key) if self.deferrable else None
        if index is not None:
            base = self.leaves[index]
            # An input changed in place by the region before this save holds values
            # the replay's input will not have: keep it for real (rule 6; the version
            # read here may lag on asynchronous frameworks, mutated_inputs checks again).
            version = backend.version(base)
            view = backend.view_spec(t, base)
            if view is not NOT_A_VIEW and version == self.entry_versions.get(index):
                slot = self.slots.get(index)
                if slot is None:
                    path = _input_path(backend.leaf_paths(self.in_spec)[index])
                    slot = self.slots[index] = InputSlot(
                        region, self.invocation, index, path, backend.layout(base), self.observers
                    )
                self.deferred_versions.append((index, version))
                for observer in self.observers:
                    observer.tensor_deferred(self.call, t, view is not IDENTITY)
                return _Deferred(slot, view)
        if backend.is_parameter(t):
            # The parameter object itself, as autograd saves a leaf, not an alias of the
            # memory it has now: a framework that releases a parameter's data after the
            # forward and gathers it again for backward (ZeRO-3, FSDP1) frees it here too.
            snapshot = Snapshot(t, t)
            self.snapshots.append(snapshot)
            return _KeptParameter(region, snapshot, self.call_ref, self.module_ref())
        alias = backend.keep_saved(t)
        if key in self.parameter_keys():
            snapshot = Snapshot(t, alias)
            self.snapshots.append(snapshot)
            return _KeptParameter(region, snapshot, self.call_ref, self.module_ref())
        else:
            self.kept[key] = backend.storage_nbytes(t)
            # The checkpoint keeps its own inputs on the device anyway, unless the same
            # placer holds them (one record per storage): then the region's alias would
            # keep on the device what the placer moved.
            placement = self.placement
            if key in self.checkpoint_inputs and not getattr(
                placement, "holds_checkpoint_inputs", False
            ):
                placement = None
            held = placement.put(t) if placement is not None else None
            snapshot = Snapshot(t, alias, held=held)
            for observer in self.observers:
                observer.tensor_kept(self.call, t, snapshot.value)
        self.snapshots.append(snapshot)
        return _Kept(region, snapshot, self.call_ref)

    def module_ref(self) -> Any:
        """A weak reference to the module the region runs (None for a plain function),
        made once per call: for naming a saved parameter in an error."""
        if self._module_ref is None:
            module = self.region.backend.modules.module_of(self.fn)
            self._module_ref = _NO_MODULE if module is None else weakref.ref(module)
        return self._module_ref

    def parameter_keys(self) -> set[Hashable]:
        """Storages of the wrapped module's parameters. A parameter may be saved through
        an alias (a transpose, a cast view): recognised by storage, it is not counted
        in saved_bytes, which is about activations. Computed on first need."""
        if self._parameter_keys is None:
            backend = self.region.backend
            params = backend.modules.parameters_of(self.fn)
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

    def close(self) -> tuple[dict[Hashable, int], dict[int, InputSlot]]:
        """Forget the inputs and the call (see the class docstring); return the storages
        kept and the slots that were created."""
        kept, slots = self.kept, self.slots
        self.call = None  # type: ignore[assignment]
        self.leaves = []
        self.deferrable = {}
        self.slots = {}
        self.snapshots = []
        self.kept = {}
        self.fn = None
        self._parameter_keys = None
        self._module_ref = None
        self.placement = None
        self.observers = ()
        self.invocation = None  # type: ignore[assignment]
        return kept, slots


def _input_path(path: str) -> str:
    """'[0][1]' of the flattened (args, kwargs) pair -> 'args[1]'; '[1]['x']' -> "kwargs['x']"."""
    if path.startswith("[0]"):
        return "args" + path[3:]
    if path.startswith("[1]"):
        return "kwargs" + path[3:]
    return path


def check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__}).")
