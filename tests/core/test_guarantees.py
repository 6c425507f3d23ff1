"""Where skipping a region in the replay could go silently wrong, recomp stays right:
the guarantees both frameworks give, each tested once per framework (the ``fw``
fixture, ``tests/support/frameworks.py``).

RNG after a skipped region, a forward replayed twice (second-order gradients),
in-place writes to what a region returned, foreign checkpoints, nested
checkpoints, mixed precision, a thread training while another is paused mid-step,
and what recomp keeps being freed. Each control switches a mechanism off
(``recomp._testing``) and sees the guarantee fail. What holds on one framework
only, or is reached through an API only one framework has (PyTorch's
``retain_graph``, selective checkpointing, concurrent training threads;
MindSpore's ``nn.Dropout``, ``vjp``, O2 mixed precision), is in
``tests/torch/test_guarantees.py`` and ``tests/mindspore/test_guarantees.py``;
so are the memory soaks, whose baselines are each framework's own checkpoint.
"""

from __future__ import annotations

import re
import threading
import warnings
import weakref
from typing import Any

import numpy as np
import pytest

import recomp
from frameworks import ADAPTERS, assert_same
from recomp import _testing


@pytest.fixture
def restore_rng(fw, request):
    """The test seeds the random ops; the random state is put back afterwards."""
    if fw.name == "mindspore":
        request.getfixturevalue("seeded")
        yield
        return
    state = fw.torch.get_rng_state()
    yield
    fw.torch.set_rng_state(state)


def checkpoint_returned(fw, function, returned, *args, **kwargs):
    """``function`` checkpointed (``args`` before the input); appends to ``returned``
    once the checkpoint's forward has returned."""

    def call(t):
        out = fw.api.checkpoint(function, *args, t, **kwargs)
        returned.append(True)
        return out

    return call


# --------------------------------------------------------------------------- RNG


def dropout_case(fw):
    """(plain function, its parameters, checkpointed function with the region
    excluded, its parameters, the region): dropout inside the region, after it,
    and on the input."""
    first, ref_first = fw.dense_pair(8, 8)
    inner, ref_inner = fw.dense_pair(8, 8)
    last, ref_last = fw.dense_pair(8, 8)
    ops = fw.ops

    def body(first, region, last):
        def f(x):
            y = region(ops.tanh(first(ops.sin(x))))
            # the last op saves no dropout output: MindSpore's early stop cannot end there
            return last(fw.dropout(y, 0.5) + fw.dropout(x, 0.2)) * y

        return f

    region = fw.api.checkpoint_exclude_wrapper(
        lambda h: fw.dropout(inner(h), 0.3), name="drop_region"
    )
    plain = body(ref_first, lambda h: fw.dropout(ref_inner(h), 0.3), ref_last)
    model = body(first, region, last)
    ref_params = [p for m in (ref_first, ref_inner, ref_last) for p in fw.parameters(m)]
    params = [p for m in (first, inner, last) for p in fw.parameters(m)]
    return plain, ref_params, model, params, region


def train_steps(fw, f, params, steps=2):
    """Gradients of ``steps`` steps, seeded once before the first (the random stream
    must also be where the plain run leaves it after each step), and the random
    state at the end."""
    fw.seed(123)
    grads = [fw.grads(f, fw.tensor(4, 8, seed=s), params=params)[1] for s in range(steps)]
    return grads, fw.random_state()


@pytest.mark.parametrize("early_stop", [True, False])
def test_dropout_inside_and_after_a_skipped_region_matches_unwrapped(fw, restore_rng, early_stop):
    plain, ref_params, model, params, region = dropout_case(fw)
    expected, ref_state = train_steps(fw, plain, ref_params)
    actual, state = train_steps(
        fw, lambda t: fw.api.checkpoint(model, t, early_stop=early_stop), params
    )
    for e, a in zip(expected, actual):
        assert_same(e, a)
    assert state == ref_state  # the random stream ends where the plain run's does
    assert (region.region_runs, region.region_skips) == (2, 2)


