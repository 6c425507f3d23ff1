"""Whisper (an encoder-decoder HF model) trained with recomp: KV-cache warnings only
where a cache is really written twice.

HF passes ``config.use_cache`` to Whisper's encoder layers through ``**kwargs``;
their attention has no ``layer_idx`` and writes no cache. With every attention
excluded, the decoder's cache is written once and kept.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.models.whisper import modeling_whisper as mw  # noqa: E402

import recomp.torch as rt  # noqa: E402

LABELS = 6


def whisper():
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=100,
        num_mel_bins=8,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        d_model=16,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_source_positions=16,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    model = mw.WhisperForConditionalGeneration(config)
    model.train()
    return model


def step(model, **kwargs):
    g = torch.Generator().manual_seed(0)
    features = torch.randn(2, 8, 32, generator=g)
    labels = torch.randint(3, 100, (2, LABELS), generator=g)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.zero_grad(set_to_none=True)
        out = model(input_features=features, labels=labels, **kwargs)
        out.loss.backward()
    cache_warnings = [str(w.message) for w in record if "KV cache" in str(w.message)]
    return out, cache_warnings, [p.grad for p in model.parameters()]


def with_recomp(model, exclude=mw.WhisperAttention):
    return rt.apply_activation_checkpointing(
        model, checkpoint_fn=(mw.WhisperEncoderLayer, mw.WhisperDecoderLayer), exclude_fn=exclude
    )


def assert_same(want, got):
    for a, b in zip(want, got):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("use_cache", [False, True, None], ids=["off", "on", "config_default"])
def test_every_attention_excluded_warns_nothing_and_keeps_the_cache(use_cache):
    reference = whisper()
    model = with_recomp(copy.deepcopy(reference))
    kwargs = {} if use_cache is None else {"use_cache": use_cache}
    expected, _, want = step(reference, **kwargs)
    got, cache_warnings, grads = step(model, **kwargs)
    assert cache_warnings == []  # warned for the encoder layers, naming use_cache=False
    assert_same(want, grads)
    if expected.past_key_values is None:
        assert got.past_key_values is None
    else:  # the decoder's self-attention cache, written once
        assert got.past_key_values.get_seq_length() == expected.past_key_values.get_seq_length()
        assert got.past_key_values.get_seq_length() == LABELS


def test_recomputed_decoder_attention_still_turns_the_cache_off():
    model = with_recomp(whisper(), exclude=None)
    got, cache_warnings, _ = step(model, use_cache=True)
    assert got.past_key_values is None
    assert cache_warnings and all(
        "Encoder" not in w.split(" in training")[0] for w in cache_warnings
    )
