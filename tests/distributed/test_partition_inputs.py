"""``checkpoint(..., partition_inputs=group)`` on 2 gloo ranks (cases in
partition_cases.py): gradients bit for bit those without checkpointing, each rank keeping
half of each split input (padded where the size is odd), one all-gather per split input
in the backward and none in the forward beyond the block's own all-reduce."""

from __future__ import annotations

import pytest
import torch

import recomp.torch as rt

pytestmark = [pytest.mark.distributed, pytest.mark.system, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def results(launcher):
    return launcher("partition_cases:run")


@pytest.mark.parametrize("case", ["even", "odd"])
def test_split_inputs_are_exact_and_half_kept(results, case):
    for r in results:
        got = r[case]
        assert got["exact"]
        per_rank = -(-got["numel"] // 2)
        assert got["kept_bytes"] == per_rank * 4  # float32, this rank's half (padded)
        assert got["released_bytes"] == (got["numel"] - per_rank) * 4
        assert got["gathers"] == 1  # x; the one-element scale is kept whole
        assert got["counts"]["forward"] == {"all_reduce": 1}  # the block's own
        assert got["counts"]["replay"] == {}  # its result kept, not communicated again
        assert got["counts"]["backward"] == {"all_gather": 1}  # the split input, gathered


def test_excluded_regions_keep_what_they_keep(results):
    for r in results:
        assert r["excluded"]["exact"]
        assert r["excluded"]["runs"] == [1, 1]


def test_options_it_cannot_be_combined_with_are_refused_before_anything_runs(results):
    for r in results:
        assert r["refused"]["swap_inputs"].startswith("ValueError") and (
            "cannot be combined with swap_inputs=True" in r["refused"]["swap_inputs"]
        )
        assert r["refused"]["not_a_group"].startswith("TypeError") and (
            "ProcessGroup" in r["refused"]["not_a_group"]
        )
        assert r["refused_calls"] == 0


def test_partition_inputs_without_a_process_group_names_what_to_pass():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        rt.checkpoint(torch.sin, torch.randn(4, requires_grad=True), partition_inputs=object())
