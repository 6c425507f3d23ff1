"""One small adapter per framework, for the tests of behaviour that is the same on
both (``tests/core/test_regions.py``): the ``fw`` fixture in ``conftest.py`` hands one out.

Each adapter builds layers and inputs, runs a gradient step and compares gradients
the way that framework's own tests do: exactly (``np.array_equal``), since on CPU
the recomputed code runs the same kernels on the same values.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any

import numpy as np


def square_sum(out: Any) -> Any:
    return (out**2).sum()


def assert_same(expected: list[Any], actual: list[Any]) -> None:
    """Equal lists of arrays (None where a gradient is missing), exactly."""
    assert len(expected) == len(actual), (len(expected), len(actual))
    for i, (a, b) in enumerate(zip(expected, actual)):
        assert (a is None) == (b is None), f"gradient {i}: {a is None} vs {b is None}"
        if a is not None:
            assert np.array_equal(a, b), f"gradient {i}: max diff {np.abs(a - b).max()}"


class Torch:
    name = "torch"
    layer = "module"  # what the API's messages call a layer

    def __init__(self) -> None:
        import torch
        from torch import nn

        import recomp.torch

        self.torch = torch
        self.nn = nn
        self.api = recomp.torch
        self.ops = torch  # sin, cos, tanh, relu

    def dense(self, n_in: int, n_out: int) -> Any:
        return self.nn.Linear(n_in, n_out)

    def sequential(self, *layers: Any) -> Any:
        return self.nn.Sequential(*layers)

    def dense_pair(self, n_in: int, n_out: int) -> tuple[Any, Any]:
        """Two dense layers with the same parameter values: one to wrap, one reference."""
        layer = self.dense(n_in, n_out)
        return layer, copy.deepcopy(layer)

    def tensor(self, *shape: int, seed: int = 0) -> Any:
        return self.torch.from_numpy(np.random.RandomState(seed).randn(*shape).astype(np.float32))

    def no_grad(self) -> Any:
        return self.torch.no_grad()

    def numpy(self, t: Any) -> Any:
        return t.detach().numpy()

    def parameters(self, layer: Any) -> list[Any]:
        return list(layer.parameters())

    def attention_excluded_stack(self, n: int) -> tuple[Any, Any]:
        """A stack of ``n`` blocks and its twin with every block's attention excluded and
        every block checkpointed."""
        from torch_models import exclude_attention, stack, twin

        ref = stack(n)
        return ref, exclude_attention(twin(ref))

    def blocks(self, model: Any) -> list[Any]:
        return list(model)

    def grads(
        self,
        f: Callable[..., Any],
        *inputs: Any,
        params: list[Any] | None = None,
        loss: Callable[[Any], Any] = square_sum,
    ) -> tuple[Any, list[Any]]:
        """(loss, gradients of the inputs then of ``params``) of one backward, as numpy
        arrays; ``params`` defaults to those of ``f``."""
        params = self.parameters(f) if params is None else params
        for p in params:
            p.grad = None
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        value = loss(f(*leaves))
        value.backward()
        found = [t.grad for t in leaves] + [p.grad for p in params]
        return value.detach().numpy(), [None if g is None else g.numpy() for g in found]

    # ---- guarantees (tests/core/test_guarantees.py) ------------------------------
    # Checkpoints of PyTorch itself that know nothing of excluded regions (the first:
    # a function that takes any callable, non-reentrant).
    foreign_checkpoints = ("checkpoint", "checkpoint_reentrant")

    def block_pair(self) -> tuple[Any, Any]:
        """Two pre-norm blocks (``attn``, ``mlp``) with the same parameter values."""
        from torch_models import Block

        ref = Block()
        return ref, copy.deepcopy(ref)

    def normless_stack(self, n: int) -> tuple[Any, Any]:
        """``attention_excluded_stack`` without the blocks' LayerNorm (a gradient nested
        in another fails at LayerNorm on MindSpore 2.10, whatever recomp does)."""
        from torch_models import exclude_attention, stack, twin

        ref = stack(n)
        for blk in ref:
            blk.norm = self.nn.Identity()
        return ref, exclude_attention(twin(ref))

    def from_numpy(self, array: Any) -> Any:
        return self.torch.from_numpy(array)

    def parameter(self, array: Any, name: str) -> Any:
        """A trainable parameter holding ``array`` (``name``: MindSpore wants one)."""
        return self.nn.Parameter(self.torch.from_numpy(array))

    def float32(self, t: Any) -> Any:
        return t.float()

    def input_leaf(self, t: Any) -> Any:
        """``t`` as an input whose gradient a backward would compute (MindSpore needs no mark)."""
        return t.detach().requires_grad_()

    def seed(self, value: int) -> None:
        """Seed the random ops (here: the default generator)."""
        self.torch.manual_seed(value)

    def random_state(self) -> Any:
        """Where the random ops' stream stands, as a value that compares with ``==``."""
        return self.torch.get_rng_state().numpy().tobytes()

    def dropout(self, x: Any, p: float) -> Any:
        return self.torch.nn.functional.dropout(x, p, training=True)

    def write_in_place(self, t: Any, value: Any) -> None:
        """Overwrite ``t``'s storage: an in-place op that bumps its version counter."""
        t.copy_(value)

    def mixed_precision(self, f: Callable[..., Any]) -> Callable[..., Any]:
        """``f`` with its forward under CPU autocast to bfloat16."""

        def run(*args: Any) -> Any:
            with self.torch.autocast("cpu", dtype=self.torch.bfloat16):
                return f(*args)

        return run

    def foreign_checkpoint(self, style: str, layer: Any) -> Callable[..., Any]:
        """``layer`` recomputed by ``torch.utils.checkpoint`` (a ``foreign_checkpoints`` style)."""
        from torch.utils.checkpoint import checkpoint

        reentrant = style == "checkpoint_reentrant"
        return lambda *args: checkpoint(layer, *args, use_reentrant=reentrant)

    def second_order_grads(self, f: Callable[[Any], Any], x: Any, params: list[Any]) -> list[Any]:
        """Gradients, with respect to ``x`` then ``params``, of the squared sum of the
        gradient of ``f(x)`` (a scalar) with respect to ``x``, as numpy arrays."""
        leaf = x.detach().clone().requires_grad_()
        (first,) = self.torch.autograd.grad(f(leaf), leaf, create_graph=True)
        found = self.torch.autograd.grad((first**2).sum(), [leaf, *params])
        return [g.numpy() for g in found]

    def flush(self) -> None:
        """Collect garbage, so that what nothing refers to any more is gone."""
        gc.collect()


