"""recomp as Hugging Face's checkpoint function (``hf_activation_checkpointing``) on real
transformers models built from tiny configs (CPU, no weights).

HF's own switch (``activation_checkpointing_enable()``, ``Trainer(gradient_checkpointing=True)``)
then checkpoints each layer once, with recomp: the excluded regions run once per step and
the gradients equal, with ``torch.equal`` and dropout on, those of the same model without
checkpointing and those of HF's own checkpointing. ``DoubleCheckpointError`` is left for a
layer that really is checkpointed twice.
"""

from __future__ import annotations

import copy
import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

import recomp  # noqa: E402
from recomp.torch import (  # noqa: E402
    ExcludeWrapper,
    apply_activation_checkpointing,
    checkpoint_exclude_wrapper,
    hf_activation_checkpointing,
    unwrap,
)
from recomp.torch import checkpoint as recomp_checkpoint  # noqa: E402

SEQ = 8
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
)
ATTENTION = modeling_llama.LlamaAttention
LAYER = modeling_llama.LlamaDecoderLayer


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL, attention_dropout=0.1)).train()


def mixtral() -> MixtralForCausalLM:
    torch.manual_seed(0)
    config = MixtralConfig(
        **SMALL,
        num_local_experts=4,
        num_experts_per_tok=2,
        attention_dropout=0.1,
        router_jitter_noise=0.1,
    )
    return MixtralForCausalLM(config).train()


def tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (batch, SEQ), generator=torch.Generator().manual_seed(1))


def train_step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(123)  # attention dropout
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss


def assert_same_grads(reference: torch.nn.Module, model: torch.nn.Module) -> None:
    expected = [p.grad for p in reference.parameters()]
    got = [p.grad for p in model.parameters()]
    assert len(expected) == len(got)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert (e is None) == (g is None), f"parameter {i}"
        assert e is None or torch.equal(e, g), f"parameter {i}: max diff {(e - g).abs().max()}"


def region_counts(model: torch.nn.Module) -> list[tuple[int, int]]:
    return [(r.region_runs, r.region_skips) for r in model.modules() if isinstance(r, ExcludeWrapper)]


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers)


def checkpoint_functions(model: torch.nn.Module) -> list[Any]:
    return [vars(layer).get("_gradient_checkpointing_func") for layer in layers(model)]


def taken_over(layer: torch.nn.Module) -> bool:
    return "_recomp_hf_checkpointing" in vars(layer)


def is_recomps(function: Any) -> bool:
    return repr(function).startswith("recomp.torch.checkpoint")


MODELS = {
    "llama": (llama, (ATTENTION,)),
    "mixtral": (mixtral, (modeling_mixtral.MixtralAttention, modeling_mixtral.MixtralTopKRouter)),
}


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_equal_no_checkpointing_and_hf_own_checkpointing(name: str) -> None:
    factory, excluded = MODELS[name]
    reference = factory()
    hf_own = copy.deepcopy(reference)
    hf_own.activation_checkpointing_enable()
    model = hf_activation_checkpointing(copy.deepcopy(reference), exclude_fn=excluded)
    assert model.is_activation_checkpointing  # HF's switch is on, with recomp's function
    assert all(is_recomps(f) for f in checkpoint_functions(model))
    ids = tokens()
    expected, own, got = (train_step(m, ids) for m in (reference, hf_own, model))
    assert torch.equal(expected, got) and torch.equal(own, got)
    assert_same_grads(reference, model)
    assert_same_grads(hf_own, model)
    # Each excluded module ran once and was skipped by its layer's one replay.
    assert region_counts(model) == [(1, 1)] * (len(excluded) * SMALL["num_hidden_layers"])


def test_hf_switch_turned_on_again_keeps_recomp_and_off_turns_it_off() -> None:
    reference = llama()
    model = hf_activation_checkpointing(copy.deepcopy(reference), exclude_fn=ATTENTION)
    ids = tokens()
    # Turned on again with HF's defaults (PyTorch's checkpoint, use_reentrant=False), as
    # Trainer, TRL and PEFT do: the layers keep recomp.
    model.activation_checkpointing_enable()
    assert not any(is_recomps(f) for f in checkpoint_functions(model))  # what HF put there
    train_step(reference, ids)
    train_step(model, ids)
    assert all(is_recomps(f) for f in checkpoint_functions(model))
    assert_same_grads(reference, model)
    assert region_counts(model) == [(1, 1)] * 2
    # Off: nothing is checkpointed, the excluded modules run as plain calls.
    model.activation_checkpointing_disable()
    assert not model.is_activation_checkpointing
    for m in (reference, model):
        m.zero_grad(set_to_none=True)
        train_step(m, ids)
    assert_same_grads(reference, model)
    assert region_counts(model) == [(2, 1)] * 2
    # On again through the older name (a FutureWarning in transformers 5.x).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for m in (reference, model):
        m.zero_grad(set_to_none=True)
        train_step(m, ids)
    assert_same_grads(reference, model)
    assert region_counts(model) == [(3, 2)] * 2


