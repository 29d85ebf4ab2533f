"""Decay kinds: what a LION layer's mask is made of (docs/design.md section 1).

A kind is an `nn.Module` that its layer owns (`LionAttention.decay`), as timm's and FLA's layers own
their gates: its parameters are its own (`blocks.0.attn.decay.logit`; timm's no_weight_decay leaves every
decay kind's parameters out, lion_vit.testing.randomize_decays perturbs them), and its forward turns them,
and the layer's input, into log decays log(lam) <= 0. The ops take it from there: every form and backend
follows a new kind.

    class HalfDecay(Decay):  # lam = 1/2 everywhere, for every head and scan
        def forward(self, x):
            return torch.full((self.num_scans, 1, self.num_heads, 1), -math.log(2.0), device=x.device)

    register_decay("half", HalfDecay)             # then LionViT(decay="half") or
    lion_vit.models.register_variant("lion_half", decay="half")   # lion_half_{tiny,small,base}
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Type

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Decay", "NoDecay", "PerHeadDecay", "SelectiveDecay", "RetNetDecay", "Mamba2Decay", "XLSTMForgetDecay",
           "GLADecay", "HGRN2Decay", "RWKV6Decay", "DECAYS", "register_decay", "initial_decays", "in_mask_precision"]


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
    vector = False  # True: one decay per key channel too, [S, B|1, H, L, Dk] (ops/vector.py)
    shared_by_scans = False  # True: every scan reads the same decays (along its own order)

    def __init__(self, dim: int, num_heads: int, num_scans: int = 1, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.dim, self.num_heads, self.num_scans = dim, num_heads, num_scans

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The parameters' initial values (none by default)."""

    def forward(self, x: Tensor) -> Optional[Tensor]:
        """log lam <= 0 as [S, B|1, H, L|1] (last dim 1: one decay per head) in token order, or for a vector
        kind [S, B|1, H, L, Dk], from the layer's input x [B, L, dim]; any float dtype (the layer casts to the
        masks' dtype). None: no decay."""
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


class RetNetDecay(Decay):
    """RetNet's fixed decays, gamma_h = 1 - 2^(-5-h) per head (the paper's Table 1): no parameters."""

    def forward(self, x):
        # 0, 1, ..., H - 1 as a method of x: torch.fx before PyTorch 2.9 cannot trace arange(device=x.device)
        heads = x.new_ones(self.num_heads, dtype=torch.float64).cumsum(0) - 1
        return torch.log1p(-torch.exp2(-5.0 - heads)).expand(self.num_scans, self.num_heads)[:, None, :, None]


