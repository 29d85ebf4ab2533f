"""Log-space builders for the bidirectional LION mask (paper Eq. 14, DESIGN.md section 1).

    M_ij = prod_{k=j}^{i-1} lam_k   (i > j)      1 (i == j)      prod_{k=i+1}^{j} lam_k   (i < j)

Every entry is exp of a sum of log decays a_k <= 0, built as a difference of cumulative sums
that is <= 0 by construction, so nothing overflows however long the sequence is.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

# Above this length the cumulative sums are formed in float64: the exponent of an entry is a
# difference of two sums of up to L terms, whose float32 rounding error (~eps * L * |a|) would
# otherwise reach 1e-4 relative for the entries that matter (|a| ~ 1, L ~ 6000).
FLOAT64_CUMSUM_ABOVE = 512


def mask_dtype(dtype: torch.dtype) -> torch.dtype:
    """Masks and normalisers stay in float32 (or float64) even for half-precision inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _positions(length: int, positions: Optional[Tensor], device: torch.device) -> Tensor:
    return torch.arange(length, device=device) if positions is None else positions


def toeplitz_mask(log_decay: Tensor, length: int, positions: Optional[Tensor] = None) -> Tensor:
    """Fixed-decay (LION-d) mask lam^|p_i - p_j| from a (..., 1) log decay; returns (..., L, L).

    positions: scan position of each token (default: the identity order).
    """
    pos = _positions(length, positions, log_decay.device).to(mask_dtype(log_decay.dtype))
    distance = (pos[:, None] - pos[None, :]).abs()  # [L, L]
    return torch.exp(log_decay.to(distance.dtype)[..., None] * distance)


def selective_mask(log_decay: Tensor, positions: Optional[Tensor] = None) -> Tensor:
    """Per-token decay (LION-s) mask from (..., L) log decays; returns (..., L, L).

    With `positions` (scan position of each token), log_decay is given in scan order and the mask
    is returned in token order, without ever permuting an L x L matrix.
    """
    length = log_decay.shape[-1]
    out_dtype = mask_dtype(log_decay.dtype)
    work_dtype = torch.float64 if length > FLOAT64_CUMSUM_ABOVE else out_dtype
    a = log_decay.to(work_dtype)
    inclusive = a.cumsum(-1)  # c_i = a_0 + ... + a_i
    exclusive = inclusive - a  # c_{i-1}
    if positions is not None:  # scan order -> token order, O(L)
        inclusive, exclusive = inclusive[..., positions], exclusive[..., positions]
    # i >= j: sum_{k=j}^{i-1} a_k = c_{i-1} - c_{j-1};  i < j: sum_{k=i+1}^{j} a_k = c_j - c_i
    lower = exclusive[..., :, None] - exclusive[..., None, :]
    upper = inclusive[..., None, :] - inclusive[..., :, None]
    row = _positions(length, positions, a.device)
    log_mask = torch.where(row[:, None] >= row[None, :], lower, upper)
    return torch.exp(log_mask.to(out_dtype))


def decay_mask(log_decay: Tensor, length: int, positions: Optional[Tensor] = None) -> Tensor:
    """The LION mask for log decays of shape (..., L) (selective) or (..., 1) (fixed).

    positions: for a scan, the scan position of each token; log_decay is then in scan order and
    the mask comes back in token order.
    """
    if log_decay.shape[-1] == 1:
        return toeplitz_mask(log_decay, length, positions)
    return selective_mask(log_decay, positions)
