"""Chunkwise LION: masked attention inside each chunk plus state passing between chunks.

The sequence is cut into N = ceil(L / chunk_size) chunks of C = ceil(L / N) <= chunk_size tokens
(when C does not divide L, the last one is padded with fewer than N zero keys and values, which
change nothing). For a query at local
position p of chunk n (local inclusive log-decay cumsum c_p, exclusive e_p = c_p - a_p, chunk
total T_n):

    intra:     the LION mask restricted to the chunk, [C, C] per chunk
    forward:   exp(e_p) q_p . F_n,        F_0 = 0,       F_{n+1} = exp(T_n) F_n + sum_r exp(T_n - e_r) k_r v1_r^T
    backward:  exp(T_n - c_p) q_p . G_n,  G_{N-1} = 0,   G_{n-1} = exp(T_n) G_n + sum_r exp(c_r) k_r v1_r^T

with v1 = [v, 1] (the normaliser rides along). Every exponent is a sum of log decays, so <= 0.
The states entering every chunk are computed at once (one small [N, N] decay matmul, or a loop
over chunks when N is large): peak memory O(L C + (L / C) d^2), linear in L for a fixed chunk
size. Any chunk size >= 1 works (above L: one chunk). Several scans: each along its order (scans.over_scans).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import decay_mask, mask_dtype, masked_scores
from .scans import over_scans


def chunk_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor],
               orders: Optional[Tensor] = None, chunk_size: Optional[int] = None,
               normalised: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """Numerator [B, H, L, Dv] and normaliser [B, H, L, 1] (None where not normalised) chunk by chunk (see the
    module docstring).

    q, k: [B, H, L, Dk]; v: [B, H, L, Dv]; log_decays: None or [S, B|1, H|1, L|1] in token order;
    orders: [S, L], or None for one scan in token order; chunk_size: None for one chunk.
    """
    return over_scans(_one_scan, q, k, v, log_decays, orders, chunk_size=chunk_size, normalised=normalised)


def _one_scan(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor],
              chunk_size: Optional[int], normalised: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """The chunk form along one scan in token order.

    When C does not divide L the last chunk is padded with zero keys, values and log decays: a padded
    key adds nothing to any state or score, and the padded queries' rows are dropped. One shape of
    equal chunks takes half the operations of full chunks plus a shorter last one.
    """
    length = q.shape[-2]
    num_chunks = chunk_count(length, chunk_size)
    size = -(-length // num_chunks)
    pad = num_chunks * size - length
    # [v, 1]: the normaliser rides along as a column (padded rows of ones meet zero keys: they add nothing)
    v1c = F.pad(v, (0, int(normalised), 0, pad), value=1.0).unflatten(-2, (num_chunks, size))
    qc, kc = (F.pad(t, (0, 0, 0, pad)).unflatten(-2, (num_chunks, size)) for t in (q, k))  # [B, H, N, C, D]
    if log_decay is None:
        out = (qc @ kc.transpose(-1, -2)) @ v1c
    else:
        a = log_decay.to(mask_dtype(q.dtype))
        a = F.pad(a.expand(*a.shape[:-1], length), (0, pad)).unflatten(-1, (num_chunks, size))  # [B|1, H|1, N, C]
        # one decay per head: every chunk shares one [C, C] Toeplitz block
        intra_mask = decay_mask(log_decay[..., None, :] if log_decay.shape[-1] == 1 else a, size)
        out = masked_scores(qc, kc, intra_mask) @ v1c
    for reverse in (False, True) if num_chunks > 1 else ():
        out = out + _across_chunks(qc, kc, v1c, None if log_decay is None else a, reverse)
    out = out.flatten(-3, -2)[..., :length, :]
    return (out[..., :-1], out[..., -1:]) if normalised else (out, None)


def _across_chunks(qc: Tensor, kc: Tensor, v1c: Tensor, a: Optional[Tensor], reverse: bool) -> Tensor:
    """What each query reads from the other chunks in one direction: q_p . (state entering its chunk),
    weighted (see the module docstring). qc, kc, v1c: [B, H, N, C, D]; a: [B|1, H|1, N, C] or None."""
    if a is None:
        contributions = kc.transpose(-1, -2) @ v1c  # [B, H, N, Dk, Dv+1]
        return qc @ _carried_states(contributions, None, reverse)
    inclusive = a.cumsum(-1)
    exclusive = inclusive - a
    total = inclusive[..., -1:]  # [B|1, H|1, N, 1]: each chunk's summed log decay
    # key r enters its chunk's state, query p reads the state entering its chunk
    key_log, query_log = (inclusive, total - inclusive) if reverse else (total - exclusive, exclusive)
    contributions = (kc * torch.exp(key_log)[..., None].to(kc.dtype)).transpose(-1, -2) @ v1c
    states = _carried_states(contributions, total[..., 0], reverse)
    return (qc @ states) * torch.exp(query_log)[..., None].to(states.dtype)


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
        ones = torch.ones(num_chunks, num_chunks, dtype=torch.bool, device=contributions.device)
        carried = ones.triu(diagonal=1) if reverse else ones.tril(diagonal=-1)  # (n, m): m after / before n
        if log_chunk_decay is None:
            weights = carried
        else:
            # float64: the sums run over up to L tokens of decay, and only [N, N] entries are formed
            a = log_chunk_decay.double()
            inclusive = a.cumsum(-1)
            exclusive = inclusive - a
            # entry (n, m): m < n: T_{m+1} + ... + T_{n-1} = E_n - G_m;  m > n: T_{n+1} + ... + T_{m-1} = E_m - G_n
            exponent = exclusive[..., None, :] - inclusive[..., :, None] if reverse else \
                exclusive[..., :, None] - inclusive[..., None, :]
            # outside the triangle the exponent is positive and may overflow: exp(-inf) = 0 there keeps
            # both the weights and their gradient (grad * exp) free of inf and NaN
            weights = torch.exp(exponent.masked_fill(~carried, float("-inf")))
        weights = weights.to(contributions.dtype)  # [B|1, H|1, N, N]
        return (weights @ contributions.flatten(-2)).unflatten(-1, contributions.shape[-2:])
    if reverse:
        flipped = None if log_chunk_decay is None else log_chunk_decay.flip(-1)
        return _carried_states(contributions.flip(2), flipped, reverse=False).flip(2)
    # chunk after chunk in the masks' precision (float32 for 16-bit contributions), rounded once at the end: states
    # rounded to 16 bits at every chunk drift over hundreds of them, as the rnn form's did (recurrent.py)
    dtype = mask_dtype(contributions.dtype)
    states = [contributions.new_zeros(contributions[:, :, 0].shape, dtype=dtype)]
    for n in range(1, num_chunks):
        state = states[-1] if log_chunk_decay is None else \
            states[-1] * torch.exp(log_chunk_decay[:, :, n - 1, None, None]).to(dtype)
        states.append(state + contributions[:, :, n - 1])
    return torch.stack(states, dim=2).to(contributions.dtype)


def chunk_count(length: int, chunk_size: Optional[int]) -> int:
    """N = ceil(L / chunk_size) chunks (None: one), each of ceil(L / N) <= chunk_size tokens."""
    return 1 if chunk_size is None else -(-length // chunk_size)


def whole_product_is_cheaper(length: int, chunk_size: Optional[int], key_dim: int, value_dim: int,
                             num_scans: int = 1, decayed: bool = True) -> bool:
    """Whether one product over the whole sequence takes fewer multiply-adds than the chunk form with
    this chunk_size (lion_attention's chunk form then runs that product: the same function).

    Per (batch, head) row of L tokens, chunks of C = ceil(L / N) tokens and V1 = [V, 1] (Dv1 = Dv + 1):
      chunks, each scan:  L C (Dk + Dv1) for the scores inside the chunks and their product with V1,
                          plus 4 L Dk Dv1 for the states passed both ways (K^T V1 in, Q out, each way);
      whole, all scans:   L^2 (Dk + Dv1), the scans' masks summed into one; without decays
                          2 L Dk Dv1 (Q (K^T V1)), which no chunking beats, even one chunk.
    The threshold this gives, and what it means at head width 64: docs/design.md, "One product or
    chunks". One chunk (no states to pass) is that product for one scan (False), and costs S of them
    for S scans (True).
    """
    if not decayed:
        return True
    num_chunks = chunk_count(length, chunk_size)
    size, dv1 = -(-length // num_chunks), value_dim + 1
    states = 4 * key_dim * dv1 if num_chunks > 1 else 0
    return length * (key_dim + dv1) < num_scans * (size * (key_dim + dv1) + states)
