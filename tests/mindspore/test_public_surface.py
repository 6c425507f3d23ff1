"""The public surface of ``recomp.mindspore``: the same shape as ``recomp.torch`` (recomp's
own names, ``.report``, ``.hyperparallel`` with HyperParallel's names), moved names that
still work for one release with a warning, and HyperParallel's names that MindSpore
cannot serve present and refusing with what MindSpore lacks."""

from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")  # the PyTorch-only environments skip this file

import recomp.errors  # noqa: E402
import recomp.mindspore as rm  # noqa: E402
import recomp.mindspore.hyperparallel as hp  # noqa: E402
import recomp.mindspore.report as rr  # noqa: E402
from ms_models import assert_same, grads, nn, ops, tensor  # noqa: E402
from public_surface import (  # noqa: E402
    HYPERPARALLEL_API,
    HYPERPARALLEL_REGIONS,
    HYPERPARALLEL_SWAP,
    assert_moved,
    assert_star_import_is_quiet,
    moves_of,
)

TORCH_SHAPED = {  # recomp.torch's own names that MindSpore has no counterpart for
    "hf_activation_checkpointing", "Offloader", "OffloadStats", "default_offloader",
    "RecomputeHandle", "recompute_handle", "recompute_handle_collector_ctx",
    "recompute_session_ctx", "clear_recompute_session", "offload_session", "pipeline_swap",
}


def test_counts_and_shape():
    assert len(rm.__all__) <= 25
    assert set(hp.__all__) >= set(HYPERPARALLEL_API) | set(HYPERPARALLEL_SWAP)
    assert set(hp.__all__) >= set(HYPERPARALLEL_REGIONS)
    assert not [n for n in rm.__all__ if n.endswith(("Error", "Warning"))]


def test_the_same_names_as_recomp_torch_where_both_have_them():
    torch_hp = pytest.importorskip("recomp.torch.hyperparallel")
    import recomp.torch as rt
    import recomp.torch.report as trr

    # hyper_parallel.distributed's helpers are PyTorch code: recomp.torch.hyperparallel only.
    torch_only = {
        "apply_attention_swap", "attention_swap_policy", "validate_attention_swap",
        "make_selective_checkpoint_context_fn", "compile_selective_checkpoint_policy",
        "ensure_fsdp_ops_sac_ignored", "ensure_profiler_ops_sac_ignored",
    }
    assert sorted(hp.__all__) == sorted(set(torch_hp.__all__) - torch_only)
    assert set(rm.__all__) == set(rt.__all__) - TORCH_SHAPED | {"ReplayableDropout"}
    assert {"ReportRow", "SavedTensorsReport"} <= set(rr.__all__) & set(trr.__all__)
    assert rr.SavedTensorsReport is trr.SavedTensorsReport
    assert rm.CheckpointPolicy is rt.CheckpointPolicy is hp.CheckpointPolicy


@pytest.mark.parametrize("module", [rm, hp, rr], ids=lambda m: m.__name__)
def test_every_listed_name_is_there(module):
    for name in module.__all__:
        assert getattr(module, name) is not None, name


@pytest.mark.parametrize(("name", "new"), sorted(moves_of("recomp.mindspore").items()))
def test_a_moved_name_still_works_and_warns(name, new):
    assert_moved("recomp.mindspore", name, new)


def test_every_name_of_before_is_still_reachable():
    before = {  # recomp.mindspore.__all__ of the release before
        "AsyncSaveOnCpu", "CheckpointPolicy", "CheckpointWrapper", "ExcludeWrapper",
        "ReplayableDropout", "SwapManager", "SwapNotSupportedError", "SwapPolicyError",
        "apply_activation_checkpointing", "async_save_on_cpu", "checkpoint",
        "checkpoint_exclude_wrapper", "checkpoint_wrapper", "create_selective_checkpoint_contexts",
        "ignore_sac_ops", "record_saved_tensors", "swap", "swap_tensor_wrapper", "swap_wrapper",
        "unwrap",
    }
    assert before == set(rm.__all__) | set(moves_of("recomp.mindspore"))


def test_star_import_is_quiet():
    for package in ("recomp.mindspore", "recomp.mindspore.hyperparallel", "recomp.mindspore.report"):
        assert_star_import_is_quiet(package)


def test_the_errors_are_recomp_errors_classes():
    from recomp.mindspore import _swap

    assert _swap.SwapNotSupportedError is recomp.errors.SwapNotSupportedError
    assert _swap.SwapPolicyError is recomp.errors.SwapPolicyError
    with pytest.raises(recomp.errors.SwapNotSupportedError, match="group_swap"):
        hp.swap_wrapper(nn.Dense(2, 2), group_swap=True)


