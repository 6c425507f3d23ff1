"""Code written against HyperParallel's MindSpore activation-checkpoint API runs on
recomp.mindspore with one import changed: the calls mindformers 2.1.0's PyNative trainer
makes (``mindformers/pynative/distributed/activation_checkpoint.py``), written here on a
small decoder. Gradients equal the model without checkpointing or swapping; what
MindSpore cannot do raises saying so."""

from __future__ import annotations

import contextlib
import gc

import pytest

ms = pytest.importorskip("mindspore")  # the PyTorch-only environments skip this file

import recomp.mindspore as rm  # noqa: E402
import recomp.mindspore._swap as _swap  # noqa: E402
import recomp.mindspore.hyperparallel as hp  # noqa: E402
from ms_models import assert_same, copy_params, grads, nn, ops, tensor  # noqa: E402
from recomp import errors  # noqa: E402

# The one import a HyperParallel user changes (hyper_parallel.core.activation_checkpoint).
from recomp.mindspore.hyperparallel import (  # noqa: E402
    CheckpointPolicy,
    SwapManager,
    checkpoint_exclude_wrapper,
    checkpoint_wrapper,
    swap_wrapper,
)

D = 8


def gather(x):
    """Stands for a communication op kept in a layer's function table."""
    return x * 1.0


