"""recomp.torch.collectives.count_collectives on 2 gloo ranks (cases in counter_cases.py).

Every collective API (classic, functional, DTensor) must be counted once, with
its kind, in the right phase.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from dist_harness import child_env

pytestmark = [pytest.mark.distributed, pytest.mark.system, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def results(launcher):
    return launcher("counter_cases:run")


def test_imports_without_a_process_group():
    code = (
        "import torch.distributed as dist\n"
        "from recomp.torch.collectives import count_collectives, collective_kind\n"
        "import torch\n"
        "assert not dist.is_initialized()\n"
        "with count_collectives() as c:\n"
        "    torch.ones(2).sum()\n"
        "assert c.total() == 0 and c.as_dict() == {'forward': {}, 'replay': {}, 'backward': {}}\n"
        "assert collective_kind(torch.ops.c10d.allreduce_.default) == 'all_reduce'\n"
        "assert collective_kind(torch.ops._c10d_functional.wait_tensor.default) is None\n"
        "assert collective_kind(torch.ops.aten.add.Tensor) is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=child_env(), timeout=120)


def test_classic_api(results):
    for r in results:
        assert r["c10d"]["counts"] == {
            "forward": {
                "all_reduce": 2,  # sync + async_op=True
                "all_gather": 2,  # all_gather_into_tensor + all_gather
                "reduce_scatter": 1,
                "all_to_all": 1,
                "broadcast": 1,
                "barrier": 1,
            },
            "replay": {},
            "backward": {},
        }
        assert r["c10d"]["ops"][0] == "c10d.allreduce_.default"


def test_functional_collectives(results):
    for r in results:
        assert r["functional"]["counts"]["forward"] == {
            "all_reduce": 1,
            "all_gather": 1,
            "reduce_scatter": 1,
            "all_to_all": 1,
        }
        assert all(op.startswith("_c10d_functional.") for op in r["functional"]["ops"])


def test_dtensor_redistribution(results):
    for r in results:
        # Shard->Replicate, Partial->Replicate, Shard(0)->Shard(1) (which this
        # PyTorch version does with an all-gather).
        assert r["dtensor_redistribute"]["counts"]["forward"] == {
            "all_gather": 2,
            "all_reduce": 1,
        }, r["dtensor_redistribute"]


def test_dtensor_op_dispatch(results):
    # The all-gather DTensor issues while dispatching a matmul: the counter
    # lets DTensor handle the op with the mode still active, so it is seen.
    for r in results:
        assert r["dtensor_dispatch"]["counts"]["forward"] == {"all_gather": 1}, r[
            "dtensor_dispatch"
        ]


def test_phases(results):
    for r in results:
        # Forward all-reduce, its replay (not excluded, results not kept), and the backward one.
        assert r["phases"] == {
            "forward": {"all_reduce": 1},
            "replay": {"all_reduce": 1},
            "backward": {"all_reduce": 1},
        }
        assert (
            r["phases_str"]
            == "forward: all_reduce=1 | replay: all_reduce=1 | backward: all_reduce=1"
        )
        assert r["phases_kept"] == {
            "forward": {"all_reduce": 1},
            "replay": {},
            "backward": {"all_reduce": 1},
        }
        assert r["phases_excluded"] == {
            "forward": {"all_reduce": 1},
            "replay": {},
            "backward": {"all_reduce": 1},
        }


def test_replay_of_other_checkpoints_needs_a_predicate(results):
    for r in results:
        assert r["torch_checkpoint_default"] == {
            "forward": {"all_reduce": 1},
            "replay": {},
            "backward": {"all_reduce": 2},
        }
        assert r["torch_checkpoint_predicate"] == {
            "forward": {"all_reduce": 1},
            "replay": {"all_reduce": 1},
            "backward": {"all_reduce": 1},
        }


def test_nesting_and_scope(results):
    for r in results:
        assert r["nested"] == {"outer": 2, "inner": 1}
        assert r["outside"] == 0
