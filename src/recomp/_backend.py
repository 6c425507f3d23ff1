"""The questions the engine asks a framework, with the answers most frameworks share.

One small object per framework (``recomp.torch._backend.BACKEND``,
``recomp.mindspore._backend.BACKEND``) subclasses :class:`Backend` and
overrides what differs: what a tensor is, storage identity, the boundary
function, random state; its ``modules`` (a :class:`Modules`) answers what the
engine asks about the framework's modules. Framework names and the wording of framework-specific
advice live here too, so the engine's messages stay framework-free.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator
from typing import Any, NamedTuple

from . import _pytree

NOT_A_VIEW = object()
IDENTITY = None  # a view spec meaning "the input itself"


class StateChange(NamedTuple):
    """A place of a module's state a replay must see as the forward did: the module holds
    ``live`` under ``name`` now, the forward saw ``seen``: another tensor, or, where
    ``updated``, a copy of the value from before the forward's update, which a replay
    would update again (so every replay needs it as it is)."""

    module: Any
    name: str
    live: Any
    seen: Any
    updated: bool


def addressing_strides(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int | None, ...]:
    """``stride`` with the entries that never address memory left out (``None``): those of
    dimensions of size 1, and all of them when the tensor is empty. Two tensors that differ
    only there hold the same elements at the same places; a replay may hand back either (a
    clone of a (1, 4) tensor with strides (1, 1) has strides (4, 1))."""
    if 0 in shape:
        return (None,) * len(shape)
    return tuple(None if size == 1 else step for size, step in zip(shape, stride, strict=True))


class Backend:
    """Defaults shared by the frameworks; abstract methods raise ``NotImplementedError``."""

    #: short framework name, as in ``recomp.<name>``
    name = "framework"
    #: the framework's own checkpoint, named in the warning about foreign replays
    foreign_checkpoint = "checkpoint"
    #: what that warning adds for a model zoo's own checkpointing switch, if anything
    foreign_switch_fix = ""
    #: True where reading a version counter needs the framework's work queue drained
    #: first; the engine then calls :meth:`sync` once per batch of reads
    versions_need_sync = False
    #: the framework's :class:`Modules`; ``modules`` is one of it, built with this backend
    modules_class: type[Modules]
    #: the framework's tensor class(es), for ``isinstance`` where a call per value would
    #: cost more than the check (the engine's fast paths); :meth:`is_tensor` agrees
    tensor_class: type | tuple[type, ...] = ()

    def __init__(self) -> None:
        self.modules = self.modules_class(self)

    @property
    def package(self) -> str:
        """The recomp package users call for this framework."""
        return f"recomp.{self.name}"

    # -- tensors ----------------------------------------------------------------

    def is_tensor(self, x: Any) -> bool:
        raise NotImplementedError

    def is_parameter(self, x: Any) -> bool:
        raise NotImplementedError

    def requires_grad(self, t: Any) -> bool:
        return bool(t.requires_grad)

    def storage_key(self, t: Any) -> Hashable | None:
        """Identity of the memory behind ``t``, equal for all views of it; None if unknown.

        Only compared while the tensors it was taken from are alive (the engine
        holds them for as long as it keeps the key), so a reused address cannot
        be mistaken for the old storage."""
        raise NotImplementedError

    def storage_nbytes(self, t: Any) -> int:
        """Size of the memory behind ``t`` (all of it, for a view)."""
        raise NotImplementedError

    def version(self, t: Any) -> int | None:
        """In-place modification counter of ``t``, or None if the framework has none
        (mutation checks are then skipped). Frameworks read theirs in their compat
        module.

        Where ``versions_need_sync`` is set, only valid after :meth:`sync`."""
        return None

    def versions(self, tensors: list[Any]) -> list[int | None]:
        """:meth:`version` of each of ``tensors``."""
        return [self.version(t) for t in tensors]

    def sync(self) -> None:
        """Wait until version counters reflect every queued in-place operation."""

    def detach(self, t: Any) -> Any:
        """An alias of ``t`` without autograd history, sharing its memory."""
        raise NotImplementedError

    def keep_saved(self, t: Any) -> Any:
        """What a region keeps for a tensor its autograd saved: an alias without
        autograd history, so that an op saving its own output (``tanh``) forms no
        reference cycle node -> saved tensor -> node that only a backward breaks."""
        return self.detach(t)

    def replay_alias(self, t: Any, requires_grad: bool) -> Any:
        """A fresh alias of cached ``t`` to hand to the replay."""
        raise NotImplementedError

    def stub(self, requires_grad: bool) -> Any:
        """A zero-element tensor standing in for an output that was not saved."""
        raise NotImplementedError

    def placeholder(self, t: Any, region_name: str) -> Any:
        """A stand-in for a ``save_output=False`` output in the replay; where the
        framework allows it, one that raises ``OutputNotSavedError`` when used."""
        return t

    def copy(self, t: Any) -> Any:
        """A copy of ``t`` with its own memory and no autograd history."""
        raise NotImplementedError

    def clone(self, t: Any) -> Any:
        """A copy of ``t`` recorded by autograd (not a leaf, so it may be changed in place)."""
        raise NotImplementedError

    def copy_into(self, dst: Any, src: Any) -> None:
        """Write ``src``'s values into ``dst`` in place, unrecorded by autograd (the replay
        repeating an in-place change a region made to its input in the forward)."""
        raise NotImplementedError

    # -- views --------------------------------------------------------------------

    def geometry(self, t: Any) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(shape, strides in elements, storage offset) of a strided tensor."""
        return tuple(t.shape), tuple(t.stride()), int(t.storage_offset())

    def layout(self, t: Any) -> Hashable:
        """What must match between a forward input and its replay (shape, strides, dtype)."""
        shape, stride, _ = self.geometry(t)
        return (shape, addressing_strides(shape, stride), t.dtype)

    def same_kind(self, t: Any, base: Any) -> bool:
        """Whether ``t`` can be a view of ``base`` (same element type and device)."""
        return bool(t.dtype == base.dtype)

    def view_spec(self, t: Any, base: Any) -> Any:
        """How to rebuild ``t`` from ``base`` (same storage): ``IDENTITY``, a
        (shape, strides, offset) triple, or ``NOT_A_VIEW`` when ``t`` reaches memory
        outside what ``base`` spans."""
        if not self.same_kind(t, base):
            return NOT_A_VIEW
        shape, stride, t_offset = self.geometry(t)
        base_shape, base_stride, base_offset = self.geometry(base)
        offset = t_offset - base_offset
        if offset == 0 and shape == base_shape and stride == base_stride:
            return IDENTITY
        if offset < 0 or offset + _extent(shape, stride) > _extent(base_shape, base_stride):
            return NOT_A_VIEW
        return (shape, stride, offset)

    def as_strided(self, base: Any, shape: Any, stride: Any, offset: int) -> Any:
        raise NotImplementedError

    def apply_view(self, spec: Any, base: Any) -> Any:
        """Rebuild the view ``spec`` (from :meth:`view_spec`) on ``base``."""
        shape, stride, offset = spec
        return self.as_strided(base, shape, stride, self.geometry(base)[2] + offset)

    # -- pytrees ------------------------------------------------------------------

    def flatten(self, tree: Any) -> tuple[list[Any], Any]:
        """Leaves of a region's or checkpoint's arguments or outputs, and how to rebuild them."""
        return _pytree.flatten(tree)

    def unflatten(self, leaves: list[Any], spec: Any) -> Any:
        return _pytree.unflatten(leaves, spec)

    def leaf_paths(self, spec: Any) -> list[str]:
        """Readable paths of the leaves of ``spec``, in flatten order."""
        return _pytree.leaf_paths(spec)

    def register_hint(self, kind: type) -> str:
        """How a user makes ``kind`` something the flattener looks into."""
        return f"make {kind.__name__} a dataclass"

    def opaque_tensors(self, leaf: Any) -> list[str]:
        """Attribute paths of tensors hidden inside a leaf the flattener cannot look
        into (a plain dataclass, say); empty if none."""
        return _pytree.opaque_tensors(leaf, self.is_tensor)

    # -- autograd -----------------------------------------------------------------

    def grad_enabled(self) -> bool:
        raise NotImplementedError

    def in_backward(self) -> bool:
        """True while the framework's autograd engine is running a backward."""
        raise NotImplementedError

    def saved_tensors_hooks(self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> Any:
        raise NotImplementedError

    def region_context(self, name: str) -> Any:
        """Context entered around the forward of region ``name`` (hides op-level checkpoint
        caches; labels the region's allocations where the framework records them)."""
        return contextlib.nullcontext()

    def boundary(self, saved: list[Any], outputs: list[Any]) -> list[Any]:
        """Apply the boundary function: aliases of ``outputs`` whose backward first
        unpacks ``saved`` (packed by the enclosing checkpoint's hook)."""
        raise NotImplementedError

    def save_counter(self) -> Callable[[], int | None] | None:
        """Inside a checkpoint: a function returning how many tensors it has saved so
        far if its replay stops after its last saved tensor, else None. Outside one (or
        where the framework cannot tell): None."""
        return None

    # -- random state ---------------------------------------------------------------

    def get_rng_state(self) -> Any:
        raise NotImplementedError

    def set_rng_state(self, state: Any) -> None:
        raise NotImplementedError


class Modules:
    """The questions the engine asks about a framework's modules (``nn.Module``,
    ``nn.Cell``): which module a function runs, its children, its own state, its mode.

    A backend's ``modules`` (one object, built with the backend it asks about
    tensors). Kept apart from :class:`Backend`'s questions about tensors: module walks
    and ``recomp._module_state`` ask only these."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def parameters_of(self, fn: Any) -> list[Any]:
        """The parameters of a module (empty for a plain function)."""
        return []

    # Attribute names under which the framework's BatchNorm modules keep the running
    # statistics that their training forward updates.
    running_stat_names: tuple[str, ...] = ()

    def module_of(self, fn: Any) -> Any | None:
        """The module a checkpointed function runs: the module itself, or the module of a
        bound method (a wrapper's ``forward``); None for any other function."""
        return None

    def running_module(self, frame: Any) -> Any | None:
        """The innermost module whose ``forward``/``construct`` runs at ``frame`` or
        below it on the Python stack (its first argument, whatever it is called)."""
        while frame is not None:
            code = frame.f_code
            if code.co_name in ("forward", "construct") and code.co_argcount:
                owner = frame.f_locals.get(code.co_varnames[0])
                if owner is not None and self.module_of(owner) is owner:
                    return owner
            frame = frame.f_back
        return None

    def operation_name(self, obj: Any) -> str | None:
        """The name of the framework operation ``obj``, if it is one (a MindSpore
        primitive); None otherwise. Used to name what saved a tensor."""
        return None

    def named_children(self, module: Any) -> list[tuple[str, Any]]:
        """``module``'s direct sub-modules, with their attribute names."""
        return []

    def module_attributes(self, module: Any, names: tuple[str, ...]) -> list[Any]:
        """``getattr(module, name, None)`` for each of ``names``."""
        return [getattr(module, name, None) for name in names]

    def is_training(self, module: Any) -> bool:
        raise NotImplementedError

    # -- state outside the autograd graph (``recomp._module_state``) ----------------

    #: Whether version counters show every in-place write to a module's state (buffers,
    #: parameters without gradients). Where they do not, the first forward of a module
    #: copies all of it and compares (NOTE [ Which state a checkpoint call copies ]).
    state_versions_track_writes = False

    def module_state(self, module: Any) -> list[tuple[str, Any, str]]:
        """The tensors ``module`` itself holds (not its children's), as ``(name, tensor,
        kind)``; ``kind`` is ``"parameter"`` (trains), ``"frozen"`` (a parameter without
        gradients) or ``"buffer"``."""
        raise NotImplementedError

    def same_values(self, a: Any, b: Any) -> bool:
        """Whether two tensors of one shape and type hold equal values."""
        raise NotImplementedError

    def tree_layout(self, walked: list[tuple[Any, bool]], marker: str) -> Any:
        """A layout of the modules ``walked`` (each with whether a walk skipped it, as it
        skips modules holding a ``marker`` attribute) from which :meth:`layout_tensors`
        reads their tensors without a walk; None where the framework has no such read
        (``recomp._module_state`` then walks at every call). This default: None."""
        return None

    def layout_tensors(self, layout: Any) -> list[Any] | None:
        """The tensors the modules of ``layout`` (from :meth:`tree_layout`) hold now, in
        the order of the walk and of :meth:`module_state`; None once the layout no
        longer holds (a module, parameter or buffer added, removed or replaced, a
        tensor's ``requires_grad``, the marker or, where some state does not train, a
        module's training flag changed)."""
        return None

    def layout_versions(self, layout: Any, tensors: list[Any]) -> list[int | None] | None:
        """The versions of ``tensors`` (what :meth:`layout_tensors` read when the call
        started; as :meth:`Backend.version`) where the modules of ``layout`` hold them now;
        None where they hold others. Within one checkpoint call the modules are the
        call's: the tree's structure is not checked. This default (no layouts): None."""
        return None

    def module_tensor(self, module: Any, name: str) -> Any:
        """The tensor ``module`` holds under ``name`` now (None if none)."""
        return getattr(module, name, None)

    def state_for_replay(self, changes: list[StateChange]) -> Any:
        """A context in which each ``change.module`` holds ``change.seen``'s value under
        its name, and after which it holds ``change.live`` as it was. This default
        copies values in and back out (the module keeps its tensor objects)."""
        return _copied_state(self.backend, changes)

    def running_statistics(self, module: Any) -> list[Any] | str | None:
        """For ``module`` alone (not its children): the running-statistics tensors its
        forward updates now (empty in eval mode or without tracked statistics); a reason,
        for a module that looks like a BatchNorm but keeps none under
        ``running_stat_names``; None for any other module."""
        found = self.module_attributes(module, self.running_stat_names)
        tensors = [t for t in found if t is not None and self.backend.is_tensor(t)]
        if tensors:
            return tensors if self.is_training(module) else []
        if not _looks_like_batchnorm(module.__class__):  # cached per class: asked first
            return None
        if getattr(module, "track_running_stats", True) is False:
            return None
        if not self.is_training(module):
            return []
        return f"no tensor attribute named {' or '.join(self.running_stat_names)}"


def tensor_path(backend: Backend, module: Any, tensor: Any) -> str | None:
    """The path below ``module`` (``"0.weight"``) of the parameter or buffer that is
    ``tensor`` or shares its memory (an alias such as a transpose), or None. For error
    messages: it walks the module tree."""
    key = backend.storage_key(tensor)
    stack: list[tuple[str, Any]] = [("", module)]
    seen: set[int] = set()
    while stack:
        prefix, current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for name, held, _ in backend.modules.module_state(current):
            if held is tensor or (key is not None and backend.storage_key(held) == key):
                return prefix + name
        for name, child in reversed(backend.modules.named_children(current)):
            stack.append((f"{prefix}{name}.", child))
    return None


@functools.cache
def _looks_like_batchnorm(cls: type) -> bool:
    return any("batchnorm" in c.__name__.lower() for c in cls.__mro__)


def _extent(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Number of elements from the first to one past the last element a view addresses."""
    if any(size == 0 for size in shape):
        return 0
    return 1 + sum((size - 1) * st for size, st in zip(shape, stride))


@contextlib.contextmanager
def _copied_state(backend: Backend, changes: list[StateChange]) -> Iterator[None]:
    kept = [(change.live, backend.copy(change.live)) for change in changes]
    for change in changes:
        backend.copy_into(change.live, change.seen)
    try:
        yield
    finally:
        for live, value in kept:
            backend.copy_into(live, value)
