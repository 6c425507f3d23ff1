"""The published models of ``recomp.plan.models``: their parameter counts against the
published totals, a forward and backward of each under fake tensors at a small layer
count, and the tensor- and expert-parallel shards each rank holds."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from recomp.plan import models
from recomp.torch import _compat


@pytest.mark.parametrize("name", list(models.MODELS))
def test_parameter_count_is_the_published_total(name: str) -> None:
    """Built on the meta device from the config values, each model has exactly the
    parameters of its released checkpoint (the Hub's safetensors totals; DeepSeek-V3:
    the 61 layers of its main model, published as 671B)."""
    spec = models.MODELS[name]
    count = models.parameter_count(name)
    assert count == spec.parameters
    if name == "deepseek-v3":
        assert round(count / 1e9) == 671


def test_published_totals() -> None:
    """The figures themselves, as published (guards a mistyped table entry)."""
    published = {
        "llama-3.1-8b": 8_030_261_248,
        "llama-3.1-70b": 70_553_706_496,
        "llama-3.1-405b": 405_853_388_800,
        "mixtral-8x22b": 140_620_634_112,
        "qwen3-30b-a3b": 30_532_122_624,
        "qwen3-235b-a22b": 235_093_634_560,
    }
    for name, total in published.items():
        assert models.MODELS[name].parameters == total


def _forward_backward(sm: models.SimulatedModel) -> tuple[torch.nn.Module, torch.Tensor]:
    with _compat.fake_tensor_mode():
        model = sm.build(None)
        out = model(**sm.inputs(None))
        out.loss.backward()
        return model, out.loss


@pytest.mark.parametrize("name", ["llama-3.1-8b", "mixtral-8x22b", "deepseek-v3", "qwen3-30b-a3b"])
def test_forward_and_backward_on_fake_tensors(name: str) -> None:
    """Every family runs a training step at full width on fake tensors (CPU device: the
    autograd engine needs a device for CUDA tensors), two layers of it, and every
    parameter gets a gradient of its own shape."""
    sm = models.SimulatedModel(name, layers=2, seq=128, device="cpu")
    model, loss = _forward_backward(sm)
    assert _compat.is_fake(loss) and loss.shape == ()
    for pname, p in model.named_parameters():
        if "e_score_correction" in pname:
            continue
        assert p.grad is not None and p.grad.shape == p.shape, pname
    assert len(model.model.layers) == 2


def test_layer_kinds_and_scaling_counts() -> None:
    """A simulated model keeps a layer of each kind; its last layer of a kind stands for
    the full model's layers of that kind."""
    ds = models.SimulatedModel("deepseek-v3", layers=2)
    assert ds.kinds() == ["dense", "moe"]
    assert ds.layer_counts() == [3, 58]
    assert models.SimulatedModel("deepseek-v3", layers=5).layer_counts() == [1, 1, 1, 1, 57]
    assert models.SimulatedModel("llama-3.1-70b", layers=3).layer_counts() == [1, 1, 78]
    assert models.SimulatedModel("qwen3-30b-a3b", layers=2).layer_counts() == [1, 47]
    with pytest.raises(ValueError, match="at least 2 layers"):
        models.hf_config("deepseek-v3", 1)


def test_options_that_do_not_go_together_name_the_fix() -> None:
    with pytest.raises(ValueError, match="--tp must divide both"):
        models.SimulatedModel("qwen3-30b-a3b", tp=8, sp=True)
    with pytest.raises(ValueError, match="add --sp"):
        models.SimulatedModel("mixtral-8x22b", tp=8)
    with pytest.raises(ValueError, match="drop --ep"):
        models.SimulatedModel("llama-3.1-8b", ep=2)
    with pytest.raises(ValueError, match="--ep must divide it"):
        models.SimulatedModel("mixtral-8x22b", tp=2, sp=True, ep=3)
    with pytest.raises(KeyError, match=r"known: llama-3\.1-8b"):
        models.spec("llama-4")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_shards_per_rank(sp: bool) -> None:
    """Under a fake group of 8 ranks, rank 0 holds an eighth of each projection and of
    the vocabulary, whole norms, and runs a forward whose loss is a scalar."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sm = models.SimulatedModel("llama-3.1-8b", layers=2, seq=256, tp=8, sp=sp, device="cpu")
    with _compat.fake_process_group(8):
        mesh = init_device_mesh("cpu", (8,))
        with _compat.fake_tensor_mode():
            model = sm.build(mesh)
            layer = model.model.layers[0]
            shapes = {
                "q": tuple(_local(layer.self_attn.q_proj.weight).shape),
                "k": tuple(_local(layer.self_attn.k_proj.weight).shape),
                "o": tuple(_local(layer.self_attn.o_proj.weight).shape),
                "down": tuple(_local(layer.mlp.down_proj.weight).shape),
                "embed": tuple(_local(model.model.embed_tokens.weight).shape),
                "head": tuple(_local(model.lm_head.weight).shape),
                "norm": tuple(_local(layer.input_layernorm.weight).shape),
            }
            out = model(**sm.inputs(mesh))
            assert out.loss.shape == ()
        assert dist.get_world_size() == 8
    assert shapes == {
        "q": (512, 4096),
        "k": (128, 4096),
        "o": (4096, 512),
        "down": (4096, 1792),
        "embed": (16032, 4096),
        "head": (16032, 4096),
        "norm": (4096,),
    }


def test_expert_parallel_shards_per_rank() -> None:
    """DeepSeek-V3 under tp 8 with sequence parallelism: MLA's up-projections sharded by
    heads, 256 / 8 routed experts per rank, the router whole."""
    from torch.distributed.device_mesh import init_device_mesh

    sm = models.SimulatedModel("deepseek-v3", layers=2, seq=256, tp=8, sp=True, device="cpu")
    with _compat.fake_process_group(8):
        mesh = init_device_mesh("cpu", (8,))
        with _compat.fake_tensor_mode():
            model = sm.build(mesh)
            moe = model.model.layers[1].mlp
            attn = model.model.layers[1].self_attn
            assert tuple(moe.experts.gate_up_proj.shape) == (32, 2 * 2048, 7168)
            assert tuple(moe.experts.down_proj.shape) == (32, 7168, 2048)
            assert tuple(moe.gate.weight.shape) == (256, 7168)
            assert tuple(_local(attn.q_b_proj.weight).shape) == (16 * 192, 1536)
            assert tuple(_local(attn.kv_b_proj.weight).shape) == (16 * 256, 512)
            out = model(**sm.inputs(mesh))
            assert out.loss.shape == ()
