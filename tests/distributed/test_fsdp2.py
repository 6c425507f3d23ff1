"""FSDP2 ``fully_shard`` over recomp-checkpointed layers on 2 gloo ranks (examples/fsdp2.py).

Order under test (the documented one): ``apply_activation_checkpointing`` with
an excluded attention first, then ``fully_shard`` on each wrapped layer, then
on the root. Fails if the replay issues a collective, if recomp changes
FSDP2's own communication, or if a sharded gradient differs by a single bit
from FSDP2 without recomp. The reverse order is measured as well.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def reports(launcher):
    return launcher("fsdp2:run")


def test_wrapping_order(reports):
    v = reports[0]["variants"]
    layers = reports[0]["layers"]
    # Both wrap in place by giving the layer a subclass of its class: fully_shard's
    # class derives from recomp's in the documented order, and the other way round.
    # recomp's class keeps the name of the class it wraps.
    assert v["recomp"]["wrapping"] == ["FSDPBlock"] * layers
    assert v["recomp_after_fsdp"]["wrapping"] == ["FSDPBlock"] * layers
    assert v["recomp"]["bases"] == [["FSDPModule", "Block"]] * layers
    assert v["recomp_after_fsdp"]["bases"] == [["CheckpointWrapper", "FSDPBlock"]] * layers


@pytest.mark.parametrize("variant", ["recomp", "recomp_after_fsdp"])
def test_replay_issues_no_collective(reports, variant):
    layers = reports[0]["layers"]
    for r in reports:
        v = r["variants"][variant]
        ref = r["variants"]["reference"]["counts"]
        assert v["counts"]["replay"] == {}, v["counts"]
        assert v["counts"]["forward"] == ref["forward"]
        assert v["counts"]["backward"] == ref["backward"]
        # The checkpoint did replay: each excluded attention was skipped once.
        assert v["exclusions"] == {
            f"layers.{i}.attn": {"runs": 1, "skips": 1} for i in range(layers)
        }


def test_fsdp2_communicates_as_expected(reports):
    layers = reports[0]["layers"]
    for r in reports:
        c = r["variants"]["reference"]["counts"]
        # One all-gather per FSDP unit (layers + root) in the forward; the
        # layers (resharded after forward) gather again before their backward;
        # every unit reduce-scatters its gradients once.
        assert c["forward"] == {"all_gather": layers + 1}
        assert c["backward"] == {"all_gather": layers, "reduce_scatter": layers + 1}


@pytest.mark.parametrize("variant", ["recomp", "recomp_after_fsdp"])
def test_sharded_gradients_bit_equal(reports, variant):
    for r in reports:
        g = r["variants"][variant]["grads_vs_reference"]
        assert g["same_names"] and g["bitwise_equal"], g


def test_fsdp2_matches_single_process(reports):
    for r in reports:
        sp = r["single_process"]
        assert sp["grad_max_rel_diff"] < sp["rtol"], sp


def test_all_checks_pass(reports):
    for r in reports:
        assert r["ok"], r["checks"]
