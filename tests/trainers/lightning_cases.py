"""Lightning runs for ``test_lightning.py``: a small pre-norm transformer with dropout, a
LightningModule that applies recomp (or PyTorch's checkpointing, or both) in
``configure_model``, ``FSDPStrategy`` made to run on CPU, and the function that
``dist_harness.launch_ranks`` runs on each of 2 gloo ranks. Not a test module.

Every run records, per step, the loss and the gradients the optimizer is about to apply
(each rank's local shard), the weights after the last step, the parameter names, and how
many times each block's attention ran (a forward hook on it: recomp's excluded region,
PyTorch's replay and the plain forward all go through it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing as torch_apply_activation_checkpointing,
)

import recomp
import recomp.torch as rt

STEPS = 3
LAYERS = 2
WIDTH = 16
TORCH_PREFIX = "_checkpoint_wrapped_module."
FSDP_PREFIX = "_fsdp_wrapped_module."


class Attention(nn.Module):
    def __init__(self, d: int = WIDTH, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        p = 0.1 if self.training else 0.0
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.drop(self.proj(o.transpose(1, 2).reshape(b, s, d)))


class Block(nn.Module):
    def __init__(self, d: int = WIDTH) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def recomp_blocks(net: nn.Module) -> None:
    """What the Lightning guide (docs/guides/lightning.md) puts in ``configure_model``."""
    rt.apply_activation_checkpointing(net, checkpoint_fn=Block, exclude_fn=Attention)


def torch_blocks(net: nn.Module) -> None:
    """PyTorch's own checkpointing of the blocks (what Lightning's FSDP policy applies)."""
    torch_apply_activation_checkpointing(net, check_fn=lambda m: isinstance(m, Block))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) tensor, as a plain copy."""
    to_local = getattr(t, "to_local", None)
    return (to_local() if to_local is not None else t).detach().clone()


def clean(name: str) -> str:
    return name.replace(FSDP_PREFIX, "").replace(TORCH_PREFIX, "")


