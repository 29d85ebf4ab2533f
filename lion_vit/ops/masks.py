"""Log-space builders for the bidirectional LION mask (paper Eq. 14, docs/design.md section 1).

    M_ij = prod_{k=j}^{i-1} lam_k   (i > j)      1 (i == j)      prod_{k=i+1}^{j} lam_k   (i < j)

Every entry is exp of a sum of log decays a_k <= 0, built as a difference of cumulative sums
that is <= 0 by construction, so nothing overflows however long the sequence is.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import cpu
from .cpu import masks as cpu_masks
from .exponents import exact_exponent_exp, exp_nonpositive
from .rows import tracing

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


def _distance(length: int, positions: Optional[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """|p_i - p_j| [L, L]: the exponent of lam in a fixed-decay mask."""
    pos = _positions(length, positions, device).to(mask_dtype(dtype))
    return (pos[:, None] - pos[None, :]).abs()


def toeplitz_mask(log_decay: Tensor, length: int, positions: Optional[Tensor] = None) -> Tensor:
    """Fixed-decay (LION-d) mask lam^|p_i - p_j| from a (..., 1) log decay; returns (..., L, L).

    positions: scan position of each token (default: the identity order).
    """
    distance = _distance(length, positions, log_decay.dtype, log_decay.device)
    return exp_nonpositive(log_decay.to(distance.dtype)[..., None] * distance)


def _selective_log_parts(log_decay: Tensor, positions: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Inclusive and exclusive cumsums of the log decays, in token order."""
    length = log_decay.shape[-1]
    a = log_decay.to(_cumsum_dtype(length, log_decay.dtype))
    inclusive = a.cumsum(-1)  # c_i = a_0 + ... + a_i
    exclusive = inclusive - a  # c_{i-1}
    if positions is not None:  # scan order -> token order, O(L)
        inclusive, exclusive = inclusive[..., positions], exclusive[..., positions]
    return inclusive, exclusive


def _slab_groups(count: int, length: int, dtype: torch.dtype, device: torch.device) -> Iterator[slice]:
    """Slices of `count` L x L slabs that the selective mask's several passes walk one after the other.

    On a CPU each group is about cpu.budgets.MASK_GROUP_BYTES, so that every pass after the first finds the group
    in the last-level cache instead of memory; a GPU takes all slabs at once.
    """
    if tracing():  # all at once: a traced graph must not depend on the batch size it was traced with
        yield slice(None)
        return
    slab_bytes = length * length * torch.finfo(dtype).bits // 8
    per_group = cpu.groups.group_size(count, slab_bytes, cpu.budgets.MASK_GROUP_BYTES, device)
    for start in range(0, count, per_group):
        yield slice(start, start + per_group)


def _selective_mask_values(log_decay: Tensor, positions: Optional[Tensor]) -> Tensor:
    inclusive, exclusive = _selective_log_parts(log_decay, positions)
    *lead, length = inclusive.shape
    inclusive, exclusive = inclusive.reshape(-1, length), exclusive.reshape(-1, length)
    # returned whole, not as a view of `slabs` (an autograd Function's output must not be a view to
    # be written in place later, as a multi-scan layer does)
    mask = torch.empty(*lead, length, length, dtype=mask_dtype(log_decay.dtype), device=inclusive.device)
    slabs = mask.view(-1, length, length)
    # (a GPU or a compiler: a few kernels beat a loop over blocks)
    if cpu.groups.tuned(mask.device) and cpu_masks.fill_in_row_blocks(slabs, exclusive, inclusive, positions):
        return mask
    in_place = mask.dtype == inclusive.dtype and not tracing()
    for group in _slab_groups(slabs.shape[0], length, inclusive.dtype, mask.device):
        before, at = exclusive[group], inclusive[group]
        values = exact_exponent_exp(before, at, out=slabs[group] if in_place else None)
        if not in_place:
            slabs[group] = values
    return mask


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
        # dL/d(log M) = dL/dM * M, formed in the saved mask: nothing reads it after this backward
        # (a second backward through the graph fails autograd's version check).
        return _selective_log_decay_grad(mask, grad_mask, positions, ctx.input_dtype), None


