"""accelerate's FSDP2 preparation (wrap policy by ``_no_split_modules`` class names)
of an HF Qwen3 model with recomp applied before and after sharding, on 2 gloo ranks."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.system, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def reports(launcher):
    return launcher("accelerate_fsdp2_cases:run", timeout=180)


def test_accelerate_shards_the_same_units_with_recomp(reports):
    for r in reports:
        v = r["variants"]
        layers = [f"model.layers.{i}" for i in range(2)]
        assert set(layers) <= set(v["reference"]["sharded"])
        for variant in ("recomp_first", "recomp_after"):
            assert v[variant]["sharded"] == v["reference"]["sharded"]


@pytest.mark.parametrize("variant", ["recomp_first", "recomp_after", "accelerate_ac_offload"])
def test_gradients_bit_equal_and_attention_excluded(reports, variant):
    for r in reports:
        v = r["variants"][variant]
        assert r["grad_names"] > 0
        assert v["grads_bit_equal"], v
        assert v["loss"] == r["variants"]["reference"]["loss"]
        # Each layer was checkpointed and replayed; its attention ran once and was skipped once.
        assert v["exclusions"] == [[1, 1], [1, 1]]


def test_layers_report_their_class_names(reports):
    for r in reports:
        v = r["variants"]
        assert v["reference"]["layer_classes"] == ["FSDPQwen3DecoderLayer"] * 2
        assert v["recomp_first"]["layer_classes"] == ["FSDPQwen3DecoderLayer"] * 2
        assert v["recomp_after"]["layer_classes"] == ["FSDPQwen3DecoderLayer"] * 2


def test_accelerates_own_checkpointing_and_offload_run_recomp(reports):
    # accelerate's activation_checkpointing and activation_checkpointing_offload wrapped
    # the layers in PyTorch's wrappers; their checkpoint is recomp's (the attention ran
    # once and was skipped by the replay, above).
    for r in reports:
        wrappers = r["variants"]["accelerate_ac_offload_wrappers"]  # FSDP renames the outer
        assert [w.removeprefix("FSDP") for w in wrappers] == ["CheckpointWrapper", "OffloadWrapper"]
