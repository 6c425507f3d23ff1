"""recomp.mindspore.collectives in one process: wrapping and unwrapping of the entry points.

The counts of real collectives (forward / replay / backward) are checked on
2 msrun workers in test_mindspore_tp.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore")

import mindspore.mint.distributed as mint_dist
from mindspore.ops.operations import comm_ops

from recomp.mindspore.collectives import count_collectives


def test_entry_points_are_wrapped_only_inside_the_block():
    primitive_call = comm_ops.AllReduce.__call__
    own_call = comm_ops.AllGather.__dict__.get("__call__")
    function = mint_dist.all_reduce
    with count_collectives():
        assert comm_ops.AllReduce.__call__ is not primitive_call
        assert mint_dist.all_reduce is not function
        with count_collectives():  # nesting does not wrap twice
            assert mint_dist.all_reduce.__wrapped__ is function
    assert comm_ops.AllReduce.__call__ is primitive_call
    assert "__call__" not in comm_ops.AllReduce.__dict__  # inherited again, not pinned
    assert comm_ops.AllGather.__dict__.get("__call__") is own_call
    assert mint_dist.all_reduce is function


def test_a_call_is_counted_once_in_the_innermost_block(monkeypatch):
    # Real collectives need msrun (a call without an initialised group crashes
    # the process later); stand-ins exercise the bookkeeping here. The first
    # calls the second, as a function built on another entry point would.
    calls = []

    def fake_broadcast(tensor, src=0, group=None, async_op=False):
        calls.append("broadcast")

    def fake_all_reduce(tensor, op="sum", group=None, async_op=False):
        calls.append("all_reduce")
        mint_dist.broadcast(tensor)

    monkeypatch.setattr(mint_dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(mint_dist, "broadcast", fake_broadcast)
    with count_collectives() as outer:
        with count_collectives() as inner:
            mint_dist.all_reduce(None)
        mint_dist.broadcast(None)
    assert calls == ["all_reduce", "broadcast", "broadcast"]
    assert inner.as_dict() == {"forward": {"all_reduce": 1}, "replay": {}, "backward": {}}
    assert inner.events[0].op == "mint.distributed.all_reduce"
    assert outer.as_dict()["forward"] == {"broadcast": 1}
    assert mint_dist.all_reduce is fake_all_reduce  # unwrapped on exit
