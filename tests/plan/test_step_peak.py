"""The step's peak memory above parameters, gradients and optimizer states
(``job_memory(...).ranks[i].activations``): the saved activations at the schedule's
peak plus what a backward step holds for a while (the loss's backward on the rank that
computes the loss, a checkpointed layer's replay), against peaks measured on a GPU; and
where a pipeline holds the bytes outside the layers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from recomp.plan import simulate  # noqa: E402
from recomp.plan.job import Parallel, job_memory, model_params  # noqa: E402

GiB = float(1 << 30)
MiB = float(1 << 20)

# Peak memory above the model in one training step (forward, loss, backward), measured
# with /work/shared/gpu/hf_strategies.py on one NVIDIA H200 (torch 2.11, transformers
# 5.17, bf16, 2026-11-30; its README's tables): HF Llama, 8 layers, hidden 2048, 16/4
# heads, intermediate 5632, vocabulary 32000, 2 sequences of 4096 tokens, SDPA. The
# rows whose strategy is one of the profile's options (hf-gc is a full checkpoint of
# each layer, as recomp-full; sac-sdpa and the compiled runs are not profile options).
H200_LLAMA_8L = {
    "none": 8.92,
    "full": 3.79,  # hf-gc and recomp-full
    "exclude:self_attn": 4.67,
    "exclude:mlp": 6.54,
}


def _llama_h200():
    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096,
        attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip

    def build(mesh):
        return transformers.LlamaForCausalLM(config).train()

    def inputs(mesh):
        ids = torch.randint(0, 32000, (2, 4096))
        return {"input_ids": ids, "labels": ids}

    def regions(module):
        return type(module).__name__.endswith(("Attention", "MLP"))

    prof = simulate(build, inputs, dtype=torch.bfloat16, exclude=regions)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)
    return prof, meta


@pytest.fixture(scope="module")
def llama_h200():
    return _llama_h200()


def test_the_loss_backward_holds_the_logits_and_two_fp32_gradients(llama_h200):
    prof, _ = llama_h200
    tokens, vocab = 2 * 4096, 32000
    # The bf16 logits the caller holds and two fp32 logits-sized gradients: 2,500 MiB.
    assert prof.loss_backward_bytes == tokens * vocab * (2 + 4 + 4)
    assert prof.loss_backward_bytes / MiB == 2500
    # Everything kept outside the layers is the head's and the loss's, after the layers.
    assert prof.before_layers_bytes == 0
    assert prof.after_layers_bytes + prof.spread_bytes == prof.shared_bytes


@pytest.mark.parametrize("option", list(H200_LLAMA_8L))
def test_the_step_peak_matches_the_h200_measurements(llama_h200, option):
    prof, meta = llama_h200
    rank = job_memory(meta, activations=prof, option=option, microbatches=1).ranks[0]
    measured = H200_LLAMA_8L[option] * GiB
    assert rank.activations == pytest.approx(measured, rel=0.01), (
        option, rank.activations / GiB, H200_LLAMA_8L[option]
    )
    # The peak falls in the loss's backward: the saved bytes plus its buffers.
    assert rank.transient == prof.loss_backward_bytes
    assert rank.saved == prof.uniform_bytes(option)


def test_a_checkpointed_layer_replay_is_part_of_the_peak_where_no_loss_runs(llama_h200):
    prof, meta = llama_h200
    result = job_memory(meta, Parallel(pp=2), activations=prof, option="full", microbatches=4)
    first, last = result.ranks
    layer = prof.layers[0]
    replay = layer.no_checkpoint_bytes - layer.options[1].kept_bytes
    assert first.transient == replay > 0
    assert last.transient == prof.loss_backward_bytes


# ------------------------------------------------------------------ Llama-3.1-405B, PP 16

@pytest.fixture(scope="module")
def llama_405b():
    from recomp.cli.plan_simulate import _meta_model, candidate_regions
    from recomp.plan.models import SimulatedModel

    sm = SimulatedModel("llama-3.1-405b", layers=2, seq=8192, tp=8, sp=True)
    prof = sm.scale_profile(
        simulate(sm.build, sm.inputs, world_size=8, exclude=candidate_regions)
    )
    return prof, model_params(_meta_model(sm))


@pytest.mark.parametrize("option", ["none", "full"])
def test_405b_first_rank_is_not_billed_for_the_head(llama_405b, option):
    """Meta's layout for Llama-3.1-405B (TP 8 with sequence parallelism, 16 pipeline
    stages, one layer fewer on the first and the last, 1F1B over 32 micro-batches):
    the first rank holds the embedding and, per micro-batch in flight, what is saved
    before the layers; the head, logits and loss are the last rank's alone."""
    prof, params = llama_405b
    stages = [7] + [8] * 14 + [7]
    result = job_memory(
        params, Parallel(tp=8, pp=16), activations=prof, option=option, schedule="1F1B",
        microbatches=32, stage_layers=stages,
    )  # fmt: skip
    first, second, last = result.ranks[0], result.ranks[1], result.ranks[-1]
    embedding = sum(
        t.numel for t in params.tensors if t.where == "first"
    ) // 8 * 18  # bf16-adam: 18 bytes per parameter, a vocabulary shard per TP rank
    assert first.total <= second.total + prof.before_layers_bytes + embedding
    # The head's bytes (the fp32 log-softmax of 8192 x 128256 logits and more) are on
    # the last rank only.
    assert prof.after_layers_bytes > 4 * GiB
    assert last.saved >= prof.after_layers_bytes
    # 16 micro-batches of 7 layers on the first rank, 15 of 8 on the second.
    assert first.saved < second.saved
