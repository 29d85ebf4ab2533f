"""Decay kinds: what a LION layer's mask is made of (docs/design.md section 1).

A kind adds its parameters to a LionAttention (named `decay_*`: timm's no_weight_decay leaves them
out, lion_vit.testing.randomize_decays perturbs them) and turns them, and the layer's input, into
log decays log(lam) <= 0. The ops take it from there: every form and backend follows a new kind.

    class RetNetDecay(Decay):  # gamma_h = 1 - 2^(-5-h), fixed (the paper's Table 1)
        def log_decays(self, inputs, num_scans, num_heads, dtype, device):
            gamma = 1 - 2.0 ** (-5.0 - torch.arange(num_heads, dtype=dtype, device=device))
            return gamma.log().expand(num_scans, num_heads)[:, None, :, None]

    register_decay("retnet", RetNetDecay())             # then LionViT(decay="retnet") or
    lion_vit.models.register_variant("lion_retnet", decay="retnet")   # lion_retnet_{tiny,small,base}
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Decay", "NoDecay", "PerHeadDecay", "SelectiveDecay", "DECAYS", "register_decay", "initial_decays"]


def initial_decays(num_heads: int) -> Tensor:
    """Spread initial decays over heads, from local (0.75) to near-global (~0.992) mixing.

    Like RetNet's per-head gammas 1 - 2^-(5..), but on the scale of an image patch grid.
    """
    return 1.0 - torch.pow(2.0, -torch.linspace(2.0, 7.0, num_heads))


class Decay:
    """A decay kind. LionAttention calls add_parameters once, reset_parameters after timm's weight init,
    and at every forward inputs() (module calls, which torch.fx traces) then log_decays() (tensor math
    on them, an fx leaf)."""

    decayed = True  # False: the all-ones mask of LION-lit, which needs positional embeddings

    def add_parameters(self, attn: nn.Module, dim: int, factory: Dict[str, Any]) -> None:
        """Create the kind's parameters on attn (names starting with decay_); factory: device, dtype."""

    @torch.no_grad()
    def reset_parameters(self, attn: nn.Module) -> None:
        """Their initial values."""

    def inputs(self, attn: nn.Module, x: Tensor) -> Optional[Tensor]:
        """What log_decays reads: parameters, or a projection of x [B, L, dim]."""
        return None

    def log_decays(self, inputs: Optional[Tensor], num_scans: int, num_heads: int, dtype: torch.dtype,
                   device: torch.device) -> Optional[Tensor]:
        """log lam <= 0 in dtype as [S, B|1, H, L|1] (last dim 1: one decay per head), token order."""
        raise NotImplementedError


class NoDecay(Decay):
    """LION-lit: lam = 1, the all-ones mask."""

    decayed = False

    def log_decays(self, inputs, num_scans, num_heads, dtype, device):
        return None


class PerHeadDecay(Decay):
    """LION-d: lam = sigmoid(a_h), one learnable decay per scan and head."""

    def add_parameters(self, attn, dim, factory):
        attn.decay_logit = nn.Parameter(torch.zeros(attn.num_scans, attn.num_heads, **factory))

    @torch.no_grad()
    def reset_parameters(self, attn):
        attn.decay_logit.copy_(torch.logit(initial_decays(attn.num_heads)).expand(attn.num_scans, -1))

    def inputs(self, attn, x):
        return attn.decay_logit

    def log_decays(self, inputs, num_scans, num_heads, dtype, device):
        return F.logsigmoid(inputs.to(dtype))[:, None, :, None]


class SelectiveDecay(Decay):
    """LION-s: lam_i = sigmoid(w_h . x_i + b_h), one projection per scan (per token and head)."""

    def add_parameters(self, attn, dim, factory):
        attn.decay_proj = nn.Linear(dim, attn.num_scans * attn.num_heads, **factory)

    @torch.no_grad()
    def reset_parameters(self, attn):
        nn.init.normal_(attn.decay_proj.weight, std=0.02)
        attn.decay_proj.bias.copy_(torch.logit(initial_decays(attn.num_heads)).repeat(attn.num_scans))

    def inputs(self, attn, x):
        return attn.decay_proj(x)  # [B, L, S * H]

    def log_decays(self, inputs, num_scans, num_heads, dtype, device):
        return F.logsigmoid(inputs.to(dtype).unflatten(-1, (num_scans, num_heads))).permute(2, 0, 3, 1)


DECAYS: Dict[str, Decay] = {"lit": NoDecay(), "fixed": PerHeadDecay(), "selective": SelectiveDecay()}


def register_decay(name: str, decay: Decay) -> None:
    """Make `decay` available as LionAttention / LionViT(decay=name)."""
    DECAYS[name] = decay
