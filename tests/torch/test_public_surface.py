"""The public surface of ``recomp.torch``: recomp's own names (at most 25), HyperParallel's
in ``recomp.torch.hyperparallel`` (a superset of its API's 18), the reports in
``recomp.torch.report``; the names that moved still work for one release, warning once
per access with the new place."""

from __future__ import annotations

import importlib

import pytest

torch = pytest.importorskip("torch")

import recomp.errors  # noqa: E402
import recomp.torch as rt  # noqa: E402
import recomp.torch.hyperparallel as hp  # noqa: E402
import recomp.torch.report as rr  # noqa: E402
from public_surface import (  # noqa: E402
    HYPERPARALLEL_API,
    HYPERPARALLEL_REGIONS,
    HYPERPARALLEL_SWAP,
    assert_moved,
    assert_star_import_is_quiet,
    moves_of,
)


def test_counts():
    assert len(rt.__all__) <= 25
    assert set(hp.__all__) >= set(HYPERPARALLEL_API) | set(HYPERPARALLEL_SWAP)
    assert set(hp.__all__) >= set(HYPERPARALLEL_REGIONS)
    assert len(rt.__all__) + len(rr.__all__) < 38  # the 38 of before, HyperParallel's aside


def test_recomp_torch_keeps_recomp_s_own_api():
    for name in ("checkpoint", "checkpoint_wrapper", "checkpoint_exclude_wrapper",
                 "apply_activation_checkpointing", "hf_activation_checkpointing", "unwrap",
                 "CheckpointWrapper", "ExcludeWrapper", "CheckpointPolicy", "swap", "swap_wrapper",
                 "Offloader", "recompute_handle_collector_ctx", "RecomputeHandle",
                 "offload_session", "pipeline_swap"):
        assert name in rt.__all__, name
    # No error class in a framework package's __all__: they are recomp.errors'.
    assert not [n for n in rt.__all__ if n.endswith(("Error", "Warning"))]


@pytest.mark.parametrize("module", [rt, hp, rr], ids=lambda m: m.__name__)
def test_every_listed_name_is_there(module):
    for name in module.__all__:
        assert getattr(module, name) is not None, name


def test_shared_names_are_the_same_objects():
    for name in ("CheckpointPolicy", "swap", "swap_wrapper", "checkpoint_exclude_wrapper",
                 "recompute_handle_collector_ctx", "recompute_handle", "recompute_session_ctx",
                 "clear_recompute_session"):
        assert getattr(hp, name) is getattr(rt, name), name
    # HyperParallel's checkpoint and wrapper have its defaults: functions of their own.
    assert hp.checkpoint is not rt.checkpoint
    assert hp.checkpoint_wrapper is not rt.checkpoint_wrapper


@pytest.mark.parametrize(("name", "new"), sorted(moves_of("recomp.torch").items()))
def test_a_moved_name_still_works_and_warns(name, new):
    assert_moved("recomp.torch", name, new)


def test_every_name_of_before_is_still_reachable():
    before = {  # recomp.torch.__all__ of the release before
        "AsyncSaveOnCpu", "CheckpointPolicy", "CheckpointWrapper", "ExcludeWrapper",
        "OffloadStats", "Offloader", "OomReport", "PinnedMemoryPool", "RecomputeHandle",
        "ReportRow", "SavedTensorsReport", "SwapManager", "SwapPolicyError",
        "apply_activation_checkpointing", "async_save_on_cpu", "checkpoint",
        "checkpoint_exclude_wrapper", "checkpoint_wrapper", "clear_recompute_session",
        "create_native_selective_checkpoint_contexts", "create_selective_checkpoint_contexts",
        "default_offloader", "get_class_activation_wrapper", "hf_activation_checkpointing",
        "ignore_sac_ops", "install_oom_report", "is_compiling", "label_layers",
        "noop_context_fn", "print_saved_tensors_report", "recompute_handle",
        "recompute_handle_collector_ctx", "recompute_session_ctx", "saved_tensors_report",
        "swap", "swap_tensor_wrapper", "swap_wrapper", "unwrap",
    }
    assert len(before) == 38
    added = {"offload_session", "pipeline_swap"}  # names new in this release
    assert before | added == set(rt.__all__) | set(moves_of("recomp.torch"))


def test_star_import_is_quiet():
    assert_star_import_is_quiet("recomp.torch")
    assert_star_import_is_quiet("recomp.torch.hyperparallel")
    assert_star_import_is_quiet("recomp.torch.report")


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'SwapManagr'"):
        rt.SwapManagr  # noqa: B018


def test_the_error_of_a_policy_is_recomp_errors_class():
    layer = rt.checkpoint_wrapper(torch.nn.Linear(4, 4), policy_fn=lambda ctx, op, *a, **k: 42)
    with pytest.raises(recomp.errors.SwapPolicyError, match="returned 42"):
        layer(torch.randn(2, 4, requires_grad=True))
    swap = importlib.import_module("recomp.torch._swap")
    assert swap.SwapPolicyError is recomp.errors.SwapPolicyError


def test_the_submodules_are_there_after_importing_the_package():
    import subprocess
    import sys

    code = (
        "import recomp.torch as rt; "
        "print(rt.hyperparallel.SwapManager.__name__, rt.report.saved_tensors_report.__name__)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["SwapManager", "saved_tensors_report"]
