"""The code blocks of the README and of the documentation site (``docs/**/*.md``), for
tests/docs: each Python block runs as written.

A block runs in a fresh namespace unless a comment on the line before its fence says
otherwise. The comment is ``<!-- docs-test: ... -->`` with any of:

- ``setup=NAME``: the block starts from the names ``SETUPS[NAME]()`` returns (a block
  that uses ``model`` or ``DecoderLayer`` as prose does, without building them);
- ``continue``: the block runs in the namespace of the previous block of the page;
- ``requires=a,b``: the block needs these importable modules (skipped without them);
- ``skip=PATH ...``: not run here, because it needs a GPU, several processes or a
  trainer's environment; PATH (a test file or an example) is what runs it, and must
  exist.

Blocks in other languages are not run; the ``recomp ...`` command lines of ``bash``
blocks, and the ``$ recomp ...`` line above a command's output in ``text`` blocks, are
parsed by the command's own argument parser, so that the options a page shows exist.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paths

FENCE = re.compile(r"^( *)```(\w*)\s*$")  # indented inside a list item too
MARK = re.compile(r"<!--\s*docs-test:(.*?)-->")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(paths.ROOT)}:{self.line}"


def pages() -> list[Path]:
    return [paths.README, *sorted(paths.DOCS.rglob("*.md"))]


def parse_options(text: str) -> dict[str, str]:
    options = {}
    for item in shlex.split(text):
        key, _, value = item.partition("=")
        options[key] = value
    return options


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        indent = m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != indent + "```":
            j += 1
        options: dict[str, str] = {}
        if start > 0:
            mark = MARK.search(lines[start - 1])
            if mark:
                options = parse_options(mark.group(1))
        code = "\n".join(line.removeprefix(indent) for line in lines[start + 1 : j])
        found.append(Block(page, start + 1, m.group(2), code, options))
        i = j + 1
    return found


def all_blocks(lang: str) -> list[Block]:
    return [b for page in pages() for b in blocks(page) if b.lang == lang]


# --------------------------------------------------------------------------- setups
# The names prose-like blocks use without defining them. Each builds small models, so a
# block runs in a fraction of a second.


def _decoder() -> dict[str, Any]:
    """A tiny decoder: ``model`` with ``model.layers`` of ``DecoderLayer`` (alias
    ``Block``), each holding an ``Attention``/``attn`` and an ``mlp``, and a ``batch``."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.o = nn.Linear(d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return self.o(torch.nn.functional.scaled_dot_product_attention(q, k, v))

    class DecoderLayer(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.attn = Attention(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.norm(x))
            return x + self.mlp(x)

    class Model(nn.Module):
        def __init__(self, d: int = 32, n: int = 2) -> None:
            super().__init__()
            self.layers = nn.ModuleList(DecoderLayer(d) for _ in range(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    import recomp.torch

    torch.manual_seed(0)
    model = Model()
    return {
        **{name: getattr(recomp.torch, name) for name in recomp.torch.__all__},
        "torch": torch,
        "nn": nn,
        "model": model,
        "layer": nn.TransformerEncoderLayer(d_model=32, nhead=4, batch_first=True),
        "loss_fn": lambda out: out.square().mean(),
        "batch": torch.randn(2, 8, 32, requires_grad=True),
        "x": torch.randn(2, 8, 32, requires_grad=True),
        "DecoderLayer": DecoderLayer,
        "Block": DecoderLayer,
        "Attention": Attention,
        "is_layer": lambda m: isinstance(m, DecoderLayer),
        "is_attention": lambda m: isinstance(m, Attention),
    }


def _llama() -> dict[str, Any]:
    """A tiny Hugging Face Llama as ``model`` (its ``config``) with its layer and attention
    classes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    return {
        "torch": torch,
        "config": config,
        "model": LlamaForCausalLM(config),
        "ids": torch.randint(0, 100, (2, 16)),
        "LlamaAttention": LlamaAttention,
        "LlamaDecoderLayer": LlamaDecoderLayer,
    }


def _torch() -> dict[str, Any]:
    import torch
    from torch import nn

    import recomp
    import recomp.torch

    return {"torch": torch, "nn": nn, "recomp": recomp}


def _resnet() -> dict[str, Any]:
    """torchvision's ResNet-18 as ``resnet``, with ``BasicBlock``."""
    from torch import nn
    from torchvision.models import resnet18
    from torchvision.models.resnet import BasicBlock

    from recomp.torch import apply_activation_checkpointing

    return {
        "nn": nn,
        "resnet": resnet18(num_classes=10),
        "BasicBlock": BasicBlock,
        "apply_activation_checkpointing": apply_activation_checkpointing,
    }


def _tracker() -> dict[str, Any]:
    """An RNG tracker (``my_tracker``) and the two functions of another one."""
    import recomp

    class Tracker:
        def __init__(self) -> None:
            self.states = {"model-parallel": 0}

        def get_states(self) -> dict[str, int]:
            return dict(self.states)

        def set_states(self, states: dict[str, int]) -> None:
            self.states = states

    other = Tracker()
    return {
        "recomp": recomp,
        "my_tracker": Tracker(),
        "save_fn": other.get_states,
        "load_fn": other.set_states,
    }


def _stage() -> dict[str, Any]:
    """One pipeline stage of the tiny decoder, checkpointed with attention excluded, and
    what one micro-batch's step names: ``x``, ``y``, ``loss_fn``, ``mb``,
    ``stage_inputs``, ``weights``."""
    names = _decoder()
    torch = names["torch"]
    stage = names["model"]
    names["apply_activation_checkpointing"](
        stage, checkpoint_fn=names["DecoderLayer"], exclude_fn=names["Attention"]
    )
    x = torch.randn(2, 8, 32, requires_grad=True)
    names.update(
        stage=stage,
        x=x,
        y=torch.randn(2, 8, 32),
        loss_fn=lambda out, y: (out - y).square().mean(),
        mb=0,
        stage_inputs=[x],
        weights=list(stage.parameters()),
    )
    return names


def _ms_net() -> dict[str, Any]:
    """A small MindSpore network ``net`` with one checkpointed block, inputs ``x``, ``y``
    and ``grad_fn`` (``mindspore.value_and_grad`` of its loss)."""
    import mindspore as ms
    import numpy as np
    from mindspore import nn

    from recomp.mindspore import checkpoint_exclude_wrapper, checkpoint_wrapper

    ms.set_device("CPU")
    net = nn.SequentialCell(
        [checkpoint_wrapper(nn.SequentialCell([checkpoint_exclude_wrapper(nn.Dense(16, 16)), nn.Tanh()])),
         nn.Dense(16, 4)]
    )
    loss = nn.MSELoss()

    def forward(x: Any, y: Any) -> Any:
        return loss(net(x), y)

    return {
        "ms": ms,
        "net": net,
        "x": ms.Tensor(np.random.randn(8, 16).astype(np.float32)),
        "y": ms.Tensor(np.random.randn(8, 4).astype(np.float32)),
        "grad_fn": ms.value_and_grad(forward, None, net.trainable_params()),
    }


SETUPS: dict[str, Callable[[], dict[str, Any]]] = {
    "decoder": _decoder,
    "llama": _llama,
    "ms_net": _ms_net,
    "resnet": _resnet,
    "stage": _stage,
    "torch": _torch,
    "tracker": _tracker,
}
