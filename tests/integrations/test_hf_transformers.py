"""recomp on real Hugging Face transformers models built from tiny configs (CPU, no weights).

Gradients are compared with ``torch.equal`` against the same model without recomp,
with dropout on, parameter by parameter in module order.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import paths

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402
from transformers.models.qwen2_moe import modeling_qwen2_moe  # noqa: E402

import recomp  # noqa: E402
from recomp.torch import ExcludeWrapper, apply_activation_checkpointing  # noqa: E402
from recomp.torch import unwrap as rt_unwrap  # noqa: E402

ROOT = paths.ROOT
SEQ = 8
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
)


def llama(attention_dropout: float = 0.1) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL, attention_dropout=attention_dropout)).train()


def mixtral(router_jitter_noise: float = 0.1) -> MixtralForCausalLM:
    torch.manual_seed(0)
    config = MixtralConfig(
        **SMALL,
        num_local_experts=4,
        num_experts_per_tok=2,
        attention_dropout=0.1,
        router_jitter_noise=router_jitter_noise,
    )
    return MixtralForCausalLM(config).train()


def qwen2_moe() -> Qwen2MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        **SMALL,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        attention_dropout=0.1,
    )
    return Qwen2MoeForCausalLM(config).train()


MODELS = {
    "llama-attention": (
        llama,
        modeling_llama.LlamaDecoderLayer,
        (modeling_llama.LlamaAttention,),
    ),
    "llama-no-exclusion": (llama, modeling_llama.LlamaDecoderLayer, ()),
    "mixtral-attention-router": (
        mixtral,
        modeling_mixtral.MixtralDecoderLayer,
        (modeling_mixtral.MixtralAttention, modeling_mixtral.MixtralTopKRouter),
    ),
    "mixtral-moe-block": (
        lambda: mixtral(router_jitter_noise=0.0),
        modeling_mixtral.MixtralDecoderLayer,
        (modeling_mixtral.MixtralSparseMoeBlock,),
    ),
    "mixtral-moe-block-jitter": (
        mixtral,
        modeling_mixtral.MixtralDecoderLayer,
        (modeling_mixtral.MixtralSparseMoeBlock,),
    ),
    "qwen2moe-moe-block": (
        qwen2_moe,
        modeling_qwen2_moe.Qwen2MoeDecoderLayer,
        (modeling_qwen2_moe.Qwen2MoeSparseMoeBlock,),
    ),
    "qwen2moe-attention-router": (
        qwen2_moe,
        modeling_qwen2_moe.Qwen2MoeDecoderLayer,
        (modeling_qwen2_moe.Qwen2MoeAttention, modeling_qwen2_moe.Qwen2MoeTopKRouter),
    ),
}


def with_recomp(model: torch.nn.Module, layer: type, excluded: tuple[type, ...]) -> torch.nn.Module:
    return apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, layer),
        exclude_fn=(lambda m: isinstance(m, excluded)) if excluded else None,
    )


def tokens(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(
        0, SMALL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1)
    )


def train_step(model: torch.nn.Module, ids: torch.Tensor, **kwargs: object) -> object:
    torch.manual_seed(123)
    out = model(ids, labels=ids, **kwargs)
    out.loss.backward()
    return out


def grads(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [p.grad for p in model.parameters()]


def assert_same_grads(reference: torch.nn.Module, model: torch.nn.Module) -> None:
    expected, got = grads(reference), grads(model)
    assert len(expected) == len(got)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert (e is None) == (g is None), f"parameter {i}"
        assert e is None or torch.equal(e, g), f"parameter {i}: max diff {(e - g).abs().max()}"


def regions(model: torch.nn.Module) -> list[ExcludeWrapper]:
    return [m for m in model.modules() if isinstance(m, ExcludeWrapper)]


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("case", list(MODELS))
def test_gradients_equal_unwrapped_model(case: str) -> None:
    factory, layer, excluded = MODELS[case]
    reference = factory()
    model = with_recomp(copy.deepcopy(reference), layer, excluded)
    ids = tokens()
    expected = train_step(reference, ids, use_cache=False)
    got = train_step(model, ids, use_cache=False)
    assert torch.equal(expected.loss, got.loss)
    assert_same_grads(reference, model)
    wrapped = regions(model)
    n_layers = SMALL["num_hidden_layers"]
    assert len(wrapped) == n_layers * len(excluded)
    # MixtralSparseMoeBlock's jitter (hidden_states *= noise) changes its input in place,
    # so its saved input is kept, not deferred, and needs no replay: with early stop the
    # replay ends before reaching the block, the layer's last region.
    skips = 0 if case == "mixtral-moe-block-jitter" else 1
    for region in wrapped:
        assert (region.region_runs, region.region_skips) == (1, skips), region.region.name


def test_debug_mode_leaves_gradients_of_a_real_model_unchanged() -> None:
    reference = llama()
    layer, excluded = MODELS["llama-attention"][1:]
    model = apply_activation_checkpointing(
        copy.deepcopy(reference),
        checkpoint_fn=lambda m: isinstance(m, layer),
        exclude_fn=lambda m: isinstance(m, excluded),
        debug=True,
    )
    ids = tokens()
    train_step(reference, ids, use_cache=False)
    train_step(model, ids, use_cache=False)
    assert_same_grads(reference, model)
    assert all((r.region_runs, r.region_skips) == (1, 1) for r in regions(model))


def test_names_and_order_of_parameters_unchanged() -> None:
    reference = llama()
    model = with_recomp(copy.deepcopy(reference), *MODELS["llama-attention"][1:])
    names = [n.replace("_checkpoint_wrapped_module.", "") for n, _ in model.named_parameters()]
    assert names == [n for n, _ in reference.named_parameters()]


# --------------------------------------------------------------------------- debug=True


def _two_regions() -> tuple[torch.nn.Module, ExcludeWrapper, ExcludeWrapper]:
    from recomp.torch import checkpoint_exclude_wrapper

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    proj = checkpoint_exclude_wrapper(torch.nn.Linear(8, 8), name="proj")
    gate = checkpoint_exclude_wrapper(torch.nn.Linear(8, 8), name="gate")
    return lin, proj, gate


def test_debug_flag_and_global_switch_accepted_with_same_gradients() -> None:
    from torch.utils.checkpoint import set_checkpoint_debug_enabled

    from recomp.torch import checkpoint

    lin, proj, _ = _two_regions()
    x = torch.randn(4, 8, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(proj(lin(t).tanh()), 0.3).sin()

    results = []
    for mode in ("plain", "flag", "global"):
        x.grad = None
        lin.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        if mode == "global":
            with set_checkpoint_debug_enabled(True):
                checkpoint(fn, x).sum().backward()
        else:
            checkpoint(fn, x, debug=mode == "flag").sum().backward()
        results.append((x.grad.clone(), lin.weight.grad.clone()))
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], got))
    assert (proj.region_runs, proj.region_skips) == (3, 3)


def test_global_debug_switch_stays_on_inside_the_checkpointed_function() -> None:
    import torch.utils.checkpoint as tuc

    from recomp.torch import checkpoint

    seen = []

    def no_contexts() -> tuple[object, object]:
        return contextlib.nullcontext(), contextlib.nullcontext()

    def fn(t: torch.Tensor) -> torch.Tensor:
        # PyTorch refuses a context_fn while its debug switch is on: shows the switch is on here.
        with pytest.raises(ValueError, match="debug=True is incompatible"):
            tuc.checkpoint(torch.sin, t, use_reentrant=False, context_fn=no_contexts)
        seen.append(True)
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    with tuc.set_checkpoint_debug_enabled(True):
        checkpoint(fn, x).sum().backward()
    assert seen == [True, True]  # the forward and the replay


def test_debug_report_lists_ops_with_regions_run_and_skipped() -> None:
    from torch.utils.checkpoint import CheckpointError

    from recomp.torch import checkpoint

    lin, proj, _ = _two_regions()
    x = torch.randn(4, 8, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        h = proj(lin(t).tanh())
        return (h[:2] if recomp.is_recomputing() else h).sin()

    with pytest.raises(CheckpointError) as info:
        checkpoint(fn, x).sum().backward()
    assert "Ops in the forward" not in str(info.value)  # the log is only there with debug
    with pytest.raises(CheckpointError) as info:
        checkpoint(fn, x, debug=True).sum().backward()
    report = str(info.value)
    assert "have different metadata" in report
    forward, replay = report.split("Ops in the replay")
    assert "Ops in the forward" in forward
    assert "excluded region 'proj' runs" in forward and "skipped" not in forward
    assert "excluded region 'proj' skipped: cached output returned" in replay
    assert "aten.tanh.default(float32[4, 8]) -> float32[4, 8]" in forward
    assert "test_hf_transformers.py" in forward  # each op names the line of user code that ran it
    assert "First difference: forward op" in replay
    assert "is aten.sin.default, replay op" in replay and "is aten.slice.Tensor" in replay


def test_debug_report_on_region_order_mismatch() -> None:
    from recomp.torch import checkpoint

    lin, proj, gate = _two_regions()
    x = torch.randn(4, 8, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        h = lin(t)
        first, second = (gate, proj) if recomp.is_recomputing() else (proj, gate)
        return second(first(h)).sin()

    with pytest.raises(recomp.ReplayMismatchError) as info:
        checkpoint(fn, x, debug=True).sum().backward()
    report = str(info.value)
    assert "replay called excluded region 'gate'" in report
    assert "where its forward called 'proj'" in report
    assert "excluded region 'proj' runs" in report and "Ops in the replay" in report


def test_debug_keeps_nothing_alive_and_works_without_grad() -> None:
    import gc
    import weakref

    import torch.utils.checkpoint as tuc

    from recomp.torch import checkpoint

    lin, proj, _ = _two_regions()
    x = torch.randn(4, 8, requires_grad=True)
    outputs: list[weakref.ref[torch.Tensor]] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        h = proj(lin(t).tanh())
        outputs.append(weakref.ref(h))
        return h.sin()

    out = checkpoint(fn, x, debug=True)
    del out
    gc.collect()
    assert outputs[0]() is None  # the region's output died with the graph
    with torch.no_grad(), tuc.set_checkpoint_debug_enabled(True):
        assert checkpoint(fn, x).shape == (4, 8)
        assert checkpoint(fn, x, debug=True).shape == (4, 8)


def test_debug_composes_with_selective_checkpointing() -> None:
    from functools import partial

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from recomp.torch import checkpoint

    lin, proj, _ = _two_regions()
    x = torch.randn(4, 8, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return proj(lin(t).relu() @ lin.weight).tanh()

    sac = partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    checkpoint(fn, x, context_fn=sac).sum().backward()
    expected = (x.grad.clone(), lin.weight.grad.clone())
    x.grad = None
    lin.zero_grad(set_to_none=True)
    checkpoint(fn, x, context_fn=sac, debug=True).sum().backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(lin.weight.grad, expected[1])
    assert (proj.region_runs, proj.region_skips) == (2, 2)


def test_debug_with_two_backwards_through_one_graph() -> None:
    from recomp.torch import checkpoint

    lin, proj, _ = _two_regions()
    x = torch.randn(4, 8, requires_grad=True)
    out = checkpoint(lambda t: proj(lin(t).tanh()).sin(), x, debug=True).sum()
    out.backward(retain_graph=True)
    first = x.grad.clone()
    out.backward()
    assert torch.equal(x.grad, 2 * first)
    assert (proj.region_runs, proj.region_skips) == (1, 2)


@pytest.mark.parametrize("check", ["default", "none"])
def test_determinism_check_behaves_as_in_pytorch(check: str) -> None:
    """'default' compares shapes, dtypes and devices of what the replay saves; 'none' does not.

    The replay multiplies by a weight of another shape (broadcast): PyTorch and
    recomp both raise with 'default', and both run, to the same result, with 'none'.
    """
    import torch.utils.checkpoint as tuc

    from recomp.torch import checkpoint

    def run(impl: str) -> torch.Tensor | Exception:
        calls = []
        x = torch.randn(4, 3, requires_grad=True)

        def fn(t: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            w = torch.full((3,), 2.0) if len(calls) == 1 else torch.full((1,), 3.0)
            return (t.sin() * w).sum()

        try:
            if impl == "torch":
                out = tuc.checkpoint(fn, x, use_reentrant=False, determinism_check=check)
            else:
                out = checkpoint(fn, x, determinism_check=check)
            out.backward()
        except tuc.CheckpointError as exc:
            return exc
        assert x.grad is not None
        return x.grad

    torch.manual_seed(0)
    expected = run("torch")
    torch.manual_seed(0)
    got = run("recomp")
    if check == "default":
        assert isinstance(expected, Exception) and isinstance(got, Exception)
        assert "different metadata" in str(got)
    else:
        assert isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor)
        assert torch.equal(got, expected)


def test_bad_determinism_check_is_refused() -> None:
    from recomp.torch import checkpoint

    with pytest.raises(ValueError, match="determinism_check"):
        checkpoint(torch.sin, torch.randn(2, requires_grad=True), determinism_check="shapes")


# --------------------------------------------------------------------------- HF checkpointing


@pytest.mark.parametrize(
    "switch", ["activation_checkpointing_enable", "gradient_checkpointing_enable"]
)
def test_hf_checkpointing_on_top_is_one_clear_error(switch: str) -> None:
    reference = llama()
    model = with_recomp(copy.deepcopy(reference), *MODELS["llama-attention"][1:])
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", FutureWarning
        )  # gradient_checkpointing_enable is deprecated
        getattr(model, switch)()
    ids = tokens()
    with pytest.raises(recomp.DoubleCheckpointError) as info:
        train_step(model, ids, use_cache=False)
    message = str(info.value)
    assert "recomp" in message and "activation_checkpointing_enable()" in message
    assert "gradient_checkpointing" in message and "activation_checkpointing_disable()" in message
    # The fix named in the message works, and the failed step left nothing behind.
    model.zero_grad(set_to_none=True)
    model.activation_checkpointing_disable()
    train_step(reference, ids, use_cache=False)
    train_step(model, ids, use_cache=False)
    assert_same_grads(reference, model)
    # The failed step stopped before any layer ran: each region ran in the good step only.
    assert all((r.region_runs, r.region_skips) == (1, 1) for r in regions(model))


def test_hf_checkpointing_detected_for_a_layer_its_forward_or_a_partial() -> None:
    import functools

    from recomp.torch import checkpoint

    model = llama()
    model.activation_checkpointing_enable()
    layer = model.model.layers[0]
    hidden = torch.randn(2, SEQ, SMALL["hidden_size"], requires_grad=True)
    rope = model.model.rotary_emb(hidden, torch.arange(SEQ)[None])
    for function in (layer, layer.forward, functools.partial(type(layer).forward, layer)):
        with pytest.raises(recomp.DoubleCheckpointError):
            checkpoint(function, hidden, position_embeddings=rope)
    model.activation_checkpointing_disable()
    checkpoint(layer, hidden, position_embeddings=rope).sum().backward()
    assert hidden.grad is not None


def test_hf_checkpointing_in_eval_or_without_grad_is_not_an_error() -> None:
    # HF's checkpointing on top of recomp's is refused only where it would checkpoint
    # twice: in training with gradients. Without gradients the model computes what the
    # unwrapped model computes and nothing is checkpointed; in eval mode (where HF does
    # not checkpoint) recomp's checkpoints alone run, and the gradients are exact.
    reference = llama()
    model = with_recomp(copy.deepcopy(reference), *MODELS["llama-attention"][1:])
    model.activation_checkpointing_enable()
    ids = tokens()
    with torch.no_grad():
        torch.manual_seed(5)  # attention dropout is on in training mode
        expected = reference(ids).logits
        torch.manual_seed(5)
        assert torch.equal(expected, model(ids).logits)
    assert all((r.region_runs, r.region_skips) == (1, 0) for r in regions(model))
    reference.eval()
    model.eval()
    expected, actual = reference(ids).logits, model(ids).logits
    assert torch.equal(expected, actual)
    expected.sum().backward()
    actual.sum().backward()
    assert_same_grads(reference, model)
    assert all((r.region_runs, r.region_skips) == (2, 1) for r in regions(model))


def test_trainer_with_gradient_checkpointing_raises_and_without_trains(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = tokens(1)[0]
            return {"input_ids": ids, "labels": ids}

    def trainer(checkpointing: bool) -> Trainer:
        model = with_recomp(llama(), *MODELS["llama-attention"][1:])
        args = TrainingArguments(
            output_dir=str(tmp_path),
            max_steps=1,
            per_device_train_batch_size=2,
            gradient_checkpointing=checkpointing,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
        )
        return Trainer(model=model, args=args, train_dataset=Tokens())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(recomp.DoubleCheckpointError, match="TrainingArguments"):
            trainer(True).train()
        fine = trainer(False)
        fine.train()
    runs = [(r.region_runs, r.region_skips) for r in regions(fine.model)]
    assert runs == [(1, 1)] * SMALL["num_hidden_layers"]


# --------------------------------------------------------------------------- KV cache


def _cache_length(out: object) -> int | None:
    cache = out.past_key_values  # type: ignore[attr-defined]
    return None if cache is None else int(cache.get_seq_length())


def test_use_cache_in_training_is_turned_off_for_recomputed_attention() -> None:
    reference = llama()
    model = with_recomp(copy.deepcopy(reference), *MODELS["llama-no-exclusion"][1:])
    ids = tokens()
    expected = train_step(reference, ids, use_cache=True)
    assert _cache_length(expected) == SEQ
    with pytest.warns(UserWarning, match=r"KV cache is turned off .*use_cache=False"):
        got = train_step(model, ids, use_cache=True)
    # Not written twice (that gave 2 * SEQ), nor an empty cache the layers were told not
    # to write (that gave 0): no cache, as HF's own checkpointing returns.
    assert _cache_length(got) is None
    assert_same_grads(reference, model)
    # The config's default (use_cache=True) too; a copy of the model behaves the same.
    with pytest.warns(UserWarning, match=r"KV cache is turned off .*LlamaForCausalLM"):
        assert _cache_length(copy.deepcopy(model)(ids)) is None
    # Unwrapped, the model writes its cache in training again.
    rt_unwrap(model)
    assert _cache_length(model(ids, use_cache=True)) == SEQ


def _encoder_cache_cases() -> dict[str, tuple]:
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        BertConfig,
        BertForMaskedLM,
        BertLMHeadModel,
        RobertaConfig,
        RobertaForMaskedLM,
    )
    from transformers.models.bart import modeling_bart
    from transformers.models.bert import modeling_bert
    from transformers.models.roberta import modeling_roberta

    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    small.update(intermediate_size=64, vocab_size=100)
    bart = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "vocab_size": 100}
    bart.update(encoder_attention_heads=4, decoder_attention_heads=4)
    bart.update(encoder_ffn_dim=64, decoder_ffn_dim=64)
    return {
        # (model, its checkpointed layers, whether their replay would write a cache)
        "bert": (lambda: BertForMaskedLM(BertConfig(**small)), (modeling_bert.BertLayer,), False),
        "roberta": (
            lambda: RobertaForMaskedLM(RobertaConfig(**small)),
            (modeling_roberta.RobertaLayer,),
            False,
        ),
        # BART's encoder layers only: its encoder is called without use_cache.
        "bart-encoder": (
            lambda: BartForConditionalGeneration(BartConfig(**bart)),
            (modeling_bart.BartEncoderLayer,),
            False,
        ),
        "bert-decoder": (
            lambda: BertLMHeadModel(BertConfig(**small, is_decoder=True)),
            (modeling_bert.BertLayer,),
            True,
        ),
    }


@pytest.mark.parametrize("name", ["bert", "roberta", "bart-encoder", "bert-decoder"])
def test_use_cache_of_encoders_is_left_alone_without_a_warning(name: str) -> None:
    """An encoder's attention carries a layer_idx but says is_decoder=False: its layers
    write no cache, so recomp turns nothing off and warns about nothing, with the
    config's use_cache=True; a decoder built from the same classes still gets the
    warning. Gradients equal the unwrapped model's either way."""
    make, layers, writes = _encoder_cache_cases()[name]
    torch.manual_seed(0)
    reference = make().train()
    model = with_recomp(copy.deepcopy(reference), layers, ())
    assert reference.config.use_cache
    ids = tokens()
    train_step(reference, ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(model, ids)
    cache_warnings = [w for w in caught if "KV cache is turned off" in str(w.message)]
    assert bool(cache_warnings) is writes, [str(w.message) for w in cache_warnings]
    assert_same_grads(reference, model)


def test_falcon_mlp_excluded_needs_its_output_copied() -> None:
    """Falcon's layer (parallel_attn, the default) adds the attention output into the
    MLP's output in place: with the MLP excluded and dropout after it, recomp refuses
    the write to its cached output, naming the option; with the MLP also in
    copy_output_fn the gradients equal the unwrapped model's."""
    from transformers import FalconConfig, FalconForCausalLM
    from transformers.models.falcon import modeling_falcon

    def falcon() -> torch.nn.Module:
        torch.manual_seed(0)
        config = FalconConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
            hidden_dropout=0.1, attention_dropout=0.1,
        )
        return FalconForCausalLM(config).train()

    layer, mlp = modeling_falcon.FalconDecoderLayer, modeling_falcon.FalconMLP
    ids = tokens()
    model = apply_activation_checkpointing(falcon(), checkpoint_fn=layer, exclude_fn=mlp)
    with pytest.raises(recomp.errors.CachedValueMutatedError, match="copy_output_fn"):
        train_step(model, ids, use_cache=False)
    reference = falcon()
    model = apply_activation_checkpointing(
        falcon(), checkpoint_fn=layer, exclude_fn=mlp, copy_output_fn=mlp
    )
    train_step(reference, ids, use_cache=False)
    train_step(model, ids, use_cache=False)
    assert_same_grads(reference, model)
    assert all(r.region_runs == r.region_skips == 1 for r in regions(model))


