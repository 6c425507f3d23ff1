"""Guarantees of recomp.mindspore on MindSpore 2.10 (PyNative, CPU) that only
MindSpore raises, and what cannot hold there, and why (all checked on this machine).

The guarantees both frameworks give (RNG after a skipped region with
``ops.dropout``, second-order gradients and the replay rewind, in-place writes
inside the forward, foreign checkpoints, nesting, mixed precision, a thread paused
mid-step and the process-global-state control, what a step or a forward kept being
freed) are tested once for both in ``tests/core/test_guarantees.py``. Each test
fails without the guarantee it names; the controls switch the mechanism off.

1. RNG. CPU random ops (``ops.dropout``, ``nn.Dropout``, ``ops.uniform`` ...) draw
   from MindSpore's seed system, not from its generator. ``ops.dropout`` replays
   exactly when a global seed is set (``mindspore.set_seed``): recomp restores the
   per-op kernel seeds for the replay and fast-forwards them past a skipped region.
   Without a global seed nor op seed the kernel picks a random seed on every call
   and no checkpoint can replay it. ``nn.Dropout`` builds its primitive once, with
   fixed seeds, and the CPU kernel keeps its own random state (``random_cache``) that
   no Python API reads or restores: recomputed by a bare ``mindspore.recompute``,
   ``nn.Dropout`` draws a new mask in the replay (the control below). recomp keeps
   the mask it drew instead (``ReplayableDropout``). Inside an excluded region it is
   correct anyway, because it is not replayed.
2. More than one backward. PyNative has no ``retain_graph``; each ``ms.grad`` /
   ``value_and_grad`` call runs its own forward, and calling a ``vjp_fn`` twice
   re-runs the forward (tested here). The only path where one forward is replayed
   twice is higher-order grad (``ms.grad(ms.grad(f))``, in the core tests). Exact
   equality does not hold there even for a correct result: the boundary node
   changes the order in which MindSpore sums gradient contributions (a few ulp in
   float32, 5e-16 relative in float64), so that test compares in float64 with
   rtol 1e-12.
3. Mutation. On CPU only ``copy_`` is really in place and bumps ``_version``
   (``add_``/``mul_``/... return a new tensor and leave the original alone; setitem
   writes without bumping ``_version``, so no version check can see it). When the
   region's input was computed inside the checkpoint, its outputs pass through the
   boundary, a custom Function, and MindSpore itself rejects ``copy_`` on them at the
   call site ("A view of base is being inplace modified ..."), before recomp could
   (tested here). The cache holds ``ops.stop_gradient(out)``, which has a version
   counter of its own, so recomp also checks the original output's counter: at the
   end of the forward (it holds the output until then) and in the replay (while it
   lives).
4. Threads. MindSpore 2.10 cannot run ``ms.grad`` from two Python threads at once,
   with or without recomp: the PyNative executor has one process-wide top-cell
   stack, and concurrent steps fail with "Can not find top cell for backward",
   "The pointer[top_cell_] is null", "The pointer[v] is null", abort in
   ``async_rqueue.cc WorkerLoop``, or deadlock (two threads calling
   ``ms.get_rng_state()`` and an op at the same time deadlock even without grad).
   What can run, and what the core tests ask of both frameworks: one thread's whole
   training step while another thread is paused in the middle of its forward or of
   its replay (LIFO from MindSpore's point of view). Nested ``ms.grad`` through
   ``nn.LayerNorm`` fails in MindSpore itself ("For LayerNormGrad, the index 7 is out
   of range"), so those models have no LayerNorm.
5. ``auto_mixed_precision`` O2 gives each Cell a mixed-precision type that the
   replay must set again.
6. Leaks. After a gradient step everything recomp kept is freed (core tests), and
   training steps add no heap growth over a bare ``mindspore.recompute``
   (``LEAK_STEPS`` steps, bound below; ``RECOMP_LEAK_STEPS=2000`` runs 2,000). Also
   when a checkpoint's output gets no backward inside ``ms.grad`` (unused, or
   returned as ``has_aux``) or a ``vjp_fn`` is never called, with a region op that
   saves its own output (tanh): a pack hook holding such a tensor itself would form
   a C++ cycle (node -> packed object -> tensor -> node) that only a backward
   breaks, so recomp keeps a ``stop_gradient`` alias. MindSpore itself keeps the
   graph of an uncalled ``vjp_fn`` until ``clear_res()`` (without recomp too), and
   its heap grows by several KB per ``value_and_grad`` step with no checkpoint at
   all, hence the baseline.

MindSpore 2.10 bug, independent of recomp: after an exception escapes an
``ms.grad`` forward, the next LayerNorm gradient fails until
``_pynative_executor.clear_res()`` is called (fixture ``recover_mindspore``).
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
import weakref

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")  # the PyTorch-only environments skip this file
from mindspore.graph.api import _pynative_executor  # noqa: E402
from mindspore.train.amp import auto_mixed_precision  # noqa: E402

import recomp  # noqa: E402
import recomp.mindspore as rm  # noqa: E402
from memory import run_measured  # noqa: E402
from ms_models import (  # noqa: E402
    Block,
    assert_same,
    copy_params,
    grads,
    nn,
    ops,
    tensor,
)
from recomp import _testing  # noqa: E402

_seed = sys.modules["mindspore.common.seed"]


def same(expected, actual) -> bool:
    return len(expected) == len(actual) and all(
        np.array_equal(a, b) for a, b in zip(expected, actual)
    )


def flush() -> None:
    """Let MindSpore finish its queued work (it frees graphs asynchronously), then collect."""
    _pynative_executor.sync()
    gc.collect()


# --------------------------------------------------------------------------- 1. RNG


class DropRegion(nn.Cell):
    """Draws random numbers: ops.dropout, or an nn.Dropout cell."""

    def __init__(self, cell_dropout: bool = False) -> None:
        super().__init__()
        self.dense = nn.Dense(8, 8)
        self.drop = nn.Dropout(p=0.5) if cell_dropout else None

    def construct(self, x):
        h = self.dense(x)
        return self.drop(h) if self.drop is not None else ops.dropout(h, p=0.5)


class DropBody(nn.Cell):
    """Dropout inside the region, and dropout after it in the recomputed code."""

    def __init__(self, region_cell: bool = False, after_cell: bool = False) -> None:
        super().__init__()
        self.d1 = nn.Dense(8, 8)
        self.region = DropRegion(region_cell)
        self.d2 = nn.Dense(8, 8)
        self.drop = nn.Dropout(p=0.5) if after_cell else None

    def construct(self, x):
        h = ops.tanh(self.d1(x))
        y = self.region(h)
        z = self.drop(y) if self.drop is not None else ops.dropout(y, p=0.5)
        return self.d2(z) * y


def drop_pair(exclude: bool = True, **kw):
    """The unwrapped model and a copy whose region is excluded. Built under the same
    seed, so that nn.Dropout primitives get the same seeds."""
    ms.set_seed(7)
    ref = DropBody(**kw)
    ms.set_seed(7)
    model = DropBody(**kw)
    copy_params(ref, model)
    for m in (ref, model):
        m.set_train()  # nn.Dropout draws only in training mode
    if exclude:
        model.region = rm.checkpoint_exclude_wrapper(model.region, name="drop_region")
    return ref, model


def train_steps(model, checkpointed: bool, steps: int = 2, **checkpoint_kwargs):
    """Gradients of ``steps`` steps, seeded once before the first: the random stream
    must also be where the unwrapped model leaves it after each step."""
    f = (lambda t: rm.checkpoint(model, t, **checkpoint_kwargs)) if checkpointed else model
    ms.set_seed(123)
    out = [grads(f, model.trainable_params(), tensor(4, 8, seed=s)) for s in range(steps)]
    return out, dict(_seed._KERNEL_SEED)


def test_nn_dropout_inside_region_is_right_because_it_is_not_replayed(seeded):
    ref, model = drop_pair(region_cell=True)
    expected, _ = train_steps(ref, checkpointed=False)
    actual, _ = train_steps(model, checkpointed=True)
    for e, a in zip(expected, actual):
        assert_same(e, a)
    assert not isinstance(model.region.drop, rm.ReplayableDropout)  # runs once anyway


def test_control_nn_dropout_recomputed_by_mindspore_alone_draws_another_mask(seeded):
    """What recomp's kept masks fix: replayed as it is, nn.Dropout draws a new mask."""
    ref, model = drop_pair(exclude=False, after_cell=True)
    expected, _ = train_steps(ref, checkpointed=False, steps=1)
    ms.set_seed(123)
    actual = grads(
        lambda t: ms.recompute(model, t, use_reentrant=False, early_stop=False),
        model.trainable_params(),
        tensor(4, 8, seed=0),
    )
    assert not same(expected[0], actual)


