"""Chunkwise LION: masked attention inside each chunk plus state passing between chunks.

The sequence is cut into N chunks of C tokens (the last one zero-padded). For a query at local
position p of chunk n (local inclusive log-decay cumsum c_p, exclusive e_p = c_p - a_p, chunk
total T_n):

    intra:     the LION mask restricted to the chunk, [C, C] per chunk
    forward:   exp(e_p) q_p . F_n,        F_0 = 0,       F_{n+1} = exp(T_n) F_n + sum_r exp(T_n - e_r) k_r v1_r^T
    backward:  exp(T_n - c_p) q_p . G_n,  G_{N-1} = 0,   G_{n-1} = exp(T_n) G_n + sum_r exp(c_r) k_r v1_r^T

with v1 = [v, 1] (the normaliser rides along). Every exponent is a sum of log decays, so <= 0.
The states entering every chunk are computed at once (one small [N, N] decay matmul, or a loop
over chunks when N is large): peak memory O(L C + (L / C) d^2), linear in L for a fixed chunk
size. Any chunk size from 1 to L works.
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


def _padded_with_ones(v: Tensor, pad: int, num_chunks: int) -> Tensor:
    """[v, 1] zero-padded to N * C tokens, as [B, H, N, C, Dv+1], built in one allocation."""
    batch, heads, length, dv = v.shape
    v1 = v.new_zeros(batch, heads, length + pad, dv + 1)
    v1[:, :, :length, :dv] = v
    v1[:, :, :length, dv] = 1.0
    return v1.unflatten(2, (num_chunks, -1))


# Up to this many chunks the carried states come from one matmul with an [N, N] decay matrix
# (no Python loop, which matters on GPUs); beyond it, from a loop over chunks (O(N d^2) work
# instead of O(N^2 d^2)).
MATMUL_CARRY_MAX_CHUNKS = 256


def _carried_states(contributions: Tensor, log_chunk_decay: Optional[Tensor], reverse: bool) -> Tensor:
    """State entering each chunk: F_n = sum_{m<n} exp(T_{m+1} + ... + T_{n-1}) C_m (reverse: m > n).

    contributions C: [B, H, N, Dk, Dv+1]; log_chunk_decay T: [B, H, N] or None (no decay).
    """
    num_chunks = contributions.shape[2]
    if reverse:
        flipped = None if log_chunk_decay is None else log_chunk_decay.flip(-1)
        return _carried_states(contributions.flip(2), flipped, reverse=False).flip(2)
    if num_chunks <= MATMUL_CARRY_MAX_CHUNKS:
        if log_chunk_decay is None:
            weights = torch.ones(num_chunks, num_chunks, dtype=contributions.dtype, device=contributions.device)
        else:
            # float64: the sums run over up to L tokens of decay, and only [N, N] entries are formed
            a = log_chunk_decay.double()
            inclusive = a.cumsum(-1)
            # entry (n, m), m < n: T_{m+1} + ... + T_{n-1} = (G_n - T_n) - G_m  <= 0
            weights = torch.exp((inclusive - a)[..., :, None] - inclusive[..., None, :])
        weights = torch.tril(weights, diagonal=-1).to(contributions.dtype)  # [B|1, H|1, N, N]
        return (weights @ contributions.flatten(-2)).unflatten(-1, contributions.shape[-2:])
    states = [torch.zeros_like(contributions[:, :, 0])]
    for n in range(1, num_chunks):
        state = states[-1] if log_chunk_decay is None else \
            states[-1] * torch.exp(log_chunk_decay[:, :, n - 1, None, None]).to(contributions.dtype)
        states.append(state + contributions[:, :, n - 1])
    return torch.stack(states, dim=2)


def chunk_unnormalized(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor],
                       chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Numerator [B, H, L, Dv] and normaliser [B, H, L, 1] chunk by chunk (see module docstring).

    q, k: [B, H, L, Dk]; v: [B, H, L, Dv]; log_decay: None or broadcastable to [B, H, L].
    """
    batch, heads, length, _ = q.shape
    size = length if chunk_size is None else min(chunk_size, length)
    num_chunks = -(-length // size)
    pad = num_chunks * size - length
    # Padding sits at the end: zero keys/values add nothing, and a zero log decay (lam = 1) is only
    # ever crossed on the way to a padded position.
    qc, kc, vc = _pad_chunks(q, pad, num_chunks), _pad_chunks(k, pad, num_chunks), _padded_with_ones(v, pad, num_chunks)

    forward_k = forward_q = backward_k = backward_q = log_chunk_decay = intra_mask = None
    if log_decay is not None:
        a = log_decay.to(mask_dtype(q.dtype)).expand(batch, heads, length)
        a = F.pad(a, (0, pad)).unflatten(2, (num_chunks, size))  # [B, H, N, C]
        inclusive = a.cumsum(-1)
        exclusive = inclusive - a
        total = inclusive[..., -1:]  # [B, H, N, 1]
        # one decay per head (LION-d): every chunk shares one [C, C] Toeplitz block
        fixed = log_decay.shape[-1] == 1
        intra_mask = decay_mask(log_decay[..., None, :] if fixed else a, size)  # [B|1, H, N|1, C, C]
        forward_q, backward_q = torch.exp(exclusive)[..., None], torch.exp(total - inclusive)[..., None]
        forward_k, backward_k = torch.exp(total - exclusive)[..., None], torch.exp(inclusive)[..., None]
        log_chunk_decay = total[..., 0]  # [B, H, N]
        forward_k, backward_k = forward_k.to(q.dtype), backward_k.to(q.dtype)

    scores = qc @ kc.transpose(-1, -2)  # [B, H, N, C, C]
    if intra_mask is not None:
        scores = scores.to(intra_mask.dtype)
        # in place when nothing needs the unmasked scores for a backward pass
        scores = scores * intra_mask if scores.requires_grad else scores.mul_(intra_mask)
    out = scores @ vc.to(scores.dtype)  # [B, H, N, C, Dv+1]
    del scores, intra_mask
    directions = ((forward_k, forward_q, False), (backward_k, backward_q, True)) if num_chunks > 1 else ()
    for key_weight, query_weight, reverse in directions:
        contributions = (kc if key_weight is None else kc * key_weight).transpose(-1, -2) @ vc
        states = _carried_states(contributions, log_chunk_decay, reverse)  # [B, H, N, Dk, Dv+1]
        del contributions
        update = qc @ states  # [B, H, N, C, Dv+1]
        del states
        # in place: neither tensor is saved for backward, and each is as large as the output
        out.add_(update if query_weight is None else update.mul_(query_weight))
        del update
    out = out.flatten(2, 3)[:, :, :length]
    return out[..., :-1], out[..., -1:]
