"""Excluded regions inside recomp checkpoints, the behaviour both frameworks share:
run counts, gradients, errors, and what a failure leaves behind.

Each test runs once per framework (the ``fw`` fixture, ``tests/support/frameworks.py``).
Every gradient comparison is exact against the same model without checkpoints:
on CPU, with the same op order, the results are bitwise identical, so any replay
or caching mistake shows. Behaviour that differs between the frameworks is
tested in the per-framework files.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple
from typing import Any

import pytest

import recomp
from frameworks import assert_region_output_type, assert_same
from recomp import _testing


def test_gradients_equal_unwrapped_and_region_runs_once(fw):
    ref, model = fw.attention_excluded_stack(3)
    x = fw.tensor(4, 5, 8)
    for step in (1, 2):
        loss_ref, g_ref = fw.grads(ref, x)
        loss, g = fw.grads(model, x)
        assert_same([loss_ref], [loss])
        assert_same(g_ref, g)
        # once per step: never in the replay
        assert [blk.attn.region_runs for blk in fw.blocks(model)] == [step] * 3
        # one replay per step returned the cache
        assert [blk.attn.region_skips for blk in fw.blocks(model)] == [step] * 3


def test_without_exclusion_the_region_is_replayed(fw):
    """Control for the counts above: a plain recomp checkpoint replays the same layer."""
    calls = []
    ref, _ = fw.attention_excluded_stack(1)
    blk = fw.blocks(ref)[0]
    blk.attn.register_forward_hook(lambda *args: calls.append(1))
    fw.grads(fw.api.checkpoint_wrapper(blk), fw.tensor(2, 8))
    assert len(calls) == 2


def test_excluded_region_is_plain_call_outside_checkpoint_and_without_grad(fw):
    dense, plain = fw.dense_pair(4, 4)
    wrapped = fw.api.checkpoint_exclude_wrapper(dense)
    x = fw.tensor(2, 4)
    assert_same([fw.numpy(plain(x))], [fw.numpy(wrapped(x))])
    with fw.no_grad():
        assert_same([fw.numpy(plain(x))], [fw.numpy(wrapped(x))])
        # under no_grad a checkpoint has nothing to replay: the region is a plain call too
        fw.api.checkpoint(lambda t: wrapped(t) * 2, x)
    assert (wrapped.region_runs, wrapped.region_skips) == (3, 0)


def test_same_wrapper_called_several_times_replays_in_order(fw):
    dense, ref = fw.dense_pair(6, 6)
    wrapped = fw.api.checkpoint_exclude_wrapper(dense)
    ops = fw.ops

    def body(m, x):
        a = ops.tanh(m(x))
        b = ops.sin(m(a * 2))
        return ops.cos(m(b + a))

    x = fw.tensor(3, 6)
    _, expected = fw.grads(lambda t: body(ref, t), x, params=fw.parameters(ref))
    _, actual = fw.grads(
        lambda t: fw.api.checkpoint(body, wrapped, t), x, params=fw.parameters(dense)
    )
    assert_same(expected, actual)
    assert (wrapped.region_runs, wrapped.region_skips) == (3, 3)


def test_several_invocations_of_one_wrapper_keep_separate_caches(fw):
    """One excluded layer shared by several checkpoints (micro-batches) of different values."""
    dense, ref = fw.dense_pair(5, 5)
    wrapped = fw.api.checkpoint_exclude_wrapper(dense)
    ops = fw.ops
    xs = [fw.tensor(2, 5, seed=i) * (i + 1) for i in range(3)]

    def total(m, checkpointed):
        def one(t):
            return ops.relu(m(ops.tanh(t)))

        f = (lambda t: fw.api.checkpoint(one, t)) if checkpointed else one
        return lambda *ts: sum(((f(t) ** 2).sum() for t in ts[1:]), (f(ts[0]) ** 2).sum())

    identity = lambda v: v  # noqa: E731
    _, expected = fw.grads(total(ref, False), *xs, params=fw.parameters(ref), loss=identity)
    _, actual = fw.grads(total(wrapped, True), *xs, params=fw.parameters(dense), loss=identity)
    assert_same(expected, actual)
    assert (wrapped.region_runs, wrapped.region_skips) == (3, 3)


def test_save_output_false_chain_gives_same_gradients(fw):
    up, ref_up = fw.dense_pair(8, 16)
    down, ref_down = fw.dense_pair(16, 8)
    first = fw.api.checkpoint_exclude_wrapper(fw.sequential(up, fw.nn.ReLU()), save_output=False)
    second = fw.api.checkpoint_exclude_wrapper(down)
    ops = fw.ops
    x = fw.tensor(4, 8)
    _, expected = fw.grads(
        lambda t: ops.tanh(ref_down(ops.relu(ref_up(ops.sin(t))))),
        x,
        params=fw.parameters(ref_up) + fw.parameters(ref_down),
    )
    _, actual = fw.grads(
        lambda t: fw.api.checkpoint(lambda u: ops.tanh(second(first(ops.sin(u)))), t),
        x,
        params=fw.parameters(up) + fw.parameters(down),
    )
    assert_same(expected, actual)
    assert (first.region_runs, first.region_skips) == (1, 1)
    assert (second.region_runs, second.region_skips) == (1, 1)
    # the ReLU's saved output is the one copy of `first`'s output; no cache on top
    assert first.region_saved_bytes == 4 * 16 * 4


def checkpoint_returned(fw, function, returned):
    """``function`` checkpointed; appends to ``returned`` when the checkpoint's forward
    has returned (a failure before that is a failure in the forward)."""

    def call(t):
        out = fw.api.checkpoint(function, t)
        returned.append(True)
        return out

    return call


def test_save_output_false_output_that_feeds_no_excluded_region_raises_in_forward(fw, recover):
    first = fw.api.checkpoint_exclude_wrapper(fw.dense(4, 4), save_output=False, name="proj")
    returned = []
    with pytest.raises(recomp.OutputNotSavedError, match=r"'proj'.*save_output=True"):
        fw.grads(
            checkpoint_returned(fw, lambda u: fw.ops.tanh(first(u)) * 2, returned),
            fw.tensor(2, 4),
            params=fw.parameters(first),
        )
    assert not returned


def test_nested_exclusion_raises_naming_both(fw, recover):
    inner = fw.api.checkpoint_exclude_wrapper(fw.dense(4, 4), name="inner_a")
    outer = fw.api.checkpoint_exclude_wrapper(
        fw.sequential(inner, fw.nn.ReLU(), fw.dense(4, 4)), name="outer"
    )
    returned = []
    with pytest.raises(recomp.NestedExclusionError, match=r"'inner_a'.*inside.*'outer'"):
        fw.grads(checkpoint_returned(fw, outer, returned), fw.tensor(2, 4), params=[])
    assert not returned


def test_replay_that_calls_regions_differently_raises(fw, recover):
    wrapped = fw.api.checkpoint_exclude_wrapper(fw.dense(4, 4), name="lin")

    def diverging(x):
        y = wrapped(x)
        if recomp.is_recomputing():
            y = wrapped(y)  # an extra call the forward never made
        return fw.ops.tanh(y)

    with pytest.raises(recomp.ReplayMismatchError, match=r"'lin'.*recorded only 1"):
        fw.grads(lambda t: fw.api.checkpoint(diverging, t), fw.tensor(2, 4), params=[])


def test_save_output_false_view_of_the_checkpoint_input_counts_as_consumed(fw):
    """Found by the property tests: a save_output=False output that is a view of the
    checkpoint's input counts as consumed by the next excluded region."""
    split = fw.api.checkpoint_exclude_wrapper(lambda t: t.reshape(24), save_output=False)
    mix = fw.api.checkpoint_exclude_wrapper(fw.ops.sin)
    x = fw.tensor(4, 6)

    def total(v):
        return v.sum()

    _, expected = fw.grads(lambda t: fw.ops.sin(t.reshape(24)), x, params=[], loss=total)
    _, got = fw.grads(
        lambda t: fw.api.checkpoint(lambda u: mix(split(u)), t), x, params=[], loss=total
    )
    assert_same(expected, got)
    assert (split.region_runs, mix.region_runs) == (1, 1)


