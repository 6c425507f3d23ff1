"""Wrappers are transparent: the module itself is wrapped in place, so attributes, names,
state_dict keys and loading both ways are those of the unwrapped model; model-wide wrapping."""

from __future__ import annotations

import abc
import pickle
import warnings

import pytest
import torch
from torch import nn

import recomp
import recomp.torch as rt
from recomp._wrapping import recomp_wrapper_of
from torch_models import Block, assert_same_grads, exclude_attention, grads_of, stack, twin


def wrapped_stack():
    ref = stack(2)
    return ref, exclude_attention(twin(ref))


def test_attributes_fall_through():
    ref = stack(2)
    blk, attn, weight, mlp0 = ref[0], ref[0].attn, ref[0].attn.weight, ref[0].mlp[0]
    blk.attn = rt.checkpoint_exclude_wrapper(blk.attn)
    ref[0] = rt.checkpoint_wrapper(blk)
    # the same objects, wrapped in place
    assert ref[0] is blk and ref[0].attn is attn and isinstance(attn, nn.Linear)
    assert ref[0].attn.in_features == 8
    assert ref[0].attn.weight is weight
    assert isinstance(ref[0].norm, nn.LayerNorm)
    assert ref[0].mlp[0] is mlp0
    seq = rt.checkpoint_wrapper(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert isinstance(seq[1], nn.ReLU)  # indexing works as before


def test_state_dict_keys_are_those_of_the_unwrapped_model():
    ref, model = wrapped_stack()
    assert list(model.state_dict().keys()) == list(ref.state_dict().keys())
    assert [n for n, _ in model[0].named_parameters()] == [n for n, _ in ref[0].named_parameters()]


def test_state_dict_loads_both_ways():
    ref, model = wrapped_stack()
    fresh_ref = stack(2, seed=7)
    fresh_ref.load_state_dict(model.state_dict())  # wrapped -> plain
    for a, b in zip(fresh_ref.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)
    _, fresh_model = wrapped_stack()
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.add_(1.0)
    fresh_model.load_state_dict(ref.state_dict())  # plain -> wrapped, strict
    for a, b in zip(fresh_model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)


def test_distributed_state_dict_utilities_round_trip():
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    ref, model = wrapped_stack()
    sd = get_model_state_dict(model)
    assert list(sd.keys()) == list(ref.state_dict().keys())
    target = stack(2, seed=3)
    set_model_state_dict(target, sd)
    back = wrapped_stack()[1]
    with torch.no_grad():
        for p in back.parameters():
            p.zero_()
    set_model_state_dict(back, get_model_state_dict(target))
    for a, b in zip(back.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList(Block(8) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_apply_activation_checkpointing_in_two_lines():
    torch.manual_seed(0)
    ref = Decoder()
    model = twin(ref)
    out = rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, Block),
        exclude_fn=lambda m: (
            m.__class__ is nn.Linear and m.out_features == 8 and m.in_features == 8
        ),
    )
    assert out is model
    assert all(isinstance(layer, rt.CheckpointWrapper) for layer in model.layers)
    # exclusions only inside checkpointed modules: embed is untouched
    assert type(model.embed) is nn.Linear and type(model.head) is nn.Linear
    attn = model.layers[1].attn
    assert isinstance(attn, rt.ExcludeWrapper) and attn.region.name == "layers.1.attn"
    assert list(model.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 5, 8, requires_grad=True)
    _, g_ref = grads_of(ref, lambda o: o.pow(2).sum(), x)
    _, g = grads_of(model, lambda o: o.pow(2).sum(), x)
    assert_same_grads(g_ref, g)
    assert [layer.attn.region_runs for layer in model.layers] == [1, 1, 1]
    assert [layer.attn.region_skips for layer in model.layers] == [1, 1, 1]
    # applying again leaves the wrapped modules as they are
    attn_class, region = type(model.layers[0].attn), model.layers[0].attn.region
    rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, Block),
        exclude_fn=lambda m: isinstance(m, nn.Linear),
    )
    assert type(model.layers[0].attn) is attn_class and attn_class.__bases__[1] is nn.Linear
    assert model.layers[0].attn.region is region


def test_apply_activation_checkpointing_on_the_root_returns_the_wrapper():
    block = Block(8)
    out = rt.apply_activation_checkpointing(block, checkpoint_fn=lambda m: m is block)
    assert isinstance(out, rt.CheckpointWrapper) and out is block


def test_checkpoint_kwargs_pass_through_the_wrapper():
    block = Block(8)
    wrapped = rt.checkpoint_wrapper(block, preserve_rng_state=False, determinism_check="none")
    assert wrapped.checkpoint_kwargs == {"preserve_rng_state": False, "determinism_check": "none"}
    x = torch.randn(2, 8, requires_grad=True)
    wrapped(x).sum().backward()
    assert x.grad is not None


class MegatronLikeModule(nn.Module):
    pass


class AbcFirstRouter(abc.ABC, MegatronLikeModule):
    """Megatron-Core's ``class Router(ABC, MegatronModule)``: ``ABC`` before the module class."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, x):
        return self.proj(x).sin()


def test_an_abc_first_module_is_wrapped_pickled_and_unwrapped():
    module = AbcFirstRouter()
    keys = list(module.state_dict())
    rt.checkpoint_wrapper(module)
    assert list(module.state_dict()) == keys
    clone = pickle.loads(pickle.dumps(module))
    assert isinstance(clone, rt.CheckpointWrapper) and isinstance(clone, AbcFirstRouter)
    x = torch.ones(2, 3)
    assert torch.equal(clone(x), module(x))
    assert type(rt.unwrap(module)) is AbcFirstRouter
    assert type(rt.unwrap(clone)) is AbcFirstRouter


@pytest.mark.parametrize("wrapped", ["checkpoint_wrapper", "checkpoint_exclude_wrapper"])
def test_jit_script_of_a_wrapped_model_names_the_fix(wrapped):
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    getattr(rt, wrapped)(model[0])
    # TorchScript is deprecated (a FutureWarning on recent PyTorch, none on 2.9)
    with warnings.catch_warnings(), pytest.raises(recomp.RecompError) as info:
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.script(model)
    message = str(info.value)
    assert "\n" not in message
    assert f"cannot compile Linear: recomp wrapped it ({wrapped})" in message
    assert "unwrap(model)" in message and "torch.compile" in message
    assert recomp_wrapper_of(model[0]) is not None  # still wrapped
    rt.unwrap(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.script(model)  # unwrapped, it scripts


def test_unwrap_between_forward_and_backward_is_refused_and_the_backward_stays_exact():
    ref = stack(2)
    model = exclude_attention(twin(ref))
    x = torch.randn(4, 5, 8)
    _, expected = grads_of(ref, lambda out: out.square().sum(), x)
    loss = model(x).square().sum()
    classes = [type(m) for m in model.modules()]
    pending = r"'0.attn', '1.attn' ran in a forward whose backward"
    with pytest.raises(recomp.RecompError, match=pending) as info:
        rt.unwrap(model)
    assert "Call unwrap after the backward (or before the forward)" in str(info.value)
    assert [type(m) for m in model.modules()] == classes  # still wrapped
    loss.backward()
    assert_same_grads(expected, {n: p.grad for n, p in model.named_parameters()})
    assert [blk.attn.region_runs for blk in model] == [1, 1]
    rt.unwrap(model)  # after the backward it unwraps
    assert type(model[0].attn) is type(ref[0].attn)
