"""TRL's ``SFTTrainer`` with recomp as Hugging Face's checkpoint function
(``hf_activation_checkpointing``), ``SFTConfig``'s defaults untouched: its
``gradient_checkpointing=True`` then checkpoints each layer with recomp. A tiny Llama
built from a config, a word-level tokenizer built here (nothing is downloaded), CPU, with
TRL's defaults (bf16=True among them). Losses and trained weights equal, bit for bit, those of the same
run without checkpointing (attention and LoRA dropout on); each excluded attention runs
once per step and is skipped by the replay."""

from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

trl = pytest.importorskip("trl")
pytest.importorskip("peft")
torch = pytest.importorskip("torch")

import datasets  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaAttention  # noqa: E402

import paths  # noqa: E402
from recomp.torch import ExcludeWrapper, hf_activation_checkpointing  # noqa: E402

STEPS = 3
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "big", "red", "house"]
VOCAB = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}


def tokenizer() -> PreTrainedTokenizerFast:
    words = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def dataset() -> datasets.Dataset:
    texts = [" ".join(WORDS[i % 5 : i % 5 + 6 + i % 3]) for i in range(8)]
    return datasets.Dataset.from_dict({"text": texts})


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=len(VOCAB),
        attention_dropout=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    return LlamaForCausalLM(config)


def train(model: torch.nn.Module, out: Path, lora: bool, **config: Any) -> Any:
    args = trl.SFTConfig(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        **config,
    )
    peft_config = (
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        if lora
        else None
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset(),
        processing_class=tokenizer(),
        peft_config=peft_config,
    )
    trainer.train()
    return trainer


def losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize(
    ("lora", "config"),
    [
        pytest.param(True, {}, id="lora-defaults"),
        # TRL's selective checkpointing: its context_fn goes to recomp's checkpoint.
        pytest.param(False, {"gradient_checkpointing_kwargs": {"selective": True}}, id="full-selective"),
    ],
)
def test_sft_trainer_defaults_train_as_without_checkpointing(
    tmp_path: Path, lora: bool, config: dict[str, Any]
) -> None:
    datasets.disable_progress_bars()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True)
        assert default.gradient_checkpointing and default.gradient_checkpointing_kwargs is None
        reference = train(llama(), tmp_path / "plain", lora, gradient_checkpointing=False)
        model = hf_activation_checkpointing(llama(), exclude_fn=LlamaAttention)
        run = train(model, tmp_path / "recomp", lora, **config)
    assert run.args.gradient_checkpointing
    assert len(losses(run)) == STEPS and losses(run) == losses(reference)
    trained = list(run.model.named_parameters())
    expected = list(reference.model.named_parameters())
    assert [n for n, _ in trained] == [n for n, _ in expected]
    assert sum(p.requires_grad for _, p in trained) == (4 * 2 if lora else len(trained))
    for (name, got), (_, want) in zip(trained, expected):
        assert torch.equal(got, want), name
    layers = [m for m in run.model.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert len(layers) == 2
    for layer in layers:
        assert repr(vars(layer)["_gradient_checkpointing_func"]).startswith("recomp.torch.checkpoint")
    if config:
        assert "create_selective_checkpoint_contexts" in repr(vars(layers[0])["_gradient_checkpointing_func"])
    regions = [m for m in run.model.modules() if isinstance(m, ExcludeWrapper)]
    assert [(r.region_runs, r.region_skips) for r in regions] == [(STEPS, STEPS)] * 2


def test_hf_guide_lines_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The Hugging Face guide's lines as written, on this test's model and data; SFTConfig gets what a
    # machine without a GPU and a one-step test need (use_cpu, max_steps, no reports).
    text = (paths.DOCS / "guides" / "huggingface.md").read_text()
    text = text.split("## Hugging Face Trainer and TRL", 1)[1]
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    datasets.disable_progress_bars()
    model = llama()
    names = {
        "model": model,
        "data": dataset(),
        "LlamaAttention": LlamaAttention,
        "LoraConfig": LoraConfig,
        "tokenizer": tokenizer(),
        "SFTTrainer": trl.SFTTrainer,
        "SFTConfig": functools.partial(
            trl.SFTConfig, use_cpu=True, max_steps=1, report_to=[], save_strategy="no"
        ),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, "docs/guides/huggingface.md TRL example", "exec"), names)
    regions = [m for m in names["trainer"].model.modules() if isinstance(m, ExcludeWrapper)]
    assert [(r.region_runs, r.region_skips) for r in regions] == [(1, 1)] * 2