def no_state_left() -> bool:
    return recomp.get_recompute_state() is None and _testing.active_region_name() is None


def test_failure_inside_region_leaves_no_state_and_next_step_works(fw, recover):
    dense, plain = fw.dense_pair(4, 4)
    fail = [True]

    def fail_after_the_layer_ran(*args):  # a forward hook: inside the region
        if fail[0]:
            raise ValueError("boom")

    dense.register_forward_hook(fail_after_the_layer_ran)
    wrapped = fw.api.checkpoint_exclude_wrapper(dense)
    ops = fw.ops

    def step():
        return fw.grads(
            lambda t: fw.api.checkpoint(lambda u: ops.tanh(wrapped(ops.sin(u))), t),
            fw.tensor(2, 4),
            params=fw.parameters(dense),
        )

    with pytest.raises(ValueError, match="boom"):
        step()
    assert no_state_left()
    assert wrapped.region_runs == 0
    fail[0] = False
    _, expected = fw.grads(
        lambda u: ops.tanh(plain(ops.sin(u))), fw.tensor(2, 4), params=fw.parameters(plain)
    )
    assert_same(expected, step()[1])
    assert (wrapped.region_runs, wrapped.region_skips) == (1, 1)


def test_failure_in_the_replay_leaves_no_state_nor_tag(fw, recover):
    dense, plain = fw.dense_pair(4, 4)
    wrapped = fw.api.checkpoint_exclude_wrapper(dense, name="lin")
    ops = fw.ops
    fail = [True]
    seen = {}

    def body(t):
        y = wrapped(ops.sin(t))
        if fail[0] and recomp.is_recomputing():
            raise ValueError("boom in replay")
        return ops.tanh(y)

    def checkpointed(t):
        seen["input"] = t
        seen["output"] = fw.api.checkpoint(body, t)
        return seen["output"]

    def attributes(t):
        return dict(vars(t)), set(dir(t))

    with pytest.raises(ValueError, match="boom in replay"):
        fw.grads(checkpointed, fw.tensor(2, 4), params=fw.parameters(dense))
    assert no_state_left()
    untagged = attributes(fw.tensor(2, 4))
    for name in ("input", "output"):  # recomp tags no tensor
        assert attributes(seen[name]) == untagged, name
    fail[0] = False
    x = fw.tensor(2, 4)
    _, expected = fw.grads(lambda u: ops.tanh(plain(ops.sin(u))), x, params=fw.parameters(plain))
    _, actual = fw.grads(lambda t: fw.api.checkpoint(body, t), x, params=fw.parameters(dense))
    assert_same(expected, actual)


