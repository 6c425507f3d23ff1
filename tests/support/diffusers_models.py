"""Tiny diffusers models built from configs, for the tests of recomp with diffusers."""

from __future__ import annotations

from typing import Any

import torch


def tiny_unet(dropout: float = 0.0) -> Any:
    """A seeded ``UNet2DConditionModel`` on 8x8 latents of 4 channels, text states of width
    16: one cross-attention block down and one up, each with one transformer block."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=8,
        dropout=dropout,
    )