def test_use_reentrant_true_from_hf_warns_and_checkpoints_with_recomp() -> None:
    reference = llama()
    model = hf_activation_checkpointing(copy.deepcopy(reference), exclude_fn=ATTENTION)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    ids = tokens()
    train_step(reference, ids)
    with pytest.warns(UserWarning, match="use_reentrant=True") as caught:
        train_step(model, ids)
    message = str(next(w.message for w in caught if "use_reentrant=True" in str(w.message)))
    assert "non-reentrant" in message and "use_reentrant=False" in message
    assert sum("use_reentrant=True" in str(w.message) for w in caught) == 1  # once, not per layer
    assert_same_grads(reference, model)
    assert region_counts(model) == [(1, 1)] * 2


def test_checkpoint_options_pass_through_and_hf_kwargs_win() -> None:
    reference = llama()
    model = hf_activation_checkpointing(
        copy.deepcopy(reference), exclude_fn=ATTENTION, determinism_check="none", debug=True
    )
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False, "determinism_check": "default"}
    )
    ids = tokens()
    train_step(reference, ids)
    train_step(model, ids)
    function = checkpoint_functions(model)[0]
    assert function.kwargs == {"determinism_check": "default", "debug": True}
    assert_same_grads(reference, model)


# --------------------------------------------------------------------------- HF's own plug point


@pytest.mark.parametrize("how", ["function", "partial"])
def test_recomp_checkpoint_given_to_hf_is_not_a_double_checkpoint(how: str) -> None:
    # HF's API on its own: its switch on, then recomp's checkpoint as the layers' function
    # (transformers 5.24 takes it through _set_gradient_checkpointing). HF calls it with
    # the layer's own forward, below its switch: each layer is checkpointed once.
    reference = llama()
    model = copy.deepcopy(reference)
    for layer in layers(model):
        checkpoint_exclude_wrapper(layer.self_attn)
    function = recomp_checkpoint if how == "function" else functools.partial(recomp_checkpoint, debug=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=function)
    ids = tokens()
    train_step(reference, ids)
    train_step(model, ids)
    assert_same_grads(reference, model)
    assert region_counts(model) == [(1, 1)] * 2


# --------------------------------------------------------------------------- Trainer


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = tokens(4)[i]
        return {"input_ids": ids, "labels": ids}


def trainer(
    model: torch.nn.Module, out: Path, checkpointing: bool, kwargs: dict[str, Any] | None = None
) -> Any:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs=kwargs,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
    )
    return Trainer(model=model, args=args, train_dataset=Tokens())


@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": True}])
def test_trainer_gradient_checkpointing_default_keeps_recomp(
    tmp_path: Path, kwargs: dict[str, Any] | None
) -> None:
    pytest.importorskip("accelerate")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = trainer(llama(), tmp_path / "plain", checkpointing=False)
        reference.train()
        model = hf_activation_checkpointing(llama(), exclude_fn=ATTENTION)
        run = trainer(model, tmp_path / "recomp", checkpointing=True, kwargs=kwargs)
        run.train()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (reference, run)]
    assert len(losses[1]) == 2 and losses[0] == losses[1]
    for expected, got in zip(reference.model.parameters(), run.model.parameters()):
        assert torch.equal(expected, got)
    assert all(is_recomps(f) for f in checkpoint_functions(run.model))
    assert region_counts(run.model) == [(2, 2)] * 2  # two steps, one run and one skip each


