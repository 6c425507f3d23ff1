"""Small MindSpore models and gradient helpers shared by the tests (PyNative, CPU)."""

from __future__ import annotations

import contextlib

import mindspore as ms
import numpy as np
from mindspore import nn, ops

# Explicitly, so that later set_device("CPU") calls (the README's example) are accepted;
# a RuntimeError means MindSpore already ran a kernel in this process, on its default CPU.
with contextlib.suppress(RuntimeError):
    ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)


class Block(nn.Cell):
    """Pre-norm residual block: attention-like dense layer, then an MLP."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((d,))
        self.attn = nn.Dense(d, d)
        self.mlp = nn.SequentialCell([nn.Dense(d, 2 * d), nn.SiLU(), nn.Dense(2 * d, d)])

    def construct(self, x):
        h = x + self.attn(self.norm(x))
        return h + self.mlp(h)


class Stack(nn.Cell):
    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.CellList([Block(d) for _ in range(n)])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def copy_params(src: nn.Cell, dst: nn.Cell) -> None:
    """Give ``dst`` the values of ``src`` (matched by Parameter.name)."""
    values = {p.name: ms.Parameter(p.value().copy(), name=p.name) for p in src.get_parameters()}
    _, not_loaded = ms.load_param_into_net(dst, values, strict_load=True)
    assert not not_loaded, not_loaded


def twin_stack(n: int = 3) -> tuple[Stack, Stack]:
    """Two stacks of ``n`` blocks with the same parameter values."""
    ref, model = Stack(n), Stack(n)
    copy_params(ref, model)
    return ref, model


def exclude_attention(model: Stack, checkpoint: bool = True) -> Stack:
    """Exclude every block's attention from the replay and (with ``checkpoint``)
    checkpoint every block, in place; returns ``model``."""
    import recomp.mindspore as rm

    for i, layer in enumerate(model.layers):
        layer.attn = rm.checkpoint_exclude_wrapper(layer.attn)
        if checkpoint:
            model.layers[i] = rm.checkpoint_wrapper(layer)
    return model


def tensor(*shape: int, seed: int = 0) -> ms.Tensor:
    return ms.Tensor(np.random.RandomState(seed).randn(*shape).astype(np.float32))


def grads(cell_or_fn, params, *inputs, loss=lambda out: (out**2).sum()):
    """Gradients of ``loss(f(*inputs))`` w.r.t. every input and ``params``, as numpy arrays."""
    positions = tuple(range(len(inputs)))
    fn = ms.grad(lambda *xs: loss(cell_or_fn(*xs)), positions, params)
    g_inputs, g_params = fn(*inputs)
    if not isinstance(g_inputs, (tuple, list)):
        g_inputs = (g_inputs,)
    return [g.asnumpy() for g in g_inputs] + [g.asnumpy() for g in g_params]


def assert_same(expected, actual) -> None:
    assert len(expected) == len(actual)
    for i, (a, b) in enumerate(zip(expected, actual)):
        assert np.array_equal(a, b), f"gradient {i}: max diff {np.abs(a - b).max()}"


def held_for_backward(
    model: nn.Cell, *inputs: ms.Tensor, after_loss: bool = False
) -> tuple[int, int]:
    """(bytes the forward leaves allocated for backward, peak bytes of the step) for one
    training step of ``model`` after a warm-up, read from MindSpore's memory record at
    the model's output (``after_loss``: once the loss is computed, as ``recomp bench``)."""
    import bisect
    import gc
    import tempfile

    from recomp.cli.mindspore.runner import _profiled, _read_record, allocated_at_mark, mark

    marks: list[int] = []

    def loss(*xs):
        out = model(*xs)
        if not after_loss:
            marks.append(mark())
        value = (out**2).sum()
        if after_loss:
            marks.append(mark())
        return value

    step = ms.grad(loss, None, model.trainable_params())
    step(*inputs)
    ms.runtime.launch_blocking()
    # Garbage of earlier tests in this process, freed by the collector in the middle of
    # the step, would move the readings: collect it first, and keep the collector off.
    gc.collect()
    gc.disable()
    try:
        with tempfile.TemporaryDirectory(prefix="recomp-test-ms-") as tmp:
            with _profiled(tmp):
                marks.clear()
                start = mark()
                step(*inputs)  # the gradients are dropped at once
                end = mark()
            rows = _read_record(tmp)
    finally:
        gc.enable()
    base = allocated_at_mark(rows, start)
    first, middle, last = (bisect.bisect_left(rows, (t, -1)) for t in (start, marks[0], end))
    peak = max(rows[i][1] for i in range(first + 1, last) if i != middle)
    return allocated_at_mark(rows, marks[0]) - base, peak - base


__all__ = [
    "Block",
    "Stack",
    "assert_same",
    "copy_params",
    "exclude_attention",
    "grads",
    "held_for_backward",
    "nn",
    "ops",
    "tensor",
    "twin_stack",
]