def test_use_cache_in_training_kept_when_attention_is_excluded() -> None:
    reference = llama()
    model = with_recomp(copy.deepcopy(reference), *MODELS["llama-attention"][1:])
    ids = tokens()
    expected = train_step(reference, ids, use_cache=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got = train_step(model, ids, use_cache=True)
    assert _cache_length(got) == SEQ
    for e, g in zip(expected.past_key_values.layers, got.past_key_values.layers):
        assert torch.equal(e.keys, g.keys) and torch.equal(e.values, g.values)
    assert_same_grads(reference, model)


def _prefix(model: torch.nn.Module, ids: torch.Tensor) -> object:
    torch.manual_seed(7)  # the same attention dropout for both models
    with torch.no_grad():
        return model(ids[:, : SEQ // 2], use_cache=True).past_key_values


def test_prefix_cache_in_training_with_excluded_attention_matches_unwrapped() -> None:
    reference = llama()
    model = with_recomp(copy.deepcopy(reference), *MODELS["llama-attention"][1:])
    ids = tokens()
    expected = train_step(
        reference, ids[:, SEQ // 2 :], cache=_prefix(reference, ids), use_cache=True
    )
    got = train_step(model, ids[:, SEQ // 2 :], cache=_prefix(model, ids), use_cache=True)
    assert torch.equal(expected.loss, got.loss)
    assert _cache_length(got) == SEQ
    assert_same_grads(reference, model)


def test_prefix_cache_with_recomputed_attention_is_a_clear_error() -> None:
    model = with_recomp(llama(), *MODELS["llama-no-exclusion"][1:])
    ids = tokens()
    prefix = _prefix(model, ids)
    with pytest.raises(recomp.RecompError, match=r"already holds entries .*Exclude the modules"):
        train_step(model, ids[:, SEQ // 2 :], cache=prefix, use_cache=True)
    assert prefix.get_seq_length() == SEQ // 2  # untouched


def test_cache_untouched_without_gradients() -> None:
    model = with_recomp(llama(), *MODELS["llama-no-exclusion"][1:])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with torch.no_grad():
            out = model(tokens(), use_cache=True)
    assert _cache_length(out) == SEQ


# --------------------------------------------------------------------------- PEFT


@pytest.mark.parametrize("order", ["peft_then_recomp", "recomp_then_peft"])
def test_lora_gradients_equal_in_either_order(order: str) -> None:
    peft = pytest.importorskip("peft")

    def lora(model: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(3)  # LoRA's A matrices are drawn at random
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
        return peft.get_peft_model(model, config)

    base = llama()
    reference = lora(copy.deepcopy(base))
    layer, excluded = MODELS["llama-attention"][1:]
    if order == "peft_then_recomp":
        model = lora(copy.deepcopy(base))
        with_recomp(model, layer, excluded)
    else:
        model = lora(with_recomp(copy.deepcopy(base), layer, excluded))
    ids = tokens()
    train_step(reference, ids, use_cache=False)
    train_step(model, ids, use_cache=False)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert len(trained) == 4 * SMALL["num_hidden_layers"]
    assert_same_grads(reference, model)
    assert all((r.region_runs, r.region_skips) == (1, 1) for r in regions(model))


def test_lora_layers_are_read_without_a_walk_from_the_third_step() -> None:
    """PEFT's LoRA leaves the base weights frozen and every projection without bias: the
    checkpointed layers are walked at their first two calls (the first learns that no
    forward updates the frozen state) and read from a layout after, exact at every step."""
    peft = pytest.importorskip("peft")
    from recomp import _module_state

    def lora(model: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(3)
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"])
        return peft.get_peft_model(model, config)

    base = llama()
    reference = lora(copy.deepcopy(base))
    model = lora(copy.deepcopy(base))
    with_recomp(model, *MODELS["llama-no-exclusion"][1:])
    walk = _module_state._replayed_modules
    walks: list[int] = []  # per step

    def counted(*args: object, **kwargs: object) -> object:
        walks[-1] += 1
        return walk(*args, **kwargs)

    ids = tokens()
    _module_state._replayed_modules = counted  # counts, then walks as before
    try:
        for _ in range(4):
            walks.append(0)
            for m in (reference, model):
                m.zero_grad()
                train_step(m, ids, use_cache=False)
            assert_same_grads(reference, model)
    finally:
        _module_state._replayed_modules = walk
    layers = SMALL["num_hidden_layers"]
    assert walks == [layers, layers, 0, 0]


def test_prefix_tuning_trains_with_excluded_attention_and_refuses_recomputed() -> None:
    peft = pytest.importorskip("peft")

    def prefix_tuned(model: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(3)
        config = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
        return peft.get_peft_model(model, config)

    base = llama()
    reference = prefix_tuned(copy.deepcopy(base))
    model = prefix_tuned(copy.deepcopy(base))
    with_recomp(model, *MODELS["llama-attention"][1:])
    ids = tokens()
    assert torch.equal(train_step(reference, ids).loss, train_step(model, ids).loss)
    assert_same_grads(reference, model)
    recomputed = prefix_tuned(copy.deepcopy(base))
    with_recomp(recomputed, *MODELS["llama-no-exclusion"][1:])
    with pytest.raises(recomp.RecompError, match="already holds entries"):
        train_step(recomputed, ids)


def test_lora_adapter_state_dict_found_after_recomp() -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(llama(), config)
    expected = sorted(peft.get_peft_model_state_dict(model))
    assert len(expected) == 4 * SMALL["num_hidden_layers"]
    with_recomp(model, *MODELS["llama-attention"][1:])
    assert sorted(peft.get_peft_model_state_dict(model)) == expected


# --------------------------------------------------------------------------- the HF guide and example


def test_hf_guide_example_runs() -> None:
    import contextlib
    import io
    import re

    text = (ROOT / "docs" / "guides" / "huggingface.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/guides/huggingface.md example", "exec"), {"__name__": "readme_example"})
    assert out.getvalue().split() == ["1", "1"]


def test_hf_train_example_runs_and_checks_gradients() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_train.py"), "--steps", "2", "--seq", "8"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gradients equal to the model without recomp: yes" in proc.stdout
    assert "OK" in proc.stdout.splitlines()[-1]


# --------------------------------------------------------------------------- more architectures


def _encoder_models() -> dict[str, tuple]:
    from transformers import (
        AlbertConfig,
        AlbertForMaskedLM,
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        T5Config,
        T5ForConditionalGeneration,
        ViTConfig,
        ViTForImageClassification,
    )
    from transformers.models.albert import modeling_albert
    from transformers.models.bert import modeling_bert
    from transformers.models.gpt2 import modeling_gpt2
    from transformers.models.t5 import modeling_t5
    from transformers.models.vit import modeling_vit

    def text() -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, 100, (2, 8)), "labels": torch.randint(0, 100, (2, 8))}

    small = {"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
    return {
        "gpt2": (
            lambda: GPT2LMHeadModel(
                GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=32)
            ),
            modeling_gpt2.GPT2Block,
            modeling_gpt2.GPT2Attention,
            lambda: {**text(), "use_cache": False},
        ),
        "bert": (
            lambda: BertForMaskedLM(BertConfig(hidden_size=32, vocab_size=100, **small)),
            modeling_bert.BertLayer,
            modeling_bert.BertAttention,
            text,
        ),
        "vit": (
            lambda: ViTForImageClassification(
                ViTConfig(hidden_size=32, image_size=16, patch_size=4, num_labels=3, **small)
            ),
            modeling_vit.ViTLayer,
            modeling_vit.ViTAttention,
            lambda: {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.randint(0, 3, (2,))},
        ),
        "t5": (
            lambda: T5ForConditionalGeneration(
                T5Config(
                    d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=100,
                    decoder_start_token_id=0,
                )
            ),
            modeling_t5.T5Block,
            modeling_t5.T5Attention,
            lambda: {**text(), "use_cache": False},
        ),
        "albert": (
            lambda: AlbertForMaskedLM(
                AlbertConfig(hidden_size=32, embedding_size=16, vocab_size=100, **small)
            ),
            modeling_albert.AlbertLayer,
            modeling_albert.AlbertAttention,
            text,
        ),
    }


@pytest.mark.parametrize("name", ["gpt2", "bert", "vit", "t5", "albert"])
def test_more_architectures_with_attention_excluded(name: str) -> None:
    """Encoder, decoder, encoder-decoder and vision models, dropout on: the unwrapped
    model's loss and gradients, every attention run once and skipped once per use
    (ALBERT shares one layer between its two positions), names unchanged."""
    make, layer, attention, inputs = _encoder_models()[name]
    torch.manual_seed(0)
    reference = make()
    model = apply_activation_checkpointing(
        copy.deepcopy(reference),
        checkpoint_fn=lambda m: isinstance(m, layer),
        exclude_fn=lambda m: isinstance(m, attention),
    )
    torch.manual_seed(1)
    batch = inputs()
    losses = []
    for m in (reference, model):
        m.train()
        torch.manual_seed(2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = m(**batch).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(*losses)
    assert_same_grads(reference, model)
    assert [n for n, _ in reference.named_parameters()] == [n for n, _ in model.named_parameters()]
    found = regions(model)
    assert found and all(r.region_runs == r.region_skips > 0 for r in found)


def test_excluded_submodule_returning_a_model_output() -> None:
    """BertModel checkpointed with its encoder excluded: the encoder's ModelOutput comes
    back as itself in the replay, where the pooler reads ``encoder_outputs[0]``."""
    from transformers import BertConfig, BertModel
    from transformers.models.bert import modeling_bert
    from transformers.utils import ModelOutput

    torch.manual_seed(0)
    reference = BertModel(
        BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            vocab_size=100,
        )
    )
    model = apply_activation_checkpointing(
        copy.deepcopy(reference),
        checkpoint_fn=lambda m: isinstance(m, BertModel),
        exclude_fn=lambda m: isinstance(m, modeling_bert.BertEncoder),
    )
    seen: list[type] = []
    model.encoder.register_forward_hook(lambda m, i, out: seen.append(type(out)))
    ids = torch.randint(0, 100, (2, 8))
    for m in (reference, model):
        torch.manual_seed(2)
        out = m(input_ids=ids)
        (out.pooler_output.sum() + out.last_hidden_state.square().sum()).backward()
    assert_same_grads(reference, model)
    # ran once (a replay handing back a plain dict would fail on encoder_outputs[0])
    assert len(seen) == 1 and issubclass(seen[0], ModelOutput)
    assert (model.encoder.region_runs, model.encoder.region_skips) == (1, 1)


# --------------------------------------------------------------------------- reference cycles


def _unreachable_per_step(model: torch.nn.Module, ids: torch.Tensor) -> list[int]:
    """Objects the collector finds unreachable after each of three training steps (after
    a warm-up), with the collector off during the steps."""
    for _ in range(2):
        train_step(model, ids)
        model.zero_grad()
    gc.collect()
    gc.disable()
    try:
        counts = []
        for _ in range(3):
            train_step(model, ids)
            model.zero_grad()
            counts.append(gc.collect())
    finally:
        gc.enable()
    return counts


def test_excluded_attention_with_the_default_cache_leaves_no_reference_cycles() -> None:
    """use_cache at its default (True): each checkpointed layer asks which of its modules
    write the cache. What is left in cycles is what PyTorch's own checkpoint leaves
    (``torch.utils._pytree.tree_flatten``'s recursive helper, 7 objects per call): the
    same model under HF's checkpointing (one PyTorch checkpoint per layer) is the baseline."""
    ids = tokens()
    assert _unreachable_per_step(llama(), ids) == [0, 0, 0]
    baseline = llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF turns the cache off, with a warning
        baseline.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch_checkpoint = _unreachable_per_step(baseline, ids)
    model = with_recomp(llama(), *MODELS["llama-attention"][1:])
    assert _unreachable_per_step(model, ids) == torch_checkpoint


def test_ibert_quantisation_ranges_updated_in_place_train_as_unwrapped() -> None:
    """HF I-BERT in quantisation mode keeps the ranges of its activations in buffers that
    each training forward updates in place and reads at once (``QuantAct``): with its
    layers checkpointed, gradients and every buffer stay the unwrapped model's, bit for
    bit, over several steps (the replay reads the ranges the forward read; they move
    once per step)."""
    from transformers import IBertConfig, IBertModel
    from transformers.models.ibert.modeling_ibert import IBertLayer

    torch.manual_seed(0)
    config = IBertConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        quant_mode=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    ref = IBertModel(config).train()

    def train(model: torch.nn.Module) -> tuple[list[dict], dict]:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        history = []
        for step in range(3):
            ids = torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(step))
            opt.zero_grad(set_to_none=True)
            model(ids).last_hidden_state.pow(2).sum().backward()
            history.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
        return history, {n: b.clone() for n, b in model.named_buffers()}

    model = copy.deepcopy(ref)
    apply_activation_checkpointing(model, checkpoint_fn=IBertLayer)
    want_grads, want_buffers = train(ref)
    got_grads, got_buffers = train(model)
    for want, got in zip(want_grads, got_grads):
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), name
    assert want_buffers.keys() == got_buffers.keys()
    for name in want_buffers:
        assert torch.equal(want_buffers[name], got_buffers[name]), name
