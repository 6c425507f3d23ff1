"""Tests of ``recomp.plan.simulate`` (the planner's profile on fake tensors) and of its
cost model (``recomp.plan.cost``).

Checked three ways:

* against ``profile()`` on models small enough to run here: every byte count of every
  option equal (device "cpu" in both, so that the kernels save the same tensors);
  the 2-rank tensor- and sequence-parallel case is in
  ``tests/distributed/test_simulate_parallel.py``;
* against Table 2 of Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models" (MLSys 2023), at GPT-3 175B size on fake CUDA tensors;
* against Megatron-LM's activation formula (``megatron/training/theoretical_memory_usage.py``),
  where it applies, with the difference explained.
"""

from __future__ import annotations

import functools
import json

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import paper_gpt  # noqa: E402
from profile_counts import profile_counts  # noqa: E402
from recomp.plan import make_plan, plan_table, profile, profile_table, save_plan, simulate  # noqa: E402
from recomp.plan.cost import ACCELERATORS, Hardware, OpCostModel, resolve_hardware  # noqa: E402
from recomp.plan.planner import Profile  # noqa: E402

# GPT-3 175B (the paper's Table 3 row): sequence, hidden, heads; micro-batch 1, bf16.
S, H, A, B, T = 2048, 12288, 96, 1, 8
SBH = S * B * H
ATTENTION = 5 * A * S / H  # the paper's 5as/h (softmax, its dropout mask, dropout output)




# --------------------------------------------------------------------------- against profile()


SMALL = {"layers": 2, "hidden": 64, "heads": 4}


def test_simulated_counts_equal_the_measured_profile_on_cpu():
    torch.manual_seed(0)
    model = paper_gpt.build(**SMALL)
    x = paper_gpt.inputs(seq=32, batch=2, hidden=SMALL["hidden"])
    measured = profile(model, x, steps=1, clock="cpu")
    simulated = simulate(
        functools.partial(paper_gpt.build, **SMALL),
        functools.partial(paper_gpt.inputs, seq=32, batch=2, hidden=SMALL["hidden"]),
        device="cpu",
    )
    assert profile_counts(simulated) == profile_counts(measured)
    assert simulated.bookkeeping_bytes == torch.get_rng_state().nbytes > 0
    # Every option differs from the others somewhere: the comparison is not vacuous.
    options = simulated.layers[1].options
    assert len({o.kept_bytes for o in options}) > 10


def test_simulated_counts_equal_the_measured_profile_of_a_hugging_face_model():
    """With eager attention. Under SDPA, transformers builds an explicit causal mask when
    it sees fake tensors (``masking_utils``: it cannot look at their values) where a real
    run passes ``is_causal``: the simulation then counts the masked kernel's saves
    (docs/tools/simulate.md, limits)."""
    transformers = pytest.importorskip("transformers")

    def build(mesh):
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, attn_implementation="eager",
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    def inputs(mesh):
        ids = torch.arange(2 * 16).remainder(100).view(2, 16)
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    torch.manual_seed(0)
    measured = profile(build(None), inputs(None), steps=1, clock="cpu")
    simulated = simulate(build, inputs, device="cpu")
    assert profile_counts(simulated) == profile_counts(measured)


# --------------------------------------------------------------------------- the paper's Table 2


def _gpt3(parallel="tp", world_size=1, **kwargs):
    return simulate(
        functools.partial(paper_gpt.build, layers=2, hidden=H, heads=A, parallel=parallel),
        functools.partial(paper_gpt.inputs, seq=S, batch=B, hidden=H, parallel=parallel),
        world_size=world_size,
        dtype=torch.bfloat16,
        **kwargs,
    )


def _close(got: float, expected: float) -> None:
    assert abs(got - expected) <= 0.005 * expected, (got / SBH, expected / SBH)