class LitNet(L.LightningModule):
    """``configure`` runs in ``configure_model`` (before any sharding of Lightning's own)."""

    def __init__(self, configure: Callable[[LitNet], None] | None = None) -> None:
        super().__init__()
        self.net = Net()
        self.configure = configure
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.attention_calls = [0] * LAYERS
        for i, block in enumerate(self.net.blocks):
            block.attn.register_forward_hook(self._counter(i))

    def _counter(self, i: int) -> Callable[..., None]:
        def count(*_: Any) -> None:
            if torch.is_grad_enabled():
                self.attention_calls[i] += 1

        return count

    def configure_model(self) -> None:
        if self.configure is not None:
            self.configure(self)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads.append(
            {clean(n): local(p.grad) for n, p in self.named_parameters() if p.grad is not None}
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def weights(self) -> dict[str, torch.Tensor]:
        return {clean(n): local(p) for n, p in self.named_parameters()}

    def regions(self) -> list[list[int]]:
        """(runs, skips) of each block's excluded attention; [] where recomp did not wrap it."""
        return [
            [b.attn.region_runs, b.attn.region_skips]
            for b in self.net.blocks
            if isinstance(b.attn, rt.ExcludeWrapper)
        ]


def data(samples: int = 8 * STEPS) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 6, 8, generator=g)
    y = torch.randn(samples, 6, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


class CPUFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` on CPU, for these tests only. Lightning refuses the FSDP strategy
    without a GPU unless its type is a subclass, and it passes ``device_id`` as the
    device's index (None on CPU), where PyTorch's FSDP wants ``torch.device("cpu")``: the
    model is wrapped here with that, and Lightning's own ``_setup_model`` then finds it
    wrapped and applies its ``activation_checkpointing_policy`` as it does on GPUs."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        kwargs = dict(self.kwargs)
        self.kwargs.pop("auto_wrap_policy", None)  # used here; Lightning would warn otherwise
        model = FullyShardedDataParallel(
            model,
            device_id=torch.device("cpu"),
            sharding_strategy=self.sharding_strategy,
            **kwargs,
        )
        return super()._setup_model(model)


def trainer(strategy: Any, devices: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def fit(
    configure: Callable[[LitNet], None] | None, strategy: Any = "auto", devices: int = 1
) -> tuple[LitNet, str | None]:
    """One seeded run; the error it raised (``DoubleCheckpointError``), if any."""
    L.seed_everything(0, verbose=False)
    model = LitNet(configure)
    try:
        trainer(strategy, devices).fit(model, data())
    except recomp.DoubleCheckpointError as e:
        return model, str(e)
    return model, None


def max_diff(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference, name by name (inf if the names differ)."""
    if expected.keys() != actual.keys():
        return float("inf")
    diffs = [0.0]
    for k, e in expected.items():
        a = actual[k]
        if e.shape != a.shape:
            return float("inf")
        if e.numel():
            diffs.append((e - a).abs().max().item())
    return max(diffs)


def compare(reference: LitNet, run: LitNet, error: str | None) -> dict[str, Any]:
    """What a test asserts about a run, against the run without checkpointing."""
    names = [n for n, _ in run.named_parameters()]
    if error is not None:
        return {"error": error, "names": names, "attention_calls": run.attention_calls}
    return {
        "error": None,
        "losses_equal": run.losses == reference.losses,
        "steps": len(run.losses),
        "grad_diff": [max_diff(e, a) for e, a in zip(reference.grads, run.grads)],
        "weight_diff": max_diff(reference.weights(), run.weights()),
        "names": names,
        "attention_calls": run.attention_calls,
        "regions": run.regions(),
    }


# --------------------------------------------------------------------------- the 2 ranks


def fsdp_strategy(policy: bool) -> CPUFSDPStrategy:
    return CPUFSDPStrategy(
        auto_wrap_policy={Block}, activation_checkpointing_policy={Block} if policy else None
    )


def fully_shard_in(prepare: Callable[[nn.Module], None] | None) -> Callable[[LitNet], None]:
    """``configure_model`` for ``ModelParallelStrategy``: ``prepare`` (checkpointing),
    then FSDP2 on each block and on the root."""

    def configure(module: LitNet) -> None:
        from torch.distributed.fsdp import fully_shard

        if prepare is not None:
            prepare(module.net)
        mesh = module.device_mesh["data_parallel"]
        for block in module.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(module.net, mesh=mesh)

    return configure


def model_parallel(devices: int) -> ModelParallelStrategy:
    return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)


def both_checkpointings(net: nn.Module) -> None:
    recomp_blocks(net)
    torch_blocks(net)  # refused by recomp


def run_strategies(rank: int, world_size: int) -> dict[str, Any]:
    """On each rank: FSDPStrategy and ModelParallelStrategy, each without checkpointing,
    with recomp (``configure_model``), with PyTorch's checkpointing only (the control),
    and with both (refused; run first, so the runs after it show that it left nothing
    behind)."""
    os.environ["LOCAL_RANK"] = str(rank)  # the processes are started outside Lightning
    out: dict[str, Any] = {}

    def on_blocks(f: Callable[[nn.Module], None]) -> Callable[[LitNet], None]:
        return lambda module: f(module.net)

    fsdp = {
        "both": (on_blocks(recomp_blocks), lambda: fsdp_strategy(policy=True)),
        "none": (None, lambda: fsdp_strategy(policy=False)),
        "recomp": (on_blocks(recomp_blocks), lambda: fsdp_strategy(policy=False)),
        "torch": (None, lambda: fsdp_strategy(policy=True)),
    }
    mp = {
        "both": (fully_shard_in(both_checkpointings), lambda: model_parallel(world_size)),
        "none": (fully_shard_in(None), lambda: model_parallel(world_size)),
        "recomp": (fully_shard_in(recomp_blocks), lambda: model_parallel(world_size)),
        "torch": (fully_shard_in(torch_blocks), lambda: model_parallel(world_size)),
    }
    for label, variants in (("fsdp", fsdp), ("model_parallel", mp)):
        runs = {v: fit(configure, make(), world_size) for v, (configure, make) in variants.items()}
        reference = runs["none"][0]
        out[label] = {v: compare(reference, m, e) for v, (m, e) in runs.items()}
    return out
