"""``recomp.torch._compat.fake``: fake tensors and torch.distributed's fake process group,
for ``recomp.plan.simulate``. Each entry fails here when PyTorch changes underneath."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from recomp.torch import _compat  # noqa: E402


def test_fake_tensor_mode_makes_tensors_without_memory_on_any_device():
    with _compat.fake_tensor_mode(), torch.device("cuda"):
        t = torch.empty(1 << 20, 1 << 20, dtype=torch.bfloat16)  # 2 TiB, allocated nowhere
        assert _compat.is_fake(t) and isinstance(t, _compat.fake_tensor_type())
        assert t.device.type == "cuda" and t.untyped_storage().nbytes() == 2 << 40
        assert _compat.storage_key(t.view(-1)) == _compat.storage_key(t)
    assert not _compat.is_fake(torch.ones(1))


def test_fake_process_group_answers_collectives_and_is_destroyed_errors_included():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with _compat.fake_process_group(8):
        assert dist.get_world_size() == 8 and dist.get_rank() == 0
        mesh = init_device_mesh("cpu", (8,))
        with _compat.fake_tensor_mode():
            d = distribute_tensor(torch.empty(16, 4), mesh, [Shard(0)], src_data_rank=None)
            assert d.to_local().shape == (2, 4)
            assert d.full_tensor().shape == (16, 4)  # an all-gather, answered without peers
    assert not dist.is_initialized()
    with pytest.raises(KeyError), _compat.fake_process_group(2):
        raise KeyError("inside")
    assert not dist.is_initialized()


def test_fake_process_group_refuses_an_existing_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already initialised"), _compat.fake_process_group(2):
            pass
        assert dist.is_initialized()  # the caller's group is left alone
    finally:
        dist.destroy_process_group()


def test_reset_dtensor_random_drops_the_global_tracker():
    from torch.distributed.tensor import _random

    _random._rng_tracker = object()
    _compat.reset_dtensor_random()
    assert _random._rng_tracker is None


def test_view_operators_are_told_apart():
    assert _compat.is_view_op(torch.ops.aten.view.default)
    assert _compat.is_view_op(torch.ops.aten.t.default)
    assert not _compat.is_view_op(torch.ops.aten.mm.default)


def test_attention_on_fake_cuda_runs_the_fused_kernels_a_gpu_would_choose():
    if torch.cuda.is_available():
        pytest.skip("with a GPU, PyTorch chooses from the device's properties itself")
    import torch.nn.functional as F

    with _compat.fake_tensor_mode(), torch.device("cuda"):
        q = torch.empty(1, 8, 1024, 64, dtype=torch.bfloat16, requires_grad=True)
        kv = torch.empty(1, 2, 1024, 64, dtype=torch.bfloat16, requires_grad=True)
        mask = torch.ones(1, 1, 1024, 1024, dtype=torch.bool)
        fp32 = torch.empty(1, 8, 1024, 64, requires_grad=True)
        with _compat.target_attention_kernels(torch.device("cuda")):
            flash = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            grouped = F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
            masked = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            single = F.scaled_dot_product_attention(fp32, fp32, fp32)
        plain = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert type(flash.grad_fn).__name__ == "ScaledDotProductFlashAttentionBackward0"
    assert type(grouped.grad_fn).__name__ == "ScaledDotProductFlashAttentionBackward0"
    assert type(masked.grad_fn).__name__ == "ScaledDotProductEfficientAttentionBackward0"
    assert type(single.grad_fn).__name__ == "ScaledDotProductEfficientAttentionBackward0"
    # Outside the block PyTorch's own choice on a fake device without a driver: math.
    assert "Flash" not in type(plain.grad_fn).__name__


def test_group_size_of_a_named_group():
    from torch.distributed.device_mesh import init_device_mesh

    with _compat.fake_process_group(8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        assert _compat.group_size(mesh.get_group("tp").group_name) == 4
        assert _compat.group_size(mesh.get_group("dp").group_name) == 2
    assert _compat.group_size("no such group") is None


def test_a_device_mesh_grid_is_made_inside_the_fake_mode():
    with _compat.fake_process_group(8):
        with _compat.fake_tensor_mode():
            grid = _compat.device_mesh_grid("cpu", (2, 4), ("cp", "tp"))
        assert grid["cp"].size() == 2 and grid["tp"].size() == 4
        assert grid.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_dtensor_meta_propagation_runs_no_op_under_the_fake_mode_once_cached():
    """``loss_parallel()``'s log-softmax asks DTensor for the global output's shape: under
    the fake mode DTensor runs the op on fake global tensors each time, unless the block
    sends it to its cache (as on real tensors); the shim is undone on leaving."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.parallel import loss_parallel

    global_shapes: list[tuple[int, ...]] = []

    class Shapes(_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            from torch.distributed.tensor import DTensor

            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (4, 64):
                global_shapes.append(tuple(out.shape))
            return out

    def log_softmax(x):
        with loss_parallel():
            return torch.nn.functional.log_softmax(x, -1)

    before = ShardingPropagator.__dict__["_propagate_tensor_meta"]
    with _compat.fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        with _compat.fake_tensor_mode():
            x = distribute_tensor(torch.empty(4, 64), mesh, [Shard(1)], src_data_rank=None)
            with Shapes():
                log_softmax(x)
                log_softmax(x)
            assert len(global_shapes) == 4, "without the shim the global op runs each time"
            global_shapes.clear()
            with _compat.dtensor_meta_as_on_device(), Shapes():
                log_softmax(x)  # fills the cache
                log_softmax(x)  # asks it
            assert len(global_shapes) == 2
    assert ShardingPropagator.__dict__["_propagate_tensor_meta"] is before