def _selective_log_decay_grad(buffer: Tensor, factor: Optional[Tensor], positions: Optional[Tensor],
                              input_dtype: torch.dtype) -> Tensor:
    """dL/d(log decays) [..., L] of a selective mask, from G = dL/d(log M) = buffer * factor [..., L, L]
    (factor None: G = buffer).

    G is formed in `buffer` (overwritten) one slab group at a time, each group reduced while it is
    in cache. See _SelectiveMask for the formula.
    """
    *lead, length = buffer.shape[:-1]
    row = _positions(length, positions, buffer.device)
    # 1 where token j comes strictly before token i in the scan (a float product: masked_fill_
    # with a broadcast boolean mask is several times slower on a CPU)
    earlier = (row[:, None] > row[None, :]).to(buffer.dtype)
    grad_log = buffer.view(-1, length, length)
    factor = None if factor is None else factor.reshape(-1, length, length)
    rows, cols, diagonal, rows_lower, cols_lower = grad_log.new_empty(5, grad_log.shape[0], length)
    for group in _slab_groups(grad_log.shape[0], length, buffer.dtype, buffer.device):
        g = grad_log[group] if factor is None else grad_log[group].mul_(factor[group])
        torch.sum(g, -1, out=rows[group])
        torch.sum(g, -2, out=cols[group])
        diagonal[group] = g.diagonal(dim1=-2, dim2=-1)
        lower = g.mul_(earlier)
        torch.sum(lower, -1, out=rows_lower[group])
        torch.sum(lower, -2, out=cols_lower[group])
    rows_upper, cols_upper = rows - rows_lower - diagonal, cols - cols_lower - diagonal
    work_dtype = _cumsum_dtype(length, buffer.dtype)
    from_lower, from_upper = (cols_lower - rows_lower).to(work_dtype), (rows_upper - cols_upper).to(work_dtype)
    if positions is not None:  # token order -> scan order
        order = torch.argsort(positions)
        from_lower, from_upper = from_lower[..., order], from_upper[..., order]
    grad = from_lower.cumsum(-1) + from_upper.cumsum(-1) - from_upper
    return grad.view(*lead, length).to(input_dtype)


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


def decay_mask_backward(buffer: Tensor, factor: Tensor, log_decay: Tensor,
                        positions: Optional[Tensor] = None) -> Tensor:
    """dL/d(log_decay) for M = decay_mask(log_decay, L, positions), from G = dL/d(log M) = buffer * factor.

    buffer, factor: [..., L, L], broadcast over M's shape; `buffer` is overwritten. An op that keeps
    W = S * M can pass (W, dL/dW) here instead of (M, dL/dM = dL/dW * S) and need not keep S.
    """
    length = buffer.shape[-1]
    mask_shape = log_decay.shape[:-1] + (length, length)
    if log_decay.shape[-1] != 1:
        if buffer.shape == mask_shape:  # G formed group by group inside the reduction, in cache
            return _selective_log_decay_grad(buffer, factor, positions, log_decay.dtype)
        grad_log = buffer.mul_(factor).sum_to_size(mask_shape)  # a mask broadcast over the batch
        return _selective_log_decay_grad(grad_log, None, positions, log_decay.dtype)
    # log M = a |p_i - p_j|:  dL/da = sum_ij G_ij |p_i - p_j|, one matrix-vector product per slab
    distance = _distance(length, positions, buffer.dtype, buffer.device)
    grad_log = buffer.mul_(factor).flatten(-2) @ distance.flatten()  # [..., ] over every slab
    return grad_log.sum_to_size(log_decay.shape[:-1]).unsqueeze(-1).to(log_decay.dtype)


def positions_per_scan(positions: Optional[Tensor], num_scans: int) -> List[Optional[Tensor]]:
    """Each scan's positions [L] (scan position of each token), or None for token order."""
    return [None] * num_scans if positions is None else list(positions.unbind(0))
