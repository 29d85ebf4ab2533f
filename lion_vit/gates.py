"""Key gates: a factor on each key, i_j k_j, that some linear transformers of the paper's Table 1 put on the
state's input (xLSTM's input gate: S_i = f_i S_{i-1} + i_i k_i v_i^T), or keys made of the decays (HGRN-2's
k_j = 1 - lam_j). Like a decay kind (decays.py), a gate kind is an `nn.Module` its layer owns
(`LionAttention.key_gate`); its forward gives the gate [B, H, L, 1 | Dk] from the layer's input and log decays,
which the layer multiplies into the keys' features (or, replaces_keys, takes as the keys).
"""
from __future__ import annotations

from typing import Dict, Optional, Type

import torch
from torch import Tensor, nn

from .decays import in_mask_precision

torch.fx.wrap("in_mask_precision")  # (torch.fx wraps a name per module: here too, as in decays.py)

__all__ = ["KeyGate", "NoKeyGate", "InputGate", "OneMinusDecay", "KEY_GATES", "register_key_gate"]


class KeyGate(nn.Module):
    """A key gate kind for a layer of `dim` channels and `num_heads` heads; reset_parameters runs after timm's
    weight init, forward(x) at every call."""

    gated = True  # False: no gate, the keys as their features are
    replaces_keys = False  # True: the gate is the keys (the projected keys are not read)

    def __init__(self, dim: int, num_heads: int, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.dim, self.num_heads = dim, num_heads

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The parameters' initial values (none by default)."""

    def forward(self, x: Tensor, log_decays: Optional[Tensor] = None) -> Optional[Tensor]:
        """The gate [B|1, H, L, 1|Dk] > 0 for the layer's input x [B, L, dim] and its log decays (its decay kind's,
        [S, ...]), in float32 (float64 for float64 x)."""
        raise NotImplementedError


class NoKeyGate(KeyGate):
    """Every key as it is (LION, RetNet, Mamba-2, GLA)."""

    gated = False

    def forward(self, x: Tensor, log_decays: Optional[Tensor] = None) -> None:
        return None


class InputGate(KeyGate):
    """xLSTM's (mLSTM's) exponential input gate, i_j = exp(w_h . x_j + b_h) per token and head: its weights start
    at zero and its biases at N(0, 0.1), as xLSTM's do. Not stabilised by a running maximum (the max(|n|, 1)
    scaling is not invariant to one): keep its logits moderate (weight decay applies to its weights)."""

    def __init__(self, dim, num_heads, device=None, dtype=None):
        super().__init__(dim, num_heads)
        self.proj = nn.Linear(dim, num_heads, device=device, dtype=dtype)

    @torch.no_grad()
    def reset_parameters(self):
        nn.init.zeros_(self.proj.weight)
        nn.init.normal_(self.proj.bias, std=0.1)

    def forward(self, x, log_decays=None):  # [B, L, H] -> [B, H, L, 1]
        return in_mask_precision(self.proj(x)).exp().transpose(1, 2)[..., None]


class OneMinusDecay(KeyGate):
    """HGRN-2's keys, k_j = 1 - lam_j per key channel, from its forget gate (a vector decay kind whose decays every
    scan shares, decays.HGRN2Decay): the projected keys are not read."""

    replaces_keys = True

    def forward(self, x, log_decays=None):  # [S, B|1, H, L, Dk] -> [B|1, H, L, Dk]
        return -torch.expm1(log_decays[0])


KEY_GATES: Dict[str, Type[KeyGate]] = {"none": NoKeyGate, "input": InputGate, "one_minus_decay": OneMinusDecay}


def register_key_gate(name: str, kind: Type[KeyGate]) -> None:
    """Make the KeyGate subclass `kind` available as LionAttention / LionViT(key_gate=name)."""
    if not (isinstance(kind, type) and issubclass(kind, KeyGate)):
        raise TypeError(f"register_key_gate({name!r}, ...) takes a subclass of lion_vit.gates.KeyGate, got {kind!r}")
    KEY_GATES[name] = kind