@pytest.mark.replay_differs
def test_control_without_rng_alignment_dropout_after_the_region_differs(fw, restore_rng):
    plain, ref_params, model, params, region = dropout_case(fw)
    expected, _ = train_steps(fw, plain, ref_params, steps=1)
    with _testing.without_rng_alignment():  # the replay does not skip the region's draws
        actual, _ = train_steps(fw, lambda t: fw.api.checkpoint(model, t), params, steps=1)
    with pytest.raises(AssertionError):
        assert_same(expected[0], actual[0])
    assert region.region_skips == 1  # the region was skipped, nothing else changed


# --------------------------------------------------------------------------- a forward replayed twice


def float64_case(fw):
    w = fw.parameter(np.random.RandomState(1).randn(6, 6), "w")
    ops = fw.ops

    def project(h):
        return ops.tanh(ops.matmul(h, w))

    def body(region, x):
        h = ops.sin(x) * 1.5  # computed inside the checkpoint: deferred, boundary
        y = region(h)
        return ops.tanh(y * h) + ops.sin(y)

    return w, project, body, fw.from_numpy(np.random.RandomState(0).randn(3, 6))


@pytest.mark.parametrize("early_stop", [True, False])
def test_second_order_gradients_replay_twice_region_runs_once(fw, early_stop):
    """The gradient of a gradient replays the one forward twice; both replays are
    served from the same cache, which lives as long as the graph and no longer.
    Not bitwise: the boundary changes the order in which the second-order graph sums
    the same terms (a few ulp in float32), hence float64 and rtol 1e-12."""
    w, project, body, x = float64_case(fw)
    region = fw.api.checkpoint_exclude_wrapper(project, name="proj")
    invocations = []

    def tracked(reg, t):
        state = recomp.get_recompute_state()
        if not state.is_recomputing:
            invocations.append(weakref.ref(_testing.record_of(state)))
        return body(reg, t)

    expected = fw.second_order_grads(lambda t: (body(project, t) ** 2).sum(), x, [w])
    actual = fw.second_order_grads(
        lambda t: (fw.api.checkpoint(tracked, region, t, early_stop=early_stop) ** 2).sum(),
        x,
        [w],
    )
    assert len(actual) == len(expected) == 2
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=0)
    # one forward, one replay per backward pass, both served from the same cache
    assert (region.region_runs, region.region_skips) == (1, 2)
    assert len(invocations) == 1
    fw.flush()
    assert invocations[0]() is None


def test_control_second_replay_needs_the_cache_from_the_start(fw, recover):
    w, project, body, x = float64_case(fw)
    region = fw.api.checkpoint_exclude_wrapper(project, name="proj")
    # what a replay that does not start again from the first cached region would do
    with (
        _testing.without_replay_rewind(),
        pytest.raises(recomp.ReplayMismatchError, match=r"'proj'.*recorded only 1"),
    ):
        fw.second_order_grads(lambda t: (fw.api.checkpoint(body, region, t) ** 2).sum(), x, [w])


# --------------------------------------------------------------------------- in-place writes


def mutation_case(fw, region_op):
    """A region ``region_op(t @ w)`` and a body that writes its output in place after
    using it (``sin`` saves it), still inside the checkpoint's forward."""
    w = fw.parameter(np.random.RandomState(1).randn(6, 6).astype(np.float32), "w")
    ops = fw.ops
    z = fw.tensor(3, 6, seed=5)

    def project(t):
        return region_op(ops.matmul(t, w))

    def body(region, t):
        y = region(t)  # the checkpoint's input: no boundary
        out = ops.sin(y) * t
        fw.write_in_place(y, z * 1)
        return out

    return w, project, body


