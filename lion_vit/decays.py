"""Decay kinds: what a LION layer's mask is made of (docs/design.md section 1).

A kind is an `nn.Module` that its layer owns (`LionAttention.decay`), as timm's and FLA's layers own
their gates: its parameters are its own (`blocks.0.attn.decay.logit`; timm's no_weight_decay leaves every
decay kind's parameters out, lion_vit.testing.randomize_decays perturbs them), and its forward turns them,
and the layer's input, into log decays log(lam) <= 0. The ops take it from there: every form and backend
follows a new kind.

    class RetNetDecay(Decay):  # gamma_h = 1 - 2^(-5-h), fixed (the paper's Table 1)
        def forward(self, x):
            gamma = 1 - 2.0 ** (-5.0 - torch.arange(self.num_heads, dtype=torch.float64, device=x.device))
            return gamma.log().expand(self.num_scans, self.num_heads)[:, None, :, None]

    register_decay("retnet", RetNetDecay)             # then LionViT(decay="retnet") or
    lion_vit.models.register_variant("lion_retnet", decay="retnet")   # lion_retnet_{tiny,small,base}
"""
from __future__ import annotations

from typing import Dict, Optional, Type

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Decay", "NoDecay", "PerHeadDecay", "SelectiveDecay", "DECAYS", "register_decay", "initial_decays",
           "in_mask_precision"]


def in_mask_precision(t: Tensor) -> Tensor:
    """t in float32, or float64 if it is float64: the precision masks are built in (a bfloat16 logit under
    autocast is widened before its logsigmoid)."""
    return t if t.dtype == torch.float64 else t.float()


torch.fx.wrap("in_mask_precision")  # (a dtype branch: torch.fx records the call, which runs on real tensors)


def initial_decays(num_heads: int) -> Tensor:
    """Spread initial decays over heads, from local (0.75) to near-global (~0.992) mixing.

    Like RetNet's per-head gammas 1 - 2^-(5..), but on the scale of an image patch grid.
    """
    return 1.0 - torch.pow(2.0, -torch.linspace(2.0, 7.0, num_heads))


class Decay(nn.Module):
    """A decay kind for a layer of `dim` channels, `num_heads` heads and `num_scans` scans. Its layer calls
    reset_parameters after timm's generic weight init, and forward(x) at every call (torch.fx traces it)."""

    decayed = True  # False: the all-ones mask of LION-lit, which needs positional embeddings

    def __init__(self, dim: int, num_heads: int, num_scans: int = 1, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.dim, self.num_heads, self.num_scans = dim, num_heads, num_scans

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The parameters' initial values (none by default)."""

    def forward(self, x: Tensor) -> Optional[Tensor]:
        """log lam <= 0 as [S, B|1, H, L|1] (last dim 1: one decay per head) in token order, from the layer's
        input x [B, L, dim]; any float dtype (the layer casts to the masks' dtype). None: no decay."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, scans={self.num_scans}"


class NoDecay(Decay):
    """LION-lit: lam = 1, the all-ones mask."""

    decayed = False

    def forward(self, x: Tensor) -> None:
        return None


class PerHeadDecay(Decay):
    """LION-d: lam = sigmoid(a_h), one learnable decay per scan and head."""

    def __init__(self, dim, num_heads, num_scans=1, device=None, dtype=None):
        super().__init__(dim, num_heads, num_scans)
        self.logit = nn.Parameter(torch.zeros(num_scans, num_heads, device=device, dtype=dtype))

    @torch.no_grad()
    def reset_parameters(self):
        self.logit.copy_(torch.logit(initial_decays(self.num_heads)).expand(self.num_scans, -1))

    def forward(self, x):
        return F.logsigmoid(in_mask_precision(self.logit))[:, None, :, None]


class SelectiveDecay(Decay):
    """LION-s: lam_i = sigmoid(w_h . x_i + b_h), one projection per scan (per token and head)."""

    def __init__(self, dim, num_heads, num_scans=1, device=None, dtype=None):
        super().__init__(dim, num_heads, num_scans)
        self.proj = nn.Linear(dim, num_scans * num_heads, device=device, dtype=dtype)

    @torch.no_grad()
    def reset_parameters(self):
        nn.init.normal_(self.proj.weight, std=0.02)
        self.proj.bias.copy_(torch.logit(initial_decays(self.num_heads)).repeat(self.num_scans))

    def forward(self, x):  # [B, L, S * H] -> [S, B, H, L]
        logits = in_mask_precision(self.proj(x)).unflatten(-1, (self.num_scans, self.num_heads))
        return F.logsigmoid(logits).permute(2, 0, 3, 1)


DECAYS: Dict[str, Type[Decay]] = {"lit": NoDecay, "fixed": PerHeadDecay, "selective": SelectiveDecay}


def register_decay(name: str, kind: Type[Decay]) -> None:
    """Make the Decay subclass `kind` available as LionAttention / LionViT(decay=name)."""
    if not (isinstance(kind, type) and issubclass(kind, Decay)):
        raise TypeError(f"register_decay({name!r}, ...) takes a subclass of lion_vit.decays.Decay (the class, which "
                        f"each layer builds its own of), got {kind!r}")
    DECAYS[name] = kind
