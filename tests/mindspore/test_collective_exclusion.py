"""exclude_collectives on MindSpore in one process: which sub-cells a checkpoint excludes,
the option's validation, the warnings about collectives it cannot exclude.

A real collective needs msrun (test_mindspore_tp.py runs them on 2 workers); here a
stand-in for ``mindspore.mint.distributed.all_reduce`` (``tensor * 2``) plays the
collective, which the per-phase counter sees as it sees the real one.
"""

from __future__ import annotations

import warnings

import pytest

ms = pytest.importorskip("mindspore")

import mindspore.mint.distributed as mint_dist  # noqa: E402
from mindspore.common._grad_function import _Function  # noqa: E402

import recomp.mindspore as rm  # noqa: E402
from ms_models import assert_same, copy_params, grads, nn, ops, tensor  # noqa: E402
from recomp.errors import CollectiveReplayedWarning  # noqa: E402
from recomp.mindspore.collectives import count_collectives  # noqa: E402


def fake_all_reduce(tensor, op="sum", group=None, async_op=False):
    return tensor * 2


@pytest.fixture
def fake_collective(monkeypatch):
    monkeypatch.setattr(mint_dist, "all_reduce", fake_all_reduce)


class ReduceForward(_Function):
    """Megatron's ``g``: the all-reduce in a custom function's forward."""

    @staticmethod
    def forward(ctx, x):
        return ops.AllReduce()(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ReduceBackward(_Function):
    """Megatron's ``f``: identity forward, the all-reduce only in backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return mint_dist.all_reduce(grad)


class ThroughFunction(nn.Cell):
    def construct(self, x):
        return ReduceForward.apply(x)


class HoldsPrimitive(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.all_reduce = ops.AllReduce()

    def construct(self, x):
        return self.all_reduce(x)


class HoldsPrimitiveInAList(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.comms = [ops.AllGather()]

    def construct(self, x):
        return self.comms[0](x)


class Functional(nn.Cell):
    """Calls the functional form, through a method of its own."""

    def construct(self, x):
        return self.reduce(x)

    def reduce(self, x):
        return mint_dist.all_reduce(x)


class Hidden:
    """An object the search does not follow: its collective is found only when it runs."""

    def reduce(self, x):
        return mint_dist.all_reduce(x)


class ThroughHiddenObject(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.comm = Hidden()

    def construct(self, x):
        return self.comm.reduce(x)


class Mlp(nn.Cell):
    def __init__(self, reduce: nn.Cell) -> None:
        super().__init__()
        self.dense = nn.Dense(8, 8)
        self.reduce = reduce

    def construct(self, x):
        return self.reduce(ops.tanh(self.dense(ReduceBackward.apply(x))))


class Block(nn.Cell):
    def __init__(self, reduce: nn.Cell) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((8,))
        self.mlp = Mlp(reduce)
        self.out = nn.Dense(8, 8)

    def construct(self, x):
        return self.out(x + self.mlp(self.norm(x)))


def excluded_paths(cell) -> list[str]:
    return [name for name, c in cell.cells_and_names() if isinstance(c, rm.ExcludeWrapper)]


@pytest.mark.parametrize(
    "reduce", [ThroughFunction, HoldsPrimitive, HoldsPrimitiveInAList, Functional]
)
def test_the_innermost_communicating_cell_is_excluded(reduce):
    block = rm.checkpoint_wrapper(Block(reduce()))
    # Not the Mlp: its own code all-reduces only in a backward (ReduceBackward).
    assert excluded_paths(block) == ["mlp.reduce"]
    assert block.mlp.reduce.region.name == "Block.mlp.reduce"
    rm.unwrap(block)
    assert excluded_paths(block) == []


def test_exclude_collectives_false_excludes_nothing():
    block = rm.checkpoint_wrapper(Block(HoldsPrimitive()), exclude_collectives=False)
    assert excluded_paths(block) == []
    assert block.checkpoint_kwargs == {"exclude_collectives": False}


def test_apply_activation_checkpointing_excludes_them_by_path():
    model = nn.CellList([Block(ThroughFunction()), Block(HoldsPrimitive())])
    rm.apply_activation_checkpointing(model, checkpoint_fn=Block)
    assert excluded_paths(model) == ["0.mlp.reduce", "1.mlp.reduce"]
    assert model[0].mlp.reduce.region.name == "0.mlp.reduce"
    plain = nn.CellList([Block(ThroughFunction())])
    rm.apply_activation_checkpointing(plain, checkpoint_fn=Block, exclude_collectives=False)
    assert excluded_paths(plain) == []


def test_a_hand_made_exclusion_is_kept():
    block = Block(HoldsPrimitive())
    block.mlp = rm.checkpoint_exclude_wrapper(block.mlp, name="mine")
    rm.checkpoint_wrapper(block)
    assert excluded_paths(block) == ["mlp"]
    assert block.mlp.region.name == "mine"


@pytest.mark.parametrize("api", ["checkpoint", "checkpoint_wrapper", "apply"])
def test_exclude_collectives_must_be_a_bool(api):
    block = Block(HoldsPrimitive())
    with pytest.raises(ValueError, match="exclude_collectives must be True or False"):
        if api == "checkpoint":
            rm.checkpoint(block, tensor(2, 8), exclude_collectives="no")
        elif api == "checkpoint_wrapper":
            rm.checkpoint_wrapper(block, exclude_collectives=None)
        else:
            rm.apply_activation_checkpointing(
                nn.CellList([block]), checkpoint_fn=Block, exclude_collectives=1
            )
    assert excluded_paths(block) == [] and not isinstance(block, rm.CheckpointWrapper)


@pytest.mark.parametrize("exclude_collectives", [True, False])
def test_replay_does_not_communicate_and_gradients_are_exact(fake_collective, exclude_collectives):
    ref, model = Block(Functional()), Block(Functional())
    copy_params(ref, model)
    rm.checkpoint_wrapper(model, exclude_collectives=exclude_collectives)
    x = tensor(4, 8)
    with count_collectives() as reference:
        want = grads(ref, ref.trainable_params(), x)
    with count_collectives() as counts:
        got = grads(model, model.trainable_params(), x)
    assert_same(want, got)
    assert reference.as_dict()["forward"] == counts.as_dict()["forward"] == {"all_reduce": 1}
    assert counts.as_dict()["replay"] == ({} if exclude_collectives else {"all_reduce": 1})


def test_functional_checkpoint_of_a_cell_excludes_them(fake_collective):
    ref, model = Block(Functional()), Block(Functional())
    copy_params(ref, model)
    x = tensor(4, 8)
    with count_collectives() as counts:
        got = grads(lambda t: rm.checkpoint(model, t), model.trainable_params(), x)
    assert excluded_paths(model) == ["mlp.reduce"]
    assert_same(grads(ref, ref.trainable_params(), x), got)
    assert counts.as_dict()["replay"] == {}


class OwnCollective(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Dense(8, 8)

    def construct(self, x):
        return ops.AllReduce()(self.dense(x))


def test_a_collective_in_the_checkpointed_cells_own_construct_warns_once():
    with pytest.warns(CollectiveReplayedWarning, match="OwnCollective issues a collective in its own code") as record:
        rm.checkpoint_wrapper(OwnCollective())
    message = str(record[0].message)
    assert "Move the collective into a sub-cell" in message
    assert "exclude_collectives=False" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rm.checkpoint_wrapper(OwnCollective(), exclude_collectives=False)


def test_a_collective_the_search_misses_warns_at_the_first_forward(fake_collective):
    ref, model = Block(ThroughHiddenObject()), Block(ThroughHiddenObject())
    copy_params(ref, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rm.checkpoint_wrapper(model)  # nothing found yet
    assert excluded_paths(model) == []
    x = tensor(4, 8)
    missed = "in its sub-cell 'mlp.reduce'"
    with pytest.warns(CollectiveReplayedWarning, match=missed) as record, count_collectives() as counts:
        got = grads(model, model.trainable_params(), x)
    assert len([w for w in record if w.category is CollectiveReplayedWarning]) == 1
    assert "exclude that sub-cell by hand" in str(record[0].message)
    assert counts.as_dict()["replay"] == {"all_reduce": 1}  # what the warning says
    assert_same(grads(ref, ref.trainable_params(), x), got)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads(model, model.trainable_params(), x)  # once per checkpointed cell


class OwnHiddenCollective(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Dense(8, 8)
        self.comm = Hidden()

    def construct(self, x):
        return self.comm.reduce(self.dense(x))


def test_a_collective_in_the_own_construct_warns_at_the_first_forward(fake_collective):
    model = rm.checkpoint_wrapper(OwnHiddenCollective())
    with pytest.warns(CollectiveReplayedWarning, match="in OwnHiddenCollective's own construct"):
        grads(model, model.trainable_params(), tensor(4, 8))


def test_no_warning_with_exclude_collectives_false(fake_collective):
    model = rm.checkpoint_wrapper(Block(ThroughHiddenObject()), exclude_collectives=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CollectiveReplayedWarning)
        grads(model, model.trainable_params(), tensor(4, 8))


def test_a_collective_inside_an_excluded_region_does_not_warn(fake_collective):
    block = Block(ThroughHiddenObject())
    block.mlp.reduce = rm.checkpoint_exclude_wrapper(block.mlp.reduce)
    model = rm.checkpoint_wrapper(block)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CollectiveReplayedWarning)
        with count_collectives() as counts:
            grads(model, model.trainable_params(), tensor(4, 8))
    assert counts.as_dict()["replay"] == {}


def test_the_first_forward_is_watched_under_mixed_precision(fake_collective):
    # The checkpointed function is then a wrapper around construct, still bound to the Cell.
    model = rm.checkpoint_wrapper(OwnHiddenCollective())
    model.to_float(ms.float16)
    assert model.mixed_precision_type is not None
    with pytest.warns(CollectiveReplayedWarning, match="in OwnHiddenCollective's own construct"):
        grads(model, model.trainable_params(), tensor(4, 8))


def test_a_checkpointed_function_that_communicates_warns_at_the_first_forward(fake_collective):
    """A plain function given to checkpoint has no sub-cells to exclude: a collective in
    its recomputed code warns once, naming the fix."""
    dense, hidden = nn.Dense(8, 8), Hidden()

    def block(x):
        return ops.tanh(hidden.reduce(dense(x)))

    x = tensor(4, 8)
    step = lambda t: (rm.checkpoint(block, t) ** 2).sum()  # noqa: E731
    fn = ms.grad(step, 0, dense.trainable_params())
    with pytest.warns(CollectiveReplayedWarning, match="function .*block") as record:
        fn(x)
    assert "checkpoint_exclude_wrapper (it takes Cells and functions)" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CollectiveReplayedWarning)
        fn(x)  # once per function
    reduce = rm.checkpoint_exclude_wrapper(hidden.reduce)

    def block_excluded(x):
        return ops.tanh(reduce(dense(x)))

    with warnings.catch_warnings():
        warnings.simplefilter("error", CollectiveReplayedWarning)
        with count_collectives() as counts:
            ms.grad(lambda t: (rm.checkpoint(block_excluded, t) ** 2).sum(), 0)(x)
    assert counts.as_dict()["replay"] == {}