@pytest.mark.parametrize("early_stop", [True, False])
def test_in_place_write_to_a_cached_output_raises_naming_the_region(fw, recover, early_stop):
    w, project, body = mutation_case(fw, lambda m: m)  # matmul saves no output: only the cache
    region = fw.api.checkpoint_exclude_wrapper(project, name="proj")
    returned = []
    with pytest.raises(recomp.CachedValueMutatedError, match=r"'proj'.*modified in place"):
        fw.grads(
            checkpoint_returned(fw, body, returned, region, early_stop=early_stop),
            fw.tensor(3, 6),
            params=[w],
            loss=lambda out: out.sum(),
        )
    assert not returned  # caught at the end of the checkpoint's forward already


def test_in_place_write_to_an_output_the_region_saved_raises_naming_the_region(fw, recover):
    w, project, body = mutation_case(fw, fw.ops.tanh)  # tanh saves its output: a kept tensor
    region = fw.api.checkpoint_exclude_wrapper(project, name="proj")
    with pytest.raises(recomp.CachedValueMutatedError, match=r"'proj'.*modified in place"):
        fw.grads(
            lambda t: fw.api.checkpoint(body, region, t),
            fw.tensor(3, 6),
            params=[w],
            loss=lambda out: out.sum(),
        )


def test_region_that_writes_its_own_output_in_place_is_not_a_mutation(fw):
    w = fw.parameter(np.random.RandomState(1).randn(6, 6).astype(np.float32), "w")
    ops = fw.ops

    def into_buffer(t):
        buf = ops.zeros((3, 6))
        fw.write_in_place(buf, ops.tanh(ops.matmul(t, w)))
        return buf

    region = fw.api.checkpoint_exclude_wrapper(into_buffer, name="buffer")
    x = fw.tensor(3, 6)

    def total(out):
        return out.sum()

    _, expected = fw.grads(lambda t: ops.sin(into_buffer(t)) * t, x, params=[w], loss=total)
    _, actual = fw.grads(
        lambda t: fw.api.checkpoint(lambda u: ops.sin(region(u)) * u, t), x, params=[w], loss=total
    )
    assert_same(expected, actual)
    assert (region.region_runs, region.region_skips) == (1, 1)


# --------------------------------------------------------------------------- arguments changed after the call


def history_net(fw):
    """(reference, model): blocks that each read the last entry of the list of hidden
    states so far, the list growing after each block; the model checkpoints each block
    (NOTE [ Arguments a replay sees ] in ``recomp._engine``)."""
    ops = fw.ops
    block = fw.layer_class("Block", lambda b, history: ops.tanh(b.dense(history[-1])))

    def net_body(net, x):
        history = [x]
        for layer in net.layers:
            history.append(fw.api.checkpoint(layer, history) if net.checkpointed else layer(history))
        return history[-1]

    net = fw.layer_class("Net", net_body)
    ref, model = fw.twins(
        lambda: net(layers=fw.layer_list([block(dense=fw.dense(8, 8)) for _ in range(3)]))
    )
    ref.checkpointed, model.checkpointed = False, True
    return ref, model


def test_a_list_argument_appended_to_after_the_call_is_replayed_as_it_was(fw):
    ref, model = history_net(fw)
    x = fw.tensor(2, 8)
    _, expected = fw.grads(ref, x)
    _, actual = fw.grads(model, x)
    # A replay that read the list as it is at backward would compute with the last
    # block's output (the same shape): wrong gradients, no error.
    assert_same(expected, actual)


# --------------------------------------------------------------------------- foreign checkpoints


def foreign_block(fw):
    """A block and its twin with two excluded regions, ``attn`` and ``up``."""
    ref, model = fw.block_pair()
    model.attn = fw.api.checkpoint_exclude_wrapper(model.attn, name="attn")
    model.mlp[0] = fw.api.checkpoint_exclude_wrapper(model.mlp[0], name="up")
    return ref, model


FOREIGN = [
    (name, style) for name, adapter in ADAPTERS.items() for style in adapter.foreign_checkpoints
]