def _selective_per_layer(parallel: str, world_size: int) -> int:
    """Megatron's selective recompute: a checkpoint around the core attention only. As a
    plan: the core attention modules are the planned layers, checkpointed ("full");
    everything else is kept. One transformer layer's share: two layers minus one (the
    first layer's input is the model's input, not an activation)."""

    def total(layers: int) -> int:
        prof = simulate(
            functools.partial(paper_gpt.build, layers=layers, hidden=H, heads=A, parallel=parallel),
            functools.partial(paper_gpt.inputs, seq=S, batch=B, hidden=H, parallel=parallel),
            world_size=world_size,
            dtype=torch.bfloat16,
            layers=lambda m: isinstance(m, paper_gpt.CoreAttention),
        )
        return prof.uniform_bytes("full")

    return total(2) - total(1)


def test_table2_no_parallelism():
    prof = _gpt3()
    layer = prof.layers[1]  # its input is the first layer's output: an activation
    _close(layer.no_checkpoint_bytes, SBH * (34 + ATTENTION))
    _close(layer.option("full").kept_bytes, 2 * SBH)  # full recompute keeps the input
    _close(_selective_per_layer("tp", 1), SBH * 34)
    # recomp's own way to recompute only the core attention, a checkpoint of the whole
    # layer with every other part excluded, keeps 2sbh less than the paper's selective
    # recompute: the output projection's input (the core attention's output) is not
    # kept, as the replay, which recomputes the core attention anyway, gives it again.
    excluded = "exclude:" + "+".join(["ln1", "attn.q", "attn.k", "attn.v", "attn.proj", "ln2", "mlp"])
    prof = _gpt3(exclude=lambda m: isinstance(m, (nn.LayerNorm, nn.Linear, paper_gpt.Projection, paper_gpt.MLP)))
    _close(prof.layers[1].option(excluded).kept_bytes, SBH * 32)


def test_table2_tensor_parallel():
    prof = _gpt3("tp", T, exclude_collectives=False)
    layer = prof.layers[1]
    _close(layer.no_checkpoint_bytes, SBH * (10 + 24 / T + ATTENTION / T))
    _close(layer.option("full").kept_bytes, 2 * SBH)
    _close(_selective_per_layer("tp", T), SBH * (10 + 24 / T))


def test_table2_tensor_and_sequence_parallel_as_dtensor_does_it():
    # The paper's row is sbh(34/t + 5as/(ht)): Megatron keeps the LayerNorms' outputs
    # as sequence shards (2sbh/t each) and all-gathers them again in backward for the
    # weight gradients of the first linears of the attention and the MLP. DTensor's
    # ColwiseParallel saves the all-gathered input itself (2sbh each): 4sbh instead of
    # 4sbh/t, so sbh(4 + 30/t + 5as/(ht)).
    prof = _gpt3("sp", T, exclude_collectives=False)
    layer = prof.layers[1]
    _close(layer.no_checkpoint_bytes, SBH * (4 + 30 / T + ATTENTION / T))
    _close(layer.option("full").kept_bytes, 2 * SBH / T)  # the sequence shard of the input
    _close(_selective_per_layer("sp", T), SBH * (4 + 30 / T))


def test_full_checkpoint_keeps_the_collective_results_it_would_replay():
    # exclude_collectives=True (the default): the checkpoint also keeps what the
    # all-gathers (2sbh each) and the reduce-scatters (2sbh/t each; the MLP's too, as
    # the dropout after it saves its mask) returned, besides its input (2sbh/t).
    prof = _gpt3("sp", T)
    full = prof.layers[1].option("full")
    _close(full.collective_bytes, SBH * (4 + 4 / T))
    _close(full.kept_bytes, SBH * (4 + 6 / T))


# --------------------------------------------------------------------------- Megatron's formula


