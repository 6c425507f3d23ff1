"""One small adapter per framework, for the tests of behaviour that is the same on
both (``tests/core/test_regions.py``): the ``fw`` fixture in ``conftest.py`` hands one out.

Each adapter builds layers and inputs, runs a gradient step and compares gradients
the way that framework's own tests do: exactly (``np.array_equal``), since on CPU
the recomputed code runs the same kernels on the same values.
"""

from __future__ import annotations

import copy
import gc
import pickle
from collections import OrderedDict
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

    # -- built layers, training, statistics and names (tests/core: test_outputs.py,
    # test_running_stats.py, test_selections.py, test_name_lookups.py)

    method = "forward"  # the method a layer call runs
    running_mean = "running_mean"  # the name recomp's statistics warning lists first
    rng_state_option = "preserve_rng_state"  # the checkpoint option that restores the RNG

    def layer_class(self, name: str, body: Callable[..., Any]) -> type:
        """A new layer class called ``name``: its constructor takes the sub-layers as
        keyword arguments, its forward is ``body(self, *args)``."""
        nn = self.nn

        def __init__(layer: Any, **children: Any) -> None:
            nn.Module.__init__(layer)
            for key, child in children.items():
                setattr(layer, key, child)

        def forward(layer: Any, *args: Any) -> Any:
            return body(layer, *args)

        return type(name, (nn.Module,), {"__init__": __init__, "forward": forward})

    def layer_list(self, layers: list[Any]) -> Any:
        return self.nn.ModuleList(layers)

    def twins(self, build: Callable[[], Any]) -> tuple[Any, Any]:
        """(reference, model): two layers from ``build`` with the same parameter values."""
        ref = build()
        return ref, copy.deepcopy(ref)

    def batch_norm(self, n: int) -> Any:
        return self.nn.BatchNorm1d(n)

    def ema_batch_norm(self, n: int) -> Any:
        """A BatchNorm-like layer of (batch, n) inputs that keeps its running mean under a
        name of its own (``mean_ema``), where recomp does not look for statistics."""
        torch, nn = self.torch, self.nn

        class EmaBatchNorm(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.register_buffer("mean_ema", torch.zeros(n))

            def forward(self, x: Any) -> Any:
                if self.training:
                    with torch.no_grad():
                        self.mean_ema.mul_(0.9).add_(0.1 * x.mean(0))
                return x - x.mean(0, keepdim=True)

        return EmaBatchNorm()

    def in_place(self, op: str, t: Any, *args: Any) -> Any:
        """``t`` with ``op`` (exp, add, relu) applied to it in place: the tensor method
        ``op_``."""
        return getattr(t, op + "_")(*args)

    def train(self, layer: Any) -> Any:
        """``layer`` in training mode (PyTorch's default)."""
        return layer.train()

    def statistics(self, layer: Any) -> dict[str, Any]:
        """The buffers of ``layer`` and below (running statistics and their counters)."""
        return {name: b.detach().numpy().copy() for name, b in layer.named_buffers()}

    def fit(self, model: Any, batches: list[Any], lr: float = 0.01) -> list[list[Any]]:
        """One SGD step of ``square_sum(model(x))`` per batch; each step's parameter
        gradients (numpy)."""
        params = self.parameters(model)
        opt = self.torch.optim.SGD(params, lr=lr)
        history = []
        for x in batches:
            opt.zero_grad(set_to_none=True)
            square_sum(model(x)).backward()
            history.append([p.grad.numpy().copy() for p in params])
            opt.step()
        return history

    def named_layers(self, model: Any) -> list[tuple[str, Any]]:
        return list(model.named_modules())

    def class_name(self, layer: Any) -> str:
        """The class name that tools looking layers up by name read (accelerate's wrap
        policies, ``_no_split_modules``): ``__class__.__name__``."""
        return str(layer.__class__.__name__)

    def copies(self, model: Any) -> list[Any]:
        """Copies of ``model`` as users make them: ``copy.deepcopy`` and a pickle round trip."""
        return [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]

    def model_output(self, **fields: Any) -> Any:
        """A model zoo's output container: transformers' ``BaseModelOutput``."""
        import pytest

        outputs = pytest.importorskip("transformers.modeling_outputs")
        return outputs.BaseModelOutput(**fields)

    def stack(self, n: int) -> Any:
        """A stack of ``n`` blocks (``Block``: norm, attn, mlp) from ``torch_models``,
        whose classes pickle."""
        from torch_models import stack

        return stack(n)

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

    # -- built layers, training, statistics and names (tests/core: test_outputs.py,
    # test_running_stats.py, test_selections.py, test_name_lookups.py)

    method = "construct"
    running_mean = "moving_mean"
    rng_state_option = "save_rng_state"

    def layer_class(self, name: str, body: Callable[..., Any]) -> type:
        nn = self.nn

        def __init__(layer: Any, **children: Any) -> None:
            nn.Cell.__init__(layer)
            for key, child in children.items():
                setattr(layer, key, child)

        def construct(layer: Any, *args: Any) -> Any:
            return body(layer, *args)

        return type(name, (nn.Cell,), {"__init__": __init__, "construct": construct})

    def layer_list(self, layers: list[Any]) -> Any:
        return self.nn.CellList(layers)

    def twins(self, build: Callable[[], Any]) -> tuple[Any, Any]:
        from ms_models import copy_params

        ref, model = build(), build()
        copy_params(ref, model)
        return ref, model

    def batch_norm(self, n: int) -> Any:
        return self.nn.BatchNorm1d(n)

    def ema_batch_norm(self, n: int) -> Any:
        ms, nn, ops = self.ms, self.nn, self.ops

        class EmaBatchNorm(nn.Cell):
            def __init__(self) -> None:
                super().__init__()
                self.mean_ema = ms.Parameter(ops.zeros(n), requires_grad=False)

            def construct(self, x: Any) -> Any:
                if self.training:
                    ops.assign(self.mean_ema, self.mean_ema * 0.9 + 0.1 * x.mean(0))
                return x - x.mean(0, keep_dims=True)

        return EmaBatchNorm()

    def in_place(self, op: str, t: Any, *args: Any) -> Any:
        """``t`` with ``op`` applied to it in place, written with ``copy_``: on CPU,
        MindSpore 2.10's ``exp_``/``add_`` return a new tensor."""
        t.copy_(getattr(self.ops, op)(t, *args))
        return t

    def train(self, layer: Any) -> Any:
        """``layer`` in training mode (a Cell starts in inference mode)."""
        return layer.set_train()

    def statistics(self, layer: Any) -> dict[str, Any]:
        """The parameters of ``layer`` and below that take no gradient (running statistics)."""
        return {p.name: p.asnumpy().copy() for p in layer.get_parameters() if not p.requires_grad}

    def fit(self, model: Any, batches: list[Any], lr: float = 0.01) -> list[list[Any]]:
        params = self.parameters(model)
        opt = self.nn.SGD(params, learning_rate=lr)
        step = self.ms.grad(lambda x: square_sum(model(x)), None, params)
        history = []
        for x in batches:
            grads = step(x)
            history.append([g.asnumpy() for g in grads])
            opt(grads)
        return history

    def named_layers(self, model: Any) -> list[tuple[str, Any]]:
        return list(model.cells_and_names())

    def class_name(self, layer: Any) -> str:
        """``Cell.cls_name``, the name MindSpore's own tools read."""
        return str(layer.cls_name)

    def copies(self, model: Any) -> list[Any]:
        """``copy.deepcopy`` (a Cell does not pickle: its primitives do not)."""
        return [copy.deepcopy(model)]

    def model_output(self, **fields: Any) -> Any:
        """A model zoo's output container: an ``OrderedDict`` subclass, as mindnlp's
        ``ModelOutput``."""
        return ZooOutput(**fields)

    def stack(self, n: int) -> Any:
        from ms_models import Stack

        return Stack(n)

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

    seen: list[type] = []  # what the region returned, in the forward and in the replay

    def body(t: Any, region: Any) -> Any:
        out = region(ops.cos(t))
        seen.append(type(out))
        return ops.exp(read(out))

    def total(v: Any) -> Any:
        return v.sum()

    x = fw.tensor(3, 4)
    expected_type = type(region_of(ref)(x))
    _, expected = fw.grads(
        lambda t: body(t, region_of(ref)), x, params=fw.parameters(ref), loss=total
    )
    region = fw.api.checkpoint_exclude_wrapper(region_of(dense), name=name)
    seen.clear()
    _, got = fw.grads(
        lambda t: fw.api.checkpoint(body, t, region),
        x,
        params=fw.parameters(dense),
        loss=total,
    )
    assert seen == [expected_type, expected_type]  # the forward and the replay
    assert_same(expected, got)
    assert (region.region_runs, region.region_skips) == (1, 1)


# -- for tests/core/test_outputs.py


class ZooOutput(OrderedDict):
    """An ``OrderedDict`` whose keys read as attributes, as model zoos return."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def assert_region_changing_its_input_matches(
    fw: Any, activation: Callable[[], Any], reads_input_after: bool
) -> None:
    """A recomputed dense layer, then an excluded ``activation()`` that changes its
    input in place, then code that reads the activation and (``reads_input_after``)
    that input, saving it for backward (``sin``): the gradients of the unwrapped model,
    the region run once and skipped once. The replay, which skips the region, must
    hand that code the changed input, as the forward did."""

    def body(layer: Any, x: Any) -> Any:
        h = layer.lin(x)
        y = layer.out(layer.act(h))
        return y + fw.ops.sin(h) * 3 if reads_input_after else y

    changes_input = fw.layer_class("ChangesInput", body)
    ref, model = fw.twins(
        lambda: changes_input(lin=fw.dense(4, 4), act=activation(), out=fw.dense(4, 4))
    )
    model.act = fw.api.checkpoint_exclude_wrapper(model.act)
    model = fw.api.checkpoint_wrapper(model)
    x = fw.tensor(3, 4)
    _, expected = fw.grads(ref, x)
    _, got = fw.grads(model, x)
    assert_same(expected, got)
    assert (model.act.region_runs, model.act.region_skips) == (1, 1)