@pytest.mark.parametrize("order", ["recomp_then_peft", "peft_then_recomp"])
def test_lora_gradients_equal_with_hf_switch_on(order: str) -> None:
    peft = pytest.importorskip("peft")

    def lora(model: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(3)
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
        return peft.get_peft_model(model, config)

    base = llama()
    reference = lora(copy.deepcopy(base))
    if order == "recomp_then_peft":
        model = lora(hf_activation_checkpointing(copy.deepcopy(base), exclude_fn=ATTENTION))
    else:
        model = hf_activation_checkpointing(lora(copy.deepcopy(base)), exclude_fn=ATTENTION)
    model.enable_input_require_grads()  # what Trainer and TRL add for PEFT
    model.activation_checkpointing_enable()  # what Trainer does for gradient_checkpointing=True
    ids = tokens()
    train_step(reference, ids)
    train_step(model, ids)
    assert_same_grads(reference, model)
    assert region_counts(model) == [(1, 1)] * 2


# --------------------------------------------------------------------------- real doubles


def test_recomp_wrapper_and_hf_switch_is_still_a_double_checkpoint() -> None:
    reference = llama()
    ids = tokens()
    train_step(reference, ids)
    # recomp's checkpoint_wrapper on the layers and HF's switch, with PyTorch's function.
    wrapped = apply_activation_checkpointing(
        copy.deepcopy(reference), checkpoint_fn=LAYER, exclude_fn=ATTENTION
    )
    wrapped.activation_checkpointing_enable()
    with pytest.raises(recomp.DoubleCheckpointError) as info:
        train_step(wrapped, ids)
    message = str(info.value)
    assert "PyTorch's checkpoint" in message and "hf_activation_checkpointing" in message
    assert "recomp.torch.unwrap(model)" in message
    # With recomp's function given to HF: still twice, and said so.
    wrapped._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=recomp_checkpoint)
    with pytest.raises(recomp.DoubleCheckpointError, match="recomp's too"):
        train_step(wrapped, ids)
    # hf_activation_checkpointing refuses such a model, changing nothing.
    with pytest.raises(ValueError, match="unwrap"):
        hf_activation_checkpointing(wrapped, exclude_fn=ATTENTION)
    assert not any(taken_over(layer) for layer in layers(wrapped))
    # And recomp's wrapper applied after hf_activation_checkpointing.
    taken = hf_activation_checkpointing(copy.deepcopy(reference), exclude_fn=ATTENTION)
    apply_activation_checkpointing(taken, checkpoint_fn=LAYER)
    with pytest.raises(recomp.DoubleCheckpointError, match="recomp's too"):
        train_step(taken, ids)
    # The fix the message names.
    fixed = hf_activation_checkpointing(unwrap(wrapped), exclude_fn=ATTENTION)
    fixed.zero_grad(set_to_none=True)
    train_step(fixed, ids)
    assert_same_grads(reference, fixed)
    assert region_counts(fixed) == [(1, 1)] * 2


def test_another_checkpoint_function_is_refused_not_used() -> None:
    # A checkpoint function recomp does not know: using it would replay the excluded regions.
    model = hf_activation_checkpointing(llama(), exclude_fn=ATTENTION)
    model._set_gradient_checkpointing(
        enable=True, gradient_checkpointing_func=lambda f, *a, **k: torch.utils.checkpoint.checkpoint(
            f, *a, use_reentrant=False, **k
        )
    )
    with pytest.raises(recomp.RecompError, match="another one"):
        train_step(model, tokens())
    assert all(p.grad is None for p in model.parameters())
    assert region_counts(model) == [(0, 0)] * 2