# --------------------------------------------------------------------------- refused names


@pytest.mark.parametrize(
    ("call", "lacks"),
    [
        (lambda: hp.recompute_handle_collector_ctx(), "recompute sessions only as private API"),
        (lambda: hp.recompute_handle(object(), "s"), "split backward"),
        (lambda: hp.recompute_session_ctx("s", retain_on_unpack=True), "mindspore.grad runs"),
        (lambda: hp.clear_recompute_session("s"), "private API"),
        (lambda: hp.create_native_selective_checkpoint_contexts(lambda *a: True),
         "PyTorch's own selective checkpointing"),
        (lambda: hp.PinnedMemoryPool(1 << 20), "no pinned host memory pool"),
    ],
    ids=["collector", "handle", "session", "clear", "native", "pool"],
)
def test_what_mindspore_cannot_serve_raises_naming_what_it_lacks(call, lacks):
    with pytest.raises(recomp.errors.SwapNotSupportedError) as info:
        call()
    message = str(info.value)
    assert "is not available on MindSpore" in message
    assert any(part in message for part in lacks.split("|")), message
    assert isinstance(info.value, NotImplementedError)


def test_is_compiling_and_the_wrapper_class():
    assert hp.is_compiling() is False  # PyNative
    cell = hp.checkpoint_exclude_wrapper(nn.Dense(2, 2))
    assert isinstance(cell, hp.get_class_activation_wrapper())
    assert not isinstance(nn.Dense(2, 2), hp.get_class_activation_wrapper())


# --------------------------------------------------------------------------- checkpoint


class Block(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(8, 16)
        self.fc2 = nn.Dense(16, 8)

    def construct(self, x):
        return x + self.fc2(ops.tanh(self.fc1(x)))


def twins() -> tuple[Block, Block]:
    ref, block = Block(), Block()
    for a, b in zip(ref.get_parameters(), block.get_parameters()):
        b.set_data(a.value().copy())
    return ref, block


X = tensor(4, 8)


@pytest.mark.parametrize("given", ["call", "function"])
@pytest.mark.parametrize("api", ["hyperparallel", "recomp"])
def test_noop_context_fn_passed_as_context_fn(api, given):
    context_fn = hp.noop_context_fn() if given == "call" else hp.noop_context_fn
    ref, block = twins()
    want = grads(ref, ref.trainable_params(), X)
    run = hp.checkpoint if api == "hyperparallel" else rm.checkpoint
    got = grads(lambda x: run(block, x, context_fn=context_fn), block.trainable_params(), X)
    assert_same(want, got)
    wrap = hp.checkpoint_wrapper if api == "hyperparallel" else rm.checkpoint_wrapper
    wrap(block, context_fn=context_fn)
    assert_same(want, grads(block, block.trainable_params(), X))


def test_checkpoint_takes_hyperparallel_s_options():
    ref, block = twins()
    want = grads(ref, ref.trainable_params(), X)
    got = grads(lambda x: hp.checkpoint(block, x, use_reentrant=True, swap_inputs=True),
                block.trainable_params(), X)
    assert_same(want, got)
    for bad in (1, None):
        with pytest.raises(ValueError, match="early_stop must be a bool"):
            hp.checkpoint(block, X, early_stop=bad)
        with pytest.raises(ValueError, match="early_stop must be a bool"):
            hp.checkpoint_wrapper(Block(), early_stop=bad)
    wrapped = hp.checkpoint_wrapper(block, use_reentrant=True)
    assert "use_reentrant" not in wrapped.checkpoint_kwargs
    assert_same(want, grads(wrapped, wrapped.trainable_params(), X))
    with pytest.raises(recomp.errors.SwapNotSupportedError, match="cpu_pool"):
        hp.checkpoint(block, X, cpu_pool=object())


def test_early_stop_defaults_to_false_on_mindspore(recover_mindspore):
    """A block whose last saved tensor comes from a LayerNorm: MindSpore 2.10's early stop
    fails there, so HyperParallel's names keep recomp's default (False) on MindSpore."""

    class Normed(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Dense(8, 8)
            self.norm = nn.LayerNorm((8,))

        def construct(self, x):
            return self.norm(self.fc(x))

    ref, block = Normed(), Normed()
    for a, b in zip(ref.get_parameters(), block.get_parameters()):
        b.set_data(a.value().copy())
    want = grads(ref, ref.trainable_params(), X)
    assert_same(want, grads(lambda x: hp.checkpoint(block, x), block.trainable_params(), X))
    assert np.isfinite(want[0]).all()
    with pytest.raises(recomp.errors.RecompError, match="saved inside LayerNorm"):
        grads(lambda x: hp.checkpoint(block, x, early_stop=True), block.trainable_params(), X)
