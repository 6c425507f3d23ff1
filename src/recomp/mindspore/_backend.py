"""MindSpore (PyNative) answers to the engine's questions (see ``recomp._engine.Backend``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Hashable
from typing import Any

import mindspore
from mindspore import ops
from mindspore.common._grad_function import _Function
from mindspore.graph.api import _pynative_executor
from mindspore.ops.auto_generate.gen_ops_def import as_strided

from .._engine import IDENTITY, NOT_A_VIEW
from ..errors import RecompError

# Dropout and the other random ops that run on CPU draw from per-op kernel
# seeds kept in this module, not from mindspore's default generator.
_seed_module = sys.modules["mindspore.common.seed"]


class _Boundary(_Function):
    """Aliases a region's outputs; its backward unpacks the region's deferred inputs first.

    See NOTE [ Deferred inputs ] in ``recomp._engine``.
    """

    @staticmethod
    def forward(ctx: Any, n_saved: int, *tensors: Any) -> tuple[Any, ...]:
        ctx.n_saved = n_saved
        ctx.save_for_backward(*tensors[:n_saved])
        # Returned as they are: MindSpore hands out new Tensor objects on the same memory.
        return tuple(tensors[n_saved:])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        ctx.saved_tensors  # noqa: B018 - the unpack is the point: it triggers the replay
        return (None,) * (1 + ctx.n_saved) + grads


class MindSporeBackend:
    name = "mindspore"

    def is_tensor(self, x: Any) -> bool:
        return isinstance(x, mindspore.Tensor)

    def is_parameter(self, x: Any) -> bool:
        return isinstance(x, mindspore.Parameter)

    def requires_grad(self, t: Any) -> bool:
        if isinstance(t, mindspore.Parameter):
            return bool(t.requires_grad)
        # Integer outputs of recorded ops are marked too; the replay must mirror the
        # flag exactly, since it decides what the ops after the region save.
        return bool(getattr(t, "_requires_grad", False))

    def grad_enabled(self) -> bool:
        return bool(_pynative_executor.enable_grad())

    def in_backward(self) -> bool:
        return bool(_pynative_executor.get_current_autodiff_engine_id() != -1)

    def storage_key(self, t: Any) -> Hashable | None:
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, TypeError, AttributeError):
            return None

    def parameters_of(self, fn: Any) -> list[Any]:
        return list(fn.get_parameters()) if isinstance(fn, mindspore.nn.Cell) else []

    def storage_nbytes(self, t: Any) -> int:
        try:
            return int(t.untyped_storage().nbytes())
        except (RuntimeError, TypeError, AttributeError):
            return int(t.nbytes)

    def version(self, t: Any) -> int | None:
        # In-place kernels run asynchronously and bump the counter when they run:
        # read it only once the queue is drained.
        _pynative_executor.sync()
        return getattr(t, "_version", None)

    def saved_tensors_hooks(
        self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]
    ) -> contextlib.AbstractContextManager[Any]:
        return mindspore.saved_tensors_hooks(pack, unpack)

    def region_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def detach(self, t: Any) -> Any:
        # Same memory, no autograd history. Its version counter is its own: the
        # engine also checks the original's (see _engine._Snapshot).
        return ops.stop_gradient(t)

    def keep_saved(self, t: Any) -> Any:
        # Same memory, no graph: an op that saves its own output (tanh) would otherwise
        # form a cycle through MindSpore's C++ graph that only a backward breaks.
        return ops.stop_gradient(t)

    def replay_alias(self, t: Any, requires_grad: bool) -> Any:
        alias = ops.stop_gradient(t)
        if requires_grad:
            alias.requires_grad_()
            # An op's output rather than a leaf: PyNative refuses `alias[i] = v` on a
            # leaf that requires grad ("Can not modify tensor id of input tensor").
            # The boundary saves nothing here, so the replay's saved tensors are unchanged.
            alias = self.boundary([], [alias])[0]
        return alias

    def stub(self, requires_grad: bool) -> Any:
        stub = ops.zeros((0,), mindspore.float32)
        if requires_grad:
            stub.requires_grad_()
        return stub

    def placeholder(self, t: Any, region_name: str) -> Any:
        # MindSpore has no per-op hook on a tensor (torch's __torch_function__); a
        # zero-element tensor makes most misuse fail on shapes. The engine checks at
        # the end of the forward that such an output went into an excluded region.
        return t

    def layout(self, t: Any) -> Hashable:
        return (tuple(t.shape), tuple(t.stride()), t.dtype)

    def view_spec(self, t: Any, base: Any) -> Any:
        if t.dtype != base.dtype:
            return NOT_A_VIEW
        offset = t.storage_offset() - base.storage_offset()
        shape, stride = tuple(t.shape), tuple(t.stride())
        if offset == 0 and shape == tuple(base.shape) and stride == tuple(base.stride()):
            return IDENTITY
        if offset < 0 or offset + _extent(shape, stride) > _extent(
            tuple(base.shape), tuple(base.stride())
        ):
            return NOT_A_VIEW
        return (shape, stride, offset)

    def apply_view(self, spec: Any, base: Any) -> Any:
        # Values only: the rebuilt view is handed to a backward formula, not differentiated.
        shape, stride, offset = spec
        return as_strided(base, shape, stride, base.storage_offset() + offset)

    def boundary(self, saved: list[Any], outputs: list[Any]) -> list[Any]:
        out = _Boundary.apply(len(saved), *saved, *outputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def save_counter(self) -> Callable[[], int] | None:
        return None  # every cache entry is kept (see the torch backend for the pruning)

    def get_rng_state(self) -> Any:
        return mindspore.get_rng_state(), dict(_seed_module._KERNEL_SEED)

    def set_rng_state(self, state: Any) -> None:
        generator, kernel_seeds = state
        mindspore.set_rng_state(generator)
        _seed_module._KERNEL_SEED.clear()
        _seed_module._KERNEL_SEED.update(kernel_seeds)


def _extent(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((size - 1) * st for size, st in zip(shape, stride))


def check_pynative(api: str) -> None:
    if mindspore.get_context("mode") != mindspore.PYNATIVE_MODE:
        raise RecompError(
            f"recomp.mindspore.{api} needs PyNative mode, but MindSpore is in GRAPH_MODE. "
            "Call mindspore.set_context(mode=mindspore.PYNATIVE_MODE) before running the model."
        )


BACKEND = MindSporeBackend()
