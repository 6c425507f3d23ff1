"""recomp as torchtitan's activation checkpointing, without editing torchtitan (0.3.0).

torchtitan applies activation checkpointing in each model's ``parallelize``
(after tensor parallelism, before FSDP) through the policy that its
``activation_checkpoint`` config node builds. This module registers an
override of that node: every ``ActivationCheckpointing.Config`` (full,
selective) becomes :class:`RecompAC.Config`, whose policy makes each
TransformerBlock a recomp checkpoint and its attention an excluded region.
Activate it on torchtitan's command line::

    PYTHONPATH=examples/torchtitan torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module llama3 --config llama3_8b \\
        --override.imports recomp_torchtitan.recomp_ac

or with options, as a ``target=JSON`` entry::

    --override.imports 'recomp_torchtitan.recomp_ac={"exclude": ["attention", "feed_forward.w2"]}'

Keep an activation-checkpoint mode selected (``full`` or ``selective``; the
llama3 configs select ``selective``): the override replaces that node, and
with ``none`` there is nothing to replace (torchtitan then warns that the
override produced no replacement).

What runs: each block's forward runs its attention once (the region keeps the
attention's saved tensors and output) and everything else once more in the
backward replay; collectives in the replayed code (the all-gathers and
reduce-scatters of torchtitan's sequence-parallel TP plan) are not issued
again, the replay reads the forward's results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torchtitan.config.override import derive, override
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing

from recomp.torch import checkpoint_exclude_wrapper, checkpoint_wrapper

__all__ = ["RecompAC", "recomp_ac"]


class RecompAC(ActivationCheckpointing):
    """Each TransformerBlock a recomp checkpoint; the sub-modules named in
    ``exclude`` (attention by default) run once and are never replayed."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        exclude: list[str] = field(default_factory=lambda: ["attention"])
        """Sub-modules of each block that run once (paths below the block, such as
        ``"attention"`` or ``"feed_forward.w2"``); the rest of the block is replayed."""

        exclude_collectives: bool = True
        """Keep the results of collectives in the replayed code instead of
        communicating again (see recomp's ``checkpoint``)."""

        early_stop: bool = True
        """End each replay at the block's last saved tensor (PyTorch's default)."""

    def _wrap_block(self, module: nn.Module, *, base_fqn: str | None = None) -> nn.Module:
        config: Any = self.config
        parts = []
        for path in config.exclude:  # every path checked before anything is wrapped
            try:
                parts.append((path, module.get_submodule(path)))
            except AttributeError as exc:
                children = ", ".join(name for name, _ in module.named_children())
                raise ValueError(
                    f"RecompAC: block {base_fqn or type(module).__name__} has no sub-module "
                    f"{path!r} to exclude (its children: {children}). Fix `exclude` in the "
                    "override.imports entry."
                ) from exc
        for path, part in parts:
            checkpoint_exclude_wrapper(part, name=f"{base_fqn}.{path}" if base_fqn else path)
        return checkpoint_wrapper(
            module,
            preserve_rng_state=config.preserve_rng_state,
            determinism_check=config.determinism_check,
            debug=config.debug,
            early_stop=config.early_stop,
            exclude_collectives=config.exclude_collectives,
        )


@override(
    target=ActivationCheckpointing.Config,
    description="recomp: checkpoint each TransformerBlock, run its attention once",
)
def recomp_ac(config: ActivationCheckpointing.Config, **options: Any) -> RecompAC.Config:
    """Replace torchtitan's activation-checkpoint config by :class:`RecompAC.Config`,
    keeping its shared fields (RNG, determinism check, debug); ``options`` are the
    JSON keyword arguments of the ``override.imports`` entry."""
    return derive(config, RecompAC.Config, **options)
