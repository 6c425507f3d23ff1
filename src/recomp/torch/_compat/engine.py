"""What the engine and the offloader ask of PyTorch's autograd: which storage a tensor
lives in, how often it was changed in place, and what the autograd engine is running.

Consumers: ``torch/_backend.py`` (the questions the framework-free engine asks),
``torch/_offload.py``, ``torch/_kept.py``, ``torch/_collective_cache.py``,
``torch/collectives.py``, ``torch/_memory_report.py`` and the planner's profiler.
Tested by ``tests/torch/compat/test_engine.py``.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

# --------------------------------------------------------------------------- storage identity


def storage_key(t: torch.Tensor) -> Hashable | None:
    """Identity of the storage behind ``t``, equal for every view of it.

    Why: deferring a region's input must recognise views of it (``linear`` saves
    a 2-D view of a 3-D input), and ``tensor._base`` names only the root of a
    view chain. ``untyped_storage()`` returns a new Python object per call, so its
    ``_cdata`` (the address of the C++ storage) is the stable identity.
    If it changes: falls back to the data pointer and device (ambiguous only for
    empty storages, which hold no memory to defer).
    Retired by: a public storage identity (``torch.UntypedStorage`` hash/eq by storage).
    """
    if t.layout is not torch.strided or t.is_meta:
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses have no storage
        return None
    cdata = getattr(storage, "_cdata", None)
    if cdata is not None:
        return cdata
    return ("ptr", storage.data_ptr(), t.device)


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (the root of its view chain), or None.

    Why: a swap keeps parameters on the device, and the views of them that ops save
    (``linear`` saves ``weight.t()``) too.
    ``Tensor._base`` is documented in PyTorch's view semantics but underscored.
    If it changes: None, and views of parameters are swapped like any tensor
    (correct, one copy too many).
    Retired by: a public accessor of a view's base.
    """
    return getattr(t, "_base", None)


def version(t: torch.Tensor) -> int | None:
    """The in-place modification counter of ``t``.

    Why: recomp detects in-place changes of what it caches, as autograd does.
    If it changes: None, and mutation checks are skipped (no false errors).
    Retired by: a public version counter accessor.
    """
    try:
        return t._version
    except (RuntimeError, AttributeError):  # inference tensors have no version counter
        return None


# --------------------------------------------------------------------------- process groups


def _world() -> Any:
    try:
        from torch.distributed import distributed_c10d
    except ImportError:  # a build without torch.distributed
        return None
    world = getattr(distributed_c10d, "_world", None)
    return world if hasattr(world, "_default_pg") else None


_WORLD = _world()


def default_group_exists() -> bool:
    """``torch.distributed.is_available() and torch.distributed.is_initialized()``.

    Why: asked at every checkpoint call (whether collectives can run in the replayed
    code); the public pair is four Python calls, this one attribute read.
    How: ``distributed_c10d._world._default_pg``, which ``is_initialized`` reads through
    ``GroupMember.WORLD`` and the ``default_pg`` property.
    If it changes: the public pair.
    Retired by: nothing needed; the public pair is the fallback.
    """
    if _WORLD is None:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized())
    return _WORLD._default_pg is not None


# --------------------------------------------------------------------------- autograd engine


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread.

    Why: an excluded region executed during backward but not in a recomp replay
    is being replayed by a checkpoint recomp does not control (warned about).
    If it changes: False (the warning is not given; nothing else depends on it).
    Retired by: a public "current graph task" query.
    """
    query = getattr(torch._C, "_current_graph_task_id", None)
    if query is None:
        return False
    return bool(query() != -1)


def _no_graph_task() -> int:
    return -1


#: ``graph_task_id()``: an id of the backward pass running on this thread (-1 outside one).
#:
#: Why: the offloader starts the next region's copy back once per backward pass, and a
#: checkpoint's kept replay tells passes apart (asked at every unpack: PyTorch's own
#: function, with no Python frame of recomp's around it).
#: If it changes: -1 always, and prefetching chains once per process instead.
#: Retired by: a public "current graph task" query.
graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", _no_graph_task)


def at_pass_end(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the backward pass running on this thread ends; False (and
    nothing queued) outside one.

    Why: a checkpoint's kept replay must know whether the pass that kept a tensor is
    still running: a backward run from a hook inside it (a nested pass) must replay for
    itself and leave that pass its tensors, while a later pass over the retained graph
    (a zero-bubble schedule's weight pass) reads what the finished one kept.
    How: ``torch.autograd.Variable._execution_engine.queue_callback``, which runs the
    callback when the current graph task finishes (not when it fails).
    If it changes: False, and every pass counts as finished: a nested pass reads the
    enclosing pass's tensors (PyTorch's checkpoint replays there instead).
    Retired by: a public "at the end of this backward" hook.
    """
    if graph_task_id() == -1:
        return False
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        return False
    queue(callback)
    return True


