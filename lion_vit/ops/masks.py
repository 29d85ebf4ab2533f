"""The bidirectional LION mask in log space (paper Eq. 14, docs/design.md section 1).

    M_ij = prod_{k=j}^{i-1} lam_k   (i after j along the scan)   1 (i == j)   prod_{k=i+1}^{j} lam_k   (i before j)

Every entry is exp of a sum of log decays a_k <= 0, formed as a difference of cumulative sums that
is <= 0 by construction, so nothing overflows however long the sequence is. Plain tensor ops:
autograd differentiates them, twice if asked.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

# Above this length the cumulative sums are formed in float64: an exponent is a difference of two
# sums of up to L terms, whose float32 rounding (about eps * L * |a|) would otherwise reach 1e-4
# relative for the entries that matter (|a| ~ 1, L ~ 6000).
FLOAT64_CUMSUM_ABOVE = 512


def mask_dtype(dtype: torch.dtype) -> torch.dtype:
    """Masks are built in float32 (or float64) even for half-precision inputs (masked_scores then rounds them
    to the scores' dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_scores(q: Tensor, k: Tensor, mask: Tensor) -> Tensor:
    """Q K^T * M in the dtype the scores come out in (autocast's): the mask is rounded to it, not the scores
    widened to the mask's float32, since the product with V rounds the weights to that dtype anyway."""
    scores = q @ k.transpose(-1, -2)
    return scores * mask.to(scores.dtype)


def decay_mask(log_decay: Tensor, length: int, order: Optional[Tensor] = None) -> Tensor:
    """M [..., L, L] in token order from log decays [..., L] (one per token) or [..., 1] (one per head,
    LION-d's Toeplitz mask lam^|i-j|), given in token order.

    order: [L], the token read at each scan position (None: token order). The mask is that of the
    sequence read along the scan, mapped back to token order.
    """
    device, dtype = log_decay.device, mask_dtype(log_decay.dtype)
    position = torch.arange(length, device=device) if order is None else torch.argsort(order)  # token -> scan
    if log_decay.shape[-1] == 1:  # log M_ij = a |p_i - p_j|
        distance = (position[:, None] - position[None, :]).abs().to(dtype)
        return torch.exp(log_decay.to(dtype)[..., None] * distance)
    a = log_decay.to(torch.float64 if length > FLOAT64_CUMSUM_ABOVE else dtype)
    if order is not None:
        a = a[..., order]  # into scan order, where the sums run
    inclusive = a.cumsum(-1)  # c_p = a_0 + ... + a_p along the scan
    exclusive = inclusive - a  # c_{p-1}
    if order is not None:
        inclusive, exclusive = inclusive[..., position], exclusive[..., position]  # back to token order
    after = position[:, None] > position[None, :]  # query i reads key j from its past along the scan
    # differences as sums with negated vectors: the backward of a broadcast subtraction would negate the
    # whole L x L gradient, that of a sum passes it on (bit for bit the same exponents)
    exponent = torch.where(after, exclusive[..., :, None] + (-exclusive)[..., None, :],
                           inclusive[..., None, :] + (-inclusive)[..., :, None])
    return torch.exp(exponent.to(dtype))