def test_use_reentrant_true_is_rejected(fw):
    with pytest.raises(ValueError, match="non-reentrant"):
        fw.api.checkpoint(fw.ops.sin, fw.tensor(2), use_reentrant=True)
    with pytest.raises(ValueError, match="non-reentrant"):
        fw.api.checkpoint_wrapper(fw.dense(2, 2), use_reentrant=True)


@pytest.mark.parametrize("bad", [None, 3, "linear", "a tensor"])
def test_non_callable_is_rejected(fw, bad):
    if bad == "a tensor":
        bad = fw.tensor(2)
    with pytest.raises(ValueError, match=f"{fw.layer} or a callable"):
        fw.api.checkpoint_exclude_wrapper(bad)
    with pytest.raises(ValueError, match=f"{fw.layer} or a callable"):
        fw.api.checkpoint_wrapper(bad)


@pytest.mark.parametrize("bad", [1, 0, None, "yes", "no"])
def test_non_bool_save_output_is_rejected(fw, bad):
    with pytest.raises(ValueError, match="save_output must be True or False"):
        fw.api.checkpoint_exclude_wrapper(fw.dense(2, 2), save_output=bad)


# --------------------------------------------------------------------------- output containers

Pair = namedtuple("Pair", "a b")


class TupleSub(tuple):
    pass


class ListSub(list):
    pass


class DictSub(dict):
    pass


@dataclasses.dataclass
class Hidden:
    hidden: Any
    scale: int = 3


# name -> (build the region's output from two tensors, read it back into one tensor); a model
# zoo's output and defaultdict are in test_outputs.py, PyTorch's own in tests/torch/test_outputs.py
CONTAINERS = {
    "OrderedDict": (lambda a, b: OrderedDict(x=a, y=b), lambda o: o["x"] * next(iter(o.values()))),
    "namedtuple": (lambda a, b: Pair(a, b), lambda o: o.a * o.b),
    "tuple subclass": (lambda a, b: TupleSub((a, b)), lambda o: o[0] * o[1]),
    "list subclass": (lambda a, b: ListSub([a, b]), lambda o: o[0] * o[1]),
    "dict subclass": (lambda a, b: DictSub(x=a, y=b), lambda o: o["x"] * o["y"]),
    "dataclass": (lambda a, b: Hidden(a * b), lambda o: o.hidden * o.scale),
}


@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_region_output_comes_back_as_the_same_type(fw, kind):
    build, read = CONTAINERS[kind]
    assert_region_output_type(fw, build, read, kind)