def _keeps_graph_unknown() -> bool:
    return True


#: ``pass_keeps_graph()``: whether the backward pass running on this thread keeps the
#: graph for another pass (``retain_graph=True``); True outside backward.
#:
#: Why: a node that runs in a pass that frees the graph can never run again, so what it
#: reads from a replay need not be kept for a later pass (no per-node check needed).
#: How: ``torch._C._autograd._get_current_graph_task_keep_graph`` (2.9 to 2.14), called
#: as it is at every unpack of a checkpoint's saved tensors.
#: If it changes: True, and each read asks :func:`node_finishes_in_this_pass` as before.
#: Retired by: a public "does this backward retain the graph" query.
pass_keeps_graph: Callable[[], bool] = getattr(
    torch._C._autograd, "_get_current_graph_task_keep_graph", _keeps_graph_unknown
)


def node_finishes_in_this_pass() -> bool:
    """Whether the autograd node running now computes, in this backward pass, every
    gradient it can give (False: a later pass over the retained graph may run it again
    for the others, as a zero-bubble pipeline's weight pass does); True outside backward.

    Why: a recomputed tensor is dropped after its unpack only where no later pass of the
    same micro-batch will ask for it again.
    How: ``torch._C._current_autograd_node`` and, for each next node,
    ``torch._C._will_engine_execute_node`` (what ``register_multi_grad_hook`` uses). A
    leaf captured by ``autograd.grad`` raises there; its gradient is computed.
    If it changes: True, and the tensor is dropped after its first unpack (a later pass
    replays, as with PyTorch's checkpoint).
    Retired by: a public "gradients this pass computes" query on a node.
    """
    current = getattr(torch._C, "_current_autograd_node", None)
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if current is None or will_execute is None:
        return True
    node = current()
    if node is None:
        return True
    for next_node, _ in node.next_functions:
        if next_node is None:
            continue
        try:
            if not will_execute(next_node):
                return False
        except RuntimeError:  # a leaf captured by autograd.grad: its gradient is computed
            continue
    return True


# --------------------------------------------------------------------------- module state


def module_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """``(name, tensor, kind)`` for each parameter and buffer ``module`` itself holds;
    ``kind``: ``"parameter"``, ``"frozen"`` (needs no gradient) or ``"buffer"``.

    Why: a checkpoint of a module notes them at every call (``recomp._module_state``):
    reading the module's two dictionaries costs two look-ups, where
    ``named_parameters(recurse=False)`` and ``named_buffers(recurse=False)`` build a
    generator and a set of seen tensors each.
    If it changes: the public iterators, which give the same pairs.
    Retired by: a cheap public view of a module's own parameters and buffers.
    """
    state = vars(module)
    params = state.get("_parameters")
    buffers = state.get("_buffers")
    if not isinstance(params, dict) or not isinstance(buffers, dict):
        params = dict(module.named_parameters(recurse=False))
        buffers = dict(module.named_buffers(recurse=False))
    found = [
        (n, p, "parameter" if p.requires_grad else "frozen")
        for n, p in params.items()
        if p is not None
    ]
    if buffers:
        found += [(n, b, "buffer") for n, b in buffers.items() if b is not None]
    return found


# Per module the replay runs: a weak reference to it, the names of its parameters, the ids
# of its sub-modules, and what else its tensors need: None for a module whose parameters
# all hold a tensor and which has no buffers (the common module); which of its parameters
# hold one, for a module with a parameter registered as None (a Linear without bias) and
# no buffers; else :class:`_WithBuffers`. Held weakly: the layout is kept between calls for
# as long as its root lives, and holds no module (a module that refers back to the root
# would otherwise keep it alive); a module that died is seen as a change (and its id, once
# reused, is not mistaken for it).
_Held = tuple[bool, ...]