class CoreAttention(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def construct(self, q, k):
        self.runs += 1
        return ops.softmax(ops.matmul(q, k.swapaxes(-1, -2)), axis=-1) @ k


class Attention(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Dense(D, D)
        self.k = nn.Dense(D, D)
        self.core_attention = CoreAttention()
        self.out = nn.Dense(D, D)
        # A function table, as mindformers keeps its communication ops.
        self._comm_ops = {"allgather": {"fn": gather}}

    def construct(self, x):
        x = self._comm_ops["allgather"]["fn"](x)
        return self.out(self.core_attention(self.q(x), self.k(x)))


class MLP(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Dense(D, 2 * D)
        self.down = nn.Dense(2 * D, D)
        self.act = ops.GeLU()  # an operator attribute, wrapped by mindformers' select recompute

    def construct(self, x):
        return self.down(self.act(self.up(x)))


class Layer(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((D,))
        self.attention = Attention()
        self.mlp = MLP()

    def construct(self, x):
        x = x + self.attention(self.norm(x))
        return x + self.mlp(x)


class Decoder(nn.Cell):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.CellList([Layer() for _ in range(n)])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum(-1)


def twins(n: int = 3) -> tuple[Decoder, Decoder]:
    ref, model = Decoder(n), Decoder(n)
    copy_params(ref, model)
    return ref, model


def names(model: nn.Cell) -> list[str]:
    return [p.name for p in model.get_parameters()]


class PhaseLog:
    """A ``context_fn`` like mindformers' ``recompute_context_fn``: one forward context
    and one recompute context per checkpoint call, sharing per-call state."""

    def __init__(self) -> None:
        self.phases: list[str] = []

    def __call__(self):
        @contextlib.contextmanager
        def phase(name):
            self.phases.append(name)
            yield

        return phase("forward"), phase("recompute")


X = tensor(2, 4, D)


def test_full_recompute_with_exclusions_by_path_and_in_a_function_table():
    ref, model = twins()
    expected_names = names(model)
    log = PhaseLog()
    for i, layer in enumerate(model.layers):
        # exclusion first (mindformers' order): a sub-cell by path, an entry of a table
        layer.attention.core_attention = checkpoint_exclude_wrapper(layer.attention.core_attention)
        entry = layer.attention._comm_ops["allgather"]
        entry["fn"] = checkpoint_exclude_wrapper(entry["fn"])
        model.layers[i] = checkpoint_wrapper(layer, context_fn=log, early_stop=False)
    assert names(model) == expected_names  # CellList item assignment kept the names

    assert_same(grads(ref, ref.trainable_params(), X), grads(model, model.trainable_params(), X))
    assert log.phases == ["forward"] * 3 + ["recompute"] * 3
    for layer in model.layers:
        core, table = layer.attention.core_attention, layer.attention._comm_ops["allgather"]["fn"]
        assert (core.region_runs, core.region_skips) == (1, 1)
        assert (table.region_runs, table.region_skips) == (1, 1)
        assert core.runs == 1  # never replayed


def test_select_recompute_of_cells_and_of_an_operator_attribute_with_output_recompute():
    ref, model = twins()
    log = PhaseLog()
    for layer in model.layers:
        # mindformers' select recompute: a cell with its context_fn, an operator
        # attribute with output_recompute=True (MindSpore then does not keep the
        # operator's output for the ops after it: it is recomputed with the operator)
        layer.attention = checkpoint_wrapper(layer.attention, context_fn=log, early_stop=True)
        layer.mlp.act = checkpoint_wrapper(layer.mlp.act, output_recompute=True)
    assert isinstance(model.layers[0].mlp.act, rm.CheckpointWrapper)
    assert_same(grads(ref, ref.trainable_params(), X), grads(model, model.trainable_params(), X))
    assert log.phases.count("recompute") == 3


class InputsStay:
    """mindformers' layer-swap policy: the model's own inputs stay, the rest is swapped
    (per tensor: a swap policy returns MUST_SAVE or MUST_SWAP)."""

    def __init__(self) -> None:
        self.inputs: set[int] = set()
        self.asked = 0

    def capture(self, cell, args):
        self.inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, ms.Tensor)}

    def __call__(self, t):
        self.asked += 1
        if t.untyped_storage().data_ptr() in self.inputs:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_SWAP


def test_layer_swap_with_prefetch_pairs_moves_every_layer_but_the_last():
    ref, model = twins()
    expected_names = names(model)
    policy = InputsStay()
    model.register_forward_pre_hook(policy.capture)
    for i in range(len(model.layers)):
        model.layers[i] = swap_wrapper(model.layers[i], policy_fn=policy)
    for i in range(len(model.layers) - 1):
        SwapManager().set_forward_prefetch_layer(model.layers[i], model.layers[i + 1])
    assert names(model) == expected_names

    _swap.STATS.reset()
    with _swap.host_copy():
        got = grads(model, model.trainable_params(), X)
    assert_same(grads(ref, ref.trainable_params(), X), got)
    stats = _swap.STATS
    assert policy.asked > 0
    assert stats.offloaded_tensors > 0
    assert stats.offloaded_bytes == stats.restored_bytes  # everything that went out came back
    # the last layer keeps its tensors; its backward brings back layer 1, whose first
    # read brings back layer 0
    groups = [SwapManager().group_name(layer, layer) for layer in model.layers]
    assert stats.prefetched_groups == [groups[1], groups[0]]
    assert stats.prefetched_bytes == stats.restored_bytes
    for layer in model.layers:
        SwapManager().unregister_forward_prefetch_layer(layer)


def test_swap_moves_the_same_bytes_each_step_and_nothing_on_cpu_without_the_test_mode():
    ref, model = twins(2)
    for i in range(2):
        model.layers[i] = swap_wrapper(model.layers[i])
    steps = []
    for _ in range(2):
        _swap.STATS.reset()
        with _swap.host_copy():
            assert_same(grads(ref, ref.trainable_params(), X), grads(model, model.trainable_params(), X))
        steps.append((_swap.STATS.offloaded_bytes, _swap.STATS.restored_bytes))
    assert steps[0] == steps[1] and steps[0][0] > 0
    _swap.STATS.reset()
    with _swap.host_copy(False):
        grads(model, model.trainable_params(), X)
    assert _swap.STATS.offloaded_bytes == 0  # a CPU device: nothing to move


def test_op_swap_and_swap_inputs_inside_checkpointed_layers():
    ref, model = twins()
    for i, layer in enumerate(model.layers):
        layer.mlp = swap_wrapper(layer.mlp, policy_fn=lambda t: CheckpointPolicy.MUST_SWAP)
        model.layers[i] = checkpoint_wrapper(layer, swap_inputs=True)
    _swap.STATS.reset()
    with _swap.host_copy():
        got = grads(model, model.trainable_params(), X)
    assert_same(grads(ref, ref.trainable_params(), X), got)
    assert _swap.STATS.offloaded_bytes == _swap.STATS.restored_bytes > 0


def test_what_mindspore_cannot_do_raises_saying_so():
    layer = Layer()
    with pytest.raises(errors.SwapNotSupportedError, match="group_swap"):
        swap_wrapper(layer, group_swap=True)
    with pytest.raises(errors.SwapNotSupportedError, match="cpu_pool"):
        checkpoint_wrapper(layer, swap_inputs=True, cpu_pool=object())
    with pytest.raises(errors.SwapNotSupportedError, match="group_swap"):
        checkpoint_wrapper(layer, policy_fn=lambda ctx, op, *a, **k: True, group_swap=True)
    with pytest.raises(TypeError, match="policy_fn"):
        checkpoint_wrapper(layer, policy_fn="Softmax")
    assert not isinstance(layer, rm.CheckpointWrapper)  # refused before wrapping
    with pytest.raises(TypeError, match="Cells"):
        SwapManager().set_forward_prefetch_layer(layer, gather)


class OpCounter(ms.MsDispatchMode):
    """Counts the ops that run (an op a checkpoint hands back from its cache does not)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __ms_dispatch__(self, func, args, kwargs=None):
        self.counts[func.name] = self.counts.get(func.name, 0) + 1
        return func(*args, **(kwargs or {}))


def counted_grads(cell):
    counter = OpCounter()
    with counter:
        got = grads(cell, cell.trainable_params(), X)
    return got, counter.counts


def swap_softmax_save_matmul(ctx, op, *args, **kwargs):
    assert ctx.is_recompute is False  # asked in the forward only
    if op.name == "Softmax":
        return CheckpointPolicy.MUST_SWAP
    if op.name == "MatMul":
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def test_per_op_policy_swaps_and_saves_op_outputs_never_recomputed():
    ref, model = twins()
    want, plain = counted_grads(ref)
    for i in range(len(model.layers)):
        model.layers[i] = checkpoint_wrapper(model.layers[i], policy_fn=swap_softmax_save_matmul)
    _swap.STATS.reset()
    gc.disable()  # what a step kept is freed with its graph, not by the collector
    try:
        with _swap.host_copy():
            got, counts = counted_grads(model)
        assert not [r for r in SwapManager().order if r() is not None]
    finally:
        gc.enable()
    assert_same(want, got)
    # kept ops run once, as without checkpointing; the rest runs again in the replay
    assert counts["Softmax"] == plain["Softmax"] == 3
    assert counts["MatMul"] == plain["MatMul"]
    assert counts["LayerNorm"] == 2 * plain["LayerNorm"]
    # one softmax output (2 x 4 x 4 float32) per layer went to the host and came back
    assert _swap.STATS.offloaded_tensors == 3
    assert _swap.STATS.offloaded_bytes == _swap.STATS.restored_bytes == 3 * 2 * 4 * 4 * 4

    # with swap_inputs=True, each layer's input (2 x 4 x 8 float32) goes in the same group
    for layer in model.layers:
        rm.unwrap(layer)
    for i in range(len(model.layers)):
        model.layers[i] = checkpoint_wrapper(
            model.layers[i], policy_fn=swap_softmax_save_matmul, swap_inputs=True
        )
    _swap.STATS.reset()
    with _swap.host_copy():
        got, counts = counted_grads(model)
    assert_same(want, got)
    assert counts["Softmax"] == 3
    assert _swap.STATS.offloaded_tensors == 6
    assert _swap.STATS.offloaded_bytes == _swap.STATS.restored_bytes == 3 * (128 + 256)


def test_per_op_policy_as_a_list_with_exclusions_and_mindspore_recompute_contexts():
    ref, model = twins()
    want, plain = counted_grads(ref)
    log = PhaseLog()
    for i, layer in enumerate(model.layers):
        # The excluded regions' ops run in the forward only: the policy does not see them
        # (else the replay's first MatMul, k's, would be handed q's output).
        layer.attention.q = checkpoint_exclude_wrapper(layer.attention.q)
        layer.attention.core_attention = checkpoint_exclude_wrapper(layer.attention.core_attention)
        model.layers[i] = checkpoint_wrapper(
            layer, policy_fn=["MatMul", "BiasAdd"], context_fn=log, early_stop=True
        )
    got, counts = counted_grads(model)
    assert_same(want, got)
    assert log.phases == ["forward"] * 3 + ["recompute"] * 3  # the user's contexts too
    for op in ("MatMul", "BiasAdd", "Softmax"):  # kept or excluded: never replayed
        assert counts[op] == plain[op]
    assert counts["LayerNorm"] > plain["LayerNorm"]
    for layer in model.layers:
        assert layer.attention.core_attention.runs == 1

    # the contexts alone, in MindSpore's own recompute: MUST_SAVE works, MUST_SWAP
    # needs a recomp checkpoint (its swap scope)
    cell = Layer()

    def run(policy):
        def fn(x):
            return ms.recompute(
                cell, x, use_reentrant=False, early_stop=False,
                context_fn=lambda: hp.create_selective_checkpoint_contexts(policy),
            ).sum()
        return grads(fn, cell.trainable_params(), X)

    assert_same(grads(lambda x: cell(x).sum(), cell.trainable_params(), X), run(["Softmax"]))
    with pytest.raises(errors.SwapPolicyError, match="no swap group"):
        run(lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SWAP)


def test_an_invalid_per_op_policy_raises():
    model = Decoder(1)
    checkpoint_wrapper(model.layers[0], policy_fn=lambda ctx, op, *a, **k: 42)
    with pytest.raises(errors.SwapPolicyError, match="returned 42"):
        grads(model, model.trainable_params(), X)


def test_an_invalid_swap_policy_raises():
    model = Decoder(1)
    swap_wrapper(model.layers[0], policy_fn=lambda t: CheckpointPolicy.MUST_RECOMPUTE)
    with pytest.raises(errors.SwapPolicyError, match="MUST_SAVE or MUST_SWAP"):
        grads(model, model.trainable_params(), X)
    model = Decoder(1)
    swap_wrapper(model.layers[0], policy_fn=lambda t: 3)
    with pytest.raises(errors.SwapPolicyError, match="not a policy"):
        grads(model, model.trainable_params(), X)
    # a bool is accepted, as by HyperParallel: True keeps it (MUST_SAVE)
    ref, model = twins(1)
    swap_wrapper(model.layers[0], policy_fn=lambda t: True)
    _swap.STATS.reset()
    with _swap.host_copy():
        assert_same(grads(ref, ref.trainable_params(), X), grads(model, model.trainable_params(), X))
    assert _swap.STATS.offloaded_bytes == 0


def test_unwrap_takes_swap_hooks_off():
    ref, model = twins(1)
    swap_wrapper(model.layers[0])
    rm.unwrap(model)
    _swap.STATS.reset()
    with _swap.host_copy():
        assert_same(grads(ref, ref.trainable_params(), X), grads(model, model.trainable_params(), X))
    assert _swap.STATS.offloaded_bytes == 0


def test_the_policy_enum_is_shared_with_pytorch():
    from recomp._policy import CheckpointPolicy as Core

    assert CheckpointPolicy is Core
    assert [p.value for p in CheckpointPolicy] == [0, 1, 2, 3, 4]


def test_swap_inputs_moves_each_checkpoints_inputs():
    ref, model = twins()
    for i in range(len(model.layers)):
        model.layers[i] = checkpoint_wrapper(model.layers[i], swap_inputs=True, early_stop=False)
    _swap.STATS.reset()
    with _swap.host_copy():
        got = grads(model, model.trainable_params(), X)
    assert_same(grads(ref, ref.trainable_params(), X), got)
    # one input per layer (no pairs set: every layer's group moves), each brought back
    # once for its replay; reading layer k's brings layer k-1's back ahead
    assert _swap.STATS.offloaded_tensors == 3
    assert _swap.STATS.offloaded_bytes == _swap.STATS.restored_bytes == 3 * X.nbytes
    assert _swap.STATS.prefetched_bytes == 2 * X.nbytes


def test_swap_tensor_wrapper_returns_its_target_outside_a_swapped_layer_and_raises_inside():
    t = tensor(2, 2)
    assert hp.swap_tensor_wrapper(t) is t

    class Keeps(nn.Cell):
        def construct(self, x):
            return hp.swap_tensor_wrapper(x * 2, tag="kv")

    cell = swap_wrapper(Keeps())
    # Called outside mindspore.grad: MindSpore 2.10's first gradient after a forward that
    # raised inside mindspore.grad fails in LayerNormGrad (without recomp too).
    with pytest.raises(errors.SwapNotSupportedError, match=r"tag='kv'.*in place"):
        cell(X)


def test_swap_call_and_async_save_on_cpu_block_with_the_environment_switch(monkeypatch):
    monkeypatch.setenv(_swap.ENV_HOST_COPY, "1")
    ref, model = twins(2)
    layer0, layer1 = model.layers

    def run(x):
        with hp.async_save_on_cpu(policy_fn=lambda t: CheckpointPolicy.MUST_SWAP):
            h = layer0(x)  # the block is one group, moved when it ends
        return rm.swap(layer1, h).sum(-1)

    _swap.STATS.reset()
    got = grads(run, model.trainable_params(), X)
    assert_same(grads(ref, ref.trainable_params(), X), got)
    assert _swap.STATS.offloaded_bytes == _swap.STATS.restored_bytes > 0
    assert "async_save_on_cpu" in _swap.STATS.prefetched_groups  # read after the swap call's


def test_the_offload_session_names_are_there_and_the_session_says_what_is_missing():
    # HyperOffload's three names: the config is the one class both frameworks share,
    # skip_offload runs what it decorates (no session is ever active here), and making a
    # session raises, naming what recomp's MindSpore backend lacks and what to use.
    from recomp import _offload_session

    config = hp.OffloadConfig(max_resident_activation_mb=512)
    assert hp.OffloadConfig is _offload_session.OffloadConfig  # recomp.torch's too
    assert config.budget_bytes == 512 << 20

    @hp.skip_offload
    def region(x):
        return ops.sin(x)

    x = tensor(2, 3)
    assert_same(region(x), ops.sin(x))
    assert hp.OffloadSession.get_active() is None
    with pytest.raises(errors.SwapNotSupportedError, match="pinned host pool") as info:
        hp.OffloadSession(config)
    assert "swap_wrapper(layer, policy_fn=...)" in str(info.value)
    with pytest.raises(ValueError, match="max_resident_activation_mb"):
        hp.OffloadConfig(max_resident_activation_mb=-1)