def test_megatron_formula_where_it_applies():
    """Megatron-LM's ``compute_activation_memory`` (sequence parallelism with selective
    recompute) counts sbh(18 + 4f/h)/t per layer (f: the MLP width), the paper's
    34sbh/t at f = 4h; its ``compute_activation_memory_without_sp`` counts sbh(10 + 24/t)
    per layer and multiplies the whole by 1.05 for "temporaries".

    * without SP: recomp simulates exactly sbh(10 + 24/t); Megatron's figure is 5 %
      above it, its overhead factor;
    * with SP: Megatron's counts Megatron's own layer, which keeps the LayerNorm outputs
      sharded; DTensor's keeps them all-gathered, 4sbh(1 - 1/t) more (see the Table 2
      SP test). The terms in the MLP width agree: checked at f = 4h and f = 2h.
    """
    megatron_without_sp = SBH * (10 + 24 / T) * 1.05
    simulated = _selective_per_layer("tp", T)
    assert megatron_without_sp / simulated == pytest.approx(1.05, rel=1e-3)

    for ffn in (4 * H, 2 * H):

        def total(layers: int, ffn: int = ffn) -> int:
            prof = simulate(
                functools.partial(paper_gpt.build, layers=layers, hidden=H, heads=A, ffn=ffn, parallel="sp"),
                functools.partial(paper_gpt.inputs, seq=S, batch=B, hidden=H, parallel="sp"),
                world_size=T,
                dtype=torch.bfloat16,
                layers=lambda m: isinstance(m, paper_gpt.CoreAttention),
            )
            return prof.uniform_bytes("full")

        megatron = SBH * (18 + 4 * ffn / H) / T
        difference = total(2) - total(1) - megatron
        assert difference == pytest.approx(4 * SBH * (1 - 1 / T), rel=1e-3), ffn


# --------------------------------------------------------------------------- the plan on it


def test_a_simulated_profile_plans_saves_and_prints_as_a_measured_one(tmp_path):
    prof = _gpt3("sp", T, hardware="H100 SXM")
    again = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again == prof
    budget = (prof.uniform_bytes("full") + prof.uniform_bytes("none")) // 2
    plan = make_plan(prof, f"{budget}B")
    assert plan.predicted["activation_bytes"] <= budget
    save_plan(plan, tmp_path / "plan.json")
    table = plan_table(plan)
    assert "times: roofline of H100 SXM" in table and "datasheet" in table
    assert "times: roofline" in profile_table(prof)
    assert plan.predicted["step_ms"] > plan.predicted["baseline_step_ms"] > 0
    assert any("fake cuda tensors, rank 0 of a fake process group of 8" in n for n in prof.notes)


def test_without_hardware_every_time_is_zero_and_the_plan_says_so():
    prof = _gpt3()
    assert prof.baseline_step_s == 0
    assert all(o.replay_s == 0 for layer in prof.layers for o in layer.options)
    assert "no hardware given" in prof.timing
    plan = make_plan(prof, "50%")
    assert "times: no hardware given" in plan_table(plan)
    # Ties on time are decided by replay FLOPs: the plan that fits with the fewest.
    assert plan.predicted["replay_flops"] <= min(
        o.replay_flops for o in prof.layers[1].options if o.kept_bytes <= plan.budget_bytes
    ) * len(prof.layers)


# --------------------------------------------------------------------------- the cost model


def _fake(*shape, dtype=torch.bfloat16):
    from recomp.torch import _compat

    with _compat.fake_tensor_mode(), torch.device("cuda"):
        return torch.empty(*shape, dtype=dtype)


def test_roofline_of_a_matrix_product_and_of_an_elementwise_op():
    h100 = OpCostModel(ACCELERATORS["H100 SXM"])
    a, b = _fake(4096, 4096), _fake(4096, 4096)
    flops = 2 * 4096**3
    mm = h100.op_seconds(torch.ops.aten.mm.default, (a, b), {}, _fake(4096, 4096), flops)
    assert mm == pytest.approx(flops / 989.5e12)  # compute-bound
    add = h100.op_seconds(torch.ops.aten.add.Tensor, (a, b), {}, _fake(4096, 4096), 0)
    assert add == pytest.approx(3 * 4096 * 4096 * 2 / 3.35e12)  # memory-bound
    view = h100.op_seconds(torch.ops.aten.view.default, (a, [-1]), {}, a.view(-1), 0)
    assert view == 0
    alias = h100.op_seconds(torch.ops.aten._unsafe_view.default, (a, [-1]), {}, a.view(-1), 0)
    assert alias == 0
    device = h100.op_seconds(torch.ops.prim.device.default, (a,), {}, a.device, 0)
    assert device == 0
    fp32 = _fake(4096, 4096, dtype=torch.float32)
    product = _fake(4096, 4096, dtype=torch.float32)
    assert h100.op_seconds(torch.ops.aten.mm.default, (fp32, fp32), {}, product, flops) == (
        pytest.approx(flops / 67e12)
    )


