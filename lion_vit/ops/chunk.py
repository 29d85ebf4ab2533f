"""Chunkwise LION: masked attention inside each chunk plus state passing between chunks.

The sequence is cut into N chunks of C tokens (the last one zero-padded). For a query at local
position p of chunk n (local inclusive log-decay cumsum c_p, exclusive e_p = c_p - a_p, chunk
total T_n):

    intra:     the LION mask restricted to the chunk, [C, C] per chunk
    forward:   q_p exp(e_p) . F_n,   F_0 = 0,   F_{n+1} = exp(T_n) F_n + sum_r exp(T_n - e_r) k_r v1_r^T
    backward:  q_p exp(T_n - c_p) . G_n,   G_{N-1} = 0,   G_{n-1} = exp(T_n) G_n + sum_r exp(c_r) k_r v1_r^T

Every exponent is a sum of log decays, so <= 0. Peak memory is O(L C + (L / C) d^2): linear in L
for a fixed chunk size. Any chunk size from 1 to L works; C >= L is the full form.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import decay_mask, mask_dtype


def _carry(contributions: Tensor, chunk_decay: Optional[Tensor], reverse: bool) -> Tensor:
    """States entering each chunk: exclusive decayed prefix (or suffix) sums over chunks.

    contributions: [B, H, N, Dk, Dv+1]; chunk_decay: exp(T_n), [B, H, N] or None.
    """
    num_chunks = contributions.shape[2]
    order = range(num_chunks - 1, -1, -1) if reverse else range(num_chunks)
    states = [None] * num_chunks
    state = torch.zeros_like(contributions[:, :, 0])
    previous = None
    for n in order:
        if previous is not None:
            if chunk_decay is not None:
                state = state * chunk_decay[:, :, previous, None, None]
            state = state + contributions[:, :, previous]
        states[n] = state
        previous = n
    return torch.stack(states, dim=2)


def chunk_unnormalized(q: Tensor, k: Tensor, v1: Tensor, log_decay: Optional[Tensor],
                       chunk_size: Optional[int] = None) -> Tensor:
    """Return (Q K^T * M) v1 chunk by chunk (see module docstring).

    q, k: [B, H, L, Dk]; v1: [B, H, L, Dv + 1]; log_decay: None or broadcastable to [B, H, L].
    """
    batch, heads, length, dk = q.shape
    size = length if chunk_size is None else min(chunk_size, length)
    num_chunks = -(-length // size)
    pad = num_chunks * size - length
    # Padding at the end: zero keys/values add nothing, and a zero log decay (lam = 1) is only
    # ever crossed on the way to a padded position.
    qc, kc, vc = (F.pad(t, (0, 0, 0, pad)).unflatten(2, (num_chunks, size)) for t in (q, k, v1))
    work = mask_dtype(q.dtype)

    if log_decay is None:
        intra_mask = None
        forward_q, backward_q, forward_k, backward_k, chunk_decay = qc, qc, kc, kc, None
    else:
        a = log_decay.to(work).expand(batch, heads, length)
        a = F.pad(a, (0, pad)).unflatten(2, (num_chunks, size))  # [B, H, N, C]
        inclusive = a.cumsum(-1)
        exclusive = inclusive - a
        total = inclusive[..., -1:]  # [B, H, N, 1]
        intra_mask = decay_mask(a, size)  # [B, H, N, C, C]
        forward_q = qc * torch.exp(exclusive)[..., None].to(q.dtype)
        backward_q = qc * torch.exp(total - inclusive)[..., None].to(q.dtype)
        forward_k = kc * torch.exp(total - exclusive)[..., None].to(k.dtype)
        backward_k = kc * torch.exp(inclusive)[..., None].to(k.dtype)
        chunk_decay = torch.exp(total[..., 0]).to(q.dtype)  # [B, H, N]

    scores = qc @ kc.transpose(-1, -2)  # [B, H, N, C, C]
    if intra_mask is not None:
        scores = scores.to(intra_mask.dtype) * intra_mask
    out = scores @ vc.to(scores.dtype)  # [B, H, N, C, Dv+1]

    if num_chunks > 1:
        forward_states = _carry(forward_k.transpose(-1, -2) @ vc, chunk_decay, reverse=False)
        backward_states = _carry(backward_k.transpose(-1, -2) @ vc, chunk_decay, reverse=True)
        out = out + forward_q @ forward_states + backward_q @ backward_states
    return out.flatten(2, 3)[:, :, :length]
