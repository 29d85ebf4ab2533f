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

from .rows import cpu_tuned, group_size, tracing

# Above this length the cumulative sums are formed in float64: the exponent of an entry is a
# difference of two sums of up to L terms, whose float32 rounding error (~eps * L * |a|) would
# otherwise reach 1e-4 relative for the entries that matter (|a| ~ 1, L ~ 6000).
FLOAT64_CUMSUM_ABOVE = 512

# On a CPU the selective mask's L x L passes walk (batch, head) slabs in groups of about this many
# bytes (a few per group fit a 16 MiB last-level cache), so that its backward's product and four
# reductions read each group from cache instead of memory after the first pass.
CPU_GROUP_BYTES = 4 << 20


# On a CPU a selective mask is built a block of about this many rows at a time where its scan allows
# (token order, a row snake; see _row_blocks, _fill_in_blocks), so that each block's passes stay in cache.
CPU_MASK_BLOCK = 32

# ... when it has at least this many entries: on smaller masks (batch-1 inference) the blocks' fixed
# cost per op outweighs what they save. (The timings behind both numbers: docs/benchmarks.md.)
CPU_MASK_BLOCK_MIN_ENTRIES = 1 << 20


# Just above the log of float32's smallest normal number (-87.34): exp() below it gives a denormal
# or 0, which a CPU's vectorised exp computes on a slow path, 5-14x slower than the normal range
# (and so it does right at the boundary: hence a margin).
_FLOAT32_EXP_FLOOR = -87.0


