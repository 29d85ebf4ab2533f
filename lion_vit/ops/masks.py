"""Log-space builders for the bidirectional LION mask (paper Eq. 14, DESIGN.md section 1).

    M_ij = prod_{k=j}^{i-1} lam_k   (i > j)      1 (i == j)      prod_{k=i+1}^{j} lam_k   (i < j)

Every entry is exp of a sum of log decays a_k <= 0, built as a difference of cumulative sums
that is <= 0 by construction, so nothing overflows however long the sequence is.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# Above this length the cumulative sums are formed in float64: the exponent of an entry is a
# difference of two sums of up to L terms, whose float32 rounding error (~eps * L * |a|) would
# otherwise reach 1e-4 relative for the entries that matter (|a| ~ 1, L ~ 6000).
FLOAT64_CUMSUM_ABOVE = 512


def mask_dtype(dtype: torch.dtype) -> torch.dtype:
    """Masks and normalisers stay in float32 (or float64) even for half-precision inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _cumsum_dtype(length: int, dtype: torch.dtype) -> torch.dtype:
    """Where log-decay sums over `length` tokens are formed: float64 above FLOAT64_CUMSUM_ABOVE."""
    return torch.float64 if length > FLOAT64_CUMSUM_ABOVE else mask_dtype(dtype)


def _positions(length: int, positions: Optional[Tensor], device: torch.device) -> Tensor:
    return torch.arange(length, device=device) if positions is None else positions


def toeplitz_mask(log_decay: Tensor, length: int, positions: Optional[Tensor] = None) -> Tensor:
    """Fixed-decay (LION-d) mask lam^|p_i - p_j| from a (..., 1) log decay; returns (..., L, L).

    positions: scan position of each token (default: the identity order).
    """
    pos = _positions(length, positions, log_decay.device).to(mask_dtype(log_decay.dtype))
    distance = (pos[:, None] - pos[None, :]).abs()  # [L, L]
    return torch.exp(log_decay.to(distance.dtype)[..., None] * distance)


def _selective_log_parts(log_decay: Tensor, positions: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """Inclusive and exclusive cumsums (in token order) and each token's scan position."""
    length = log_decay.shape[-1]
    a = log_decay.to(_cumsum_dtype(length, log_decay.dtype))
    inclusive = a.cumsum(-1)  # c_i = a_0 + ... + a_i
    exclusive = inclusive - a  # c_{i-1}
    if positions is not None:  # scan order -> token order, O(L)
        inclusive, exclusive = inclusive[..., positions], exclusive[..., positions]
    return inclusive, exclusive, _positions(length, positions, a.device)


def _selective_mask_values(log_decay: Tensor, positions: Optional[Tensor]) -> Tensor:
    inclusive, exclusive, row = _selective_log_parts(log_decay, positions)
    # i >= j: sum_{k=j}^{i-1} a_k = c_{i-1} - c_{j-1};  i < j: sum_{k=i+1}^{j} a_k = c_j - c_i
    lower = exclusive[..., :, None] - exclusive[..., None, :]
    upper = inclusive[..., None, :] - inclusive[..., :, None]
    log_mask = torch.where(row[:, None] >= row[None, :], lower, upper, out=lower)
    return log_mask.exp_().to(mask_dtype(log_decay.dtype))


class _SelectiveMask(torch.autograd.Function):
    """The selective mask with a backward that never forms an L x L temporary beyond G = dM * M.

    With G the gradient with respect to log M, in scan order, A its strict lower triangle and B its
    strict upper one (row sums r, column sums c), a_k lies in the exponent of (i, j) when
    j <= k < i (lower) or i < k <= j (upper), so

        dL/da_k = sum_{i>k, j<=k} A_ij + sum_{i<k, j>=k} B_ij
                = cumsum(c^A - r^A)_k + exclusive_cumsum(r^B - c^B)_k.
    """

    @staticmethod
    def forward(ctx, log_decay: Tensor, positions: Optional[Tensor]) -> Tensor:
        mask = _selective_mask_values(log_decay, positions)
        ctx.save_for_backward(mask, positions)
        ctx.input_dtype = log_decay.dtype
        return mask

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_mask: Tensor) -> Tuple[Tensor, None]:
        mask, positions = ctx.saved_tensors
        length = mask.shape[-1]
        # dL/d(log M) = dL/dM * M, written into the saved mask: nothing reads it after this
        # backward (a second backward through the graph fails autograd's version check).
        grad_log = mask.mul_(grad_mask)  # [..., L, L], token order
        rows, cols = grad_log.sum(-1), grad_log.sum(-2)
        diagonal = grad_log.diagonal(dim1=-2, dim2=-1).clone()
        row = _positions(length, positions, mask.device)
        lower = grad_log.masked_fill_(row[:, None] <= row[None, :], 0.0)  # strictly earlier in the scan
        rows_lower, cols_lower = lower.sum(-1), lower.sum(-2)
        rows_upper, cols_upper = rows - rows_lower - diagonal, cols - cols_lower - diagonal
        work_dtype = _cumsum_dtype(length, mask.dtype)
        from_lower, from_upper = (cols_lower - rows_lower).to(work_dtype), (rows_upper - cols_upper).to(work_dtype)
        if positions is not None:  # token order -> scan order
            order = torch.argsort(positions)
            from_lower, from_upper = from_lower[..., order], from_upper[..., order]
        grad = from_lower.cumsum(-1) + from_upper.cumsum(-1) - from_upper
        return grad.to(ctx.input_dtype), None


def selective_mask(log_decay: Tensor, positions: Optional[Tensor] = None) -> Tensor:
    """Per-token decay (LION-s) mask from (..., L) log decays; returns (..., L, L).

    With `positions` (scan position of each token), log_decay is given in scan order and the mask
    is returned in token order, without ever permuting an L x L matrix.
    """
    return _SelectiveMask.apply(log_decay, positions)  # without autograd: just its forward


def decay_mask(log_decay: Tensor, length: int, positions: Optional[Tensor] = None) -> Tensor:
    """The LION mask for log decays of shape (..., L) (selective) or (..., 1) (fixed).

    positions: for a scan, the scan position of each token; log_decay is then in scan order and
    the mask comes back in token order.
    """
    if log_decay.shape[-1] == 1:
        return toeplitz_mask(log_decay, length, positions)
    return selective_mask(log_decay, positions)
