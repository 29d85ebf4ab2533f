"""Chunkwise LION: masked attention inside each chunk plus state passing between chunks.

The sequence is cut into N chunks of C tokens (the last one shorter when C does not divide L,
handled as a second group of chunks: nothing is padded). For a query at local
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
from torch import Tensor

from .masks import decay_mask, mask_dtype
from .rows import needs_grad, row_groups, take_rows


def _with_ones(v: Tensor) -> Tensor:
    """[v, 1]: [B, H, L, Dv+1], built in one allocation."""
    v1 = v.new_empty(*v.shape[:-1], v.shape[-1] + 1)
    v1[..., :-1] = v
    v1[..., -1] = 1.0
    return v1


# Up to this many chunks the carried states come from one matmul with an [N, N] decay matrix
# (no Python loop, which matters on GPUs); beyond it, from a loop over chunks (O(N d^2) work
# instead of O(N^2 d^2)).
MATMUL_CARRY_MAX_CHUNKS = 256


def _carried_states(contributions: Tensor, log_chunk_decay: Optional[Tensor], reverse: bool) -> Tensor:
    """State entering each chunk: F_n = sum_{m<n} exp(T_{m+1} + ... + T_{n-1}) C_m (reverse: m > n).

    contributions C: [B, H, N, Dk, Dv+1]; log_chunk_decay T: [B, H, N] or None (no decay).
    """
    num_chunks = contributions.shape[2]
    if num_chunks <= MATMUL_CARRY_MAX_CHUNKS:
        if log_chunk_decay is None:
            weights = torch.ones(num_chunks, num_chunks, dtype=contributions.dtype, device=contributions.device)
        else:
            # float64: the sums run over up to L tokens of decay, and only [N, N] entries are formed
            a = log_chunk_decay.double()
            inclusive = a.cumsum(-1)
            exclusive = inclusive - a
            # entry (n, m): m < n: T_{m+1} + ... + T_{n-1} = E_n - G_m;  m > n: T_{n+1} + ... + T_{m-1} = E_m - G_n
            exponent = exclusive[..., None, :] - inclusive[..., :, None] if reverse else \
                exclusive[..., :, None] - inclusive[..., None, :]
            weights = torch.exp(exponent)  # entries outside the triangle may overflow: they are dropped
        weights = torch.triu(weights, diagonal=1) if reverse else torch.tril(weights, diagonal=-1)
        weights = weights.to(contributions.dtype)  # [B|1, H|1, N, N]
        return (weights @ contributions.flatten(-2)).unflatten(-1, contributions.shape[-2:])
    if reverse:
        flipped = None if log_chunk_decay is None else log_chunk_decay.flip(-1)
        return _carried_states(contributions.flip(2), flipped, reverse=False).flip(2)
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
    out = v.new_empty(batch, heads, length, v.shape[-1] + 1)  # [numerator, normaliser]
    groups = [(slice(None), slice(None))] if needs_grad(q, k, v, log_decay) else \
        row_groups(batch, heads, length * out.shape[-1] * out.element_size(), out.device)
    for rows in groups:
        _chunk_rows(*(None if t is None else take_rows(t, rows) for t in (q, k, v, log_decay)), size,
                    take_rows(out, rows))
    return out[..., :-1], out[..., -1:]


def _chunk_rows(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor], size: int, out: Tensor) -> None:
    """The chunk form for [b, h] rows, numerator and normaliser written into out [b, h, L, Dv+1]."""
    batch, heads, length, _ = q.shape
    num_full, tail = divmod(length, size)
    # The full chunks and a shorter last one (when C does not divide L) are two groups of equal-size
    # chunks, each a view of the sequence: nothing is padded or copied. (start, chunks, size):
    groups = [(0, num_full, size)] + ([(num_full * size, 1, tail)] if tail else [])
    v1 = _with_ones(v)  # the normaliser rides along as a column
    a = None if log_decay is None else log_decay.to(mask_dtype(q.dtype)).expand(batch, heads, length)

    def chunked(t: Tensor, start: int, count: int, c: int) -> Tensor:  # [..., L, D] -> [..., n, c, D]
        return t[:, :, start:start + count * c].unflatten(2, (count, c))

    parts = []  # per group: its place, forward/backward weights and chunk totals
    for start, count, c in groups:
        qg, kg, vg, outg = (chunked(t, start, count, c) for t in (q, k, v1, out))
        scores = qg @ kg.transpose(-1, -2)  # [B, H, n, c, c]
        weights = {False: (None, None), True: (None, None)}
        total = None
        if a is not None:
            ag = a[:, :, start:start + count * c].unflatten(2, (count, c))  # [B, H, n, c]
            inclusive = ag.cumsum(-1)
            exclusive = inclusive - ag
            total = inclusive[..., -1:]  # [B, H, n, 1]
            # one decay per head (LION-d): every chunk shares one [c, c] Toeplitz block
            fixed = log_decay.shape[-1] == 1
            intra_mask = decay_mask(log_decay[..., None, :] if fixed else ag, c)  # [B|1, H, n|1, c, c]
            scores = scores.to(intra_mask.dtype)
            # in place when nothing needs the unmasked scores for a backward pass
            scores = scores * intra_mask if scores.requires_grad else scores.mul_(intra_mask)
            del intra_mask
            weights = {  # (key weight, query weight) per direction (reverse: False, True)
                False: (torch.exp(total - exclusive)[..., None].to(q.dtype), torch.exp(exclusive)[..., None]),
                True: (torch.exp(inclusive)[..., None].to(q.dtype), torch.exp(total - inclusive)[..., None]),
            }
        intra = scores @ vg.to(scores.dtype)  # [B, H, n, c, Dv+1]
        del scores
        outg.copy_(intra)  # (autograd follows writes into views of out)
        del intra
        parts.append((start, count, c, weights, total))

    if length > size:
        log_chunk_decay = None if a is None else torch.cat([total for *_, total in parts], dim=2)[..., 0]  # [B, H, N]
        for reverse in (False, True):  # one direction at a time: its states are O(N d^2) memory
            contributions = []
            for start, count, c, weights, _ in parts:
                kg, key_weight = chunked(k, start, count, c), weights[reverse][0]
                contributions.append((kg if key_weight is None else kg * key_weight).transpose(-1, -2)
                                     @ chunked(v1, start, count, c))
            contributions = contributions[0] if len(contributions) == 1 else torch.cat(contributions, dim=2)
            states = _carried_states(contributions, log_chunk_decay, reverse)  # [B, H, N, Dk, Dv+1]
            del contributions
            for start, count, c, weights, _ in parts:
                update = chunked(q, start, count, c) @ states[:, :, start // size:start // size + count]
                query_weight = weights[reverse][1]
                # in place: neither tensor is saved for backward, and each is as large as the output
                outg = chunked(out, start, count, c)
                outg.add_(update if query_weight is None else update.mul_(query_weight))
                del update
            del states
