"""Patch orders for the multi-scan ("natural") LION variants.

An order lists, for each scan position, the token index it reads. Tokens are the prefix tokens
(class token, ...) followed by the h x w patch grid in row-major order; prefix tokens open every
scan. Orders depend only on (h, w), so any resolution, rectangular included, gets its own.
"""
from __future__ import annotations

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