class _WithBuffers:
    """A module with buffers: which of its parameters hold a tensor, the names of its
    buffers and which of them hold one."""

    __slots__ = ("buffers", "held", "names")

    def __init__(self, held: _Held, names: tuple[str, ...], buffers: _Held) -> None:
        self.held = held
        self.names = names
        self.buffers = buffers


_LayoutEntry = tuple[
    "weakref.ref[torch.nn.Module]", "tuple[str, ...]", "tuple[int, ...]", "_Held | _WithBuffers | None"
]


class TreeLayout:
    """The modules a replay of one module runs, as :func:`tree_layout` found them: per
    module the names of its parameters and buffers and the ids of its sub-modules; the
    modules it skips (excluded regions), only that they are. Where some tensor needs no
    gradient (a frozen parameter, a buffer: state a forward may update), also which
    tensors need one and each module's training flag, which decide how the engine
    treats that state."""

    __slots__ = ("entries", "grads", "marker", "modes", "owned", "skipped")

    def __init__(
        self,
        marker: str,
        entries: list[_LayoutEntry],
        skipped: list[weakref.ref[torch.nn.Module]],
        grads: list[bool] | None,
        modes: list[bool] | None,
    ) -> None:
        self.marker = marker
        self.entries = entries
        self.skipped = skipped
        # ``requires_grad`` of each tensor in the read's order (None where all train) and
        # the training flag of each module of ``entries`` (None then too).
        self.grads = grads
        self.modes = modes
        # The modules that hold tensors, in the walk's order, each with its entry's last
        # item.
        self.owned = [(ref, other) for ref, names, _, other in entries if names or other]


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_VERSION = operator.attrgetter("_version")
_HELD = functools.partial(operator.is_not, None)


def tree_layout(walked: list[tuple[torch.nn.Module, bool]], marker: str) -> TreeLayout | None:
    """The layout of ``walked`` (each module with whether the walk skipped it: those that
    hold the ``marker`` attribute), or None where a module cannot be read without a walk
    (no weak reference, not the three dictionaries, a buffer that needs gradients).

    Why: a checkpoint of a module notes every tensor of the modules its replay runs, at
    every call, and a replay checks that none was changed since; the modules rarely
    change between calls. :func:`layout_tensors` reads all the tensors in a few C loops
    per module and says when the layout no longer holds (a module, parameter or buffer
    added, removed or replaced, a tensor's ``requires_grad``, a module's training flag
    where some tensor needs no gradient, or the ``marker`` attribute changed), where a
    walk calls Python per module and per tensor.
    If it changes: None (a module without the three dictionaries), and the engine walks.
    Retired by: a cheap public view of a module's own parameters, buffers and children.
    """
    entries: list[_LayoutEntry] = []
    skipped_refs: list[weakref.ref[torch.nn.Module]] = []
    grads: list[bool] = []
    modes: list[bool] = []
    for module, skipped in walked:
        state = vars(module)
        if (state.get(marker) is not None) is not skipped:
            return None  # a marker that is not a region's: left to the walk
        try:
            ref = weakref.ref(module)
        except TypeError:
            return None
        if skipped:
            skipped_refs.append(ref)
            continue
        params = state.get("_parameters")
        buffers = state.get("_buffers")
        children = state.get("_modules")
        if not (
            isinstance(params, dict)
            and isinstance(children, dict)
            and isinstance(buffers, dict)
            and isinstance(state.get("training"), bool)
        ):
            return None
        held = tuple(map(_HELD, params.values()))
        grads += (p.requires_grad for p in params.values() if p is not None)
        for b in buffers.values():
            if b is not None:
                if b.requires_grad:
                    return None  # a buffer that trains (rare): left to the walk
                grads.append(False)
        other: _Held | _WithBuffers | None = None
        if buffers:
            other = _WithBuffers(held, tuple(buffers), tuple(map(_HELD, buffers.values())))
        elif not all(held):
            other = held
        modes.append(state["training"])
        entries.append((ref, tuple(params), tuple(map(id, children.values())), other))
    trains = all(grads)
    return TreeLayout(
        marker, entries, skipped_refs, None if trains else grads, None if trains else modes
    )


