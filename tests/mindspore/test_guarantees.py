"""Guarantees on MindSpore 2.10 (PyNative, CPU): what stays correct when an excluded
region is skipped in the replay.

Each test fails without the guarantee it names; the controls show that the test
would see the failure (they switch the mechanism off and get a different result).
What cannot hold on MindSpore 2.10, and why (all checked on this machine):

1. RNG. CPU random ops (``ops.dropout``, ``nn.Dropout``, ``ops.uniform`` ...) draw
   from MindSpore's seed system, not from its generator. ``ops.dropout`` replays
   exactly when a global seed is set (``mindspore.set_seed``): recomp restores the
   per-op kernel seeds for the replay and fast-forwards them past a skipped region.
   Without a global seed nor op seed the kernel picks a random seed on every call
   and no checkpoint can replay it. ``nn.Dropout`` builds its primitive once, with
   fixed seeds, and the CPU kernel keeps its own random state (``random_cache``) that
   no Python API reads or restores: recomputed ``nn.Dropout`` draws a new mask in the
   replay, with a bare ``mindspore.recompute`` as much as with recomp (strict
   xfail below). Inside an excluded region it is correct, because it is not replayed.
2. More than one backward. PyNative has no ``retain_graph``; each ``ms.grad`` /
   ``value_and_grad`` call runs its own forward, and calling a ``vjp_fn`` twice
   re-runs the forward. The only path where one forward is replayed twice is
   higher-order grad (``ms.grad(ms.grad(f))``): tested. Exact equality does not hold
   there even for a correct result: the boundary node changes the order in which
   MindSpore sums gradient contributions (a few ulp in float32, 5e-16 relative in
   float64), so that test compares in float64 with rtol 1e-12.
3. Mutation. On CPU only ``copy_`` is really in place and bumps ``_version``
   (``add_``/``mul_``/... return a new tensor and leave the original alone; setitem
   writes without bumping ``_version``, so no version check can see it). When the
   region's input was computed inside the checkpoint, its outputs pass through the
   boundary, a custom Function, and MindSpore itself rejects ``copy_`` on them at the
   call site ("A view of base is being inplace modified ..."), before recomp could.
   The cache holds ``ops.stop_gradient(out)``, which has a version counter of its
   own, so recomp also checks the original output's counter: at the end of the
   forward (it holds the output until then) and in the replay (while it lives).
   Tested both ways: a ``copy_`` on the output raises, a region that writes its
   own output with ``copy_`` before returning does not.
4. Foreign checkpoints: bare ``mindspore.recompute`` (both modes) and
   ``Cell.recompute()`` warn once per wrapper.
6. Nested recomp checkpoints, ``early_stop`` on and off, and
   ``auto_mixed_precision`` (MindSpore's autocast): tested.
7. Threads. MindSpore 2.10 cannot run ``ms.grad`` from two Python threads at once,
   with or without recomp: the PyNative executor has one process-wide top-cell
   stack, and concurrent steps fail with "Can not find top cell for backward",
   "The pointer[top_cell_] is null", "The pointer[v] is null", abort in
   ``async_rqueue.cc WorkerLoop``, or deadlock (two threads calling
   ``ms.get_rng_state()`` and an op at the same time deadlock even without grad).
   What can run: one thread's whole training step while another thread is paused
   in the middle of its forward or of its replay (LIFO from MindSpore's point of
   view). Those tests fail when recomp's state is process-global instead of
   per-context. Nested ``ms.grad`` through ``nn.LayerNorm`` fails in MindSpore
   itself ("For LayerNormGrad, the index 7 is out of range"), so those models have
   no LayerNorm.
8. Leaks. After a gradient step everything recomp kept is freed, and training steps
   add no heap growth over a bare ``mindspore.recompute`` (``LEAK_STEPS`` steps,
   bound below; ``RECOMP_LEAK_STEPS=2000`` runs 2,000). Also when a checkpoint's
   output gets no backward inside ``ms.grad`` (unused, or returned as ``has_aux``) or
   a ``vjp_fn`` is never called, with a region op that saves its own output (tanh):
   a pack hook holding such a tensor itself would form a C++ cycle (node -> packed
   object -> tensor -> node) that only a backward breaks, so recomp keeps a
   ``stop_gradient`` alias. MindSpore itself keeps the graph of an uncalled ``vjp_fn``
   until ``clear_res()`` (without recomp too), and its heap grows by several KB per
   ``value_and_grad``
   step with no checkpoint at all, hence the baseline.

MindSpore 2.10 bug, independent of recomp: after an exception escapes an
``ms.grad`` forward, the next LayerNorm gradient fails until
``_pynative_executor.clear_res()`` is called (fixture ``recover_mindspore``).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
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
    exclude_attention,
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


@pytest.mark.parametrize("early_stop", [True, False])
def test_dropout_inside_and_after_region_matches_unwrapped(seeded, early_stop):
    ref, model = drop_pair()
    expected, ref_seeds = train_steps(ref, checkpointed=False)
    actual, seeds = train_steps(model, checkpointed=True, early_stop=early_stop)
    for e, a in zip(expected, actual):
        assert_same(e, a)
    assert seeds == ref_seeds  # the kernel seeds end where the unwrapped model's do
    assert (model.region.region_runs, model.region.region_skips) == (2, 2)


def test_control_without_rng_fast_forward_dropout_after_region_differs(seeded):
    ref, model = drop_pair()
    expected, _ = train_steps(ref, checkpointed=False, steps=1)
    with _testing.without_rng_alignment():  # the replay does not skip the region's draws
        actual, _ = train_steps(model, checkpointed=True, steps=1)
    assert not same(expected[0], actual[0])
    assert model.region.region_skips == 1  # the region was skipped, nothing else changed


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


def float64_region():
    w = ms.Parameter(ms.Tensor(np.random.RandomState(1).randn(6, 6), ms.float64), name="w")

    def project(h):
        return ops.tanh(ops.matmul(h, w))

    def body(region, x):
        h = ops.sin(x) * 1.5  # computed inside the checkpoint: deferred, boundary
        y = region(h)
        return ops.tanh(y * h) + ops.sin(y)

    x = ms.Tensor(np.random.RandomState(0).randn(3, 6), ms.float64)
    return w, project, body, x


def grad_of_grad(f, w, x):
    inner = ms.grad(f)
    g_x, (g_w,) = ms.grad(lambda t: (inner(t) ** 2).sum(), 0, [w])(x)
    return [g_x.asnumpy(), g_w.asnumpy()]


@pytest.mark.parametrize("early_stop", [True, False])
def test_grad_of_grad_replays_twice_region_runs_once(early_stop):
    w, project, body, x = float64_region()
    region = rm.checkpoint_exclude_wrapper(project, name="proj")
    invocations = []

    def tracked(reg, t):
        state = recomp.get_recompute_state()
        if not state.is_recomputing:
            invocations.append(weakref.ref(_testing.record_of(state)))
        return body(reg, t)

    expected = grad_of_grad(lambda t: (body(project, t) ** 2).sum(), w, x)
    actual = grad_of_grad(
        lambda t: (rm.checkpoint(tracked, region, t, early_stop=early_stop) ** 2).sum(), w, x
    )
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=0)
    # one forward, one replay per backward engine, both served from the same cache
    assert (region.region_runs, region.region_skips) == (1, 2)
    assert len(invocations) == 1
    flush()
    assert invocations[0]() is None  # the cache lived as long as the graph, no longer


def test_control_second_replay_needs_the_cache_from_the_start(recover_mindspore):
    w, project, body, x = float64_region()
    region = rm.checkpoint_exclude_wrapper(project, name="proj")
    # what a replay that does not start again from the first cached region would do
    with (
        _testing.without_replay_rewind(),
        pytest.raises(recomp.ReplayMismatchError, match=r"'proj'.*recorded only 1"),
    ):
        grad_of_grad(lambda t: (rm.checkpoint(body, region, t) ** 2).sum(), w, x)


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


@pytest.mark.parametrize("early_stop", [True, False])
def test_copy_into_cached_output_raises_naming_region(recover_mindspore, early_stop):
    w, project, body = mutation_case(lambda m: m)  # matmul saves no output: only the cache
    region = rm.checkpoint_exclude_wrapper(project, name="proj")
    with pytest.raises(recomp.CachedValueMutatedError, match="'proj'"):
        ms.grad(lambda t: rm.checkpoint(body, region, t, early_stop=early_stop).sum(), 0, [w])(
            tensor(3, 6)
        )


def test_copy_into_output_the_region_saved_raises_naming_region(recover_mindspore):
    w, project, body = mutation_case(ops.tanh)  # tanh saves its output: a kept tensor
    region = rm.checkpoint_exclude_wrapper(project, name="proj")
    with pytest.raises(recomp.CachedValueMutatedError, match=r"'proj'.*modified in place"):
        ms.grad(lambda t: rm.checkpoint(body, region, t).sum(), 0, [w])(tensor(3, 6))


def test_copy_into_output_behind_the_boundary_is_rejected_by_mindspore(recover_mindspore):
    # input computed in the checkpoint: outputs pass through the boundary Function, and
    # MindSpore forbids in-place ops on them at the call site, before recomp sees anything
    w, project, body = mutation_case(lambda m: m)
    region = rm.checkpoint_exclude_wrapper(project, name="proj")
    with pytest.raises(RuntimeError, match="inplace"):
        ms.grad(lambda t: rm.checkpoint(body, region, t, True).sum(), 0, [w])(tensor(3, 6))


def test_region_that_writes_its_own_output_in_place_is_not_a_mutation(recover_mindspore):
    w = ms.Parameter(ms.Tensor(np.random.RandomState(1).randn(6, 6).astype(np.float32)), name="w")

    def into_buffer(t):
        buf = ops.zeros((3, 6), ms.float32)
        buf.copy_(ops.tanh(ops.matmul(t, w)))
        return buf

    region = rm.checkpoint_exclude_wrapper(into_buffer, name="buffer")
    x = tensor(3, 6)
    expected = ms.grad(lambda t: (ops.sin(into_buffer(t)) * t).sum(), 0, [w])(x)
    actual = ms.grad(lambda t: rm.checkpoint(lambda u: ops.sin(region(u)) * u, t).sum(), 0, [w])(x)
    assert_same(
        [expected[0].asnumpy(), expected[1][0].asnumpy()],
        [actual[0].asnumpy(), actual[1][0].asnumpy()],
    )


# --------------------------------------------------------------------------- 4. foreign checkpoints


def foreign_block():
    ref = Block()
    model = Block()
    copy_params(ref, model)
    model.attn = rm.checkpoint_exclude_wrapper(model.attn, name="attn")
    model.mlp[0] = rm.checkpoint_exclude_wrapper(model.mlp[0], name="up")
    return ref, model


def cell_recompute(model):
    model.recompute(use_reentrant=False)  # marks the cell; it is then recomputed when called
    return model


FOREIGN = {
    "recompute": lambda m: lambda t: ms.recompute(m, t, use_reentrant=False),
    "recompute_reentrant": lambda m: lambda t: ms.recompute(m, t),  # reentrant is the default
    "cell_recompute": cell_recompute,
}


@pytest.mark.parametrize("foreign", list(FOREIGN))
def test_foreign_checkpoint_warns_once_per_wrapper(foreign):
    ref, model = foreign_block()
    f = FOREIGN[foreign](model)
    x = tensor(2, 5, 8)
    expected = grads(ref, ref.trainable_params(), x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert_same(expected, grads(f, model.trainable_params(), x))  # plainly replayed
    messages = [str(w.message) for w in caught if w.category is recomp.ForeignCheckpointWarning]
    assert len(messages) == 2, messages
    for name, message in zip(("attn", "up"), sorted(messages)):
        assert f"'{name}'" in message
        assert "recomp.mindspore.checkpoint" in message
    assert (model.attn.region_runs, model.attn.region_skips) == (4, 0)


def test_recomp_checkpoint_does_not_warn():
    ref, model = foreign_block()
    x = tensor(2, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.ForeignCheckpointWarning)
        actual = grads(rm.checkpoint_wrapper(model), model.trainable_params(), x)
    assert_same(grads(ref, ref.trainable_params(), x), actual)


# --------------------------------------------------------------------------- 6. nesting, early stop, AMP


class Outer(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Dense(8, 8)
        self.inner = Block()
        self.post = nn.Dense(8, 8)

    def construct(self, x):
        return self.post(ops.tanh(self.inner(ops.sin(self.pre(x)))))


@pytest.mark.parametrize(
    ("outer_early_stop", "inner_early_stop"), [(True, True), (False, False), (True, False)]
)
def test_nested_checkpoints_with_exclusions_in_the_inner_one(outer_early_stop, inner_early_stop):
    ref = Outer()
    model = Outer()
    copy_params(ref, model)
    model.inner.attn = rm.checkpoint_exclude_wrapper(model.inner.attn)
    model.inner = rm.checkpoint_wrapper(model.inner, early_stop=inner_early_stop)
    wrapped = rm.checkpoint_wrapper(model, early_stop=outer_early_stop)
    x = tensor(2, 5, 8)
    expected = grads(ref, ref.trainable_params(), x)
    for step in (1, 2):
        assert_same(expected, grads(wrapped, wrapped.trainable_params(), x))
        # the outer replay re-runs the inner checkpoint call, which reuses its cache,
        # then the inner replay: skipped twice, run once
        assert (model.inner.attn.region_runs, model.inner.attn.region_skips) == (step, 2 * step)


def test_auto_mixed_precision_around_a_checkpoint_with_exclusions():
    ref = Block()
    model = Block()
    copy_params(ref, model)
    model.attn = rm.checkpoint_exclude_wrapper(model.attn)
    wrapped = rm.checkpoint_wrapper(model)
    x = tensor(2, 5, 8)
    amp_ref = auto_mixed_precision(lambda t: ref(t), "auto", ms.float16)
    amp_model = auto_mixed_precision(lambda t: wrapped(t), "auto", ms.float16)
    assert not np.array_equal(amp_ref(x).asnumpy(), ref(x).asnumpy())  # AMP is in effect
    assert_same(
        grads(amp_ref, ref.trainable_params(), x), grads(amp_model, model.trainable_params(), x)
    )
    assert (model.attn.region_runs, model.attn.region_skips) == (1, 1)


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


# --------------------------------------------------------------------------- 7. threads


class NoNormBlock(nn.Cell):
    # no LayerNorm: a nested ms.grad through LayerNorm fails in MindSpore 2.10 itself
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attn = nn.Dense(d, d)
        self.mlp = nn.SequentialCell([nn.Dense(d, 2 * d), nn.SiLU(), nn.Dense(2 * d, d)])

    def construct(self, x):
        h = x + self.attn(ops.tanh(x))
        return h + self.mlp(h)


class NoNormStack(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.CellList([NoNormBlock(), NoNormBlock()])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Pause(nn.Cell):
    """Runs ``inner``; the first time ``when()`` holds, hands over to the other thread
    and waits until it is done."""

    def __init__(self, inner, when, handover) -> None:
        super().__init__()
        self.inner = inner
        self.when = when
        self.handover = handover
        self.paused = False

    def maybe_pause(self) -> None:
        if not self.paused and self.when():
            self.paused = True
            self.handover()

    def construct(self, x):
        self.maybe_pause()
        return self.inner(x)


def thread_models(seed):
    ref = NoNormStack()
    model = NoNormStack()
    copy_params(ref, model)
    exclude_attention(model)
    x = tensor(4, 5, 8, seed=seed)
    return model, x, grads(ref, ref.trainable_params(), x)


def train_a_while_b_trains(pause_in):
    """Thread A trains; in the middle of its forward (``pause_in="forward"``, inside its
    excluded region) or of its replay, thread B runs a whole training step. Returns
    the outcomes (gradients or exception under "a" and "b", B's recompute state at its
    start under "b_state"), both models and the expected gradients of each."""
    model_a, x_a, expected_a = thread_models(0)
    model_b, x_b, expected_b = thread_models(1)
    go_b, b_done = threading.Event(), threading.Event()
    outcome = {}

    def handover():
        go_b.set()
        assert b_done.wait(60), "thread B did not finish"

    first_a = model_a.layers[0]
    if pause_in == "forward":
        # A forward pre-hook of an excluded cell runs inside its region.
        pause = Pause(None, lambda: True, handover)
        first_a.attn.register_forward_pre_hook(lambda cell, args: pause.maybe_pause())
    else:
        first_a.mlp = Pause(first_a.mlp, recomp.is_recomputing, handover)

    def run(key, model, x):
        try:
            outcome[key] = grads(model, model.trainable_params(), x)
        except Exception as exc:  # reported by the caller
            outcome[key] = exc

    def thread_b():
        if go_b.wait(60):
            try:
                # a new thread starts with an empty context: B sees no recompute state
                outcome["b_state"] = recomp.get_recompute_state()
                run("b", model_b, x_b)
            finally:
                b_done.set()

    worker = threading.Thread(target=thread_b, daemon=True)
    worker.start()
    run("a", model_a, x_a)
    worker.join(60)
    assert not worker.is_alive()
    return outcome, model_a, model_b, expected_a, expected_b


@pytest.mark.parametrize("pause_in", ["forward", "replay"])
def test_a_thread_trains_while_another_is_paused_mid_step(pause_in):
    outcome, model_a, model_b, expected_a, expected_b = train_a_while_b_trains(pause_in)
    assert outcome["b_state"] is None
    assert_same(expected_a, outcome["a"])
    assert_same(expected_b, outcome["b"])
    for model in (model_a, model_b):
        assert [layer.attn.region_runs for layer in model.layers] == [1, 1]
        assert [layer.attn.region_skips for layer in model.layers] == [1, 1]
    assert recomp.get_recompute_state() is None


@pytest.mark.parametrize(
    ("pause_in", "error"),
    [("forward", recomp.NestedExclusionError), ("replay", recomp.ReplayMismatchError)],
)
def test_control_process_global_state_breaks_the_other_thread(recover_mindspore, pause_in, error):
    assert _testing.uses_context_variables()
    with _testing.process_global_state():
        outcome, *_ = train_a_while_b_trains(pause_in)
    assert isinstance(outcome["b"], error), outcome["b"]


# --------------------------------------------------------------------------- 8. leaks


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


def test_cache_is_freed_after_the_gradient_step():
    x = tensor(4, 8)
    region, body, refs = tracked_checkpoint(x)
    for _ in range(3):
        ms.grad(lambda t: rm.checkpoint(body, t).sum(), 0, region.trainable_params())(x)
    assert len(refs) >= 3 * 3  # per step: invocation, cached output, kept tanh output
    flush()
    assert [r() is not None for r in refs] == [False] * len(refs)


@pytest.mark.parametrize("computed_input", [True, False])
@pytest.mark.parametrize(
    "how",
    [
        "forward_only",
        "unused_in_grad",
        "has_aux",
        "vjp_never_called",
    ],
)
def test_cache_is_freed_when_the_output_gets_no_backward(how, computed_input):
    x = tensor(4, 8)
    _region, body, refs = tracked_checkpoint(x, computed_input)
    for _ in range(3):
        if how == "forward_only":
            rm.checkpoint(body, x)
        elif how == "unused_in_grad":
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


def test_training_steps_keep_memory_flat():
    figures = run_measured(LEAK_CHILD.replace("STEPS", str(LEAK_STEPS)), timeout=600)
    assert figures["invocations"] == 2 * (10 + LEAK_STEPS)
    assert figures["alive"] == 0
    extra = figures["recomp"] - figures["bare"]
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