@pytest.mark.parametrize("early_stop", [False, True])
def test_nn_dropout_in_recomputed_code_matches_unwrapped(seeded, early_stop):
    """nn.Dropout keeps its kernel's random state in C++, out of reach; recomp keeps the
    mask it drew instead, and the replay applies that mask again."""
    ref, model = drop_pair(after_cell=True)
    expected, ref_seeds = train_steps(ref, checkpointed=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.UnreplayableDropoutWarning)
        actual, seeds = train_steps(model, checkpointed=True, early_stop=early_stop)
    for e, a in zip(expected, actual):
        assert_same(e, a)
    assert seeds == ref_seeds
    assert isinstance(model.drop, rm.ReplayableDropout)
    assert (model.drop.region_runs, model.drop.region_skips) == (2, 2)  # drawn once a step
    assert model.drop.region_saved_bytes == 4 * 8  # the mask, one byte per element


# --------------------------------------------------------------------------- 2. several backwards


def test_vjp_fn_called_twice_reruns_the_forward_and_stays_right():
    ref = Block()
    model = Block()
    copy_params(ref, model)
    model.attn = rm.checkpoint_exclude_wrapper(model.attn)
    wrapped = rm.checkpoint_wrapper(model)
    x = tensor(2, 5, 8)
    out, vjp_ref = ms.vjp(ref, x)
    sens = ops.ones_like(out)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "vjp_fn has been called multiple times")
        expected = [vjp_ref(sens)[0].asnumpy() for _ in range(2)]
        _, vjp_fn = ms.vjp(wrapped, x)
        for call in (1, 2):
            assert np.array_equal(vjp_fn(sens)[0].asnumpy(), expected[call - 1])
            # MindSpore re-runs the forward for the second call: one run per forward
            assert (model.attn.region_runs, model.attn.region_skips) == (call, call)