@pytest.mark.parametrize(("fw", "style"), FOREIGN, indirect=["fw"])
def test_foreign_checkpoint_warns_once_per_wrapper(fw, style):
    """Under the framework's own checkpoint the exclusion is not in effect: the
    regions are replayed like the rest, the gradients stay right, and each wrapper
    says so once."""
    ref, model = foreign_block(fw)
    f = fw.foreign_checkpoint(style, model)
    x = fw.tensor(2, 5, 8)
    _, expected = fw.grads(ref, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same(expected, fw.grads(f, x, params=fw.parameters(model))[1])
    messages = [str(w.message) for w in caught if w.category is recomp.ForeignCheckpointWarning]
    assert len(messages) == 2, messages
    for name, message in zip(("attn", "up"), sorted(messages)):
        assert re.search(rf"'{name}'.*recomp\.{fw.name}\.checkpoint", message, re.S), message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per wrapper: no second warning
        assert_same(expected, fw.grads(f, x, params=fw.parameters(model))[1])
    assert (model.attn.region_runs, model.attn.region_skips) == (4, 0)  # replayed


def test_recomp_checkpoint_inside_a_foreign_one_is_reported(fw):
    """The foreign checkpoint's replay would re-run the recomp checkpoint in full, its
    region included. PyTorch refuses it in the forward, before anything ran
    (``DoubleCheckpointError``; more cases in ``tests/torch/test_foreign_checkpoints.py``);
    MindSpore warns when the region is replayed."""
    region = fw.api.checkpoint_exclude_wrapper(fw.dense(4, 4), name="comm")
    ops = fw.ops

    def outer(t):
        # tanh saves its output: the foreign replay re-runs the recomp checkpoint in full
        return ops.tanh(fw.api.checkpoint(lambda u: ops.tanh(region(ops.sin(u))), t))

    foreign = fw.foreign_checkpoint(fw.foreign_checkpoints[0], outer)  # non-reentrant
    if fw.name == "torch":
        with pytest.raises(recomp.DoubleCheckpointError, match="inside a plain PyTorch checkpoint"):
            fw.grads(foreign, fw.tensor(2, 4), params=fw.parameters(region))
        assert region.region_runs == 0
        return
    with pytest.warns(recomp.ForeignCheckpointWarning, match="'comm'"):
        fw.grads(foreign, fw.tensor(2, 4), params=fw.parameters(region))
    assert region.region_runs == 2


def test_recomp_checkpoint_does_not_warn(fw):
    ref, model = foreign_block(fw)
    x = fw.tensor(2, 5, 8)
    _, expected = fw.grads(ref, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, actual = fw.grads(fw.api.checkpoint_wrapper(model), x)
    assert_same(expected, actual)


# --------------------------------------------------------------------------- nesting, mixed precision


@pytest.mark.parametrize(
    ("outer_early_stop", "inner_early_stop"),
    [(True, True), (False, False), (True, False), (False, True)],
)
def test_nested_checkpoints_with_exclusions_in_the_inner_ones(
    fw, outer_early_stop, inner_early_stop
):
    """An outer checkpoint around two inner ones whose blocks exclude their attention."""
    pre, ref_pre = fw.dense_pair(8, 8)
    post, ref_post = fw.dense_pair(8, 8)
    (ref_a, a), (ref_b, b) = fw.block_pair(), fw.block_pair()
    ops = fw.ops

    def outer(pre, a, b, post):
        return lambda t: post(ops.tanh(b(ops.sin(a(pre(t))))))

    for blk in (a, b):
        blk.attn = fw.api.checkpoint_exclude_wrapper(blk.attn)
        fw.api.checkpoint_wrapper(blk, early_stop=inner_early_stop)
    model = outer(pre, a, b, post)
    params = [p for m in (pre, a, b, post) for p in fw.parameters(m)]
    x = fw.tensor(2, 5, 8)
    _, expected = fw.grads(
        outer(ref_pre, ref_a, ref_b, ref_post),
        x,
        params=[p for m in (ref_pre, ref_a, ref_b, ref_post) for p in fw.parameters(m)],
    )
    for step in (1, 2):
        _, actual = fw.grads(
            lambda t: fw.api.checkpoint(model, t, early_stop=outer_early_stop), x, params=params
        )
        assert_same(expected, actual)
        # the outer replay re-runs each inner checkpoint call, which reuses its cache,
        # then the inner replay: skipped twice, run once
        for blk in (a, b):
            assert (blk.attn.region_runs, blk.attn.region_skips) == (step, 2 * step)


def test_nested_checkpoint_whose_outer_replay_runs_in_full(fw):
    """The outer replay (no early stop) re-runs the inner checkpoint to the end; the inner
    region's output, which the inner replay alone would never need, must still be there."""
    dense, ref = fw.dense_pair(6, 6)
    region = fw.api.checkpoint_exclude_wrapper(dense)
    ops = fw.ops

    def inner(layer):
        return lambda t: layer(ops.sin(t))  # nothing saved after the region

    def outer(t):
        return ops.tanh(fw.api.checkpoint(inner(region), t, early_stop=True))

    def total(out):
        return out.sum()

    x = fw.tensor(3, 6)
    _, expected = fw.grads(
        lambda t: ops.tanh(inner(ref)(t)), x, params=fw.parameters(ref), loss=total
    )
    _, actual = fw.grads(
        lambda t: fw.api.checkpoint(outer, t, early_stop=False),
        x,
        params=fw.parameters(dense),
        loss=total,
    )
    assert_same(expected, actual)
    assert region.region_runs == 1


def test_mixed_precision_around_a_checkpoint_with_exclusions(fw):
    ref, model = fw.attention_excluded_stack(2)
    x = fw.tensor(2, 5, 8)
    amp_ref, amp_model = fw.mixed_precision(ref), fw.mixed_precision(model)
    with fw.no_grad():
        lowered, full = fw.numpy(fw.float32(amp_ref(x))), fw.numpy(ref(x))
    assert not np.array_equal(lowered, full)  # mixed precision is in effect

    def loss(out):
        return (fw.float32(out) ** 2).sum()

    _, expected = fw.grads(amp_ref, x, params=fw.parameters(ref), loss=loss)
    _, actual = fw.grads(amp_model, x, params=fw.parameters(model), loss=loss)
    assert_same(expected, actual)
    assert [blk.attn.region_runs for blk in fw.blocks(model)] == [1, 1]
    assert [blk.attn.region_skips for blk in fw.blocks(model)] == [1, 1]


# --------------------------------------------------------------------------- threads


def train_a_while_b_trains(fw, pause_in):
    """Thread A trains; in the middle of its forward (``pause_in="forward"``, inside its
    excluded region) or of its replay, thread B runs a whole training step. Returns
    the outcomes (gradients or exception under "a" and "b", B's recompute state at its
    start under "b_state"), both models and the expected gradients of each.

    One thread's whole step while the other is paused is what MindSpore 2.10 can run
    (two of its gradient computations at once fail inside MindSpore, with or without
    recomp), so the same is asked of both frameworks."""
    models, expected = [], []
    for seed in (0, 1):
        ref, model = fw.normless_stack(2)
        x = fw.tensor(4, 5, 8, seed=seed)
        models.append((model, x))
        expected.append(fw.grads(ref, x)[1])
    go_b, b_done = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}
    paused = []

    def pause_once(when):
        def hook(layer, args):
            if not paused and when():
                paused.append(True)
                go_b.set()
                assert b_done.wait(60), "thread B did not finish"

        return hook

    first_a = fw.blocks(models[0][0])[0]
    if pause_in == "forward":
        # a forward pre-hook of an excluded layer runs inside its region
        first_a.attn.register_forward_pre_hook(pause_once(lambda: True))
    else:
        first_a.mlp.register_forward_pre_hook(pause_once(recomp.is_recomputing))

    def run(key, model, x):
        try:
            outcome[key] = fw.grads(model, x)[1]
        except Exception as exc:  # reported by the caller
            outcome[key] = exc

    def thread_b():
        if go_b.wait(60):
            try:
                # a new thread starts with an empty context: B sees no recompute state
                outcome["b_state"] = recomp.get_recompute_state()
                run("b", *models[1])
            finally:
                b_done.set()

    worker = threading.Thread(target=thread_b, daemon=True)
    worker.start()
    run("a", *models[0])
    worker.join(60)
    assert not worker.is_alive()
    assert paused
    return outcome, [m for m, _ in models], expected


@pytest.mark.parametrize("pause_in", ["forward", "replay"])
def test_a_thread_trains_while_another_is_paused_mid_step(fw, pause_in):
    outcome, models, (expected_a, expected_b) = train_a_while_b_trains(fw, pause_in)
    assert outcome["b_state"] is None
    assert_same(expected_a, outcome["a"])
    assert_same(expected_b, outcome["b"])
    for model in models:
        assert [blk.attn.region_runs for blk in fw.blocks(model)] == [1, 1]
        assert [blk.attn.region_skips for blk in fw.blocks(model)] == [1, 1]
    assert recomp.get_recompute_state() is None


@pytest.mark.parametrize(
    ("pause_in", "error"),
    [("forward", recomp.NestedExclusionError), ("replay", recomp.ReplayMismatchError)],
)
def test_control_process_global_state_breaks_the_other_thread(fw, recover, pause_in, error):
    assert _testing.uses_context_variables()
    with _testing.process_global_state():
        outcome, *_ = train_a_while_b_trains(fw, pause_in)
    assert isinstance(outcome["b"], error), outcome["b"]


# --------------------------------------------------------------------------- what recomp keeps is freed


def tracked_checkpoint(fw, x, computed_input=True):
    """A checkpointed function with an excluded region (dense, then tanh, which saves
    its output), the region, and weak references to what a step leaves: the
    invocation, its cached outputs, the kept saved tensors (other than the caller's
    input ``x``, which outlives the step), and the region's input (when computed
    inside the checkpoint: bound again in the replay), dense output and output."""
    refs = []
    outside = x.untyped_storage().data_ptr()
    dense = fw.dense(8, 8)
    ops = fw.ops

    def on_kept(original, kept):
        if original.untyped_storage().data_ptr() != outside:
            refs.append(weakref.ref(kept))

    def tanh_region(h):
        if computed_input:
            refs.append(weakref.ref(h))
        y = dense(h)
        out = ops.tanh(y)
        refs.extend((weakref.ref(y), weakref.ref(out)))
        return out

    region = fw.api.checkpoint_exclude_wrapper(tanh_region, name="tanh_region")

    def body(t):
        with _testing.observe(kept=on_kept):
            y = region(ops.cos(t) if computed_input else t)
        state = recomp.get_recompute_state()
        if state is not None and not state.is_recomputing:
            record = _testing.record_of(state)
            refs.append(weakref.ref(record))
            refs.extend(weakref.ref(v) for v in _testing.cached_values(record))
        return ops.sin(y) * t

    return dense, body, refs


def test_what_a_step_kept_is_freed_after_its_backward(fw):
    x = fw.tensor(4, 8)
    dense, body, refs = tracked_checkpoint(fw, x)
    for _ in range(3):
        fw.grads(lambda t: fw.api.checkpoint(body, t), x, params=fw.parameters(dense))
    # per step: invocation, cached output, kept tanh output, and the region's tensors
    assert len(refs) >= 3 * 3
    fw.flush()
    assert [r() is not None for r in refs] == [False] * len(refs)


@pytest.mark.parametrize("computed_input", [True, False])
def test_what_a_forward_kept_is_freed_without_a_backward(fw, computed_input):
    """tanh saves its result; kept as it is, node -> saved result -> grad_fn -> node
    would be a cycle the garbage collector cannot see, freed only by a backward."""
    x = fw.input_leaf(fw.tensor(4, 8))
    _, body, refs = tracked_checkpoint(fw, x, computed_input)
    for _ in range(3):
        out = fw.api.checkpoint(body, x)
    del out
    assert refs
    fw.flush()
    assert [r() is not None for r in refs] == [False] * len(refs)
