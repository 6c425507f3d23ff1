"""Pipeline swap in the whole-job memory model against a real run on 2 gloo ranks
(job_memory_swap_cases.py does the work): for each schedule, what
``recomp.torch.pipeline_swap`` moves per rank in a step, the most saved-activation
bytes it leaves on the device at once, and the most pinned host memory its copies take
equal what ``job_memory(..., pipeline_swap=PipelineSwap(...))`` predicts from a profile
of the same model (``recomp.plan.profile``, one micro-batch), to the byte."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipelines import pipeline_run_marks

pytestmark = pipeline_run_marks(timeout=300)


@pytest.fixture(scope="module")
def two_ranks(launcher):
    return launcher("job_memory_swap_cases:run", timeout=240)


@pytest.fixture(scope="module")
def profiled():
    import torch

    from job_memory_swap_cases import DIM, PER_MB, TOKENS, loss_of, make_net
    from recomp.plan import model_params, profile

    net = make_net()
    prof = profile(net, torch.randn(PER_MB, TOKENS, DIM), loss_fn=loss_of, steps=1, clock="cpu")
    # The run measures the layers' saved tensors. Not among them: what the profile
    # counts outside the layers on the last stage, the loss itself (4 bytes per
    # micro-batch, which the schedule keeps to the end of the step), and the outputs
    # the caller holds while the loss's backward runs (a transient of the peak there).
    assert prof.shared_bytes == prof.after_layers_bytes == 4
    return model_params(net), replace(
        prof, shared_bytes=0, after_layers_bytes=0, loss_backward_bytes=0
    )


@pytest.mark.parametrize(
    "schedule",
    ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"],
)
def test_moved_bytes_and_peaks_equal_the_job_model(two_ranks, profiled, schedule):
    from job_memory_swap_cases import MICRO, SCHEDULES
    from recomp.plan.job import Parallel, PipelineSwap, job_memory

    if schedule not in two_ranks[0]:
        pytest.skip(f"this PyTorch has no {schedule}")
    params, prof = profiled
    min_gap = SCHEDULES[schedule][2]
    common = {"activations": prof, "option": "none", "schedule": schedule, "microbatches": MICRO}
    job = job_memory(params, Parallel(pp=2), pipeline_swap=PipelineSwap(min_gap, 0), **common)
    without = job_memory(params, Parallel(pp=2), **common)
    for rank, result in enumerate(r[schedule] for r in two_ranks):
        predicted = job.ranks[rank]
        assert result["unplanned_steps"] == 0 and result["left"] == 0
        assert result["pool_in_use_after"] == 0  # every host block given back
        assert predicted.swap_groups == (result["swapped_groups"], result["groups"])
        assert result["moved"] == result["restored"] == predicted.swapped_bytes, (schedule, rank)
        assert result["device_peak"] == predicted.activations, (schedule, rank, result)
        assert result["host_peak"] == predicted.host, (schedule, rank, result)
        assert predicted.activations <= without.ranks[rank].activations
    lower = [job.ranks[r].activations < without.ranks[r].activations for r in range(2)]
    if schedule == "1F1B":
        # 8 micro-batches on 2 ranks: gaps of 3 at most. Those groups are copied out and
        # back (min_gap=3), but no slot has them off the device: the peak stays.
        assert not any(lower) and job.ranks[0].swapped_bytes > 0
    else:
        assert any(lower), schedule
