"""HyperParallel's distributed helpers on recomp (``recomp.torch.hyperparallel``):
attention swap on a Hugging Face Llama (bytes moved per attention in the offloader's
host-copy mode, gradients bit for bit those without swapping, the prefetch chain, a
failure part way leaving nothing behind) and the selective-checkpointing presets
(matmuls saved in turn: counted in the backward)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import recomp.torch as rt
import recomp.torch.hyperparallel as hp
from host_copies import recorded_host_copies

transformers = pytest.importorskip("transformers")

MM = torch.ops.aten.mm.default


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> list:  # type: ignore[type-arg]
    yield from recorded_host_copies(monkeypatch)


@pytest.fixture
def sac_ignored():
    """PyTorch's SAC_IGNORED_OPS as it was before the test."""
    before = set(torch.utils.checkpoint.SAC_IGNORED_OPS)
    yield
    torch.utils.checkpoint.SAC_IGNORED_OPS.clear()
    torch.utils.checkpoint.SAC_IGNORED_OPS.update(before)


def llama(layers: int = 3) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=64,
        attn_implementation="sdpa", use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).train()


IDS = torch.randint(0, 64, (1, 1024), generator=torch.Generator().manual_seed(1))


def grads(model: nn.Module) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(IDS, labels=IDS).loss.backward()
    return [p.grad.clone() for p in model.parameters()]


# --------------------------------------------------------------------------- attention swap


def test_attention_swap_policy_picks_large_whole_tensors_that_need_a_gradient():
    big = torch.randn(512, 512, requires_grad=True) * 1  # 1 MiB, its own storage
    assert hp.attention_swap_policy(big) is hp.CheckpointPolicy.MUST_SWAP
    assert hp.attention_swap_policy(big.detach()) is hp.CheckpointPolicy.MUST_SAVE  # no grad
    assert hp.attention_swap_policy(big[:256]) is hp.CheckpointPolicy.MUST_SAVE  # a view
    small = torch.randn(16, 16, requires_grad=True) * 1
    assert hp.attention_swap_policy(small) is hp.CheckpointPolicy.MUST_SAVE
    flat = torch.randn(1 << 18, requires_grad=True) * 1  # 1 MiB, one dimension
    assert hp.attention_swap_policy(flat) is hp.CheckpointPolicy.MUST_SAVE


def test_apply_attention_swap_moves_each_attentions_tensors_and_stays_exact(groups):
    reference = llama()
    model = copy.deepcopy(reference)
    keys = list(model.state_dict())
    want = grads(reference)
    assert hp.apply_attention_swap(model, "attention") is model
    assert list(model.state_dict()) == keys
    attentions = [layer.self_attn for layer in model.model.layers]
    pairs = hp.SwapManager().pairs
    assert [pairs[b]() for b in attentions[1:]] == attentions[:-1]  # chained in order
    got = grads(model)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    # One group per attention; each moves what it saved of 1 MiB or more, and brings it
    # back. The last attention ends the chain: its tensors stay on the device.
    assert len(groups) == 3
    moved = [(g.offloaded_bytes, g.restored_bytes) for g in groups]
    assert moved[-1] == (0, 0)
    assert all(out == back and out >= 1 << 20 for out, back in moved[:-1]), moved
    rt.unwrap(model)
    groups.clear()
    grads(model)
    assert groups == []


def test_apply_attention_swap_failing_part_way_leaves_nothing(monkeypatch):
    from recomp.torch import _hp_distributed

    model = llama()
    attentions = [layer.self_attn for layer in model.model.layers]
    real = _hp_distributed.swap_wrapper
    calls = []

    def failing(module, **kwargs):  # the third attention cannot be wrapped
        calls.append(module)
        if len(calls) == 3:
            raise RuntimeError("cannot wrap")
        return real(module, **kwargs)

    monkeypatch.setattr(_hp_distributed, "swap_wrapper", failing)
    with pytest.raises(RuntimeError, match="cannot wrap"):
        hp.apply_attention_swap(model, "attention")
    from recomp.torch._swap import unwrap_swaps

    assert not any(unwrap_swaps(a) for a in attentions)  # no hooks were left to remove
    assert not any(a in hp.SwapManager().pairs for a in attentions)


def test_apply_attention_swap_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="takes activation_swap='attention'"):
        hp.apply_attention_swap(llama(1), "none")
    with pytest.raises(ValueError, match="no module registered as self_attn"):
        hp.apply_attention_swap(nn.Sequential(nn.Linear(2, 2)), "attention")
    hp.validate_attention_swap("none", activation_checkpoint="full", enable_compile=True, pp_size=4)
    hp.validate_attention_swap("attention", activation_checkpoint="off")
    for kwargs, words in (
        ({"enable_compile": True}, "torch.compile"),
        ({"activation_checkpoint": "full"}, "exclude_fn=.*offload_fn="),
        ({"pp_size": 2}, "pp_size=1"),
    ):
        with pytest.raises(ValueError, match=words):
            hp.validate_attention_swap("attention", **kwargs)
    with pytest.raises(ValueError, match="must be one of"):
        hp.validate_attention_swap("attn")


# --------------------------------------------------------------------------- presets


class Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.mm += func is MM
        return func(*args, **(kwargs or {}))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear in self.linears:
            x = torch.tanh(linear(x))
        return x


def backward_mms(model: nn.Module, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(x).sum()
    counter = Counter()
    with counter:
        loss.backward()
    return counter.mm, [p.grad.clone() for p in model.parameters()]


def test_selective_preset_saves_every_other_matmul(sac_ignored):
    torch.manual_seed(0)
    reference = nn.Sequential(Block(), Block())
    x = torch.randn(2, 8, 16)  # three dimensions: linear runs as aten.mm
    full, selective = copy.deepcopy(reference), copy.deepcopy(reference)
    for block in full:
        rt.checkpoint_wrapper(block)
    context_fn = hp.make_selective_checkpoint_context_fn()
    for block in selective:
        rt.checkpoint_wrapper(block, context_fn=context_fn)
    plain_mms, want = backward_mms(reference, x)
    full_mms, got_full = backward_mms(full, x)
    selective_mms, got = backward_mms(selective, x)
    for a, b, c in zip(want, got_full, got):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert full_mms - plain_mms == 8  # the replays run the 4 matmuls of each block
    assert selective_mms - plain_mms == 4  # every other one was saved
    # Profiler and FSDP bookkeeping ops are passed through from now on.
    assert torch.ops.aten.view.default in torch.utils.checkpoint.SAC_IGNORED_OPS


def test_compile_preset_is_stateless():
    policy = hp.compile_selective_checkpoint_policy
    save, recompute = hp.CheckpointPolicy.MUST_SAVE, hp.CheckpointPolicy.MUST_RECOMPUTE
    assert [policy(None, MM) for _ in range(3)] == [save] * 3
    assert policy(None, torch.ops.aten.topk.default) is recompute
    assert policy(None, torch.ops.aten.add.Tensor) is recompute
    assert policy(None, torch.ops.aten._scaled_dot_product_efficient_attention.default) is save