class Mamba2Decay(Decay):
    """Mamba-2's selective decay, lam_i = exp(-softplus(dt_i + dt_bias) exp(A_log)) per token and head, dt_i a
    projection of x_i, with Mamba-2's init: A = exp(A_log) ~ U(1, 16), softplus(dt_bias) log-uniform in
    [0.001, 0.1], the projection's weights N(0, 0.02)."""

    def __init__(self, dim, num_heads, num_scans=1, device=None, dtype=None):
        super().__init__(dim, num_heads, num_scans)
        self.dt_proj = nn.Linear(dim, num_scans * num_heads, bias=False, device=device, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.zeros(num_scans, num_heads, device=device, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(num_scans, num_heads, device=device, dtype=dtype))

    @torch.no_grad()
    def reset_parameters(self):
        nn.init.normal_(self.dt_proj.weight, std=0.02)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt

    def forward(self, x):  # [B, L, S * H] -> [S, B, H, L]
        dt = in_mask_precision(self.dt_proj(x)).unflatten(-1, (self.num_scans, self.num_heads))
        log_decay = -F.softplus(dt + in_mask_precision(self.dt_bias)) * in_mask_precision(self.A_log).exp()
        return log_decay.permute(2, 0, 3, 1)


class XLSTMForgetDecay(SelectiveDecay):
    """xLSTM's (mLSTM's) forget gate, f_i = sigmoid(w_h . x_i + b_h) per token and head, with xLSTM's init:
    weights zero, biases spread from 3 to 6 over the heads (f from 0.95 to 0.998)."""

    @torch.no_grad()
    def reset_parameters(self):
        nn.init.zeros_(self.proj.weight)
        self.proj.bias.copy_(torch.linspace(3.0, 6.0, self.num_heads).repeat(self.num_scans))


class GLADecay(Decay):
    """GLA's gate, one decay per token, head and key channel: log lam = logsigmoid(x W_down W_up + b) / 16
    (a rank-16 projection, FLA's gate_logit_normalizer 16), with FLA's init (Xavier weights of gain 2^-2.5,
    zero bias)."""

    vector = True
    RANK, NORMALIZER = 16, 16.0

    def __init__(self, dim, num_heads, num_scans=1, device=None, dtype=None):
        super().__init__(dim, num_heads, num_scans)
        self.down = nn.Linear(dim, self.RANK, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(self.RANK, num_scans * dim, device=device, dtype=dtype)

    @torch.no_grad()
    def reset_parameters(self):
        for linear in (self.down, self.up):
            nn.init.xavier_uniform_(linear.weight, gain=2 ** -2.5)
        nn.init.zeros_(self.up.bias)

    def forward(self, x):  # [B, L, S * H * Dk] -> [S, B, H, L, Dk]
        logits = in_mask_precision(self.up(self.down(x))).unflatten(-1, (self.num_scans, self.num_heads, -1))
        return (F.logsigmoid(logits) / self.NORMALIZER).permute(2, 0, 3, 1, 4)


class HGRN2Decay(Decay):
    """HGRN-2's forget gate, one decay per token, head and key channel: lam = b + (1 - b) sigmoid(W x + c), above
    a learned lower bound b = sigmoid(beta) per channel (HGRN-2 ties the bounds to grow with depth, which a layer
    does not know: here each layer learns its own, starting near 0). One gate for every scan, since HGRN-2's keys
    are 1 - lam (gates.OneMinusDecay): the two snake scans read the same decays along their orders."""

    vector = True
    shared_by_scans = True

    def __init__(self, dim, num_heads, num_scans=1, device=None, dtype=None):
        super().__init__(dim, num_heads, num_scans)
        self.proj = nn.Linear(dim, dim, device=device, dtype=dtype)
        self.lower_bound_logit = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    @torch.no_grad()
    def reset_parameters(self):
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)
        self.lower_bound_logit.fill_(-6.0)  # b = 0.0025

    def forward(self, x):  # [B, L, H * Dk] -> [S, B, H, L, Dk], the same for every scan
        bound = torch.sigmoid(in_mask_precision(self.lower_bound_logit))
        lam = bound + (1 - bound) * torch.sigmoid(in_mask_precision(self.proj(x)))
        log_decay = torch.log(lam).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
        return log_decay[None].expand(self.num_scans, -1, -1, -1, -1)


class RWKV6Decay(Decay):
    """RWKV-6's data-dependent decay, one per token, head and key channel: log lam = -exp(w + tanh(x A) B), a
    learned base w per channel plus RWKV-6's rank-64 decay projection, with RWKV-6's init: A zero, B uniform in
    [-0.01, 0.01] (every token starts at its channel's base), w_n = -6 + 5 (n / (D - 1))^(0.7 + 1.3 r) over the
    layer's D channels (lam from about 0.998 to 0.69), r its depth ratio, here 1/2 (a layer does not know its
    depth). As the paper's Table 1 writes RWKV-6, in GLA's form: without its token shift and bonus term
    (docs/models.md)."""

    vector = True
    RANK, DEPTH_RATIO = 64, 0.5

    def __init__(self, dim, num_heads, num_scans=1, device=None, dtype=None):
        super().__init__(dim, num_heads, num_scans)
        self.base = nn.Parameter(torch.zeros(num_scans, dim, device=device, dtype=dtype))
        self.down = nn.Linear(dim, self.RANK, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(self.RANK, num_scans * dim, bias=False, device=device, dtype=dtype)

    @torch.no_grad()
    def reset_parameters(self):
        nn.init.zeros_(self.down.weight)
        nn.init.uniform_(self.up.weight, -0.01, 0.01)
        spread = torch.linspace(0, 1, self.dim, dtype=torch.float64) ** (0.7 + 1.3 * self.DEPTH_RATIO)
        self.base.copy_(-6 + 5 * spread)

    def forward(self, x):  # [B, L, S * H * Dk] -> [S, B, H, L, Dk]
        w = in_mask_precision(self.up(torch.tanh(self.down(x)))).unflatten(-1, (self.num_scans, -1))
        log_decay = -(w + in_mask_precision(self.base)).exp()
        return log_decay.unflatten(-1, (self.num_heads, -1)).permute(2, 0, 3, 1, 4)


DECAYS: Dict[str, Type[Decay]] = {"lit": NoDecay, "fixed": PerHeadDecay, "selective": SelectiveDecay,
                                  "retnet": RetNetDecay, "mamba2": Mamba2Decay, "xlstm": XLSTMForgetDecay,
                                  "gla": GLADecay, "hgrn2": HGRN2Decay, "rwkv6": RWKV6Decay}


def register_decay(name: str, kind: Type[Decay]) -> None:
    """Make the Decay subclass `kind` available as LionAttention / LionViT(decay=name)."""
    if not (isinstance(kind, type) and issubclass(kind, Decay)):
        raise TypeError(f"register_decay({name!r}, ...) takes a subclass of lion_vit.decays.Decay (the class, which "
                        f"each layer builds its own of), got {kind!r}")
    DECAYS[name] = kind
