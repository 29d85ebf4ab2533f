"""Helpers for tests and equivalence checks."""
from __future__ import annotations

import torch
from torch import nn

from .layers import LionAttention


@torch.no_grad()
def randomize_decays(model: nn.Module, seed: int = 0) -> nn.Module:
    """Spread decays far from their initial values, as training would (per head and, for selective
    decays, per token), so that form-equivalence checks see masks far from all-ones: every parameter of
    every layer's decay kind, weights of projections by N(0, 0.3), the rest (logits, biases) by N(0, 2)."""
    g = torch.Generator().manual_seed(seed)
    for attn in model.modules():
        if not isinstance(attn, LionAttention):
            continue
        for name, param in attn.decay.named_parameters():
            scale = 0.3 if name.endswith(".weight") else 2.0
            param.copy_(torch.randn(param.shape, generator=g) * scale)
    return model
