"""PyTorch answers to the engine's questions (see ``recomp._engine.Backend``)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
from torch.utils import _python_dispatch

from .._engine import IDENTITY, NOT_A_VIEW
from ..errors import OutputNotSavedError


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


def _hide_selective_checkpoint_modes() -> contextlib.AbstractContextManager[None]:
    """Take PyTorch selective-checkpoint dispatch modes off the stack for a region.

    SAC caches op outputs per op kind and call index in the forward and pops
    them in the same order in the replay; a region that runs in the forward but
    is skipped in the replay would shift that order. Other modes stay.
    """
    if not torch._C._len_torch_dispatch_stack():
        return contextlib.nullcontext()
    stack = _python_dispatch._get_current_dispatch_mode_stack()
    if not any(_is_sac_mode(m) for m in stack):
        return contextlib.nullcontext()
    return _without_modes(_is_sac_mode)


def _is_sac_mode(mode: Any) -> bool:
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    return isinstance(mode, (_CachingTorchDispatchMode, _CachedTorchDispatchMode))


@contextlib.contextmanager
def _without_modes(drop: Callable[[Any], bool]) -> Iterator[None]:
    popped = []
    while _python_dispatch._get_current_dispatch_mode_stack():
        popped.append(_python_dispatch._pop_mode())
        if not any(drop(m) for m in _python_dispatch._get_current_dispatch_mode_stack()):
            break
    kept = [m for m in reversed(popped) if not drop(m)]
    for mode in kept:
        _python_dispatch._push_mode(mode)
    try:
        yield
    finally:
        for _ in kept:
            _python_dispatch._pop_mode()
        for mode in reversed(popped):
            _python_dispatch._push_mode(mode)


class TorchBackend:
    name = "torch"

    def is_tensor(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def is_parameter(self, x: Any) -> bool:
        return isinstance(x, torch.nn.Parameter)

    def requires_grad(self, t: torch.Tensor) -> bool:
        return t.requires_grad

    def grad_enabled(self) -> bool:
        return torch.is_grad_enabled()

    def in_backward(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def storage_key(self, t: torch.Tensor) -> Hashable | None:
        if t.layout is not torch.strided or t.is_meta:
            return None
        try:
            return t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):  # wrapper subclasses have no storage
            return None

    def parameters_of(self, fn: Any) -> list[Any]:
        module = getattr(fn, "__self__", fn)  # a wrapper passes its module's bound __call__
        return list(module.parameters()) if isinstance(module, torch.nn.Module) else []

    def storage_nbytes(self, t: torch.Tensor) -> int:
        try:
            return int(t.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            return int(t.numel() * t.element_size())

    def version(self, t: torch.Tensor) -> int | None:
        try:
            return t._version
        except RuntimeError:  # inference tensors have no version counter
            return None

    def saved_tensors_hooks(
        self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]
    ) -> contextlib.AbstractContextManager[None]:
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def region_context(self) -> contextlib.AbstractContextManager[None]:
        return _hide_selective_checkpoint_modes()

    def detach(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    def keep_saved(self, t: torch.Tensor) -> torch.Tensor:
        # Autograd restores the graph edge of an unpacked saved tensor, so a detached
        # alias loses nothing (double backward included) and, for an op that saves its
        # own output, avoids the cycle node -> saved tensor -> grad_fn -> node.
        return t.detach()

    def replay_alias(self, t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        return t.detach().requires_grad_(requires_grad)

    def stub(self, requires_grad: bool) -> torch.Tensor:
        return torch.empty(0, requires_grad=requires_grad)

    def placeholder(self, t: torch.Tensor, region_name: str) -> torch.Tensor:
        p = t.detach().as_subclass(_OutputNotSaved)
        p._recomp_region = region_name
        return p

    def layout(self, t: torch.Tensor) -> Hashable:
        return (tuple(t.shape), t.stride(), t.dtype, t.device)

    def view_spec(self, t: torch.Tensor, base: torch.Tensor) -> Any:
        if t.dtype != base.dtype or t.device != base.device:
            return NOT_A_VIEW
        offset = t.storage_offset() - base.storage_offset()
        if offset == 0 and t.shape == base.shape and t.stride() == base.stride():
            return IDENTITY
        # Only rebuild views that stay inside the memory the input itself spans.
        if offset < 0 or offset + _extent(t) > _extent(base):
            return NOT_A_VIEW
        return (tuple(t.shape), t.stride(), offset)

    def apply_view(self, spec: Any, base: torch.Tensor) -> torch.Tensor:
        size, stride, offset = spec
        return base.as_strided(size, stride, base.storage_offset() + offset)

    def boundary(self, saved: list[Any], outputs: list[Any]) -> list[Any]:
        return list(_Boundary.apply(len(saved), *saved, *outputs))

    def save_counter(self) -> Callable[[], int] | None:
        # The pack hook on top of the stack is the enclosing non-reentrant
        # checkpoint's; its closure holds the checkpoint frame, whose weak_holders
        # grow by one per saved tensor. Private to torch.utils.checkpoint: if it is
        # not found as expected, answer None and every cache entry is kept.
        from torch.utils.checkpoint import _CheckpointFrame

        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        cells = getattr(hooks[0], "__closure__", None) if hooks is not None else None
        frame = next(
            (c.cell_contents for c in cells or () if isinstance(c.cell_contents, _CheckpointFrame)),
            None,
        )
        if frame is None or not frame.early_stop or not isinstance(frame.weak_holders, list):
            return None
        frame_ref = weakref.ref(frame)

        def saved_so_far() -> int:
            live = frame_ref()
            return -1 if live is None else len(live.weak_holders)

        return saved_so_far

    def get_rng_state(self) -> Any:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return torch.get_rng_state(), cuda

    def set_rng_state(self, state: Any) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _extent(t: torch.Tensor) -> int:
    """Number of elements from the first to one past the last element ``t`` addresses."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


BACKEND = TorchBackend()
