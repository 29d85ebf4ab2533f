"""Bidirectional RNN form of LION (paper Eq. 79-80, DESIGN.md section 1).

    forward:  S_i = lam_{i-1} S_{i-1} + k_i [v_i, 1]^T      y^F_i = q_i^T S_i
    backward: the same recurrence on the reversed sequence (reverse=True)
    output:   y^F_i + y^B_i - (q_i^T k_i) [v_i, 1]            (the diagonal is counted once)

Memory is O(L d) for the outputs plus one O(d^2) state per direction: no L x L matrix.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _scan(q: Tensor, k: Tensor, v1: Tensor, decay: Optional[Tensor], reverse: bool) -> Tensor:
    """One direction: y_i = q_i^T S_i with S_i = lam_prev * S_prev + k_i v1_i^T."""
    batch, heads, length, dk = q.shape
    steps = range(length - 1, -1, -1) if reverse else range(length)
    state = q.new_zeros(batch, heads, dk, v1.shape[-1])  # [B, H, Dk, Dv+1]
    outputs = [None] * length
    previous = None
    for i in steps:
        if previous is not None and decay is not None:
            state = state * decay[:, :, previous, None, None]
        state = torch.addcmul(state, k[:, :, i, :, None], v1[:, :, i, None, :])
        outputs[i] = (q[:, :, i, None, :] @ state)  # [B, H, 1, Dv+1]
        previous = i
    return torch.cat(outputs, dim=2)


def recurrent_unnormalized(q: Tensor, k: Tensor, v1: Tensor, log_decay: Optional[Tensor],
                           chunk_size: Optional[int] = None) -> Tensor:
    """Return (Q K^T * M) v1 computed by the forward and backward recurrences.

    q, k: [B, H, L, Dk]; v1: [B, H, L, Dv + 1]; log_decay: None or broadcastable to [B, H, L].
    """
    del chunk_size
    decay = None
    if log_decay is not None:
        decay = torch.exp(log_decay).to(q.dtype).expand(q.shape[:3])  # [B, H, L]
    forward = _scan(q, k, v1, decay, reverse=False)
    backward = _scan(q, k, v1, decay, reverse=True)
    diagonal = (q * k).sum(-1, keepdim=True) * v1
    return forward + backward - diagonal
