"""HyperParallel's swap names on recomp's offload (``recomp.torch._swap``), on CPU with the
offloader's host-copy test mode: gradients against the model without checkpointing,
ops counted in the backward (a ``MUST_SWAP`` op is never recomputed), bytes moved out
and back per layer counted exactly."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import recomp.torch as rt
import recomp.torch.hyperparallel as hp
from host_copies import recorded_host_copies
from recomp.errors import SwapPolicyError
from recomp.torch import CheckpointPolicy
from recomp.torch._offload import ENV_HOST_COPY, default_offloader

SIN = torch.ops.aten.sin.default


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[object, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.sin(self.fc1(x)))


def make_model(layers: int = 3, width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(layers)])


def grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    x = x.detach().requires_grad_(True)
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]  # type: ignore[union-attr]


def swap_sin(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
    return CheckpointPolicy.MUST_SWAP if op is SIN else CheckpointPolicy.PREFER_RECOMPUTE


#: PyTorch's own offload members (``torch.utils.checkpoint.CheckpointPolicy``), where it has them.
TORCH_OFFLOAD = [
    getattr(torch.utils.checkpoint.CheckpointPolicy, name)
    for name in ("MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD")
    if hasattr(torch.utils.checkpoint.CheckpointPolicy, name)
]
needs_offload_members = pytest.mark.skipif(
    not TORCH_OFFLOAD, reason="this PyTorch's CheckpointPolicy has no offload members"
)


def offload_sin(member):  # type: ignore[no-untyped-def]
    """A policy returning PyTorch's ``member`` for sin."""

    def policy(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
        return member if op is SIN else torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def recompute_all(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
    return CheckpointPolicy.PREFER_RECOMPUTE


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> list:  # type: ignore[type-arg]
    """Host-copy mode on; every offload group opened in the test, in order."""
    yield from recorded_host_copies(monkeypatch)


def step(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], OpCounter]:
    model.zero_grad()
    x = x.detach().requires_grad_(True)
    loss = model(x).pow(2).sum()
    counter = OpCounter()
    with counter:
        loss.backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()], counter  # type: ignore[union-attr]


def test_policy_values() -> None:
    assert [p.value for p in CheckpointPolicy] == [0, 1, 2, 3, 4]
    assert [p.name for p in CheckpointPolicy] == [
        "MUST_SAVE", "PREFER_SAVE", "MUST_RECOMPUTE", "PREFER_RECOMPUTE", "MUST_SWAP"
    ]
    from recomp.torch._swap import as_policy

    assert as_policy(True, "f") is CheckpointPolicy.MUST_SAVE
    assert as_policy(False, "f") is CheckpointPolicy.PREFER_RECOMPUTE
    torch_policy = torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE
    assert as_policy(torch_policy, "f") is CheckpointPolicy.MUST_RECOMPUTE
    # PyTorch's offload members (2.14 has them, 2.9 not) are HyperParallel's swap.
    for offload in TORCH_OFFLOAD:
        assert as_policy(offload, "f") is CheckpointPolicy.MUST_SWAP
    for bad in (7, 0, "MUST_SAVE", None):
        with pytest.raises(SwapPolicyError, match="not a policy"):
            as_policy(bad, "f")


def test_invalid_policy_in_a_checkpoint_raises() -> None:
    model = make_model(1)
    rt.checkpoint_wrapper(model[0], policy_fn=lambda ctx, op, *a, **k: 42)
    with pytest.raises(SwapPolicyError, match="returned 42"):
        model(torch.randn(4, 16, requires_grad=True))


def test_names_exported() -> None:
    for name in (
        "CheckpointPolicy", "create_selective_checkpoint_contexts", "noop_context_fn",
        "is_compiling", "ignore_sac_ops", "async_save_on_cpu", "AsyncSaveOnCpu",
    ):
        assert name in hp.__all__ and hasattr(hp, name)
    assert hp.is_compiling() is False