@pytest.fixture
def host_copies(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The offloader's host-copy mode (CPU tensors copied as a device's would be); every
    offload group opened in the test, in order."""
    from host_copies import recorded_host_copies

    yield from recorded_host_copies(monkeypatch)


def test_hf_offload_switch_moves_the_checkpoint_inputs_to_the_host(host_copies: list[Any]) -> None:
    # HF's offload=True (PyTorch's checkpoint inside save_on_cpu) is recomp's swap_inputs.
    reference = llama()
    model = hf_activation_checkpointing(copy.deepcopy(reference), exclude_fn=ATTENTION)
    model.activation_checkpointing_enable(offload=True)
    ids = tokens()
    train_step(reference, ids)
    train_step(model, ids)
    assert_same_grads(reference, model)
    assert all(f.kwargs == {"swap_inputs": True} for f in checkpoint_functions(model))
    assert region_counts(model) == [(1, 1)] * 2
    # Each layer's hidden states (batch 2 x SEQ x hidden, float32) to the host and back.
    hidden = 2 * SEQ * SMALL["hidden_size"] * 4
    assert [(g.offloaded_bytes, g.restored_bytes) for g in host_copies] == [(hidden, hidden)] * 2


def test_hf_every_n_layers_checkpoints_every_nth_layer_with_recomp() -> None:
    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(**{**SMALL, "num_hidden_layers": 4})).train()
    model = hf_activation_checkpointing(copy.deepcopy(reference), exclude_fn=ATTENTION)
    model.activation_checkpointing_enable(every_n_layers=2)
    ids = tokens()
    train_step(reference, ids)
    train_step(model, ids)
    assert_same_grads(reference, model)
    assert [layer.gradient_checkpointing for layer in layers(model)] == [True, False] * 2
    # The attention of a checkpointed layer runs once and is skipped by the replay; that of
    # a layer HF leaves alone runs once, with no replay to skip it.
    assert region_counts(model) == [(1, 1), (1, 0)] * 2


def test_trainer_every_n_layers_and_offload_reach_recomp(tmp_path: Path, host_copies: list[Any]) -> None:
    pytest.importorskip("accelerate")
    kwargs = {"every_n_layers": 2, "offload": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = trainer(llama(), tmp_path / "plain", checkpointing=False)
        reference.train()
        model = hf_activation_checkpointing(llama(), exclude_fn=ATTENTION)
        run = trainer(model, tmp_path / "recomp", checkpointing=True, kwargs=kwargs)
        run.train()
    for expected, got in zip(reference.model.parameters(), run.model.parameters()):
        assert torch.equal(expected, got)
    assert [layer.gradient_checkpointing for layer in layers(run.model)] == [True, False]
    assert region_counts(run.model) == [(2, 2), (2, 0)]  # two steps
    assert len(host_copies) == 2 and all(g.offloaded_bytes > 0 for g in host_copies)


def test_unwrap_gives_hf_back_its_function() -> None:
    reference = llama()
    hf_own = copy.deepcopy(reference)
    hf_own.activation_checkpointing_enable()
    for exclude in (ATTENTION, None):
        model = hf_activation_checkpointing(copy.deepcopy(reference), exclude_fn=exclude)
        assert unwrap(model) is model
        assert not any(isinstance(m, ExcludeWrapper) for m in model.modules())
        for function in checkpoint_functions(model):
            assert isinstance(function, functools.partial)
            assert function.func is torch.utils.checkpoint.checkpoint
        assert model.is_activation_checkpointing  # HF's switch stays as it was
        ids = tokens()
        hf_own.zero_grad(set_to_none=True)
        train_step(hf_own, ids)
        train_step(model, ids)
        assert_same_grads(hf_own, model)
        assert not any(taken_over(layer) for layer in layers(model))
        assert all(not layer._forward_pre_hooks for layer in layers(model))
        with pytest.raises(ValueError, match="carries no recomp wrapper"):
            unwrap(model)


def test_refuses_a_model_without_hf_layers() -> None:
    with pytest.raises(ValueError, match="GradientCheckpointingLayer"):
        hf_activation_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="non-reentrant"):
        hf_activation_checkpointing(llama(), use_reentrant=True)


def test_t5_where_bit_equality_holds_and_where_hfs_switch_changes_the_model() -> None:
    """HF's switch changes T5's forward itself (its attention layers without a relative
    bias make their zero position bias require gradients when ``gradient_checkpointing``
    is set, a workaround for reentrant checkpoints), so autograd sums T5's gradients in
    another order: under the switch recomp equals HF's own checkpointing bit for bit, and
    both differ from no checkpointing by rounding. recomp's own wrapper leaves the
    forward alone and equals no checkpointing bit for bit."""
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5Block

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0,
    )
    plain = T5ForConditionalGeneration(config).train()
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(2))

    def grads(model: torch.nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(123)  # dropout
        model(input_ids=ids, labels=labels).loss.backward()
        return [p.grad for p in model.parameters()]

    expected = grads(plain)
    hf_own = copy.deepcopy(plain)
    hf_own.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    through_switch = copy.deepcopy(plain)
    wrapped = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF's note that use_cache is turned off
        hf_grads = grads(hf_own)
        hf_activation_checkpointing(through_switch)
        switch_grads = grads(through_switch)
    apply_activation_checkpointing(wrapped, checkpoint_fn=T5Block)
    wrapped_grads = grads(wrapped)

    assert all(torch.equal(a, b) for a, b in zip(expected, wrapped_grads))
    assert all(torch.equal(a, b) for a, b in zip(hf_grads, switch_grads))
    # What changes the forward: the switch's flag on every T5Attention.
    from transformers.models.t5.modeling_t5 import T5Attention

    flags = {m.gradient_checkpointing for m in through_switch.modules() if isinstance(m, T5Attention)}
    assert flags == {True}
    assert {m.gradient_checkpointing for m in wrapped.modules() if isinstance(m, T5Attention)} == {False}
    for a, b in zip(expected, switch_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
