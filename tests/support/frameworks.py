"""One small adapter per framework, for the tests of behaviour that is the same on
both (``tests/core/test_regions.py``): the ``fw`` fixture in ``conftest.py`` hands one out.

Each adapter builds layers and inputs, runs a gradient step and compares gradients
the way that framework's own tests do: exactly (``np.array_equal``), since on CPU
the recomputed code runs the same kernels on the same values.
"""

from __future__ import annotations

import copy
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