# --------------------------------------------------------------------------- 3. mutation


def mutation_case(region_op):
    w = ms.Parameter(ms.Tensor(np.random.RandomState(1).randn(6, 6).astype(np.float32)), name="w")

    def project(t):
        return region_op(ops.matmul(t, w))

    z = tensor(3, 6, seed=5)

    def body(region, t, computed_input=False):
        y = region(ops.sin(t) if computed_input else t)
        out = ops.sin(y) * t  # sin saves y
        y.copy_(z * 1)  # in place, after the region returned, still in the forward
        return out

    return w, project, body


def test_copy_into_output_behind_the_boundary_is_rejected_by_mindspore(recover_mindspore):
    # input computed in the checkpoint: outputs pass through the boundary Function, and
    # MindSpore forbids in-place ops on them at the call site, before recomp sees anything
    w, project, body = mutation_case(lambda m: m)
    region = rm.checkpoint_exclude_wrapper(project, name="proj")
    with pytest.raises(RuntimeError, match="inplace"):
        ms.grad(lambda t: rm.checkpoint(body, region, t, True).sum(), 0, [w])(tensor(3, 6))


# --------------------------------------------------------------------------- 5. O2 mixed precision


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_auto_mixed_precision_o2_on_checkpointed_cells(seeded, dropout):
    """O2 gives each Cell a mixed-precision type that ``Cell.__call__`` sets around its
    construct; the replay runs the construct outside that call and must set it again
    (without it the gradients were off by about 2e-3), and a dropout's kept mask is
    applied in float32 as the kernel does, whatever the cell's type."""
    mindcv_vit = pytest.importorskip("mindcv.models.vit")

    def block():
        return mindcv_vit.Block(dim=16, num_heads=2, proj_drop=dropout, attn_drop=dropout)

    ms.set_seed(1)
    ref = block()
    ms.set_seed(1)
    model = block()
    copy_params(ref, model)
    for m in (ref, model):
        m.set_train()
    amp_ref = auto_mixed_precision(ref, "O2")
    rm.apply_activation_checkpointing(model, checkpoint_fn=lambda c: c is model)
    amp_model = auto_mixed_precision(model, "O2")
    assert model.mixed_precision_type is not None
    x = tensor(2, 5, 16)
    ms.set_seed(5)
    expected = grads(amp_ref, ref.trainable_params(), x)
    ms.set_seed(5)
    assert_same(expected, grads(amp_model, model.trainable_params(), x))