@pytest.mark.parametrize("policy", [swap_sin, recompute_all])
def test_must_swap_exact_and_never_recomputed(groups: list, policy) -> None:  # type: ignore[no-untyped-def,type-arg]
    model = make_model()
    x = torch.randn(4, 16)
    want = grads(model, x)
    for block in model:
        rt.checkpoint_wrapper(block, policy_fn=policy)
    got, counter = step(model, x)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    # sin's backward is a cos and a mul: a sin in the backward is a replayed one.
    replayed = counter.counts.get(SIN, 0)
    if policy is swap_sin:
        assert replayed == 0
        # one sin output (4 x 32 float32) per layer out, and back
        assert [(g.offloaded_bytes, g.restored_bytes) for g in groups] == [(512, 512)] * 3
    else:
        assert replayed == 3
        assert groups == []


def test_swapped_storage_is_released_and_nothing_stays(groups: list) -> None:  # type: ignore[type-arg]
    model = make_model()
    for block in model:
        rt.checkpoint_wrapper(block, policy_fn=swap_sin)
    x = torch.randn(4, 16, requires_grad=True)
    loss = model(x).pow(2).sum()
    records = [r for g in groups for r in g.records]
    assert len(records) == 3 and all(r() is not None for r in records)
    assert all(r().source is None for r in records)  # type: ignore[union-attr]  # device copy dropped
    loss.backward()
    del loss
    assert all(r() is None for r in records)  # host copies freed with the graph


def test_output_alias_stays_on_device(groups: list) -> None:  # type: ignore[type-arg]
    w = torch.randn(8, 8, requires_grad=True)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x @ w)  # the swapped op's output is the layer's output

    x = torch.randn(4, 8, requires_grad=True)
    out = rt.checkpoint(layer, x, policy_fn=swap_sin)
    out.sum().backward()
    assert [g.offloaded_bytes for g in groups] == [0]  # it stays on the device
    ref_x = x.detach().requires_grad_(True)
    torch.sin(ref_x @ w).sum().backward()
    assert torch.equal(ref_x.grad, x.grad)  # type: ignore[arg-type]


def test_swap_inputs_moves_the_checkpoint_inputs(groups: list) -> None:  # type: ignore[type-arg]
    model = make_model()
    x = torch.randn(4, 16)
    want = grads(model, x)
    for block in model:
        rt.checkpoint_wrapper(block, swap_inputs=True)
    got, _ = step(model, x)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    # each layer's input (4 x 16 float32): its parameters stay on the device
    assert [(g.offloaded_bytes, g.restored_bytes) for g in groups] == [(256, 256)] * 3


def test_swap_inputs_with_must_swap_and_exclusion(groups: list) -> None:  # type: ignore[type-arg]
    model = make_model()
    x = torch.randn(4, 16)
    want = grads(model, x)
    rt.apply_activation_checkpointing(
        model,
        checkpoint_fn=Block,
        exclude_fn=lambda m: m is not model and not isinstance(m, Block) and m.out_features == 16,
        policy_fn=swap_sin,
        swap_inputs=True,
    )
    got, counter = step(model, x)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert counter.counts.get(SIN, 0) == 0
    assert [(g.offloaded_bytes, g.restored_bytes) for g in groups] == [(256 + 512, 256 + 512)] * 3
    assert [block.fc2.region_runs for block in model] == [1, 1, 1]


def test_async_save_on_cpu_per_tensor_policy(groups: list) -> None:  # type: ignore[type-arg]
    model = make_model(1)
    x = torch.randn(4, 16)
    want = grads(model, x)
    seen: list[int] = []

    def policy(t: torch.Tensor) -> CheckpointPolicy:
        seen.append(t.numel())
        return CheckpointPolicy.MUST_SWAP if t.numel() >= 128 else CheckpointPolicy.MUST_SAVE

    model.zero_grad()
    xr = x.detach().requires_grad_(True)
    with hp.async_save_on_cpu(policy):
        loss = model(xr).pow(2).sum()
    loss.backward()
    got = [p.grad for p in model.parameters()] + [xr.grad]
    for a, b in zip(want, got):
        assert torch.equal(a, b)  # type: ignore[arg-type]
    # Parameters never reach the policy; the 4 x 32 tensors go out, the 4 x 16 ones stay.
    assert 16 * 32 not in seen
    # sin's input and fc2's input (sin's output), 4 x 32 float32 each
    assert sorted(n for n in seen if n >= 128) == [128, 128]
    assert [(g.offloaded_bytes, g.restored_bytes) for g in groups] == [(1024, 1024)]