def test_collectives_cost_their_bytes_over_the_link():
    h200 = OpCostModel(ACCELERATORS["H200"])
    shard, gathered = _fake(1024, 1024), _fake(8 * 1024, 1024)
    op = torch.ops._c10d_functional.all_gather_into_tensor.default
    seconds = h200.op_seconds(op, (shard, 8, "0"), {}, gathered, 0)
    assert seconds == pytest.approx(7 / 8 * gathered.numel() * 2 / 450e9)
    op = torch.ops._c10d_functional.reduce_scatter_tensor.default
    seconds = h200.op_seconds(op, (gathered, "sum", 8, "0"), {}, shard, 0)
    assert seconds == pytest.approx(7 / 8 * gathered.numel() * 2 / 450e9)
    wait = torch.ops._c10d_functional.wait_tensor.default
    assert h200.op_seconds(wait, (shard,), {}, shard, 0) == 0


def test_hardware_tables_named_given_and_refused(tmp_path):
    assert resolve_hardware("h100 sxm") is ACCELERATORS["H100 SXM"]
    assert set(ACCELERATORS) == {"H100 SXM", "H200", "B200", "A100 80GB", "MI300X", "Ascend 910B"}
    for spec in ACCELERATORS.values():
        assert spec.source and spec.peak("bfloat16") >= spec.peak("float32")
    table = {"name": "X1", "peak_flops": {"bfloat16": 1e15, "float32": 1e14},
             "memory_bandwidth": 2e12, "link_bandwidth": 1e11}  # fmt: skip
    path = tmp_path / "x1.json"
    path.write_text(json.dumps(table))
    assert resolve_hardware(table) == resolve_hardware(str(path)) == Hardware.from_dict(table)
    assert "X1" in resolve_hardware(path).describe()
    with pytest.raises(ValueError, match="unknown hardware"):
        resolve_hardware("H300")
    with pytest.raises(ValueError, match="missing keys"):
        resolve_hardware({"name": "X"})
    with pytest.raises(ValueError, match="positive"):
        resolve_hardware({**table, "memory_bandwidth": 0})


# --------------------------------------------------------------------------- no state left


def _state():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return (
        dist.is_initialized(),
        torch.get_default_dtype(),
        len(_get_current_dispatch_mode_stack()),
        torch.get_rng_state().clone(),
    )


def _same_state(before, after):
    assert before[:3] == after[:3]
    assert torch.equal(before[3], after[3])


def test_no_process_group_mode_or_default_is_left_behind_errors_included():
    real = nn.Linear(2, 2)
    before = _state()
    _gpt3("sp", 2)
    _same_state(before, _state())

    def broken(mesh):
        raise KeyError("in build")

    with pytest.raises(KeyError, match="in build"):
        simulate(broken, lambda mesh: None, world_size=4, dtype=torch.float16)
    _same_state(before, _state())
    with pytest.raises(ValueError, match="real memory"):
        simulate(lambda mesh: real, lambda mesh: torch.ones(2))
    _same_state(before, _state())


def test_refused_arguments_and_an_existing_process_group():
    build = functools.partial(paper_gpt.build, **SMALL)
    for kwargs, error in [
        ({"world_size": 0}, ValueError),
        ({"world_size": 2.0}, ValueError),
        ({"dtype": torch.int64}, ValueError),
        ({"device": "meta"}, ValueError),
        ({"device": "no such device"}, ValueError),
        ({"hardware": "H300"}, ValueError),
        ({"exclude_collectives": "yes"}, ValueError),
        ({"loss_fn": 3}, TypeError),
    ]:
        with pytest.raises(error):
            simulate(build, paper_gpt.inputs, **kwargs)
    with pytest.raises(TypeError, match="build"):
        simulate(None, paper_gpt.inputs)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already initialised"):
            simulate(build, paper_gpt.inputs, world_size=2, device="cpu")
    finally:
        dist.destroy_process_group()