# --------------------------------------------------------------------------- 6. leaks


class TanhRegion(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Dense(8, 8)

    def construct(self, h):
        return ops.tanh(self.dense(h))  # tanh saves its output


def tracked_checkpoint(x, computed_input=True):
    """A checkpointed function with an excluded region, and weak references to what
    recomp keeps for it: the invocation, the cached outputs, the kept saved tensors
    (other than the caller's input ``x``, which outlives the step)."""
    refs = []
    outside = x.untyped_storage().data_ptr()

    def on_kept(original, kept):
        if original.untyped_storage().data_ptr() != outside:
            refs.append(weakref.ref(kept))

    region = rm.checkpoint_exclude_wrapper(TanhRegion(), name="tanh_region")

    def body(t):
        with _testing.observe(kept=on_kept):
            y = region(ops.cos(t) if computed_input else t)
        state = recomp.get_recompute_state()
        if state is not None and not state.is_recomputing:
            record = _testing.record_of(state)
            refs.append(weakref.ref(record))
            refs.extend(weakref.ref(v) for v in _testing.cached_values(record))
        return ops.sin(y) * t

    return region, body, refs


@pytest.mark.parametrize("computed_input", [True, False])
@pytest.mark.parametrize(
    "how",
    # a forward with no gradient at all: tests/core/test_guarantees.py
    ["unused_in_grad", "has_aux", "vjp_never_called"],
)
def test_cache_is_freed_when_the_output_gets_no_backward(how, computed_input):
    x = tensor(4, 8)
    _region, body, refs = tracked_checkpoint(x, computed_input)
    for _ in range(3):
        if how == "unused_in_grad":
            ms.grad(lambda t: (rm.checkpoint(body, t), (t * 2).sum())[1])(x)
        elif how == "has_aux":
            ms.grad(lambda t: ((t * 2).sum(), rm.checkpoint(body, t)), has_aux=True)(x)
        else:
            ms.vjp(lambda t: rm.checkpoint(body, t), x)
    assert refs
    if how == "vjp_never_called":
        # MindSpore keeps the graph of an uncalled vjp_fn, with or without recomp
        _pynative_executor.clear_res()
    flush()
    assert sum(r() is not None for r in refs) == 0


LEAK_STEPS = int(os.environ.get("RECOMP_LEAK_STEPS", "40"))
# Extra heap growth allowed over the bare-recompute baseline. A leaked graph of this
# model holds its activations (16*32*64 floats = 128 KiB each): measured 93 KB per
# step when it leaks, against ~5-6 KB per step of MindSpore's own growth either way.
LEAK_BOUND_PER_STEP = 2048
LEAK_SLACK = 256 * 1024

LEAK_CHILD = """
import gc, weakref
import mindspore as ms
from mindspore import nn, ops
from mindspore.graph.api import _pynative_executor
import numpy as np
import recomp
import recomp.mindspore as rm
from recomp import _testing
ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)
D = 64
invocations = []
class Attn(nn.Cell):
    def __init__(self):
        super().__init__()
        self.proj = nn.Dense(D, D)
    def construct(self, h):
        return ops.tanh(self.proj(h))
class Blk(nn.Cell):
    def __init__(self):
        super().__init__()
        self.attn = Attn()
        self.mlp = nn.Dense(D, D)
    def construct(self, x):
        state = recomp.get_recompute_state()
        if state is not None and not state.is_recomputing:
            invocations.append(weakref.ref(_testing.record_of(state)))
        h = x + self.attn(ops.sin(x))
        return h + ops.tanh(self.mlp(h))
def model(kind):
    blocks = []
    for _ in range(2):
        blk = Blk()
        if kind == "bare":
            blk.recompute(use_reentrant=False)
        else:
            blk.attn = rm.checkpoint_exclude_wrapper(blk.attn)
            blk = rm.checkpoint_wrapper(blk)
        blocks.append(blk)
    return nn.SequentialCell(blocks)
x = ms.Tensor(np.random.RandomState(0).randn(16, 32, D).astype(np.float32))
def growth(kind, steps):
    m = model(kind)
    params = m.trainable_params()
    fn = ms.value_and_grad(lambda t: (m(t) ** 2).mean(), None, params)
    def step():
        _, g = fn(x)
        for p, gp in zip(params, g):
            p.set_data(p - gp * 1e-3)
    for _ in range(10):
        step()
    _pynative_executor.sync(); gc.collect()
    base = heap_bytes()
    for _ in range(steps):
        step()
    _pynative_executor.sync(); gc.collect()
    return heap_bytes() - base
bare = growth("bare", STEPS)
ours = growth("recomp", STEPS)
result = {"bare": bare, "recomp": ours, "invocations": len(invocations),
          "alive": sum(r() is not None for r in invocations)}
"""


@pytest.mark.system
def test_training_steps_keep_memory_flat():
    figures = run_measured(LEAK_CHILD.replace("STEPS", str(LEAK_STEPS)), timeout=600)
    assert figures["invocations"] == 2 * (10 + LEAK_STEPS)
    assert figures["alive"] == 0
    extra = figures["recomp"] - max(figures["bare"], 0)  # a heap that shrank grew by nothing
    assert extra <= LEAK_STEPS * LEAK_BOUND_PER_STEP + LEAK_SLACK, figures


class Flaky(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Dense(4, 4)
        self.fail = True

    def construct(self, x):
        y = self.dense(x)
        if self.fail:
            raise ValueError("boom in region")
        return y


def no_state_left() -> bool:
    return recomp.get_recompute_state() is None and _testing.active_region_name() is None


def test_failure_inside_region_leaves_no_state_nor_tag(recover_mindspore):
    flaky = Flaky()
    wrapped = rm.checkpoint_exclude_wrapper(flaky)
    x = tensor(2, 4)
    before = (dict(vars(x)), set(dir(x)))
    seen = {}

    def body(t):
        h = ops.sin(t)
        seen["h"] = h
        seen["h_before"] = (dict(vars(h)), set(dir(h)))
        return ops.tanh(wrapped(h))

    with pytest.raises(ValueError, match="boom in region"):
        grads(lambda t: rm.checkpoint(body, t), flaky.trainable_params(), x)
    assert no_state_left()
    assert (dict(vars(x)), set(dir(x))) == before
    h = seen["h"]
    assert (dict(vars(h)), set(dir(h))) == seen["h_before"]
    assert wrapped.region_runs == 0
    flaky.fail = False
    expected = grads(lambda u: ops.tanh(flaky.dense(ops.sin(u))), flaky.trainable_params(), x)
    assert_same(expected, grads(lambda t: rm.checkpoint(body, t), flaky.trainable_params(), x))
    assert (wrapped.region_runs, wrapped.region_skips) == (1, 1)