def _exp_nonpositive(exponent: Tensor) -> Tensor:
    """exp of a mask exponent (<= 0). In float32 on a CPU the exponent is first raised to at least
    -87, so no entry takes exp's slow underflow path: entries below exp(-87) = 1.6e-38 (next to the
    diagonal's 1, nothing a float32 sum can see) become 1.6e-38. In place when autograd does not
    need the exponent."""
    if exponent.dtype == torch.float32 and exponent.device.type == "cpu":
        exponent = exponent.clamp_min(_FLOAT32_EXP_FLOOR) if exponent.requires_grad else \
            exponent.clamp_min_(_FLOAT32_EXP_FLOOR)
    return exponent.exp() if exponent.requires_grad else exponent.exp_()


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
    return _exp_nonpositive(log_decay.to(distance.dtype)[..., None] * distance)


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

    On a CPU each group is about CPU_GROUP_BYTES, so that every pass after the first finds the group
    in the last-level cache instead of memory; a GPU takes all slabs at once.
    """
    if tracing():  # all at once: a traced graph must not depend on the batch size it was traced with
        yield slice(None)
        return
    per_group = group_size(count, length * length * torch.finfo(dtype).bits // 8, CPU_GROUP_BYTES, device)
    for start in range(0, count, per_group):
        yield slice(start, start + per_group)


def _exact_exponent_exp(before: Tensor, at: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """The mask [n, l, l] among l tokens of one scan (in any order, e.g. token order) from their
    exclusive (`before`, c_{i-1}) and inclusive (`at`, c_i) log-decay sums along the scan, [n, l].

    Below the diagonal the exponent is c_{i-1} - c_{j-1} <= 0, above it c_j - c_i <= 0; the other
    expression is >= 0 on each side (the sums are monotone), so their minimum is the exponent
    everywhere, with no position test.
    """
    upper = at[:, None, :] - at[:, :, None]
    if tracing():
        return _exp_nonpositive(torch.minimum(before[:, :, None] - before[:, None, :], upper))
    lower = torch.sub(before[:, :, None], before[:, None, :], out=out)
    return _exp_nonpositive(torch.minimum(lower, upper, out=lower))


def _row_blocks(length: int, positions: Optional[Tensor], block: int) -> List[int]:
    """Boundaries 0 = b_0 < b_1 < ... < b_n = L of blocks of rows (tokens) of about `block` rows, each
    block's tokens consecutive along the scan, with every token before it coming before it along
    the scan: where the mask factorises off the diagonal (see _fill_in_blocks).

    Token order: any b; a row snake: a grid row ends one, as may any token of a row read left to
    right; a column snake: none but 0 and L (a token-order block spans every column).
    """
    if positions is None:  # every b qualifies
        return list(range(0, length, block)) + [length]
    # b qualifies when tokens [0, b) are the scan's first b: their largest scan position is b - 1
    first_b = positions.cummax(0).values == torch.arange(length, device=positions.device)
    valid = [0] + (first_b.nonzero().flatten() + 1).tolist()
    bounds = [0]
    for index, b in enumerate(valid[1:], start=1):
        following = valid[index + 1] if index + 1 < len(valid) else None
        if following is None or following - bounds[-1] > block:
            bounds.append(b)
    return bounds


def _fill_in_blocks(mask: Tensor, exclusive: Tensor, inclusive: Tensor, bounds: List[int]) -> None:
    """The mask in token order, a block of rows at a time (bounds from _row_blocks): exact on the
    diagonal blocks, and off them an outer product of two factors that are each <= 0 in the
    exponent. With e = c_{.-1} and c non-increasing along the scan, for rows i of a block (scan
    positions [s, t) by _row_blocks) and r, R the block's first and last tokens along the scan:

        j before the block:  exp(e_i - e_j) = exp(e_i - e_r) exp(e_r - e_j)
        j after the block:   exp(c_j - c_i) = exp(c_R - c_i) exp(c_j - c_R)

    One multiplication per entry instead of two subtractions, a minimum and an exp (whose slow path
    for results that underflow made small decays cost several times more). Neither factor can
    overflow; where one underflows the product underflows too.
    """
    length = mask.shape[-1]
    for s, t in zip(bounds[:-1], bounds[1:]):
        before, at = exclusive[:, s:t], inclusive[:, s:t]
        mask[:, s:t, s:t] = _exact_exponent_exp(before, at)
        if s > 0:
            ref = before.amax(-1, keepdim=True)  # e at the block's first token along the scan
            torch.mul(torch.exp(before - ref).to(mask.dtype)[:, :, None],
                      torch.exp(ref - exclusive[:, :s]).to(mask.dtype)[:, None, :], out=mask[:, s:t, :s])
        if t < length:
            ref = at.amin(-1, keepdim=True)  # c at its last token along the scan
            torch.mul(torch.exp(ref - at).to(mask.dtype)[:, :, None],
                      torch.exp(inclusive[:, t:] - ref).to(mask.dtype)[:, None, :], out=mask[:, s:t, t:])


def _selective_mask_values(log_decay: Tensor, positions: Optional[Tensor]) -> Tensor:
    inclusive, exclusive = _selective_log_parts(log_decay, positions)
    *lead, length = inclusive.shape
    inclusive, exclusive = inclusive.reshape(-1, length), exclusive.reshape(-1, length)
    # returned whole, not as a view of `slabs` (an autograd Function's output must not be a view to
    # be written in place later, as a multi-scan layer does)
    mask = torch.empty(*lead, length, length, dtype=mask_dtype(log_decay.dtype), device=inclusive.device)
    slabs = mask.view(-1, length, length)
    # (a GPU or a compiler: a few kernels beat a loop over blocks)
    if cpu_tuned(mask.device) and slabs.numel() >= CPU_MASK_BLOCK_MIN_ENTRIES:
        bounds = _row_blocks(length, positions, CPU_MASK_BLOCK)
        if max(t - s for s, t in zip(bounds[:-1], bounds[1:])) <= 2 * CPU_MASK_BLOCK:  # else: grouped below
            _fill_in_blocks(slabs, exclusive, inclusive, bounds)
            return mask
    in_place = mask.dtype == inclusive.dtype and not tracing()
    for group in _slab_groups(slabs.shape[0], length, inclusive.dtype, mask.device):
        before, at = exclusive[group], inclusive[group]
        values = _exact_exponent_exp(before, at, out=slabs[group] if in_place else None)
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