def test_async_save_on_cpu_invalid_policy() -> None:
    x = torch.randn(4, 4, requires_grad=True)
    with (
        pytest.raises(SwapPolicyError, match="MUST_SAVE or MUST_SWAP"),
        hp.async_save_on_cpu(lambda t: CheckpointPolicy.PREFER_SAVE),
    ):
        torch.sin(x)


def test_must_swap_needs_a_recomp_checkpoint() -> None:
    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(SwapPolicyError, match="no swap group is active"):
        torch.utils.checkpoint.checkpoint(
            torch.sin,
            x,
            use_reentrant=False,
            context_fn=lambda: hp.create_selective_checkpoint_contexts(swap_sin),
        )


def test_user_context_fn_with_must_swap(groups: list) -> None:  # type: ignore[type-arg]
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x @ w) @ w  # the second matmul saves sin's output

    out = rt.checkpoint(
        layer, x, context_fn=lambda: hp.create_selective_checkpoint_contexts(swap_sin)
    )
    counter = OpCounter()
    with counter:
        out.sum().backward()
    assert counter.counts.get(SIN, 0) == 0
    assert [(g.offloaded_bytes, g.restored_bytes) for g in groups] == [(128, 128)]


def test_list_policy_and_group_swap_without_policy() -> None:
    model = make_model(2)
    x = torch.randn(4, 16)
    want = grads(model, x)
    rt.checkpoint_wrapper(model[0], policy_fn=[torch.ops.aten.addmm.default])
    rt.checkpoint_wrapper(model[1], group_swap=True)
    got, _ = step(model, x)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="OpOverload"):
        hp.create_selective_checkpoint_contexts([torch.ops.aten.addmm])
    with pytest.raises(TypeError, match="swap_inputs"):
        rt.checkpoint(torch.sin, torch.randn(2, requires_grad=True), swap_inputs=1)


def test_without_host_copy_nothing_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_HOST_COPY, raising=False)
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialized: the offloader moves tensors")
    model = make_model()
    x = torch.randn(4, 16)
    want = grads(model, x)
    for block in model:
        rt.checkpoint_wrapper(block, policy_fn=swap_sin, swap_inputs=True)
    got, counter = step(model, x)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert counter.counts.get(SIN, 0) == 0  # kept on the device, still not recomputed


def test_must_swap_under_compile_raises() -> None:
    w = torch.randn(8, 8, requires_grad=True)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x @ w) * 2

    f = torch.compile(lambda x: rt.checkpoint(layer, x, policy_fn=swap_sin), backend="aot_eager")
    with pytest.raises(Exception, match=r"MUST_SWAP .* not supported under torch.compile"):
        f(torch.randn(4, 8, requires_grad=True))
    g = torch.compile(
        lambda x: rt.checkpoint(layer, x, swap_inputs=True), backend="aot_eager", fullgraph=True
    )
    with pytest.raises(Exception, match="does not support swap_inputs"):
        g(torch.randn(4, 8, requires_grad=True))



# --------------------------------------------------------------------------- PyTorch's offload


@needs_offload_members
@pytest.mark.parametrize("name", ["MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"])
def test_pytorch_offload_policies_swap_in_a_recomp_checkpoint(groups: list, name: str) -> None:  # type: ignore[type-arg]
    member = getattr(torch.utils.checkpoint.CheckpointPolicy, name)
    model = make_model()
    x = torch.randn(4, 16)
    want = grads(model, x)
    for block in model:
        rt.checkpoint_wrapper(block, policy_fn=offload_sin(member))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a swap group is there: PREFER_ is no fallback
        got, counter = step(model, x)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert counter.counts.get(SIN, 0) == 0  # kept, never recomputed
    # one sin output (4 x 32 float32) per layer to the host and back, as MUST_SWAP
    assert [(g.offloaded_bytes, g.restored_bytes) for g in groups] == [(512, 512)] * 3


