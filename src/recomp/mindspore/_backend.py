"""MindSpore (PyNative) answers to the engine's questions (see ``recomp._backend.Backend``)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Hashable
from typing import Any

import mindspore
from mindspore import ops

from .._backend import Backend, Modules
from ..errors import RecompError
from . import _compat

# True where per-op policies look away (``recomp.mindspore._selective``): inside excluded
# regions, whose ops the replay never runs, and around recomp's own ops in a policy's mode.
OPS_HIDDEN: contextvars.ContextVar[bool] = contextvars.ContextVar("recomp_ms_ops_hidden", default=False)


@contextlib.contextmanager
def ops_hidden() -> Any:
    """Within the block, per-op checkpoint policies neither see nor count ops."""
    token = OPS_HIDDEN.set(True)
    try:
        yield
    finally:
        OPS_HIDDEN.reset(token)


@functools.cache
def _boundary_function() -> Any:
    class Boundary(_compat.function_base()):  # type: ignore[misc]
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

    return Boundary


class MindSporeModules(Modules):
    """``nn.Cell``s: their parameters (a Cell's buffers too), children and mode."""

    # nn.BatchNorm*: moving_mean/moving_variance; mint.nn.BatchNorm*: running_*.
    running_stat_names = (
        "moving_mean",
        "moving_variance",
        "running_mean",
        "running_var",
        "num_batches_tracked",
    )

    def module_of(self, fn: Any) -> Any | None:
        owner = getattr(fn, "__self__", fn)
        return owner if isinstance(owner, mindspore.nn.Cell) else None

    def operation_name(self, obj: Any) -> str | None:
        return type(obj).__name__ if isinstance(obj, ops.Primitive) else None

    def named_children(self, module: Any) -> list[tuple[str, Any]]:
        return [(n, c) for n, c in module.name_cells().items() if c is not None]

    def is_training(self, module: Any) -> bool:
        return bool(module.training)

    def module_state(self, module: Any) -> list[tuple[str, Any, str]]:
        # A Cell keeps its state in Parameters; those without gradients are its buffers
        # (BatchNorm's moving statistics included).
        return [
            (n, p, "parameter" if p.requires_grad else "frozen")
            for n, p in _compat.cell_parameters(module)
        ]

    def same_values(self, a: Any, b: Any) -> bool:
        return bool((a == b).all())

    def parameters_of(self, fn: Any) -> list[Any]:
        owner = getattr(fn, "__self__", fn)  # a Cell, or a Cell's bound construct
        return list(owner.get_parameters()) if isinstance(owner, mindspore.nn.Cell) else []


class MindSporeBackend(Backend):
    name = "mindspore"
    modules_class = MindSporeModules
    tensor_class = mindspore.Tensor
    foreign_checkpoint = "mindspore.recompute"
    versions_need_sync = True

    def is_tensor(self, x: Any) -> bool:
        return isinstance(x, mindspore.Tensor)

    def is_parameter(self, x: Any) -> bool:
        return isinstance(x, mindspore.Parameter)

    def requires_grad(self, t: Any) -> bool:
        if isinstance(t, mindspore.Parameter):
            return bool(t.requires_grad)
        return _compat.requires_grad(t)

    def grad_enabled(self) -> bool:
        return _compat.grad_enabled()

    def in_backward(self) -> bool:
        return _compat.in_backward()

    def storage_key(self, t: Any) -> Hashable | None:
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, TypeError, AttributeError):
            return None

    def storage_nbytes(self, t: Any) -> int:
        try:
            return int(t.untyped_storage().nbytes())
        except (RuntimeError, TypeError, AttributeError):
            return int(t.nbytes)

    def version(self, t: Any) -> int | None:
        return _compat.version(t)

    def sync(self) -> None:
        _compat.sync()

    def saved_tensors_hooks(
        self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]
    ) -> contextlib.AbstractContextManager[Any]:
        return mindspore.saved_tensors_hooks(pack, unpack)

    def region_context(self, name: str) -> Any:
        # An excluded region's ops run in the forward only: out of sight of per-op
        # policies, whose forward and replay must see the same ops.
        return ops_hidden()

    def detach(self, t: Any) -> Any:
        # Same memory, no autograd history. Its version counter is its own: the
        # engine also checks the original's (see _record.Snapshot).
        return ops.stop_gradient(t)

    def copy(self, t: Any) -> Any:
        return ops.stop_gradient(t).copy()

    def clone(self, t: Any) -> Any:
        return ops.deepcopy(t)

    def copy_into(self, dst: Any, src: Any) -> None:
        if self.storage_key(dst) == self.storage_key(src):
            return  # the same memory: the change is already there
        dst.copy_(ops.stop_gradient(src))

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

    def as_strided(self, base: Any, shape: Any, stride: Any, offset: int) -> Any:
        # Values only: the rebuilt view is handed to a backward formula, not differentiated.
        return _compat.as_strided()(base, shape, stride, offset)

    def register_hint(self, kind: type) -> str:
        return f"make {kind.__name__} a dataclass or a dict, list or tuple subclass"

    def boundary(self, saved: list[Any], outputs: list[Any]) -> list[Any]:
        out = _boundary_function().apply(len(saved), *saved, *outputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def get_rng_state(self) -> Any:
        return mindspore.get_rng_state(), dict(_compat.kernel_seeds())

    def set_rng_state(self, state: Any) -> None:
        generator, seeds = state
        mindspore.set_rng_state(generator)
        kernel_seeds = _compat.kernel_seeds()
        kernel_seeds.clear()
        kernel_seeds.update(seeds)


def check_pynative(api: str) -> None:
    if mindspore.get_context("mode") != mindspore.PYNATIVE_MODE:
        raise RecompError(
            f"recomp.mindspore.{api} needs PyNative mode, but MindSpore is in GRAPH_MODE. "
            "Call mindspore.set_context(mode=mindspore.PYNATIVE_MODE) before running the model."
        )


BACKEND = MindSporeBackend()
