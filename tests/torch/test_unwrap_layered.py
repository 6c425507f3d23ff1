"""``unwrap`` when another library changed a wrapped module's class afterwards.

HF's DAC ``apply_weight_norm()`` registers ``weight_norm`` parametrizations, which
give each parametrized module a class derived from the one it has, recomp's
included. ``unwrap`` takes recomp's class out from under the parametrization; a
class it does not know is an error that changes nothing.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402
from torch.nn.utils import parametrize  # noqa: E402
from transformers.models.dac import modeling_dac  # noqa: E402

import recomp.torch as rt  # noqa: E402
from recomp._wrapping import recomp_wrapper_of  # noqa: E402


def dac():
    torch.manual_seed(0)
    config = transformers.DacConfig(
        encoder_hidden_size=8,
        downsampling_ratios=[2, 2],
        decoder_hidden_size=16,
        upsampling_ratios=[2, 2],
        n_codebooks=2,
        codebook_size=16,
        codebook_dim=4,
        hidden_size=16,
    )
    return modeling_dac.DacModel(config)


def wrapped_modules(model):
    return [n for n, m in model.named_modules() if recomp_wrapper_of(m) is not None]


def with_recomp(model):
    return rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=modeling_dac.DacResidualUnit,
        exclude_fn=lambda m: isinstance(m, nn.Conv1d) and m.kernel_size == (7,),
    )


def encode_grads(model, x):
    model.zero_grad(set_to_none=True)
    model.encoder(x).square().mean().backward()
    return [p.grad for p in model.parameters()]


def assert_same(want, got):
    assert len(want) == len(got) and any(g is not None for g in got)
    for a, b in zip(want, got):
        assert (a is None and b is None) or torch.equal(a, b)


def test_unwrap_after_weight_norm_keeps_the_parametrizations():
    ref, model = dac(), with_recomp(dac())
    ref.apply_weight_norm()
    model.apply_weight_norm()  # parametrizes, among others, the excluded convolutions
    conv = model.encoder.block[0].res_unit1.conv1
    assert recomp_wrapper_of(conv) is rt.ExcludeWrapper and parametrize.is_parametrized(conv)
    x = torch.randn(2, 1, 64)
    assert_same(encode_grads(ref, x), encode_grads(model, x))
    assert conv.region_runs == 1

    rt.unwrap(model)  # raised "was wrapped again after recomp", leaving it wrapped
    assert wrapped_modules(model) == []
    assert type(conv).__name__ == "ParametrizedConv1d" and type(conv).__bases__ == (nn.Conv1d,)
    assert parametrize.is_parametrized(conv, "weight")
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert_same(encode_grads(ref, x), encode_grads(model, x))
    # ... and the parametrization comes off as it would without recomp.
    parametrize.remove_parametrizations(conv, "weight")
    assert type(conv) is nn.Conv1d


def test_unwrap_under_an_unknown_class_is_an_error_that_changes_nothing():
    model = with_recomp(dac())
    conv = model.encoder.block[0].res_unit1.conv1
    before = wrapped_modules(model)
    conv.__class__ = type("Traced", (type(conv),), {})  # another library's in-place wrapping
    with pytest.raises(
        ValueError, match=r"encoder\.block\.0\.res_unit1\.conv1 \(.*Traced\).*nothing was unwrapped"
    ):
        rt.unwrap(model)
    assert wrapped_modules(model) == before
