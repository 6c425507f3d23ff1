"""State a replay must see as the forward saw it, and whose forward updates happen once.

A checkpoint's replay runs the checkpointed module's forward again, during backward.
Whatever that forward reads outside the tensors autograd connects it to is read again
then, and whatever it writes is written again:

* **parameters** the forward used that are not the module's own at replay time
  (``torch.func.functional_call`` with fast weights, ``stack_module_state``: the
  swap ends when the call returns, before backward);
* **buffers and parameters without gradients** that the forward updates in place or
  rebinds (BatchNorm's running statistics, a custom running mean, a spectral norm's
  ``_u``/``_v``, a quantiser's ranges, MindSpore cells that ``ops.assign`` their own
  statistics): replayed as they are, they would be read after the forward's update
  and updated a second time.

:class:`ModuleState` is the part of a checkpoint call that handles both, for the
modules the replay re-runs (``root`` and the modules below it, excluded regions
aside: the replay does not run those). When the call starts it notes, for each
parameter and buffer, the tensor the module holds, and for the state a forward may
update (buffers, parameters without gradients: "watched") a copy of the value where
one is needed (below). When the forward ends it finds what the forward changed. Each
replay then runs with the module holding, at every changed place, what the forward
saw: the forward's tensor where the module holds another one now, the copy of the
value from before the forward where the forward updated it. After the replay the
module holds again what it held before, so the forward's updates stay, once, and the
replay's are dropped (they went to the copies).

NOTE [ Which state a checkpoint call copies ]
Copying every watched tensor at every call would double the state of a model with
frozen weights (PEFT) for the whole step. So a checkpoint call copies what forwards
of the same module in the same mode (training or eval) have been seen to update, and
on the first call of a module in a mode:

* where version counters show every in-place write (``Modules.state_versions_track_
  writes``, PyTorch): its buffers; a frozen parameter is watched by its version only.
  A watched tensor the forward updated without a copy (a frozen parameter, or a
  buffer first updated by a later call) warns once per module
  (:class:`~recomp.errors.ReplayStateWarning`: that call's replay read the updated
  value) and is copied from the next call on;
* where they do not (MindSpore: kernels and ``ops.assign`` leave them alone): every
  watched tensor, compared with its copy when the forward ends to learn which ones
  the forward updates. A first update after that call is not seen (documented).

Running statistics that kernels update without a trace in the version counter
(PyTorch's and MindSpore's BatchNorm: ``Modules.running_statistics`` names them) are
copied at every call in training mode and count as updated.

Copies of what the forward did not update are dropped when the forward ends, so the
first call costs one module's watched state for the length of its forward; the copies
that stay are the size of what the forward updates (statistics, not activations) and
live until the checkpoint's graph is freed.

How a replay is made to see the forward's state is the framework's answer
(``Modules.state_for_replay``): PyTorch swaps tensors into the module's parameter and
buffer slots, as ``functional_call`` does (a tensor the replay saves for backward is
then never written again by recomp); the default copies values in and back out.

NOTE [ Calls after the first: layouts ]
Walking the modules and making a slot per tensor at every call is most of what this part
costs a layer whose kernels take microseconds. Where the backend can read the tensors
again without a walk (``Modules.tree_layout``, PyTorch) and what a call copies is known, a
walk's result is kept as a layout (holding the modules weakly: it lives as long as its
root, and a module that refers back to the root does not keep it alive; a module that
died is a change). What a call copies is known where all of the root's state trains
(nothing), or, where versions show every write, once a forward of the root in its mode
has been seen: its running statistics and what forwards in that mode updated (a
BatchNorm's statistics and counter in training mode, a running mean kept in a buffer);
frozen parameters (PEFT's base weights) and buffers no forward updated are read, not
copied. The first call walks and learns, the second builds the layout. Later calls read
the tensors from it (``Modules.layout_tensors``, which answers None once a module,
parameter or buffer was added, removed or replaced, a tensor's ``requires_grad`` or,
where some state does not train, a module's training flag changed, or a region was
excluded or unwrapped: the call walks again), copy what the layout says before the
forward, and build no slot. Where some state does not train, the call notes every
tensor's version when it starts; the forward's end notes them again, and a forward that
wrote one it does not copy in place (a first update) builds the slots from the layout
(the copies made go with them), which report it and learn from it as below, and drops
the layout. A replay that finds the modules holding the same tensors, those it does not
copy at the same versions (``Modules.layout_versions``), puts in place only the copies,
as a slot with a copy would. Anything else (a tensor swapped in by ``functional_call``
or rebound by the forward, a parameter changed before backward) builds the slots from
the layout and takes the path below, so every guarantee is the walk's. Where versions do
not show every write (MindSpore), a root with state a forward may update is walked at
every call.

NOTE [ State changed before backward ]
A parameter or buffer changed in place after a forward that read it and before that
forward's backward (an optimizer step or weight clipping between
``d_loss.backward(retain_graph=True)`` and ``g_loss.backward()`` in a GAN step) makes
a replay recompute with the new values: the gradients are wrong without a sign.
Autograd refuses such a step without checkpointing, since the tensors it saved changed
version; a replay saves them afresh, so nothing would. recomp refuses it too
(:class:`~recomp.errors.ParameterChangedError`, naming the tensor), wherever the stale
value would be read:

* a replay (``ModuleState.__enter__``): each slot whose replay reads the tensor itself
  (no copy of it is kept) notes its version when the forward ends (``_Slot.settled``);
  a replay that finds another version refuses before it runs. Slots with a copy (the
  forward's own updates: running statistics, buffers the forward writes) are read from
  the copy and need no check, so a later forward of the same module updating them
  before this backward (all micro-batches' forwards first) stays legitimate;
* an excluded region's backward (``recomp._region._KeptParameter``): the region saved
  the parameter itself, whose version its snapshot notes; recomp's own restoring
  swaps tensors (PyTorch) and never writes a slot the check reads;
* a later backward pass reading what a replay kept for it (``recomp.torch._kept``):
  each kept tensor's version is noted when kept.

It costs one version read per parameter and buffer per checkpoint call and per replay,
and no copy. It cannot see a write that leaves the version counter alone
(``param.data.clamp_()``, which autograd does not see either; ``determinism_check=
"values"`` compares the values themselves and catches it), state a checkpointed plain
function reaches without a module (only modules' slots are noted), or a parameter object
that a framework put in place of the forward's (FSDP's sharded and unsharded
parameters, left to it as above). Where version counters do not track writes
(``Modules.state_versions_track_writes``, MindSpore) there is nothing to compare; there
a forward and its backward run in one call (``mindspore.grad``), with no user code
between them.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

from ._backend import Backend, StateChange
from ._hooks import CallPart, CheckpointCallView, Stage
from ._region import ExcludedRegion
from .errors import ReplayStateWarning, RunningStatisticsWarning, changed_before_backward

#: The attribute an excluded region's module holds its region under.
_REGION = "_recomp_region"


def _replayed_modules(
    backend: Backend, root: Any, path: str, skipped: list[Any] | None = None
) -> list[tuple[str, Any]]:
    """``root`` and the modules below it that a replay of ``root`` runs (each once), in
    depth-first order; into ``skipped``, the excluded regions' modules the walk reached
    and left out. A list filled in one loop (no generator to resume per module)."""
    seen: set[int] = set()
    found: list[tuple[str, Any]] = []
    stack = [(path, root)]
    while stack:
        where, module = stack.pop()
        if id(module) in seen:
            continue
        if isinstance(vars(module).get(_REGION), ExcludedRegion):
            if skipped is not None:
                skipped.append(module)
            continue
        seen.add(id(module))
        found.append((where, module))
        children = backend.modules.named_children(module)
        for name, child in reversed(children):
            stack.append((f"{where}.{name}" if where else name, child))
    return found


class _Slot:
    """One parameter or buffer of a replayed module, as the checkpoint call found it."""

    __slots__ = (
        "before",
        "changed",
        "kind",
        "module",
        "name",
        "path",
        "settled",
        "tensor",
        "version",
        "watched",
    )

    def __init__(self, path: str, module: Any, name: str, tensor: Any, kind: str) -> None:
        self.path = path
        self.module = module
        self.name = name
        self.tensor = tensor  # what the module held when the forward started
        # "parameter", "frozen" (no gradient), "buffer", or "statistics": running
        # statistics the forward updates without a trace (see the NOTE)
        self.kind = kind
        self.watched = kind != "parameter"  # what a forward may update
        self.version: int | None = None
        self.before: Any = None  # a copy of the value from before the forward
        self.changed = False  # the forward updated it (in place or by rebinding)
        # The version of ``tensor`` when the forward ended, where a replay reads the
        # tensor itself (no copy): NOTE [ State changed before backward ].
        self.settled: int | None = None

    @property
    def kind_name(self) -> str:
        return "buffer" if self.kind in ("buffer", "statistics") else "parameter"


def _rebound(backend: Backend, live: Any, slot: _Slot) -> bool:
    """Whether the module holds another tensor than the forward saw at ``slot``, one that
    recomp must swap back for the replay. One parameter object in place of another is a
    framework's own swap (FSDP's sharded and unsharded parameters), which it undoes
    itself before the module runs again: left to it."""
    return live is not slot.tensor and not (
        backend.is_parameter(live) and backend.is_parameter(slot.tensor)
    )


class _Layout:
    """What a walk of one root module found, where the backend can read it again without
    a walk (``Modules.tree_layout``) and what each call copies is known: all of it trains,
    or (where versions show every write) forwards of the root in its mode have been seen,
    and each call copies the running statistics and what those forwards updated
    (NOTE [ Calls after the first: layouts ]). Later calls of the root read their tensors
    from ``layout`` and build no slot unless something differs."""

    __slots__ = ("copied", "layout", "meta", "watched")

    def __init__(
        self,
        layout: Any,
        meta: list[tuple[str, weakref.ref[Any], str, str]],
        copied: tuple[int, ...],
    ) -> None:
        self.layout = layout  # the backend's
        # Path, module (weakly: the layout lives as long as its root), name and kind of
        # each tensor ``layout`` reads.
        self.meta = meta
        # Whether some of it is state a forward may update: each call then notes its
        # versions when the forward starts, to see a forward that does update it.
        self.watched = any(kind != "parameter" for _, _, _, kind in meta)
        # Which of the tensors each call copies before its forward (indices into
        # ``meta``): the forward updates them, and each replay reads the copy.
        self.copied = copied


#: Per root module, by its id: the root (weakly) and its :class:`_Layout`, or None where
#: it has none (state a forward may update, or no read without a walk). Looked up at every
#: call (a dictionary read in place, no method); an entry leaves with its root.
_LAYOUTS: dict[int, tuple[weakref.ref[Any], _Layout | None]] = {}


def _put_layout(root: Any, layout: _Layout | None) -> None:
    key = id(root)
    # The callback reads the dictionary it was put in, not this module's global: a root
    # that dies while the interpreter exits may outlive the module's globals.
    layouts = _LAYOUTS

    def forget(ref: weakref.ref[Any]) -> None:
        entry = layouts.get(key)
        if entry is not None and entry[0] is ref:
            del layouts[key]

    with contextlib.suppress(TypeError):  # no weak reference: walked at every call
        _LAYOUTS[key] = (weakref.ref(root, forget), layout)


#: Per root module and mode (training or not), the paths of the watched tensors some
#: forward updated (NOTE [ Which state a checkpoint call copies ]).
_UPDATED: weakref.WeakKeyDictionary[Any, dict[bool, set[str]]] = weakref.WeakKeyDictionary()
#: Root modules whose uncopied update was reported (once each).
_REPORTED: weakref.WeakSet[Any] = weakref.WeakSet()


def _updated(backend: Backend, root: Any) -> set[str] | None:
    """What forwards of ``root`` in its current mode have been seen to update (None before
    the first)."""
    modes = _UPDATED.get(root)
    return None if modes is None else modes.get(backend.modules.is_training(root))


def _copied(backend: Backend, root: Any, slots: list[_Slot]) -> tuple[int, ...] | None:
    """Which of ``slots`` a call of ``root`` that reads them from a layout copies before
    its forward: none where all of it trains; else (where versions show every write, and
    forwards of ``root`` in its mode have been seen) its running statistics and what those
    forwards updated. None where a call must walk: versions do not show every write, or
    no forward in this mode has been seen yet (the first call learns what it updates)."""
    if all(slot.kind == "parameter" for slot in slots):
        return ()
    if not backend.modules.state_versions_track_writes:
        return None
    updated = _updated(backend, root)
    if updated is None:
        return None
    return tuple(
        index
        for index, slot in enumerate(slots)
        if slot.kind == "statistics" or (slot.watched and slot.path in updated)
    )


def _copy_once(backend: Backend, copies: dict[int, Any], tensor: Any) -> Any:
    """A copy of ``tensor`` from ``copies`` (by its id), made there on first ask: one copy
    per tensor in a call, also where modules share it."""
    key = id(tensor)
    copy = copies.get(key)
    if copy is None:
        copy = copies[key] = backend.copy(tensor)
    return copy


class ModuleState(CallPart):
    """The part of a checkpoint call of a module that makes each replay see the state the
    forward saw and keeps the forward's updates once (see the module docstring)."""

    stage = Stage.RESTORED_STATE

    __slots__ = (
        "_before",
        "_layout",
        "_learning",
        "_replays",
        "_settled",
        "_slots",
        "_started",
        "_tensors",
        "backend",
        "root",
        "watched",
    )

    def __init__(
        self,
        backend: Backend,
        root: Any,
        slots: list[_Slot] | None,
        layout: _Layout | None = None,
        tensors: list[Any] | None = None,
    ) -> None:
        self.backend = backend
        self.root = root
        # The slots, or (the common case: nothing to copy, and a layout the backend reads
        # without a walk) none until something differs: the tensors the modules held
        # when the call started, read from ``_layout``, their versions then where some
        # of them a forward may update, and their versions when the forward ended.
        self._slots = slots
        self._layout = layout
        self._tensors = tensors
        self._started: list[int | None] | None = (
            backend.versions(tensors) if layout is not None and layout.watched else None  # type: ignore[arg-type]
        )
        self._settled: list[int | None] | None = None
        # From a layout that copies: the copies made before the forward, one per index of
        # ``_layout.copied``.
        self._before: list[Any] | None = None
        # What a forward may update (buffers, parameters without gradients): most
        # layers hold none, and their calls start with nothing to copy.
        self.watched: list[_Slot] | tuple[()] = (
            [slot for slot in slots if slot.watched] if slots is not None else ()
        )
        self._learning = False
        # Per replay entered (innermost last), the context that put the forward's tensors
        # back, or None. A tuple, empty between replays (NOTE [ What a call keeps ]).
        self._replays: tuple[Any, ...] = ()

    @property
    def slots(self) -> list[_Slot]:
        """One slot per tensor of the replayed modules (built on first use where the call
        started from a layout; from then on the call no longer uses it)."""
        if self._slots is None:
            layout, tensors = self._layout, self._tensors
            started, settled = self._started, self._settled
            assert layout is not None and tensors is not None
            before = dict(zip(layout.copied, self._before)) if self._before is not None else {}
            slots = []
            for index, ((path, ref, name, kind), tensor) in enumerate(zip(layout.meta, tensors)):
                module = ref()
                if module is None:
                    continue  # gone from the tree: the replay cannot run it
                slot = _Slot(path, module, name, tensor, kind)
                if started is not None and slot.watched:
                    slot.version = started[index]
                if index in before:  # copied before the forward: the replay reads the copy
                    slot.before = before[index]
                    slot.changed = True
                elif settled is not None:
                    slot.settled = settled[index]
                slots.append(slot)
            self._slots, self._layout, self._tensors, self._before = slots, None, None, None
            self.watched = [slot for slot in slots if slot.watched]
        return self._slots

    @classmethod
    def of(cls, backend: Backend, root: Any) -> ModuleState | None:
        """The part for a checkpoint call of the module ``root`` (the module a checkpointed
        function runs, ``Modules.module_of``), if it holds any tensor; None otherwise."""
        modules = backend.modules
        entry = _LAYOUTS.get(id(root))
        seen = entry is not None and entry[0]() is root
        layout = entry[1] if seen else None  # type: ignore[index]  # seen: an entry
        if layout is not None:
            tensors = modules.layout_tensors(layout.layout)
            if tensors is not None:
                return cls(backend, root, None, layout, tensors) if tensors else None
        skipped: list[Any] = []
        walked = _replayed_modules(backend, root, "", skipped)
        slots = []
        for path, module in walked:
            rows = modules.module_state(module)
            if not rows:
                continue
            updating: Any = ()
            # Running statistics are buffers (PyTorch) or parameters without gradients
            # (MindSpore): a module whose state trains, all of it, has none to ask for.
            if any(kind != "parameter" for _, _, kind in rows):
                statistics = modules.running_statistics(module)
                if isinstance(statistics, list):
                    updating = {id(t) for t in statistics}
            prefix = f"{path}." if path else ""
            for name, tensor, kind in rows:
                if updating and id(tensor) in updating:
                    kind = "statistics"
                slots.append(_Slot(prefix + name, module, name, tensor, kind))
        # First call, or the modules changed: a layout for the next calls, if what a call
        # copies is known and the backend has one. A root walked at every call so far
        # because it holds state a forward may update is asked again: a forward in this
        # mode may have been seen since.
        walking = seen and layout is None
        if not walking or any(slot.watched for slot in slots):
            copied = _copied(backend, root, slots)
            if copied is not None or not walking:
                found = None
                if copied is not None:
                    found = modules.tree_layout(
                        [(m, False) for _, m in walked] + [(m, True) for m in skipped], _REGION
                    )
                _put_layout(
                    root,
                    None
                    if found is None
                    else _Layout(
                        found,
                        [(s.path, weakref.ref(s.module), s.name, s.kind) for s in slots],
                        copied,  # type: ignore[arg-type]  # a layout: not None
                    ),
                )
        return cls(backend, root, slots) if slots else None

    def contexts(self, call: CheckpointCallView) -> tuple[Any, Any]:
        watched = self.watched
        layout = self._layout
        if not watched and (layout is None or not layout.copied):
            return None, self
        backend = self.backend
        copies: dict[int, Any] = {}  # by tensor id: :func:`_copy_once`
        if layout is not None:
            # From a layout: a copy of what the forward updates, for each replay to read.
            tensors = self._tensors
            self._before = [
                _copy_once(backend, copies, tensors[index])  # type: ignore[index]  # a layout's
                for index in layout.copied
            ]
            return None, self

        def keep(slot: _Slot) -> None:
            slot.before = _copy_once(backend, copies, slot.tensor)

        for slot in watched:
            if slot.kind == "statistics":
                keep(slot)
                slot.changed = True
        watched = [slot for slot in watched if slot.kind != "statistics"]
        updated = _updated(backend, self.root)
        if not backend.modules.state_versions_track_writes:
            self._learning = updated is None
            for slot in watched:
                if updated is None or slot.path in updated:
                    keep(slot)
                    slot.changed = True
            return None, self
        if backend.versions_need_sync and watched:
            backend.sync()
        for slot in watched:
            slot.version = backend.version(slot.tensor)
            first = updated is None and slot.kind == "buffer"
            if first or (updated is not None and slot.path in updated):
                keep(slot)
        return None, self

    def forward_ended(self, ok: bool) -> None:
        if not ok:
            return
        if self._slots is None:
            # From a layout: each tensor's version, for the replays to compare (NOTE
            # [ State changed before backward ]). A tensor the forward put in a module's
            # place is found by the replay, which puts back the one the call started
            # with, as a slot that saw it rebound here would.
            backend = self.backend
            if backend.versions_need_sync:
                backend.sync()
            settled = backend.versions(self._tensors)  # type: ignore[arg-type]
            started = self._started
            if started is not None and self._before is not None:
                # What was copied is read from its copy by each replay: whatever the
                # forward (or a later one, before this backward) writes there is no change.
                started = list(started)
                for index in self._layout.copied:  # type: ignore[union-attr]  # copies: a layout
                    settled[index] = started[index] = None
            if started is None or settled == started:
                self._settled = settled
                return
            # The forward wrote a tensor in place: where that is state a forward may
            # update, the first such forward of this root in this mode, which the slots
            # report and learn from (and the root's layout is dropped).
        if self.backend.modules.state_versions_track_writes:
            self._find_writes()
        elif self._learning:
            self._learn_writes()

    def _find_writes(self) -> None:
        backend = self.backend
        if backend.versions_need_sync:
            backend.sync()
        module_tensor = backend.modules.module_tensor
        version = backend.version
        updated: set[str] | None = None
        uncopied: list[str] = []
        for slot in self.slots:
            if slot.kind == "statistics":
                continue  # copied and counted as updated at the start
            tensor = slot.tensor
            live = module_tensor(slot.module, slot.name)
            rebound = live is not tensor and _rebound(backend, live, slot)
            if slot.watched and version(tensor) != slot.version:
                if updated is None:
                    modes = _UPDATED.setdefault(self.root, {})
                    updated = modes.setdefault(backend.modules.is_training(self.root), set())
                if slot.path not in updated:
                    # Later calls copy it too: the root's layout, which does not, goes.
                    updated.add(slot.path)
                    _put_layout(self.root, None)
                if slot.before is None:
                    # Too late for the value the forward read; a copy of the updated
                    # one still keeps the replay's update away from the module.
                    uncopied.append(slot.path)
                    slot.before = backend.copy(tensor)
                slot.changed = True
            else:
                slot.before = None  # the value the forward read is the tensor itself
                slot.changed = rebound
            if slot.before is None:
                slot.settled = version(tensor)
        if self.watched and updated is None:
            # Forwards of this root in this mode have been seen, updating none of it.
            _UPDATED.setdefault(self.root, {}).setdefault(
                backend.modules.is_training(self.root), set()
            )
        if uncopied and self.root not in _REPORTED:
            _REPORTED.add(self.root)
            warnings.warn(
                f"A forward of {type(self.root).__name__} updated {', '.join(uncopied)} in "
                "place, which its earlier forwards in this mode did not (or which is a "
                "parameter without gradients): recomp kept no copy from before the update, "
                "so this call's replay reads the updated value (the update still happens "
                "once) and the gradients of this step may differ from the unwrapped "
                "model's. Later calls keep a copy. To be "
                "exact from the first step, keep such state in a buffer that the module's "
                "first forward already updates, or exclude the module from the replay "
                "(exclude_fn, or checkpoint_exclude_wrapper).",
                ReplayStateWarning,
                stacklevel=2,
            )

    def _learn_writes(self) -> None:
        backend = self.backend
        updated: set[str] = set()
        for slot in self.slots:
            if not slot.watched or slot.kind == "statistics":
                continue
            if backend.modules.same_values(slot.tensor, slot.before):
                slot.before = None
                slot.changed = False
            else:
                updated.add(slot.path)
        _UPDATED.setdefault(self.root, {})[backend.modules.is_training(self.root)] = updated

    # -- the replay context: re-entrant (one entry per replay) ------------------------

    def __enter__(self) -> None:
        backend = self.backend
        layout = self._layout
        if layout is not None and self._settled is not None:
            # The modules hold the tensors the call started with, which no write has
            # changed since the forward ended: nothing to put in place (but the copies of
            # what the forward updated, where the call made some).
            now = backend.modules.layout_versions(layout.layout, self._tensors)  # type: ignore[arg-type]
            if self._before is None:
                if now == self._settled:
                    self._replays += (None,)
                    return
            elif now is not None and self._enter_copies(layout, now):
                return
        module_tensor = backend.modules.module_tensor
        version = backend.version
        changes: list[StateChange] = []
        stale: list[_Slot] = []
        for slot in self.slots:
            live = module_tensor(slot.module, slot.name)
            if slot.before is not None:
                changes.append(StateChange(slot.module, slot.name, live, slot.before, True))
                continue
            tensor = slot.tensor
            rebound = live is not tensor and _rebound(backend, live, slot)
            if (
                slot.settled is not None
                and (rebound or live is tensor)
                and version(tensor) != slot.settled
            ):
                stale.append(slot)
            elif slot.changed or rebound:
                changes.append(StateChange(slot.module, slot.name, live, tensor, False))
        if stale:
            raise changed_before_backward(
                [(slot.kind_name, slot.path) for slot in stale],
                f"the checkpointed {type(self.root).__name__}",
                "its replay",
            )
        context = backend.modules.state_for_replay(changes) if changes else None
        if context is not None:
            context.__enter__()
        self._replays += (context,)

    def _enter_copies(self, layout: _Layout, now: list[int | None]) -> bool:
        """From a layout that copies, where the modules hold the call's tensors at ``now``:
        whether those it does not copy are at the versions the forward left; if so, the
        replay runs with the modules holding the copies (entered here)."""
        before = self._before
        tensors = self._tensors
        assert before is not None and tensors is not None
        for index in layout.copied:
            now[index] = None  # read from its copy: any version
        if now != self._settled:
            return False
        meta = layout.meta
        context = self.backend.modules.state_for_replay(
            [
                StateChange(meta[i][1](), meta[i][2], tensors[i], copy, True)
                for i, copy in zip(layout.copied, before)
            ]
        )
        context.__enter__()
        self._replays += (context,)
        return True

    def __exit__(self, *exc_info: Any) -> None:
        replays = self._replays
        context = replays[-1]
        self._replays = replays[:-1]
        if context is not None:
            context.__exit__(*exc_info)


# Modules already reported by warn_unhandled (once each).
_reported: weakref.WeakSet[Any] = weakref.WeakSet()


def warn_unhandled(backend: Backend, root: Any, api: str) -> None:
    """Warn once per module about BatchNorm-like modules in ``root``'s replay whose
    running statistics are no tensor recomp can see (they would be updated twice)."""
    unhandled = []
    for path, module in _replayed_modules(backend, root, ""):
        reason = backend.modules.running_statistics(module)
        if isinstance(reason, str) and module not in _reported:
            _reported.add(module)
            unhandled.append(f"{path or type(root).__name__} ({type(module).__name__}: {reason})")
    if unhandled:
        warnings.warn(
            f"{backend.package}.{api}: the replay of {type(root).__name__} re-runs "
            f"BatchNorm-like modules whose running statistics recomp cannot restore: "
            f"{'; '.join(unhandled)}. Their statistics would be updated twice per step. "
            f"Exclude them (exclude_fn, or checkpoint_exclude_wrapper; with copy_output=True "
            f"if the code after them changes their output in place), or keep their statistics "
            f"in buffers (parameters without gradients on MindSpore).",
            RunningStatisticsWarning,
            stacklevel=4,
        )
