"""Chunkwise LION: masked attention inside each chunk plus state passing between chunks.

The sequence is cut into N chunks of C tokens (the last one zero-padded). For a query at local
position p of chunk n (local inclusive log-decay cumsum c_p, exclusive e_p = c_p - a_p, chunk
total T_n):

    intra:     the LION mask restricted to the chunk, [C, C] per chunk
    forward:   exp(e_p) q_p . F_n,        F_0 = 0,       F_{n+1} = exp(T_n) F_n + sum_r exp(T_n - e_r) k_r v1_r^T
    backward:  exp(T_n - c_p) q_p . G_n,  G_{N-1} = 0,   G_{n-1} = exp(T_n) G_n + sum_r exp(c_r) k_r v1_r^T

with v1 = [v, 1] (the normaliser rides along). Every exponent is a sum of log decays, so <= 0.
The inter-chunk states are carried in a loop over chunks and added into the output chunk by
chunk, so besides the output only one [Dk, Dv+1] state per (batch, head) is alive: peak memory
O(L C + (L / C) d^2), linear in L for a fixed chunk size. Any chunk size from 1 to L works.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import decay_mask, mask_dtype


def _pad_chunks(t: Tensor, pad: int, num_chunks: int) -> Tensor:
    """[B, H, L, D] -> [B, H, N, C, D], zero-padding the last chunk (no copy when C divides L)."""
    if pad:
        t = F.pad(t, (0, 0, 0, pad))
    return t.unflatten(2, (num_chunks, -1))


def _add_carried(out: Tensor, qc: Tensor, kc: Tensor, vc: Tensor, key_weight: Optional[Tensor],
                 query_weight: Optional[Tensor], chunk_decay: Optional[Tensor], reverse: bool) -> None:
    """out[:, :, n] += query_weight_n * (q_n @ state_n), with the state carried across chunks in order."""
    keys = kc if key_weight is None else kc * key_weight
    contributions = keys.transpose(-1, -2) @ vc  # [B, H, N, Dk, Dv+1]: each chunk's summary
    num_chunks = out.shape[2]
    order = range(num_chunks - 2, -1, -1) if reverse else range(1, num_chunks)
    state = None
    for n in order:
        previous = n + 1 if reverse else n - 1
        if state is not None and chunk_decay is not None:
            state = state * chunk_decay[:, :, previous, None, None]
        state = contributions[:, :, previous] if state is None else state + contributions[:, :, previous]
        update = qc[:, :, n] @ state  # [B, H, C, Dv+1]
        if query_weight is not None:
            update = update * query_weight[:, :, n]
        out[:, :, n] += update


def chunk_unnormalized(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor],
                       chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Numerator [B, H, L, Dv] and normaliser [B, H, L, 1] chunk by chunk (see module docstring).

    q, k: [B, H, L, Dk]; v: [B, H, L, Dv]; log_decay: None or broadcastable to [B, H, L].
    """
    batch, heads, length, _ = q.shape
    size = length if chunk_size is None else min(chunk_size, length)
    num_chunks = -(-length // size)
    pad = num_chunks * size - length
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    # Padding sits at the end: zero keys/values add nothing, and a zero log decay (lam = 1) is only
    # ever crossed on the way to a padded position.
    qc, kc, vc = (_pad_chunks(t, pad, num_chunks) for t in (q, k, v1))

    forward_k = forward_q = backward_k = backward_q = chunk_decay = intra_mask = None
    if log_decay is not None:
        a = log_decay.to(mask_dtype(q.dtype)).expand(batch, heads, length)
        a = F.pad(a, (0, pad)).unflatten(2, (num_chunks, size))  # [B, H, N, C]
        inclusive = a.cumsum(-1)
        exclusive = inclusive - a
        total = inclusive[..., -1:]  # [B, H, N, 1]
        intra_mask = decay_mask(a, size)  # [B, H, N, C, C]
        forward_q, backward_q = torch.exp(exclusive)[..., None], torch.exp(total - inclusive)[..., None]
        forward_k, backward_k = torch.exp(total - exclusive)[..., None], torch.exp(inclusive)[..., None]
        chunk_decay = torch.exp(total[..., 0])  # [B, H, N]
        forward_k, backward_k, chunk_decay = (t.to(q.dtype) for t in (forward_k, backward_k, chunk_decay))

    scores = qc @ kc.transpose(-1, -2)  # [B, H, N, C, C]
    if intra_mask is not None:
        scores = scores.to(intra_mask.dtype) * intra_mask
    out = scores @ vc.to(scores.dtype)  # [B, H, N, C, Dv+1]
    del scores, intra_mask
    if num_chunks > 1:
        _add_carried(out, qc, kc, vc, forward_k, forward_q, chunk_decay, reverse=False)
        _add_carried(out, qc, kc, vc, backward_k, backward_q, chunk_decay, reverse=True)
    out = out.flatten(2, 3)[:, :, :length]
    return out[..., :-1], out[..., -1:]
