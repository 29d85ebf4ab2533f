"""Helpers for tests and equivalence checks."""
from __future__ import annotations

import torch
from torch import nn

from .layers import LionAttention


@torch.no_grad()
def randomize_decays(model: nn.Module, seed: int = 0) -> nn.Module:
    """Spread decays far from their initial values, as training would (per head and, for
    selective decays, per token), so that form-equivalence checks see masks far from all-ones."""
    g = torch.Generator().manual_seed(seed)
    for attn in model.modules():
        if isinstance(attn, LionAttention) and attn.decay == "fixed":
            attn.decay_logit.copy_(torch.randn(attn.decay_logit.shape, generator=g) * 2.0)
        elif isinstance(attn, LionAttention) and attn.decay == "selective":
            attn.decay_proj.weight.copy_(torch.randn(attn.decay_proj.weight.shape, generator=g) * 0.3)
            attn.decay_proj.bias.copy_(torch.randn(attn.decay_proj.bias.shape, generator=g) * 2.0)
    return model