@needs_offload_members
def test_prefer_cpu_offload_without_a_recomp_checkpoint_is_saved_and_said_once() -> None:
    from recomp._policy import _FALLBACKS_SAID

    _FALLBACKS_SAID.clear()
    member = torch.utils.checkpoint.CheckpointPolicy.PREFER_CPU_OFFLOAD
    model = make_model(2)
    x = torch.randn(4, 16)
    want = grads(model, x)

    def run(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(
            block, h, use_reentrant=False,
            context_fn=lambda: hp.create_selective_checkpoint_contexts(offload_sin(member)),
        )

    x1 = x.detach().requires_grad_(True)
    with pytest.warns(UserWarning, match="PREFER_CPU_OFFLOAD .* saved on the device") as said:
        loss = run(model[1], run(model[0], x1)).pow(2).sum()
    assert len([w for w in said if "PREFER_CPU_OFFLOAD" in str(w.message)]) == 1
    model.zero_grad()
    counter = OpCounter()
    with counter:
        loss.backward()
    got = [p.grad for p in model.parameters()] + [x1.grad]
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert counter.counts.get(SIN, 0) == 0  # saved by PyTorch: not recomputed


@needs_offload_members
def test_must_cpu_offload_without_a_recomp_checkpoint_names_what_was_returned() -> None:
    member = torch.utils.checkpoint.CheckpointPolicy.MUST_CPU_OFFLOAD
    block = make_model(1)[0]
    with pytest.raises(SwapPolicyError, match=r"returned MUST_CPU_OFFLOAD for aten\.sin.* recomp"):
        torch.utils.checkpoint.checkpoint(
            block, torch.randn(4, 16, requires_grad=True), use_reentrant=False,
            context_fn=lambda: hp.create_selective_checkpoint_contexts(offload_sin(member)),
        )


@needs_offload_members
def test_pytorch_offload_policies_under_compile_are_pytorchs_to_place() -> None:
    member = torch.utils.checkpoint.CheckpointPolicy.MUST_CPU_OFFLOAD
    w = torch.randn(8, 8, requires_grad=True)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x @ w) * 2

    x = torch.randn(4, 8, requires_grad=True)
    want = torch.autograd.grad(layer(x).sum(), (x, w))
    torch._dynamo.reset()
    f = torch.compile(lambda x: rt.checkpoint(layer, x, policy_fn=offload_sin(member)),
                      backend="aot_eager")
    got = torch.autograd.grad(f(x).sum(), (x, w))
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------- swap, manager


def saved_by_block(width: int = 16, batch: int = 4) -> int:
    """Bytes a Block's forward saves besides parameters (float32): fc1's input, sin's
    input, fc2's input (sin's output); the add saves nothing."""
    return 4 * batch * (width + 2 * width + 2 * width)


def test_swap_wrapper_exact_bytes_and_no_replay(groups: list) -> None:  # type: ignore[type-arg]
    model = make_model()
    x = torch.randn(4, 16)
    want = grads(model, x)
    for block in model:
        assert rt.swap_wrapper(block) is block
    got, counter = step(model, x)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert counter.counts.get(SIN, 0) == 0
    expected = saved_by_block()
    assert [(g.offloaded_bytes, g.restored_bytes) for g in groups] == [(expected, expected)] * 3
    assert [g.name for g in groups] == [hp.SwapManager().group_name(b, b) for b in model]


def test_swap_function_with_per_tensor_policy(groups: list) -> None:  # type: ignore[type-arg]
    model = make_model(1)
    x = torch.randn(4, 16)
    want = grads(model, x)
    model.zero_grad()
    xr = x.detach().requires_grad_(True)

    def big_only(t: torch.Tensor) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SWAP if t.shape[-1] == 32 else CheckpointPolicy.MUST_SAVE

    rt.swap(model, xr, policy_fn=big_only).pow(2).sum().backward()
    got = [p.grad for p in model.parameters()] + [xr.grad]
    for a, b in zip(want, got):
        assert torch.equal(a, b)  # type: ignore[arg-type]
    assert [(g.offloaded_bytes, g.restored_bytes) for g in groups] == [(1024, 1024)]