class MindSpore:
    name = "mindspore"
    layer = "Cell"

    def __init__(self) -> None:
        import mindspore

        import recomp.mindspore
        from ms_models import nn, ops

        self.ms = mindspore
        self.nn = nn
        self.api = recomp.mindspore
        self.ops = ops

    def dense(self, n_in: int, n_out: int) -> Any:
        return self.nn.Dense(n_in, n_out)

    def sequential(self, *layers: Any) -> Any:
        return self.nn.SequentialCell(list(layers))

    def dense_pair(self, n_in: int, n_out: int) -> tuple[Any, Any]:
        from ms_models import copy_params

        layer, ref = self.dense(n_in, n_out), self.dense(n_in, n_out)
        copy_params(layer, ref)
        return layer, ref

    def tensor(self, *shape: int, seed: int = 0) -> Any:
        from ms_models import tensor

        return tensor(*shape, seed=seed)

    def no_grad(self) -> Any:
        return self.ms._no_grad()

    def numpy(self, t: Any) -> Any:
        return t.asnumpy()

    def parameters(self, layer: Any) -> list[Any]:
        return list(layer.trainable_params())

    def attention_excluded_stack(self, n: int) -> tuple[Any, Any]:
        from ms_models import exclude_attention, twin_stack

        ref, model = twin_stack(n)
        return ref, exclude_attention(model)

    def blocks(self, model: Any) -> list[Any]:
        return list(model.layers)

    def grads(
        self,
        f: Callable[..., Any],
        *inputs: Any,
        params: list[Any] | None = None,
        loss: Callable[[Any], Any] = square_sum,
    ) -> tuple[Any, list[Any]]:
        params = self.parameters(f) if params is None else params
        positions = tuple(range(len(inputs)))
        step = self.ms.value_and_grad(lambda *xs: loss(f(*xs)), positions, params)
        value, (g_inputs, g_params) = step(*inputs)
        if not isinstance(g_inputs, (tuple, list)):
            g_inputs = (g_inputs,)
        return value.asnumpy(), [g.asnumpy() for g in (*g_inputs, *g_params)]

    # ---- guarantees (tests/core/test_guarantees.py) ------------------------------
    # What MindSpore itself offers to recompute a layer: ``mindspore.recompute`` in
    # both modes (reentrant is its default), and ``Cell.recompute()``, which marks
    # the cell so that it is recomputed whenever it is called (a Cell only).
    foreign_checkpoints = ("recompute", "recompute_reentrant", "cell_recompute")

    def block_pair(self) -> tuple[Any, Any]:
        from ms_models import Block, copy_params

        ref, model = Block(), Block()
        copy_params(ref, model)
        return ref, model

    def normless_stack(self, n: int) -> tuple[Any, Any]:
        from ms_models import exclude_attention, twin_stack

        ref, model = twin_stack(n)
        for stack in (ref, model):
            for layer in stack.layers:
                layer.norm = self.nn.Identity()
        return ref, exclude_attention(model)

    def from_numpy(self, array: Any) -> Any:
        return self.ms.Tensor(array)

    def parameter(self, array: Any, name: str) -> Any:
        return self.ms.Parameter(self.ms.Tensor(array), name=name)

    def float32(self, t: Any) -> Any:
        return t.astype(self.ms.float32)

    def input_leaf(self, t: Any) -> Any:
        return t

    def seed(self, value: int) -> None:
        """The global seed, from which CPU random ops draw their kernel seeds."""
        self.ms.set_seed(value)

    def random_state(self) -> Any:
        import sys

        return dict(sys.modules["mindspore.common.seed"]._KERNEL_SEED)

    def dropout(self, x: Any, p: float) -> Any:
        return self.ops.dropout(x, p=p)

    def write_in_place(self, t: Any, value: Any) -> None:
        # On CPU only copy_ writes in place and bumps the version (add_, mul_ and
        # the rest return a new tensor).
        t.copy_(value)

    def mixed_precision(self, f: Callable[..., Any]) -> Callable[..., Any]:
        """``f`` under ``auto_mixed_precision`` ("auto", float16)."""
        from mindspore.train.amp import auto_mixed_precision

        return auto_mixed_precision(lambda *args: f(*args), "auto", self.ms.float16)

    def foreign_checkpoint(self, style: str, layer: Any) -> Callable[..., Any]:
        if style == "cell_recompute":
            layer.recompute(use_reentrant=False)
            return layer
        if style == "recompute_reentrant":
            return lambda *args: self.ms.recompute(layer, *args)  # reentrant by default
        return lambda *args: self.ms.recompute(layer, *args, use_reentrant=False)

    def second_order_grads(self, f: Callable[[Any], Any], x: Any, params: list[Any]) -> list[Any]:
        inner = self.ms.grad(f)
        g_x, g_params = self.ms.grad(lambda t: (inner(t) ** 2).sum(), 0, params)(x)
        return [g.asnumpy() for g in (g_x, *g_params)]

    def flush(self) -> None:
        """Let MindSpore finish its queued work (it frees graphs asynchronously), then
        collect garbage."""
        from mindspore.graph.api import _pynative_executor

        _pynative_executor.sync()
        gc.collect()


