"""Patch orders for the multi-scan ("natural") LION variants.

An order lists, for each scan position, the token index it reads. Tokens are the prefix tokens
(class token, ...) followed by the h x w patch grid in row-major order; prefix tokens open every
scan. Orders depend only on (h, w), so any resolution, rectangular included, gets its own.
`over_scans` runs a one-scan form along each order and sums the results in token order.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor


def row_snake(height: int, width: int) -> Tensor:
    """Row-wise boustrophedon: row 0 left to right, row 1 right to left, ..."""
    grid = torch.arange(height * width).view(height, width)
    grid[1::2] = grid[1::2].flip(-1)
    return grid.flatten()


def column_snake(height: int, width: int) -> Tensor:
    """Column-wise boustrophedon: column 0 top to bottom, column 1 bottom to top, ..."""
    grid = torch.arange(height * width).view(height, width).t().contiguous()  # [w, h]
    grid[1::2] = grid[1::2].flip(-1)
    return grid.flatten()


def snake_orders(height: int, width: int, num_prefix_tokens: int = 0) -> Tensor:
    """[2, prefix + h * w] orders (row snake, column snake), prefix tokens first in both."""
    prefix = torch.arange(num_prefix_tokens)
    return torch.stack([torch.cat([prefix, scan(height, width) + num_prefix_tokens])
                        for scan in (row_snake, column_snake)])


def over_scans(one_scan: Callable[..., Tuple[Tensor, Tensor]], q: Tensor, k: Tensor, v: Tensor,
               log_decays: Optional[Tensor], orders: Optional[Tensor], reads_orders: bool = False,
               **kwargs: Any) -> Tuple[Tensor, Optional[Tensor]]:
    """sum_s of a one-scan form's (numerator, normaliser) along scan s: q, k, v and per-token decays read
    in the scan's order, the results put back in token order. log_decays: None or [S, ...] in token
    order, their tokens along the last dim; orders: [S, L], or None for one scan in token order.
    reads_orders: one_scan takes the scan's order (order=) beside its inputs in token order, and returns its
    results in token order (it reads along the order itself)."""
    if orders is None:
        return one_scan(q, k, v, None if log_decays is None else log_decays[0], **kwargs)
    total = None
    for s, order in enumerate(orders.unbind(0)):
        a = None if log_decays is None else log_decays[s]
        if reads_orders:
            parts = one_scan(q, k, v, a, order=order, **kwargs)
        else:
            if a is not None and a.shape[-1] != 1:
                a = a.index_select(-1, order)
            parts = one_scan(*(t.index_select(-2, order) for t in (q, k, v)), a, **kwargs)
            parts = [None if t is None else t.index_select(-2, torch.argsort(order)) for t in parts]
        # (None: a result the form was not asked for, the normaliser where nothing reads it)
        total = parts if total is None else [None if t is None else t + part for t, part in zip(total, parts)]
    return total[0], total[1]