def test_swap_manager_is_one_object() -> None:
    assert hp.SwapManager() is hp.SwapManager()
    with pytest.raises(TypeError, match="modules"):
        hp.SwapManager().set_forward_prefetch_layer(lambda x: x, nn.Linear(2, 2))


def _prefetch_order(
    model: nn.Sequential, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, set[str]], list[str]]:
    """How each layer's tensors came back (ahead, on read), and the order of the layers
    brought back ahead."""
    events: list[tuple[str, str]] = []
    off = default_offloader()
    monkeypatch.setattr(off, "trace", lambda event, name: events.append((event, name)))
    x = torch.randn(4, 16, requires_grad=True)
    model(x).pow(2).sum().backward()
    names = {hp.SwapManager().group_name(b, b): f"L{i}" for i, b in enumerate(model)}
    kinds: dict[str, set[str]] = {}
    ahead: list[str] = []
    for event, name in events:
        layer = names[name]
        if event == "read":
            continue
        kinds.setdefault(layer, set()).add(event)
        if event == "copy back" and layer not in ahead:
            ahead.append(layer)
    return kinds, ahead


def test_prefetch_default_pairing_is_the_layer_before(groups: list, monkeypatch) -> None:  # type: ignore[no-untyped-def,type-arg]
    model = make_model()
    for block in model:
        rt.swap_wrapper(block)
    kinds, ahead = _prefetch_order(model, monkeypatch)
    assert kinds == {"L2": {"copy back on read"}, "L1": {"copy back"}, "L0": {"copy back"}}
    assert ahead == ["L1", "L0"]


def test_prefetch_follows_set_pairs(groups: list, monkeypatch) -> None:  # type: ignore[no-untyped-def,type-arg]
    model = make_model(4)
    for block in model:
        rt.checkpoint_wrapper(block, swap_inputs=True)
    manager = hp.SwapManager()
    manager.set_forward_prefetch_layer(model[1], model[3])  # L3's backward brings L1 back
    manager.set_forward_prefetch_layer(model[0], model[2])  # L2's backward brings L0 back
    try:
        kinds, ahead = _prefetch_order(model, monkeypatch)
    finally:
        for block in model:
            manager.unregister_forward_prefetch_layer(block)
    # L3 and L2 end their chains: they stay on the device
    assert [g.offloaded_bytes for g in groups] == [256, 256, 0, 0]
    assert kinds == {"L1": {"copy back"}, "L0": {"copy back"}}
    assert ahead == ["L1", "L0"]