def layout_tensors(layout: TreeLayout) -> list[torch.Tensor] | None:
    """The parameters and buffers the modules of ``layout`` hold now, in the walk's order
    (each module's own parameters, then its buffers, in registration order: as
    :func:`module_tensors`), or None if the layout no longer holds.

    Why and if it changes: as :func:`tree_layout`. (Read at every call of a checkpointed
    module: one pass over the modules, what is empty checked by its truth alone.)
    """
    marker = layout.marker
    found: list[torch.Tensor] = []
    try:
        for ref, names, children, other in layout.entries:
            state = ref().__dict__  # type: ignore[union-attr]  # None: gone (AttributeError)
            params = state["_parameters"]
            kids = state["_modules"]
            if (
                state.get(marker) is not None
                or (tuple(params) != names if names else params)
                or (tuple(map(id, kids.values())) != children if children else kids)
            ):
                return None
            if other is None:
                if state["_buffers"]:
                    return None
                found += params.values()  # a None put in a parameter's place: AttributeError
            elif other.__class__ is tuple:
                if state["_buffers"] or tuple(map(_HELD, params.values())) != other:
                    return None
                found += filter(_HELD, params.values())
            elif not _read_with_buffers(state, params, other, found):  # type: ignore[arg-type]
                return None
        for ref in layout.skipped:
            if ref().__dict__.get(marker) is None:  # type: ignore[union-attr]
                return None
        grads = layout.grads
        if grads is None:
            if not all(map(_REQUIRES_GRAD, found)):
                return None
        elif list(map(_REQUIRES_GRAD, found)) != grads or [
            ref().__dict__["training"]  # type: ignore[union-attr]
            for ref, _, _, _ in layout.entries
        ] != layout.modes:
            return None
    except (AttributeError, KeyError):  # a module gone, None put in a parameter's place
        return None
    return found


def _read_with_buffers(
    state: dict[str, Any], params: dict[str, Any], other: _WithBuffers, found: list[torch.Tensor]
) -> bool:
    """Add to ``found`` the tensors of a module with buffers, where it holds them as its
    layout entry says."""
    buffers = state["_buffers"]
    if (
        tuple(map(_HELD, params.values())) != other.held
        or tuple(buffers) != other.names
        or tuple(map(_HELD, buffers.values())) != other.buffers
    ):
        return False
    found += filter(_HELD, params.values())
    found += filter(_HELD, buffers.values())
    return True


def layout_versions(layout: TreeLayout, tensors: list[torch.Tensor]) -> list[int | None] | None:
    """The versions of ``tensors`` (as :func:`versions`) where the modules of ``layout``
    that held tensors hold ``tensors`` now; None where they hold others. Within one
    checkpoint call the modules are the call's, whatever the tree holds now: the tree's
    structure is not checked.

    Why and if it changes: as :func:`tree_layout` (asked when every replay starts).
    """
    live: list[torch.Tensor] = []
    for ref, other in layout.owned:
        module = ref()
        if module is None:
            return None
        state = module.__dict__
        if other is None:
            live += state["_parameters"].values()
        else:
            live += filter(_HELD, state["_parameters"].values())
            if other.__class__ is _WithBuffers:
                live += filter(_HELD, state["_buffers"].values())
    if len(live) != len(tensors) or not all(map(operator.is_, live, tensors)):
        return None
    return versions(tensors)


def versions(tensors: list[torch.Tensor]) -> list[int | None]:
    """:func:`version` of each of ``tensors``, read in one C loop where every one has a
    version counter. Why and if it changes: as :func:`version`."""
    try:
        return list(map(_VERSION, tensors))
    except (RuntimeError, AttributeError):
        return [version(t) for t in tensors]


