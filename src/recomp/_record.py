"""What one recomp checkpoint call records: the exclusion cache and its bookkeeping.

An :class:`Invocation` is created per checkpoint call (see ``_engine.begin``)
and carried by the recompute state of that call's forward and replays. It is
the engine's: the state (``_state``) only tells it, through the
:class:`~recomp._state.PhaseListener` methods, when a replay starts and when
the forward ends. Each excluded-region call appends one :class:`CacheEntry`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from .errors import CachedValueMutatedError, OutputNotSavedError, ReplayMismatchError

if TYPE_CHECKING:
    from ._backend import Backend
    from ._engine import ExcludedRegion, InputSlot
    from ._pytree import TreeSpec
    from ._state import CallIdentity


class Snapshot:
    """A tensor kept by recomp, and a way to tell whether it was changed in place since.

    ``value`` is what is kept: an alias without autograd history (see
    ``Backend.keep_saved``). The version counters of the original and of
    ``value`` are both checked: some frameworks give an alias a counter of its
    own. The original is referenced weakly, except that a cached output holds it
    (``hold=True``) until the end of its checkpoint's forward, when the first
    check runs (``release``): holding it longer would tie the cache to the
    autograd graph in a cycle the collector cannot see.

    Version counters are read by :meth:`read_versions`, which the engine calls
    once per batch of snapshots (after one ``Backend.sync``), not per tensor.
    """

    __slots__ = ("held", "offloaded", "origin", "origin_version", "value", "value_version")

    def __init__(self, tensor: Any, value: Any, hold: bool = False, offload: Any = None) -> None:
        # With ``offload`` (an offload group, see recomp.torch._offload), a host copy
        # is kept instead of ``value`` where the group takes the tensor.
        self.offloaded = offload.put(tensor) if offload is not None else None
        self.value = value if self.offloaded is None else None
        self.held = tensor if hold else None
        # Weak from the start: a kept tensor's autograd node holds this snapshot, so a
        # strong reference would close a cycle through the graph (a region that raises
        # before its versions are read would leak it).
        self.origin: Any = weakref.ref(tensor)
        self.origin_version: int | None = None
        self.value_version: int | None = None

    def read_versions(self, backend: Backend) -> None:
        """Record the current versions (the framework's queue already drained)."""
        origin = self.held if self.held is not None else self.origin()
        self.value_version = backend.version(self.value)
        self.origin_version = None if origin is None else backend.version(origin)
        if self.origin_version is None:
            self.origin = None

    def retarget(self, tensor: Any, backend: Backend) -> None:
        """Watch ``tensor`` instead of the original: the alias of it that the caller
        receives (frameworks whose aliases have their own version counters)."""
        if self.held is not None:
            self.held = tensor
        self.origin = weakref.ref(tensor)
        self.read_versions(backend)

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


class CachedOutput:
    """One tensor a region returned, as the replay will hand it back."""

    __slots__ = ("copied", "nbytes", "requires_grad", "snapshot")

    def __init__(
        self, snapshot: Snapshot | None, requires_grad: bool, nbytes: int, copied: bool
    ) -> None:
        self.snapshot = snapshot  # None when save_output=False or dropped
        self.requires_grad = requires_grad
        self.nbytes = nbytes
        self.copied = copied  # the cache holds a copy: each replay gets a fresh one


class MutatedInput:
    """A region input the region changed in place: the replay repeats the change."""

    __slots__ = ("index", "snapshot")

    def __init__(self, index: int, snapshot: Snapshot) -> None:
        self.index = index
        self.snapshot = snapshot


class CacheEntry:
    """One call of an excluded region in one invocation."""

    __slots__ = (
        "boundary_inputs",
        "callee",
        "in_spec",
        "mutated_inputs",
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

    def __init__(self, region: ExcludedRegion, callee: Any, in_spec: TreeSpec) -> None:
        self.region = region
        # What was called (see _engine.callee_identity): a replay may come through
        # another wrapper object around the same callable.
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
        # Tensors the checkpoint had saved when this call returned (None: unknown).
        self.saves_after: int | None = None
        self.unreachable = False
        self.offload: Any = None  # offload group of this call, prefetched by the replay

    def snapshots(self) -> list[Snapshot]:
        out = [c.snapshot for c in self.outputs if c.snapshot is not None]
        out.extend(m.snapshot for m in self.mutated_inputs)
        return out

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
        """The forward is over (or failed): stop holding the original outputs."""
        for snapshot in self.snapshots():
            snapshot.release()

    def drop_cache(self) -> None:
        """Called when the checkpoint saved nothing after this call: an early-stopping
        replay ends before the code after it runs (at the latest in the boundary,
        which still binds the deferred inputs), so its outputs need not be kept."""
        self.unreachable = True
        for cached in self.outputs:
            if cached.snapshot is not None:
                self.region.saved_bytes -= cached.nbytes
                cached.snapshot = None


class StorageRegistry:
    """Storages seen in a checkpoint's forward, by ``Backend.storage_key``, with the
    tensors that own them held until the forward ends: while a key is in here its
    memory cannot be freed and its address reused by another tensor."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[Hashable, Any] = {}

    def add(self, key: Hashable, tensor: Any) -> None:
        self._held.setdefault(key, tensor)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._held

    def __iter__(self) -> Any:
        return iter(self._held)

    def clear(self) -> None:
        self._held.clear()


class Invocation:
    """Everything one checkpoint call shares between its forward and its replays.

    Held by the recompute state that the framework's checkpoint keeps in its
    frame (through ``context_fn``), so it lives exactly as long as the
    checkpoint's autograd graph.
    """

    __slots__ = (
        "__weakref__",
        "_counter_asked",
        "align_rng",
        "call",
        "checkpoint_inputs",
        "child_cursor",
        "children",
        "consumed",
        "entries",
        "excluded_outputs",
        "replay_cursor",
        "save_counter",
        "unsaved_outputs",
    )

    def __init__(self, call: CallIdentity, *, align_rng: bool = True) -> None:
        # What the user sees of this call (its id, its resources), the same in every phase.
        self.call = call
        # Whether the replay restores the RNG state of the forward; only then
        # does skipping a region need to fast-forward the generators.
        self.align_rng = align_rng
        # Exclusion cache: one entry per excluded-region call, in call order.
        self.entries: list[CacheEntry] = []
        self.replay_cursor = 0
        # Storages of the checkpoint's own inputs and of the outputs of excluded
        # regions (forward only): region inputs that alias these are already held
        # elsewhere, so a region saves them as they are instead of deferring.
        self.checkpoint_inputs = StorageRegistry()
        self.excluded_outputs = StorageRegistry()
        # save_output=False outputs (storage -> region name) and the storages that
        # later excluded regions took as inputs: each of the former must be among the latter.
        self.unsaved_outputs: dict[Hashable, str] = {}
        self.consumed: set[Hashable] = set()
        # Recomp checkpoints called inside this one's forward, in call order. The
        # replay re-runs those calls; each reuses its invocation (see next_child).
        self.children: list[Invocation] = []
        self.child_cursor = 0
        # How many tensors the framework's checkpoint has saved so far, when its
        # replay stops after the last of them (early stop); None if unknown or
        # not applicable. Asked once, by the first excluded region recorded.
        self.save_counter: Callable[[], int] | None = None
        self._counter_asked = False

    def ask_save_counter(self, backend: Backend) -> Callable[[], int] | None:
        if not self._counter_asked:
            self._counter_asked = True
            self.save_counter = backend.save_counter()
        return self.save_counter

    def disable_pruning(self) -> None:
        """Keep every cached output: an enclosing checkpoint's replay re-runs this
        call in full, beyond where this checkpoint's own replay would stop."""
        self._counter_asked = True
        self.save_counter = None

    def next_child(self) -> Invocation:
        """The invocation of the nested checkpoint that this replay is re-running."""
        if self.child_cursor >= len(self.children):
            raise ReplayMismatchError(
                f"The replay of a checkpoint called a nested recomp checkpoint that its forward "
                f"did not ({len(self.children)} nested call(s) recorded). The checkpointed "
                "function must make the same checkpoint calls in the forward and the replay."
            )
        child = self.children[self.child_cursor]
        self.child_cursor += 1
        return child

    # -- PhaseListener ---------------------------------------------------------------

    def on_replay_start(self) -> None:
        """Each replay starts from the first cached region (``retain_graph`` replays again)."""
        self.replay_cursor = 0
        self.child_cursor = 0

    def on_forward_end(self, ok: bool) -> None:
        """End of the checkpoint's forward: prune, check and release the cache."""
        unsaved, consumed = self.unsaved_outputs, self.consumed
        self.unsaved_outputs, self.consumed = {}, set()
        self.checkpoint_inputs.clear()
        self.excluded_outputs.clear()
        if not ok:
            for entry in self.entries:
                entry.release()
            return
        if self.save_counter is not None:
            # A replay that stops at the last saved tensor never reaches the regions
            # recorded after it: their cached outputs would only take memory.
            total = self.save_counter()
            for entry in self.entries:
                if entry.saves_after == total:
                    entry.drop_cache()
        try:
            if self.entries:
                self.entries[0].region.backend.sync()
            for entry in self.entries:
                entry.check_outputs_unchanged()
        finally:
            for entry in self.entries:
                entry.release()
        for key, name in unsaved.items():
            if key not in consumed:
                raise OutputNotSavedError(
                    f"The output of excluded region {name!r} was created with save_output=False "
                    "but did not go into another excluded region of the same checkpoint. Without "
                    "a cached copy the replay cannot hand it to other code. Use save_output=True "
                    "for this region."
                )