def test_attention_is_counted_as_the_gpus_fused_kernel_saves_it():
    """SDPA on fake CUDA tensors: the flash kernel's saves (output, log-sum-exp), not the
    attention matrix that PyTorch's math fallback would save on a machine without a GPU."""
    import torch.nn.functional as F

    seq, heads, dim = 1024, 8, 64

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(heads * dim, 3 * heads * dim)

        def forward(self, x):
            q, k, v = self.qkv(x).view(1, seq, 3, heads, dim).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.transpose(1, 2).reshape(1, seq, heads * dim)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    prof = simulate(lambda mesh: Model(), lambda mesh: torch.randn(1, seq, heads * dim), dtype=torch.bfloat16)
    hidden = seq * heads * dim * 2  # one (1, seq, heads * dim) bf16 tensor
    lse = heads * seq * 4  # fp32 log-sum-exp per head and position
    # input of qkv + q, k, v (one storage) + output + log-sum-exp (+ the kernel's RNG seed
    # and offset, 8 bytes each)
    expected = hidden + 3 * hidden + hidden + lse
    assert 0 <= prof.layers[1].no_checkpoint_bytes - expected <= 64


def test_an_all_reduce_costs_by_the_size_of_its_own_group():
    from torch.distributed.device_mesh import init_device_mesh

    from recomp.torch import _compat

    h100 = OpCostModel(ACCELERATORS["H100 SXM"])
    t = _fake(1024, 1024)
    op = torch.ops._c10d_functional.all_reduce.default
    with _compat.fake_process_group(8):
        tp = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")).get_group("tp")
        seconds = h100.op_seconds(op, (t, "sum", tp.group_name), {}, _fake(1024, 1024), 0)
    assert seconds == pytest.approx(2 * 3 / 4 * t.numel() * 2 / 450e9)


def test_stock_sdpa_builds_no_mask_on_fake_tensors_as_on_the_gpu():
    """transformers' stock SDPA path, which on a GPU passes ``is_causal`` and no mask
    for unpadded sequences, does the same under the simulation's fake tensors: it keeps
    what an attention function that never builds a mask keeps (no ``seq x seq`` mask
    and no masked kernel's bias in any layer)."""
    transformers = pytest.importorskip("transformers")
    if torch.cuda.is_available():
        pytest.skip("with a GPU, PyTorch chooses the kernel from the device itself")
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def causal_sdpa(module, query, key, value, attention_mask, **kwargs):
        kwargs["is_causal"] = True
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)

    AttentionInterface.register("recomp_test_causal_sdpa", causal_sdpa)
    seq, hidden = 512, 256

    def profile_with(implementation):
        def build(mesh):
            config = transformers.LlamaConfig(
                hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                attn_implementation=implementation,
            )  # fmt: skip
            return transformers.LlamaForCausalLM(config)

        def inputs(mesh):
            ids = torch.zeros(1, seq, dtype=torch.long)
            return {"input_ids": ids, "labels": ids, "use_cache": False}

        return simulate(build, inputs, dtype=torch.bfloat16)

    stock, causal = profile_with("sdpa"), profile_with("recomp_test_causal_sdpa")
    for a, b in zip(stock.layers, causal.layers):
        assert a.checkpoint_input_bytes == b.checkpoint_input_bytes
        assert a.no_checkpoint_bytes == b.no_checkpoint_bytes
    assert stock.shared_bytes == causal.shared_bytes
    # The masking code is left as it was.
    from transformers import masking_utils

    assert masking_utils._ignore_causal_mask_sdpa.__module__ == "transformers.masking_utils"


def test_simulation_refuses_old_pytorch() -> None:
    """Before PyTorch 2.13 fused attention on fake CUDA tensors aborts the process:
    simulate refuses up front, naming the version and the alternative."""
    from recomp.torch._compat import simulation_unsupported

    if simulation_unsupported() is None:
        pytest.skip("this PyTorch runs the simulation")
    with pytest.raises(RuntimeError, match=r"needs PyTorch 2\.13 or newer.*recomp\.plan\.profile"):
        simulate(lambda mesh: torch.nn.Linear(2, 2), lambda mesh: torch.zeros(1, 2))
