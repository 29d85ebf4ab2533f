"""A LION call in groups of (batch, head) rows, and the vector form as the cpu backend runs it."""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
from torch import Tensor

from .. import vector
from . import chunks

# Bytes of [L, Dv + 1] values per group (a tuning hook: tests shrink it to one row per group). The
# measurements behind it: docs/benchmarks.md, "The portable core".
GROUP_BYTES = 2 << 20

# vector.vector_form with each group's chunks at once (a group's temporaries are whole sequences of a few rows,
# and its operations a few per chunk size, not tens per chunk) and leaves as large as the group's decays allow
# (vector.leaf_tokens, read eagerly from the values); in training the same chunks with a hand-written backward
# (chunks.py), where autograd's backward of the portable form makes tens of passes over [L, Dk] tensors
vector_form = partial(vector.vector_form, chunks_at_once=True, leaf_size=None)
trained_vector_form = partial(vector.vector_form, chunks_at_once=chunks.at_once, leaf_size=None)


def in_row_groups(call: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor],
                  orders: Optional[Tensor], **kwargs) -> Tensor:
    """call(q, k, v, log_decays, orders, **kwargs) -> Y [B, H, L, Dv] on groups of about GROUP_BYTES of rows, the
    results concatenated: a whole call (features, form, division) per group, so that nothing but the inputs and Y
    is the batch's size. Groups are whole images where one fits, else heads of one image; split, never sliced or
    flattened (a slice's backward writes a zero-filled copy of the whole batch, and flattening a layer's views
    of its projection copies them)."""
    batch, heads, length, value_dim = v.shape
    if not v.numel():  # no rows (or no tokens): nothing to group
        return call(q, k, v, log_decays, orders, **kwargs)
    per_group = max(1, GROUP_BYTES // (length * (value_dim + 1) * torch.finfo(v.dtype).bits // 8))
    images, group_heads = max(1, per_group // heads), min(heads, per_group)
    if log_decays is not None:  # [S, B|1, H|1, ...] -> [S, B, H, ...], views
        log_decays = log_decays.expand(len(log_decays), batch, heads, *log_decays.shape[3:])
    decays = [None] * -(-batch // images) if log_decays is None else log_decays.split(images, dim=1)
    outputs = []
    for q_rows, k_rows, v_rows, a_rows in zip(q.split(images), k.split(images), v.split(images), decays):
        parts = [call(*group, orders, **kwargs) for group in zip(
            q_rows.split(group_heads, 1), k_rows.split(group_heads, 1), v_rows.split(group_heads, 1),
            [None] * -(-heads // group_heads) if a_rows is None else a_rows.split(group_heads, dim=2))]
        outputs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