def test_native_contexts_and_wrapper_class() -> None:
    x = torch.randn(4, 4, requires_grad=True)

    def save_sin(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
        return op is SIN

    out = rt.checkpoint(
        lambda t: torch.sin(t).exp(),
        x,
        context_fn=lambda: hp.create_native_selective_checkpoint_contexts(save_sin),
    )
    counter = OpCounter()
    with counter:
        out.sum().backward()
    assert SIN not in counter.counts
    with pytest.raises(SwapPolicyError, match="no counterpart"):
        torch.utils.checkpoint.checkpoint(
            torch.sin,
            x,
            use_reentrant=False,
            context_fn=lambda: hp.create_native_selective_checkpoint_contexts(swap_sin),
        )
    block = rt.checkpoint_wrapper(nn.Linear(2, 2))
    excluded = rt.checkpoint_exclude_wrapper(nn.Linear(2, 2))
    wrapper = hp.get_class_activation_wrapper()
    assert isinstance(block, wrapper) and isinstance(excluded, wrapper)
    assert not isinstance(nn.Linear(2, 2), wrapper)


def test_group_swap_packs_small_tensors_in_one_copy(groups: list) -> None:  # type: ignore[type-arg]
    model = make_model()
    x = torch.randn(4, 16)
    want = grads(model, x)
    for block in model:
        rt.swap_wrapper(block, group_swap=True)
    off = default_offloader()
    before = off.stats.snapshot()
    got, _ = step(model, x)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    moved = off.stats - before
    expected = saved_by_block()
    assert moved.offloaded_storages == 3  # one bucket per layer instead of three copies
    assert [(g.offloaded_bytes, g.restored_bytes) for g in groups] == [(expected, expected)] * 3


def test_cpu_pool_is_reused_and_empty_after_each_step(groups: list) -> None:  # type: ignore[type-arg]
    pool = hp.PinnedMemoryPool(max_host_bytes=1 << 16)
    model = make_model()
    x = torch.randn(4, 16)
    want = grads(model, x)
    for block in model:
        rt.checkpoint_wrapper(block, policy_fn=swap_sin, swap_inputs=True, cpu_pool=pool)
    reserved = []
    for _ in range(3):
        got, _ = step(model, x)
        for a, b in zip(want, got):
            assert torch.equal(a, b)
        assert pool.in_use_bytes == 0
        reserved.append(pool.reserved_bytes)
    # 3 layers x (input 256 B -> 1 KiB block, sin output 512 B -> 1 KiB block)
    assert reserved == [6 * 1024] * 3
    small = hp.PinnedMemoryPool(max_host_bytes=2048)
    for block in model:
        rt.checkpoint_wrapper(rt.unwrap(block), swap_inputs=True, cpu_pool=small)
    with pytest.raises(RuntimeError, match="PinnedMemoryPool capacity exceeded"):
        model(torch.randn(4, 16, requires_grad=True))
    with pytest.raises(TypeError, match="cpu_pool"):
        hp.async_save_on_cpu(cpu_pool=object())


def test_unwrap_removes_swap_hooks(groups: list) -> None:  # type: ignore[type-arg]
    model = make_model(2)
    for block in model:
        rt.swap_wrapper(block)
    rt.unwrap(model)
    model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert groups == []


def test_must_swap_with_recompute_sessions_and_retain_graph(groups: list) -> None:  # type: ignore[type-arg]
    model = make_model()
    x = torch.randn(4, 16)
    want = grads(model, x)
    for block in model:
        rt.checkpoint_wrapper(block, policy_fn=swap_sin, swap_inputs=True)
    model.zero_grad()
    xr = x.detach().requires_grad_(True)
    with rt.recompute_handle_collector_ctx() as handles:
        loss = model(xr).pow(2).sum()
    counter = OpCounter()
    with counter, rt.recompute_session_ctx("mb0", retain_on_unpack=True):
        for handle in handles:
            rt.recompute_handle(handle, "mb0")
        loss.backward(retain_graph=True)
    rt.clear_recompute_session("mb0")
    got = [p.grad.clone() for p in model.parameters()] + [xr.grad.clone()]  # type: ignore[union-attr]
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert counter.counts.get(SIN, 0) == 0
    # a second backward over the same graph brings the host copies back again
    model.zero_grad()
    xr.grad = None
    loss.backward()
    got = [p.grad for p in model.parameters()] + [xr.grad]
    for a, b in zip(want, got):
        assert torch.equal(a, b)  # type: ignore[arg-type]
    assert [g.restored_bytes for g in groups] == [2 * (256 + 512)] * 3


def test_policy_asked_before_the_op_runs(groups: list) -> None:  # type: ignore[type-arg]
    """PyTorch before 2.14 asks the policy before running the op, with no ``op_output``:
    the forward tap fills the entry when the op has run."""
    from recomp.torch._swap import _SCOPES, SwapScope, _SwapState, _SwapTap

    class OldContext:
        is_recompute = False

    state = _SwapState(allow_mutation=False)
    scope = SwapScope("old order")
    x = torch.randn(4, 8)
    with _SCOPES.active(scope):
        state.chose(OldContext(), SIN, CheckpointPolicy.MUST_SWAP)
        with _SwapTap(state, replay=False):
            y = torch.sin(x)
            torch.cos(x)
        assert state.waiting is None
        scope.finish(None)
    assert [g.offloaded_bytes for g in groups] == [128]
    del y
    counter = OpCounter()
    with counter, _SwapTap(state, replay=True):
        again = torch.sin(x)
    assert SIN not in counter.counts  # handed back, not run
    assert torch.equal(again, torch.sin(x))


def test_bench_swap_strategies(monkeypatch: pytest.MonkeyPatch) -> None:
    """``recomp bench`` strategies for the GPU comparison: full checkpointing with the
    inputs swapped, and with the matmul outputs swapped instead of recomputed."""
    from recomp.cli.config import BenchConfig
    from recomp.cli.strategies import parse
    from recomp.cli.torch.runner import measure_strategy

    # The earlier spellings name the same strategies.
    assert parse("full-swap-inputs").name == "full+swap-inputs"
    assert parse("swap-mm").name == "full+swap-matmuls"
    monkeypatch.setenv(ENV_HOST_COPY, "1")
    config = BenchConfig(layers=2, hidden=32, heads=2, seq=16, batch=1, warmup=1)
    inputs = measure_strategy(config, "full+swap-inputs")
    # each layer's input, 1 x 16 x 32 float32, out and back
    assert inputs.offload.host_bytes == inputs.offload.restored_bytes == 2 * 16 * 32 * 4
    assert inputs.max_grad_diff == 0.0
    matmuls = measure_strategy(config, "full+swap-matmuls")
    # An output no backward reads (one the replay stops before) goes out and stays there.
    assert 0 < matmuls.offload.restored_bytes <= matmuls.offload.host_bytes
    assert matmuls.max_grad_diff == 0.0


class _ScaleKeptOutside(torch.autograd.Function):
    """Keeps ``scale`` as a ctx attribute, outside autograd's saved tensors."""

    @staticmethod
    def forward(ctx, x, scale):  # type: ignore[no-untyped-def]
        ctx.scale = scale
        return x * scale

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad * ctx.scale, None


class ScaledLinear(nn.Module):
    def __init__(self, tag: str | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.scales: list[torch.Tensor] = []
        self.tag = tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.sigmoid(x.detach()) + 1
        self.scales.append(hp.swap_tensor_wrapper(scale, tag=self.tag))
        return _ScaleKeptOutside.apply(self.fc(x), scale)


def test_swap_tensor_wrapper_empties_and_refills_in_place(groups: list) -> None:  # type: ignore[type-arg]
    torch.manual_seed(0)
    model = nn.Sequential(ScaledLinear(), ScaledLinear())
    x = torch.randn(4, 16)
    want = grads(model, x)
    assert all(s.untyped_storage().nbytes() == 256 for m in model for s in m.scales)
    for m in model:
        m.scales.clear()
        rt.swap_wrapper(m, policy_fn=lambda t: CheckpointPolicy.MUST_SAVE)
    model.zero_grad()
    xr = x.detach().requires_grad_(True)
    loss = model(xr).pow(2).sum()
    assert [m.scales[0].untyped_storage().nbytes() for m in model] == [0, 0]  # on the host
    loss.backward()
    assert [m.scales[0].untyped_storage().nbytes() for m in model] == [256, 256]
    got = [p.grad for p in model.parameters()] + [xr.grad]
    for a, b in zip(want, got):
        assert torch.equal(a, b)  # type: ignore[arg-type]
    assert [(g.offloaded_bytes, g.restored_bytes) for g in groups] == [(256, 256)] * 2
    assert hp.swap_tensor_wrapper(x) is x  # no layer around it: nothing to do


def test_swap_tensor_wrapper_tag_names_the_tensors_in_the_trace(groups: list) -> None:  # type: ignore[type-arg]
    from recomp._testing import offload_events

    model = nn.Sequential(ScaledLinear(tag="scale"), ScaledLinear())
    for m in model:
        rt.swap_wrapper(m, policy_fn=lambda t: CheckpointPolicy.MUST_SAVE)
    x = torch.randn(4, 16, requires_grad=True)
    loss = model(x).pow(2).sum()
    with offload_events(default_offloader()) as events:
        loss.backward()
    names = [hp.SwapManager().group_name(m, m) for m in model]
    assert sorted(name for _, name in events) == sorted([f"{names[0]}/scale", names[1]])
    with pytest.raises(TypeError, match="tag must be a str"):
        hp.swap_tensor_wrapper(x, tag=3)


NEG = torch.ops.aten.neg.default


class NegTail(nn.Module):
    """A layer whose last op (a neg that saves nothing, read only by the final add) comes
    after its last saved tensor: a replay that stops there never reaches it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(torch.sin(h)) + torch.neg(h)


def neg_tail_model() -> tuple[nn.Sequential, torch.Tensor, list[torch.Tensor]]:
    """Two NegTail layers, an input, and the gradients of the model without checkpointing."""
    torch.manual_seed(0)
    model = nn.Sequential(NegTail(16), NegTail(32))
    x = torch.randn(4, 16)
    return model, x, grads(model, x)


def swap_sin_and_neg(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
    if op is SIN or op is NEG:
        return CheckpointPolicy.MUST_SWAP
    return CheckpointPolicy.PREFER_RECOMPUTE


#: Checkpoint options that push saved-tensor hooks of their own on top of the checkpoint's.
OTHER_HOOKS = {"none": {}, "value check": {"determinism_check": "values"}, "debug": {"debug": True}}


@pytest.mark.parametrize("hooked", list(OTHER_HOOKS))
@pytest.mark.parametrize("early_stop", [True, False])
def test_must_swap_output_the_backward_never_reads_is_not_brought_back(  # type: ignore[no-untyped-def]
    groups: list, early_stop: bool, hooked: str  # type: ignore[type-arg]
) -> None:
    """The value check and the debug log push saved-tensor hooks of their own on top of the
    checkpoint's, inside the stage where the invocation asks for the save counter: a
    counter asked again there (by the per-op policy itself) would find no checkpoint and
    drop nothing. The invocation, which asks once below them, drops as without them."""
    model, x, want = neg_tail_model()
    for block in model:
        rt.checkpoint_wrapper(
            block, policy_fn=swap_sin_and_neg, early_stop=early_stop, **OTHER_HOOKS[hooked]
        )
    got, counter = step(model, x)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    # never recomputed (the backward of a neg is a neg: one per layer)
    assert counter.counts.get(SIN, 0) == 0 and counter.counts.get(NEG, 0) == 2
    sin_out = [4 * 32 * 4, 4 * 64 * 4]  # one (4, 2w) float32 sin output per layer
    moved = [(g.offloaded_bytes, g.restored_bytes) for g in groups]
    if early_stop:
        # the replay stops at fc2's saves, before the neg: its output is not even kept
        assert moved == [(n, n) for n in sin_out]
    else:
        # the replay reaches the neg and reads its kept output: out and back
        assert moved == [(2 * n, 2 * n) for n in sin_out]


def test_must_swap_output_in_a_nested_checkpoint_is_dropped(groups: list) -> None:  # type: ignore[type-arg]
    """The enclosing checkpoint's replay re-runs a nested one whole and reads back its
    region calls and collectives, which it therefore keeps; but a re-run keeps op outputs
    of its own, so the nested forward's kept outputs that its own replay never reaches are
    dropped there too."""
    model, x, want = neg_tail_model()
    for block in model:
        rt.checkpoint_wrapper(block, policy_fn=swap_sin_and_neg, early_stop=True)
    model.zero_grad()
    xr = x.detach().requires_grad_(True)
    loss = rt.checkpoint(model, xr).pow(2).sum()
    sin_out = [4 * 32 * 4, 4 * 64 * 4]
    # the two layers' forward groups: each sin output, not the neg's
    assert [g.offloaded_bytes for g in groups] == sin_out
    loss.backward()
    got = [p.grad for p in model.parameters()] + [xr.grad]
    for a, b in zip(want, got):
        assert torch.equal(a, b)  # type: ignore[arg-type]
    assert [g.restored_bytes for g in groups[:2]] == sin_out


def test_swapped_steps_leave_no_reference_cycles(groups: list) -> None:  # type: ignore[type-arg]
    # Each swapped call's hooks are freed by reference counting: a step leaves nothing for
    # the garbage collector (a cycle per call held its hooks until a collection).
    import gc

    model = make_model()
    for block in model:
        hp.swap_wrapper(block)
    x = torch.randn(4, 16)
    step(model, x)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            step(model, x)
        found = gc.collect()
    finally:
        gc.enable()
    assert found == 0
    assert len(groups) == 4 * 3 and all(g.offloaded_bytes > 0 for g in groups)
