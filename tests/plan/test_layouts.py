"""Loss (vocabulary) parallelism and context parallelism as layouts of the simulated
published models and of ``job_memory``: exact counts at full size. With loss
parallelism each tensor-parallel rank holds its vocabulary shard of the logits and of
the loss's fp32 buffers; with context parallelism each rank holds ``seq / cp`` tokens
of the activations, and its attention keeps what ring attention keeps (its query, key,
value, output and log-sum-exp), the keys and values of the whole sequence being
gathered again in its backward. The same layouts run on real ranks in
``tests/distributed/test_fit_layouts.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from recomp.plan import Parallel
from recomp.plan.job import job_memory, model_params
from recomp.plan.models import SimulatedModel

GiB = 1 << 30
VOCAB = 128256  # Llama-3.1's


def _profile(**layout):
    return SimulatedModel("llama-3.1-70b", layers=3, **layout).simulate(hardware="H100 SXM")


@pytest.fixture(scope="module")
def llama_70b_batch_16():
    """Llama-3.1-70B, TP 8 + SP, 16 sequences of 8192 tokens per micro-batch."""
    layout = {"seq": 8192, "batch": 16, "tp": 8, "sp": True}
    return _profile(**layout), _profile(**layout, loss_parallel=True)


def test_loss_parallelism_keeps_the_vocabulary_shard_of_the_logits(llama_70b_batch_16) -> None:
    gathered, sharded = llama_70b_batch_16
    tokens = 16 * 8192
    # Without it, every rank keeps the fp32 log-softmax of the whole vocabulary...
    log_softmax = tokens * VOCAB * 4
    assert log_softmax / GiB == pytest.approx(62.625)
    # ... with it, its shard: 7/8 of it less.
    assert gathered.after_layers_bytes - sharded.after_layers_bytes == log_softmax * 7 // 8
    # The loss's backward: the bf16 logits the caller holds and two fp32 logits-sized
    # gradients, of the whole vocabulary or of the shard (and the per-token fp32 maximum
    # the shards agree on, by an all-reduce).
    assert gathered.loss_backward_bytes == tokens * VOCAB * (2 + 4 + 4)
    assert sharded.loss_backward_bytes == tokens * VOCAB // 8 * (2 + 4 + 4) + tokens * 4
    # The layers are the same.
    assert [layer.no_checkpoint_bytes for layer in gathered.layers] == [
        layer.no_checkpoint_bytes for layer in sharded.layers
    ]


def test_the_job_is_billed_for_the_shard_and_its_layout_is_checked(llama_70b_batch_16) -> None:
    gathered, sharded = llama_70b_batch_16
    params = model_params(SimulatedModel("llama-3.1-70b").meta_model())
    common = {"option": "full", "microbatches": 1}
    without = job_memory(params, Parallel(tp=8, sp=True), activations=gathered, **common)
    with_it = job_memory(
        params, Parallel(tp=8, sp=True, loss_parallel=True), activations=sharded, **common
    )
    saved = without.ranks[0].saved - with_it.ranks[0].saved
    assert saved == gathered.after_layers_bytes - sharded.after_layers_bytes
    assert with_it.ranks[0].transient == sharded.loss_backward_bytes
    assert without.ranks[0].activations - with_it.ranks[0].activations > 130 * GiB
    # A profile made under another layout than the job's is refused, naming the field.
    with pytest.raises(ValueError, match=r"loss_parallel=True \(the job: False\)"):
        job_memory(params, Parallel(tp=8, sp=True), activations=sharded, **common)
    with pytest.raises(ValueError, match=r"cp=1 \(the job: 2\)"):
        job_memory(params, Parallel(tp=8, sp=True, cp=2), activations=gathered, **common)


def test_context_parallelism_keeps_each_ranks_share_of_the_sequence() -> None:
    """Llama-3.1-70B, TP 8 + SP, 8192 tokens over CP 2, against 4096 tokens on one rank:
    the same bytes per layer and outside the layers (each rank's share: two chunks of
    2048 tokens), but the flash kernel's random state (24 bytes, none under CP, which
    runs without dropout); the checkpoint's replay reaches the all-gather of the keys
    and values, whose results it keeps unless it replays it."""
    cp = _profile(seq=8192, tp=8, sp=True, cp=2)
    half = _profile(seq=4096, tp=8, sp=True)
    assert cp.layout["cp"] == 2 and half.layout["cp"] == 1
    for a, b in zip(cp.layers, half.layers, strict=True):
        assert a.no_checkpoint_bytes == b.no_checkpoint_bytes - 24
        assert a.option("full+replay-collectives").kept_bytes == b.option(
            "full+replay-collectives"
        ).kept_bytes
        # Kept otherwise: the whole sequence's keys and values (8192 tokens x 1 key-value
        # head of 128 per TP rank, bf16) besides what the layer keeps without CP.
        extra = a.option("full").collective_bytes - b.option("full").collective_bytes
        assert extra == 2 * 8192 * 128 * 2
    # Outside the layers the same, but the labels the loss shifts itself without CP
    # (int64, padded by one, a view of which the loss keeps), which CP's inputs give
    # shifted (the next token of the whole sequence).
    assert half.after_layers_bytes - cp.after_layers_bytes == (4096 + 1) * 8
    assert cp.loss_backward_bytes == half.loss_backward_bytes
    # The attention's work: rank 0's chunks are the first and the last of four (2048
    # tokens each), whose queries see 2048 and 8192 keys (the same work on every rank):
    # 2048 x (2048 + 8192) query-key pairs against 4096 x 4096 on 4096 tokens alone.
    attention = next(r for r in cp.layers[1].regions if r.path == "self_attn")
    attention_half = next(r for r in half.layers[1].regions if r.path == "self_attn")
    projections = 4096 * 8192 * (8192 + 2 * 1024) * 2 // 8 + 4096 * 8192 * 8192 * 2 // 8
    core_cp = attention.forward_flops - projections
    core_half = attention_half.forward_flops - projections
    assert core_cp * (4096 * 4096) == core_half * (2048 * (2048 + 8192))
