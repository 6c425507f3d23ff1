"""The torchtitan recipe on torchtitan's own llama3 debug model, in one process on CPU.

Run by ``make test-torchtitan`` in its own environment (torchtitan 0.3.0 wants
numpy 2, which the development environment cannot take). The override goes
through torchtitan's command line and ``apply_overrides`` as its trainer does,
and the policy it builds is applied to the model as ``parallelize_llama``
applies it. The model's inner attention is PyTorch's SDPA instead of
FlexAttention, which has no CPU backward.

Fails if a gradient differs by a bit from the model without checkpointing, if
an attention runs more than once per step, or if the replay does not recompute
the rest of the block.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from recomp_torchtitan import RecompAC
from torch.utils.flop_counter import FlopCounterMode
from torchtitan.config.manager import ConfigManager
from torchtitan.config.override import apply_overrides
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common.attention import ScaledDotProductAttention

TARGET = "recomp_torchtitan.recomp_ac"
BATCH, SEQ = 2, 64


def trainer_config(*override_args: str) -> Any:
    """The llama3 debug config as torchtitan's command line builds it, overrides applied."""
    args = ["--module", "llama3", "--config", "llama3_debugmodel", *override_args]
    config = ConfigManager().parse_args(args)
    apply_overrides(config.override, config)  # as the trainer does, before building
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def build(ac_config: Any, state: dict[str, torch.Tensor] | None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = trainer_config().model_spec.model.build()
    model.init_weights()
    if state is not None:
        model.load_state_dict(state)
    if ac_config is not None:
        ac_config.build(dump_folder="").apply(model)  # as parallelize_llama does
    return model


def step(model: torch.nn.Module) -> dict[str, Any]:
    calls: Counter[str] = Counter()
    for name, module in model.named_modules():
        if name.endswith((".inner_attention", ".feed_forward")):
            kind = name.rsplit(".", 1)[1]
            # A pre-hook: an early-stopping replay ends inside the MLP, before it returns.
            module.register_forward_pre_hook(lambda *_, kind=kind: calls.update([kind]))
    tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    with FlopCounterMode(display=False) as flops:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
    layers = len(model.layers)
    return {
        "loss": loss.item(),
        # torchtitan's wrappers add "_checkpoint_wrapped_module." to every name; recomp's do not.
        "grads": {
            n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
            for n, p in model.named_parameters()
        },
        "names_unchanged": all(
            "_checkpoint_wrapped_module" not in n for n, _ in model.named_parameters()
        ),
        "attention_runs_per_block": calls["inner_attention"] / layers,
        "mlp_runs_per_block": calls["feed_forward"] / layers,
        "flops": flops.get_total_flops(),
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    reference = build(None, None)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    out = {"none": step(reference)}
    recomp_config = trainer_config("--override.imports", TARGET).activation_checkpoint
    configs = {
        "recomp": recomp_config,
        "torchtitan_full": FullAC.Config(),
        "torchtitan_selective": SelectiveAC.Config(),
    }
    for name, ac_config in configs.items():
        out[name] = step(build(ac_config, state))
    return out


def test_the_override_replaces_torchtitans_policy():
    assert type(trainer_config().activation_checkpoint) is SelectiveAC.Config
    config = trainer_config("--override.imports", TARGET).activation_checkpoint
    assert type(config) is RecompAC.Config
    assert config.exclude == ["attention"] and config.exclude_collectives
    with_options = trainer_config(
        "--override.imports", TARGET + '={"exclude": ["attention", "feed_forward.w2"]}'
    ).activation_checkpoint
    assert with_options.exclude == ["attention", "feed_forward.w2"]


@pytest.mark.parametrize("variant", ["recomp", "torchtitan_full", "torchtitan_selective"])
def test_gradients_equal_the_model_without_checkpointing(runs, variant):
    assert runs[variant]["loss"] == runs["none"]["loss"]
    want = runs["none"]["grads"]
    got = runs[variant]["grads"]
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want), [
        n for n in want if not torch.equal(got[n], want[n])
    ]


def test_recomp_keeps_parameter_names(runs):
    assert runs["recomp"]["names_unchanged"]
    assert not runs["torchtitan_full"]["names_unchanged"]


def test_attention_runs_once_and_the_rest_is_replayed(runs):
    assert runs["none"]["attention_runs_per_block"] == 1
    assert runs["recomp"]["attention_runs_per_block"] == 1
    assert runs["recomp"]["mlp_runs_per_block"] == 2
    assert runs["torchtitan_full"]["attention_runs_per_block"] == 2
    # recomp recomputes less than torchtitan's full AC, more than no checkpointing.
    assert runs["none"]["flops"] < runs["recomp"]["flops"] < runs["torchtitan_full"]["flops"]


def test_a_wrong_exclusion_names_the_block_children_and_wraps_nothing():
    config = RecompAC.Config(exclude=["attention", "no_such_module"])
    model = build(None, None)
    classes = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"no sub-module 'no_such_module'.*feed_forward"):
        config.build(dump_folder="").apply(model)
    assert [type(m) for m in model.modules()] == classes


def test_print_what_each_policy_replays(runs):
    base = runs["none"]["flops"]
    for name, r in runs.items():
        print(
            f"{name:22s} attention runs/block {r['attention_runs_per_block']:.0f}  "
            f"block runs/step {r['mlp_runs_per_block']:.0f}  "
            f"FLOPs x{r['flops'] / base:.3f} of no checkpointing"
        )
