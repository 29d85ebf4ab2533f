"""Strictly positive feature maps phi for queries and keys (positive features keep every
normaliser q_i^T sum_j M_ij k_j > 0)."""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch import Tensor

from .rows import fx_tracing


def elu_plus_one(x: Tensor) -> Tensor:
    """ELU(x) + 1 (Katharopoulos et al., the linear transformer)."""
    return F.elu(x) + 1.0


def shifted_silu(x: Tensor) -> Tensor:
    """SiLU(x) + 0.5; SiLU >= -0.279, so the result is >= 0.22."""
    return F.silu(x).add_(0.5)  # in place: SiLU's backward reads its input, not its output


class _NormalizedShiftedSilu(torch.autograd.Function):
    """y = s / ||s||, s = SiLU(x) + 0.5, with a backward of four elementwise passes (autograd's
    chain of add, norm and div takes about twice as many)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        y = F.silu(x).add_(0.5)
        norm = torch.linalg.vector_norm(y, dim=-1, keepdim=True)  # >= 0.22 sqrt(D): never zero
        y.div_(norm)
        ctx.save_for_backward(x, y, norm)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> Tensor:
        x, y, norm = ctx.saved_tensors
        # d/ds of s / ||s||  is  (g - y (y . g)) / ||s||;  then through SiLU
        grad_s = torch.addcmul(grad, y, -(grad * y).sum(-1, keepdim=True)).div_(norm)
        return torch.ops.aten.silu_backward(grad_s, x)


def normalized_shifted_silu(x: Tensor) -> Tensor:
    """(SiLU(x) + 0.5) / ||SiLU(x) + 0.5||: the paper's choice for every LION variant."""
    if fx_tracing():  # an autograd Function cannot take fx's symbols: the same function in plain ops
        y = F.silu(x) + 0.5
        return y / torch.linalg.vector_norm(y, dim=-1, keepdim=True)
    return _NormalizedShiftedSilu.apply(x)


FeatureMap = Callable[[Tensor], Tensor]

# name -> (map for queries, map for keys). Scale() divides each row by its sum, so a positive
# factor on q_i cancels: normalising the queries changes nothing and is skipped (exactly the
# same function as normalising both, for less work).
FEATURE_MAPS: Dict[str, Tuple[FeatureMap, FeatureMap]] = {
    "silu_norm": (shifted_silu, normalized_shifted_silu),
    "silu": (shifted_silu, shifted_silu),
    "elu": (elu_plus_one, elu_plus_one),
}


def get_feature_map(name: str) -> Tuple[FeatureMap, FeatureMap]:
    """(query map, key map) for a feature map name."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature_map {name!r}; choose one of {sorted(FEATURE_MAPS)}")
    return FEATURE_MAPS[name]