ADAPTERS = {"torch": Torch, "mindspore": MindSpore}


def assert_region_output_type(
    fw: Any, build: Callable[[Any, Any], Any], read: Callable[[Any], Any], name: str
) -> None:
    """A region that returns ``build(a, b)`` hands back an object of the same type in the
    forward and in the replay, with the gradients of the unwrapped code (``read`` turns
    the region's output into one tensor)."""
    dense, ref = fw.dense_pair(4, 4)
    ops = fw.ops

    def region_of(layer: Any) -> Callable[[Any], Any]:
        return lambda h: build(ops.tanh(layer(h)), ops.sin(h))

    def body(t: Any, region: Any, seen: list[type]) -> Any:
        out = region(ops.cos(t))
        seen.append(type(out))
        return ops.exp(read(out))

    def total(v: Any) -> Any:
        return v.sum()

    x = fw.tensor(3, 4)
    expected_type = type(region_of(ref)(x))
    _, expected = fw.grads(
        lambda t: body(t, region_of(ref), []), x, params=fw.parameters(ref), loss=total
    )
    region = fw.api.checkpoint_exclude_wrapper(region_of(dense), name=name)
    seen: list[type] = []
    _, got = fw.grads(
        lambda t: fw.api.checkpoint(body, t, region, seen),
        x,
        params=fw.parameters(dense),
        loss=total,
    )
    assert seen == [expected_type, expected_type]  # the forward and the replay
    assert_same(expected, got)
    assert (region.region_runs, region.region_skips) == (1, 1)