def module_tensor(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The parameter or buffer ``module`` holds under ``name`` now (None if none).

    Why and if it changes: as :func:`module_tensors` (the public fallback is ``getattr``,
    which finds the same tensor through ``nn.Module.__getattr__``).
    """
    state = vars(module)
    params = state.get("_parameters")
    if isinstance(params, dict) and name in params:
        return params[name]
    buffers = state.get("_buffers")
    if isinstance(buffers, dict) and name in buffers:
        return buffers[name]
    return getattr(module, name, None)


def module_children(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``list(module.named_children())``, read from the module's dictionary of sub-modules.

    Why: a checkpoint of a module walks the modules its replay runs at every call;
    ``named_children`` is a generator with a set of seen modules, per module.
    If it changes: the public iterator, which gives the same pairs.
    Retired by: a cheap public view of a module's direct sub-modules.
    """
    children = vars(module).get("_modules")
    if not isinstance(children, dict):
        return list(module.named_children())
    found: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()
    for name, child in children.items():
        if child is not None and id(child) not in seen:
            seen.add(id(child))
            found.append((name, child))
    return found


def module_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """``list(module.parameters())``: each parameter of ``module`` and the modules below
    it once, read from their dictionaries.

    Why: an excluded region asks for its module's parameters at every call that saves a
    tensor (to tell parameters from activations); ``parameters()`` is three nested
    generators, resumed per module and per parameter.
    If it changes: the public iterator, which gives the same tensors.
    Retired by: a cheap public list of a module's parameters.
    """
    found: list[torch.Tensor] = []
    seen_modules: set[int] = set()
    seen: set[int] = set()
    stack = [module]
    while stack:
        current = stack.pop()
        if id(current) in seen_modules:
            continue
        seen_modules.add(id(current))
        state = vars(current)
        params = state.get("_parameters")
        children = state.get("_modules")
        if not isinstance(params, dict) or not isinstance(children, dict):
            return list(module.parameters())
        for p in params.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                found.append(p)
        for child in reversed(children.values()):
            if child is not None:
                stack.append(child)
    return found


def module_attributes(module: torch.nn.Module, names: tuple[str, ...]) -> list[object]:
    """``getattr(module, name, None)`` for each of ``names``, without raising and catching
    an ``AttributeError`` per name the module does not have.

    Why: a checkpoint of a module asks every replayed module for its running statistics
    (``running_mean``, ...) at every call, and most modules have none: each missing name
    costs ``nn.Module.__getattr__`` and an exception.
    How: where no class on the module's type defines one of ``names`` and its
    ``__getattr__`` is ``nn.Module``'s (checked once per type), ``getattr`` finds the
    instance dictionary first, then the parameters, buffers and sub-modules, in that
    order; this reads them in the same order.
    If it changes: ``getattr`` for every type.
    Retired by: nothing needed; a plain ``getattr`` is the fallback.
    """
    state = vars(module)
    params = state.get("_parameters")
    buffers = state.get("_buffers")
    children = state.get("_modules")
    if (
        not _plain_lookup(type(module), names)  # type: ignore[arg-type]  # classes hash by identity
        or not isinstance(params, dict)
        or not isinstance(buffers, dict)
        or not isinstance(children, dict)
    ):
        return [getattr(module, name, None) for name in names]
    found: list[object] = []
    for name in names:
        if name in state:
            found.append(state[name])
        elif name in params:
            found.append(params[name])
        elif name in buffers:
            found.append(buffers[name])
        else:
            found.append(children.get(name))
    return found


@functools.cache
def _plain_lookup(cls: type, names: tuple[str, ...]) -> bool:
    """Whether attribute look-ups of ``names`` on instances of ``cls`` go to the instance
    dictionary and then to ``nn.Module.__getattr__`` (no class attribute, property or
    ``__getattr__`` of the type's own comes first)."""
    if getattr(cls, "__getattr__", None) is not torch.nn.Module.__getattr__:
        return False
    if getattr(cls, "__getattribute__", None) is not object.__getattribute__:
        return False
    return not any(name in vars(klass) for klass in cls.__mro__ for name in names)


def swap_module_tensor(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make ``module`` hold ``tensor`` under ``name`` in place of its parameter or buffer,
    whatever ``tensor`` is (a plain tensor where a parameter was).

    Why: a checkpoint's replay must use the tensors its forward used, also where the
    forward ran under ``torch.func.functional_call`` (fast weights) or a buffer was
    rebound; ``nn.Module.__setattr__`` refuses a plain tensor in a parameter's place, so
    this writes the slot as ``functional_call`` itself does.
    If it changes: ``setattr``, which works for buffers and for parameters replaced by
    parameters; a plain tensor in a parameter's place then raises ``TypeError``.
    Retired by: a public context that swaps a module's tensors (``functional_call``'s own).
    """
    params = getattr(module, "_parameters", None)
    if isinstance(params, dict) and name in params:
        params[name] = tensor
        return
    buffers = getattr(module, "_buffers", None)
    if isinstance(buffers, dict) and name in buffers:
        buffers[name] = tensor
        return
    setattr(module, name, tensor)
