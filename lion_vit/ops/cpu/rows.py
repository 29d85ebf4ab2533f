"""lion_vit.ops.chunk.chunk_form and lion_vit.ops.vector.vector_form in groups of (batch, head) rows."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import chunk, vector

# Bytes of [L, Dv + 1] values per group (a tuning hook: tests shrink it to one row per group). The
# measurements behind it: docs/benchmarks.md, "The portable core".
GROUP_BYTES = 2 << 20


def chunk_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor] = None,
               chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """The portable chunk form (same arguments and results) run on groups of about GROUP_BYTES of rows,
    the results concatenated."""
    return _in_row_groups(chunk.chunk_form, q, k, v, log_decays, orders, chunk_size=chunk_size)


def vector_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Tensor, orders: Optional[Tensor] = None,
                chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """The portable vector-decay form the same way, its chunks at once within a group (a group's temporaries
    are whole sequences of a few rows, and its operations a few per chunk size, not tens per chunk), each
    group's leaves as large as its decays allow (vector.leaf_tokens)."""
    return _in_row_groups(vector.vector_form, q, k, v, log_decays, orders, chunk_size=chunk_size,
                          chunks_at_once=True, leaf_size=None)


def _in_row_groups(form, q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor],
                   **kwargs) -> Tuple[Tensor, Tensor]:
    batch, heads, length, value_dim = v.shape
    per_group = max(1, GROUP_BYTES // (length * (value_dim + 1) * torch.finfo(v.dtype).bits // 8))
    rows = [t.flatten(0, 1)[:, None] for t in (q, k, v)]  # [B * H, 1, L, D]
    if log_decays is not None:  # [S, B|1, H|1, ...] -> [S, B * H, 1, ...]
        log_decays = log_decays.expand(len(log_decays), batch, heads, *log_decays.shape[3:]).flatten(1, 2)[:, :, None]
    # (split, not slices: its backward is one concatenation where each slice's writes a zero-filled copy)
    groups = [t.split(per_group) for t in rows]
    groups.append([None] * len(groups[0]) if log_decays is None else log_decays.split(per_group, dim=1))
    parts = [form(q_rows, k_rows, v_rows, a_rows, orders, **kwargs) for q_rows, k_rows, v_rows, a_rows in zip(*groups)]
    return tuple(torch.cat(group, dim=0).unflatten(0, (batch, heads))[:, :, 0] for group in zip(*parts))
