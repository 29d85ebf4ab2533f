"""The selective mask on a CPU: built a block of rows at a time where its scan allows, each block's
passes in cache, and off the diagonal blocks one multiplication per entry (fill_in_blocks)."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from ..exponents import exact_exponent_exp
from . import budgets


def fill_in_row_blocks(slabs: Tensor, exclusive: Tensor, inclusive: Tensor, positions: Optional[Tensor]) -> bool:
    """Fill slabs [n, L, L] in row blocks of about budgets.MASK_BLOCK rows; False (nothing written) where
    the mask is too small for blocks to pay, or the scan allows no blocks that small (a column snake)."""
    if slabs.numel() < budgets.MASK_BLOCK_MIN_ENTRIES:
        return False
    bounds = row_blocks(slabs.shape[-1], positions, budgets.MASK_BLOCK)
    if max(t - s for s, t in zip(bounds[:-1], bounds[1:])) > 2 * budgets.MASK_BLOCK:
        return False
    fill_in_blocks(slabs, exclusive, inclusive, bounds)
    return True


def row_blocks(length: int, positions: Optional[Tensor], block: int) -> List[int]:
    """Boundaries 0 = b_0 < b_1 < ... < b_n = L of blocks of rows (tokens) of about `block` rows, each
    block's tokens consecutive along the scan, with every token before it coming before it along
    the scan: where the mask factorises off the diagonal (see fill_in_blocks).

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


def fill_in_blocks(mask: Tensor, exclusive: Tensor, inclusive: Tensor, bounds: List[int]) -> None:
    """The mask in token order, a block of rows at a time (bounds from row_blocks): exact on the
    diagonal blocks, and off them an outer product of two factors that are each <= 0 in the
    exponent. With e = c_{.-1} and c non-increasing along the scan, for rows i of a block (scan
    positions [s, t) by row_blocks) and r, R the block's first and last tokens along the scan:

        j before the block:  exp(e_i - e_j) = exp(e_i - e_r) exp(e_r - e_j)
        j after the block:   exp(c_j - c_i) = exp(c_R - c_i) exp(c_j - c_R)

    One multiplication per entry instead of two subtractions, a minimum and an exp (whose slow path
    for results that underflow made small decays cost several times more). Neither factor can
    overflow; where one underflows the product underflows too.
    """
    length = mask.shape[-1]
    for s, t in zip(bounds[:-1], bounds[1:]):
        before, at = exclusive[:, s:t], inclusive[:, s:t]
        mask[:, s:t, s:t] = exact_exponent_exp(before, at)
        if s > 0:
            ref = before.amax(-1, keepdim=True)  # e at the block's first token along the scan
            torch.mul(torch.exp(before - ref).to(mask.dtype)[:, :, None],
                      torch.exp(ref - exclusive[:, :s]).to(mask.dtype)[:, None, :], out=mask[:, s:t, :s])
        if t < length:
            ref = at.amin(-1, keepdim=True)  # c at its last token along the scan
            torch.mul(torch.exp(ref - at).to(mask.dtype)[:, :, None],
                      torch.exp(inclusive[:, t:] - ref).to(mask.dtype)[:, None, :], out=mask[:, s:t, t:])
