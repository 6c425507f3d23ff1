"""PyTorch answers to the engine's questions (see ``recomp._backend.Backend``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

from .. import _pytree
from .._backend import Backend, Modules, StateChange, addressing_strides
from ..errors import OutputNotSavedError
from . import _compat


class _Boundary(torch.autograd.Function):
    """Aliases a region's outputs; its backward unpacks the region's deferred inputs first.

    See NOTE [ Deferred inputs ] in ``recomp._engine``. The inputs are saved under
    the enclosing checkpoint's hook, so unpacking them in backward makes the
    checkpoint replay (binding the region's deferred inputs) before gradients
    reach the region's own autograd nodes.
    """

    @staticmethod
    def forward(ctx: Any, n_saved: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.n_saved = n_saved
        # An output that receives no gradient must pass none on (not zeros): the
        # parameters behind it then keep grad None, as without recomp.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors[:n_saved])
        # detach(): a new tensor object on the same memory and version counter,
        # so autograd treats it as a fresh output rather than a returned input.
        return tuple(t.detach() for t in tensors[n_saved:])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.saved_tensors  # noqa: B018 - the unpack is the point: it triggers the replay
        return (None,) * (1 + ctx.n_saved) + grads


class _OutputNotSaved(torch.Tensor):
    """Zero-element stand-in returned by the replay for a ``save_output=False`` region."""

    _recomp_region: str

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = next(
            (getattr(a, "_recomp_region", "?") for a in _flat(args, kwargs) if isinstance(a, cls)),
            "?",
        )
        raise OutputNotSavedError(
            f"The output of excluded region {name!r} (save_output=False) was used by "
            f"{getattr(func, '__name__', func)!s} during the checkpoint's replay. With "
            "save_output=False the output is not cached, which is valid only when it goes "
            "straight into another excluded region. Use save_output=True for this region."
        )


def _flat(args: tuple[Any, ...], kwargs: Any) -> Iterator[Any]:
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


# PyTorch's pytree registry (transformers registers ModelOutput there), with its own leaf cache.
_PYTREE_REGISTRY = _pytree.Registry(_compat.pytree_node, _compat.pytree_generation)


class TorchModules(Modules):
    """``nn.Module``s: their own tensors, children and mode, read through ``_compat``."""

    def parameters_of(self, fn: Any) -> list[Any]:
        owner = getattr(fn, "__self__", fn)  # a module, or a module's bound forward
        return _compat.module_parameters(owner) if isinstance(owner, torch.nn.Module) else []

    running_stat_names = ("running_mean", "running_var", "num_batches_tracked")
    state_versions_track_writes = True

    # Called per module and per tensor at every checkpoint call: no wrapper of our own.
    module_state = staticmethod(_compat.module_tensors)
    module_tensor = staticmethod(_compat.module_tensor)
    tree_layout = staticmethod(_compat.tree_layout)
    layout_tensors = staticmethod(_compat.layout_tensors)
    layout_versions = staticmethod(_compat.layout_versions)

    def same_values(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b)

    def state_for_replay(
        self, changes: list[StateChange]
    ) -> contextlib.AbstractContextManager[None]:
        # The module's slots hold the forward's tensors during the replay (as
        # functional_call swaps them), a fresh copy of an updated value for each replay:
        # what the replay writes in place goes to that copy, and what it saves for
        # backward is never written again by recomp.
        return _SwappedState(changes)

    def module_of(self, fn: Any) -> Any | None:
        owner = getattr(fn, "__self__", fn)
        return owner if isinstance(owner, torch.nn.Module) else None

    # Called per replayed module at every checkpoint call: no wrapper of our own.
    named_children = staticmethod(_compat.module_children)
    module_attributes = staticmethod(_compat.module_attributes)

    def is_training(self, module: Any) -> bool:
        return bool(module.training)


class TorchBackend(Backend):
    name = "torch"
    modules_class = TorchModules
    tensor_class = torch.Tensor
    foreign_checkpoint = "torch.utils.checkpoint"
    foreign_switch_fix = (
        " Where Hugging Face's switch checkpoints it (transformers' "
        "activation_checkpointing_enable(), diffusers' enable_gradient_checkpointing()), "
        "recomp.torch.hf_activation_checkpointing(model, exclude_fn=...) makes recomp's "
        "checkpoint the one that switch calls."
    )

    def is_tensor(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def is_parameter(self, x: Any) -> bool:
        return isinstance(x, torch.nn.Parameter)

    # Asked at every region call: no wrapper of our own.
    grad_enabled = staticmethod(torch.is_grad_enabled)
    in_backward = staticmethod(_compat.in_backward)

    # Read per tensor input and per saved tensor of every region call: no wrapper.
    storage_key = staticmethod(_compat.storage_key)

    def storage_nbytes(self, t: torch.Tensor) -> int:
        try:
            return int(t.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            return int(t.numel() * t.element_size())

    # Read per parameter and buffer at every checkpoint call and replay: no wrapper.
    version = staticmethod(_compat.version)
    versions = staticmethod(_compat.versions)



    def saved_tensors_hooks(
        self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]
    ) -> contextlib.AbstractContextManager[None]:
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def region_context(self, name: str) -> contextlib.AbstractContextManager[None]:
        hide = _compat.hide_selective_checkpoint_modes()
        if not _compat.memory_history_enabled():  # the common case: nothing to label
            return hide
        return _labelled(name, hide)

    def detach(self, t: torch.Tensor) -> torch.Tensor:
        # Autograd restores the graph edge of an unpacked saved tensor, so a detached
        # alias loses nothing (double backward included).
        return t.detach()

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    def clone(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.data_ptr() == src.data_ptr() and dst.untyped_storage().nbytes() > 0:
            return  # the same memory: the change is already there
        with torch.no_grad():
            dst.copy_(src)

    def replay_alias(self, t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        alias = t.detach().requires_grad_(requires_grad)
        # A view, so that it has a grad_fn as the forward's output had: module hooks that
        # branch on it (FlopCounterMode's module tracker views leaves) then run the same
        # ops in the replay as in the forward, which selective checkpointing requires.
        return alias.view_as(alias) if requires_grad else alias

    def stub(self, requires_grad: bool) -> torch.Tensor:
        return torch.empty(0, requires_grad=requires_grad)

    def placeholder(self, t: torch.Tensor, region_name: str) -> torch.Tensor:
        p = t.detach().as_subclass(_OutputNotSaved)
        p._recomp_region = region_name
        return p

    def layout(self, t: torch.Tensor) -> Hashable:
        shape = tuple(t.shape)
        return (shape, addressing_strides(shape, t.stride()), t.dtype, t.device)

    def same_kind(self, t: torch.Tensor, base: torch.Tensor) -> bool:
        return t.dtype == base.dtype and t.device == base.device

    def as_strided(self, base: torch.Tensor, shape: Any, stride: Any, offset: int) -> Any:
        return base.as_strided(shape, stride, offset)

    def flatten(self, tree: Any) -> tuple[list[Any], Any]:
        return _pytree.flatten(tree, _PYTREE_REGISTRY)

    def register_hint(self, kind: type) -> str:
        return (
            f"register {kind.__name__} as a pytree node (torch.utils._pytree.register_pytree_node)"
        )

    def boundary(self, saved: list[Any], outputs: list[Any]) -> list[Any]:
        return list(_Boundary.apply(len(saved), *saved, *outputs))

    # Asked when every checkpoint's forward starts: no wrapper of our own.
    save_counter = staticmethod(_compat.checkpoint_save_counter)

    def get_rng_state(self) -> Any:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return torch.get_rng_state(), cuda

    def set_rng_state(self, state: Any) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def _labelled(name: str, inner: contextlib.AbstractContextManager[None]) -> Iterator[None]:
    """Allocations of an excluded region, labelled in CUDA memory snapshots."""
    with inner, _compat.memory_label(f"recomp region {name}"):
        yield


BACKEND = TorchBackend()


class _SwappedState:
    """The context of :meth:`TorchModules.state_for_replay` (entered once per replay:
    a class, not a generator)."""

    __slots__ = ("changes",)

    def __init__(self, changes: list[StateChange]) -> None:
        self.changes = changes

    def __enter__(self) -> None:
        swap = _compat.swap_module_tensor
        for change in self.changes:
            seen = change.seen.detach().clone() if change.updated else change.seen
            swap(change.module, change.name, seen)

    def __exit__(self, *exc_info: Any) -> None:
        swap = _compat.swap_module_tensor
        for change in reversed(self.changes):
            swap(change.module, change.name, change.live)
