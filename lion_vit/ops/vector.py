"""LION with vector decays: one decay per token, head and key channel (GLA, HGRN-2; the paper's Table 1).

The mask is then one per key channel c, and the scores sum over the channels:

    Y_i = sum_j sum_c q_i^c k_j^c M^c_ij v_j,   M^c_ij = prod of lam^c over the path from j to i (as section 1)

which is no longer a product of matrices. Each direction is a causal gated linear attention, FLA's way
(docs/design.md, "Vector decays"): with gates g, G their cumulative sum along the sequence,

    o_i = sum_{j <= i} (q_i * exp(G_i - G_j)) . k_j v1_j      (v1 = [v, 1]: the normaliser rides along)

the forward direction with g_p = a_{p-1} (the diagonal included), the backward direction the same on the
mirrored sequence (without the diagonal). Chunk by chunk of C tokens: inside a chunk the pairs by halves
(`_within`: two matrix products per level, as FLA's kernels split a chunk into sub-chunks), between chunks a
state [Dk, Dv + 1] decayed per channel. Every exponent is a sum of log decays <= 0, so nothing overflows.
One routine serves the three forms: the attention form is one chunk (chunks of 64 above 64 tokens), the rnn
form chunks of one token (a state and nothing L-sized besides autograd's), the chunk form chunks of chunk_size.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .scans import over_scans


def vector_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Tensor, orders: Optional[Tensor] = None,
                chunk_size: Optional[int] = None, chunks_at_once: bool = False) -> Tuple[Tensor, Tensor]:
    """Numerator [B, H, L, Dv] and normaliser [B, H, L, 1] for vector log decays [S, B|1, H|1, L, Dk] in token
    order; orders [S, L] or None; chunk_size: tokens per chunk (None: one chunk, the attention form).
    chunks_at_once: every chunk's own pairs in one batch, only the states chunk after chunk (a few operations
    on whole-sequence temporaries, where the default loop runs tens per chunk on a chunk's: the CPU backend's
    way for rows of one head, lion_vit.ops.cpu)."""
    return over_scans(_one_scan, q, k, v, log_decays, orders, decay_token_dim=-2, chunk_size=chunk_size,
                      chunks_at_once=chunks_at_once)


def _one_scan(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, chunk_size: Optional[int] = None,
              chunks_at_once: bool = False) -> Tuple[Tensor, Tensor]:
    length = q.shape[-2]
    a = log_decay.to(q.dtype if q.dtype == torch.float64 else torch.float32).expand(*q.shape[:2], length, q.shape[-1])
    chunk = length if chunk_size is None else min(chunk_size, length)
    if chunks_at_once and chunk > 1:
        v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        gates = F.pad(a[..., :-1, :], (0, 0, 1, 0))  # g_p = a_{p-1}
        mirrored_gates = F.pad(a.flip(-2)[..., :-1, :], (0, 0, 1, 0))
        both = _causal_at_once(q, k, v1, gates, chunk, diagonal=True) + _causal_at_once(
            q.flip(-2), k.flip(-2), v1.flip(-2), mirrored_gates, chunk, diagonal=False).flip(-2)
    else:
        both = _causal(q, k, v, a, chunk, mirrored=False) + _causal(q, k, v, a, chunk, mirrored=True)
    return both[..., :-1], both[..., -1:]


def _causal_at_once(q: Tensor, k: Tensor, v: Tensor, g: Tensor, chunk: int, diagonal: bool) -> Tensor:
    """_causal's sums along the sequence as given (g the gates g_p = a_{p-1}, v with its ones column), every
    chunk's own pairs in one batch ([..., chunks, C, D]), then the states entering each chunk, chunk after chunk."""
    length = q.shape[-2]
    count = -(-length // chunk)
    if count * chunk > length:  # zero keys and values; zero gates keep G, so every exponent stays <= 0
        q, k, v, g = (F.pad(t, (0, 0, 0, count * chunk - length)) for t in (q, k, v, g))
    q, k, v, g = (t.unflatten(-2, (count, chunk)) for t in (q, k, v, g))
    cumulative = g.to(torch.float64 if q.dtype == torch.float64 else torch.float32).cumsum(-2)
    out = _within(q, k, v, cumulative, diagonal)
    if count > 1:
        last = cumulative[..., -1:, :]  # [..., chunks, 1, Dk]
        own = (k * (last - cumulative).exp().to(q.dtype)).transpose(-1, -2) @ v  # each chunk's keys, at its end
        decay = last.exp().to(q.dtype).transpose(-1, -2)  # [..., chunks, Dk, 1]: a whole chunk's decay
        states = [torch.zeros_like(own[..., 0, :, :])]  # the state entering each chunk
        for i in range(1, count):
            states.append(decay[..., i - 1, :, :] * states[-1] + own[..., i - 1, :, :])
        out = out + (q * cumulative.exp().to(q.dtype)) @ torch.stack(states, dim=-3)
    return out.flatten(-3, -2)[..., :length, :]


def _causal(q: Tensor, k: Tensor, v: Tensor, a: Tensor, chunk: int, mirrored: bool) -> Tensor:
    """o_i = sum_{j <= i} (q_i * exp(G_i - G_j)) . k_j [v_j, 1] [..., L, Dv + 1] in token order, G the cumulative
    sum of the gates g_p = a_{p-1} (a [B, H, L, Dk] log decays <= 0), chunk by chunk of `chunk` tokens (the last
    one shorter). mirrored: along the mirrored sequence and without the diagonal (j < i); each chunk is read from
    the tokens and its output put back in token order, so nothing mirrored is copied whole."""
    length = q.shape[-2]
    state = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1] + 1)  # [B, H, Dk, Dv + 1]
    outputs = []
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        # this direction's positions start..stop-1 are tokens start..stop-1, or L-1-start down to L-stop mirrored
        lo, hi = (length - stop, length - start) if mirrored else (start, stop)

        def read(t: Tensor) -> Tensor:
            return t[..., lo:hi, :].flip(-2) if mirrored else t[..., lo:hi, :]

        qc, kc, vc = read(q), read(k), read(v)
        vc = torch.cat([vc, torch.ones_like(vc[..., :1])], dim=-1)  # [v, 1]: the normaliser rides along
        # gates g_p = a_{p-1} in this direction: the decays of tokens lo-1..hi-2 (forward) or hi..lo+1 (mirrored)
        gates = a[..., lo + 1:hi + 1, :].flip(-2) if mirrored else a[..., max(lo - 1, 0):hi - 1, :]
        if start == 0:  # position 0 has no token before it
            gates = F.pad(gates, (0, 0, 1, 0))
        gc = gates.to(torch.float64 if q.dtype == torch.float64 else torch.float32).cumsum(-2)
        out = _within(qc, kc, vc, gc, diagonal=not mirrored)
        if start:  # the state of the chunks before, decayed to this chunk's tokens
            out = out + (qc * gc.exp().to(q.dtype)) @ state
        outputs.append(out.flip(-2) if mirrored else out)
        if stop < length:  # the state at this chunk's last token, decayed per channel
            last = gc[..., -1:, :]
            state = last.exp().to(q.dtype).transpose(-1, -2) * state + \
                (kc * (last - gc).exp().to(q.dtype)).transpose(-1, -2) @ vc
    return torch.cat(outputs[::-1] if mirrored else outputs, dim=-2)


def _within(q: Tensor, k: Tensor, v: Tensor, cumulative: Tensor, diagonal: bool) -> Tensor:
    """sum_{j <= i} (q_i * exp(G_i - G_j)) . k_j v_j inside one chunk (j < i without the diagonal), G the
    non-increasing `cumulative` gates, by halves: in every block, the pairs (i in its right half, j in its
    left half) factor through G_r, the left half's last G, as (q_i * exp(G_i - G_r)) . (k_j * exp(G_r - G_j))
    with both exponents <= 0: two matrix products per level, log2(chunk) levels, and no [C, C, Dk] tensor.
    The chunk is padded to a power of two (zero keys and values, the last G repeated)."""
    size = q.shape[-2]
    n = 1 << (size - 1).bit_length()
    if n > size:
        q, k, v = (F.pad(t, (0, 0, 0, n - size)) for t in (q, k, v))
        cumulative = torch.cat([cumulative, cumulative[..., -1:, :].expand(*cumulative.shape[:-2], n - size, -1)], -2)
    out = (q * k).sum(-1, keepdim=True) * v if diagonal else torch.zeros_like(v)
    half = 1
    while half < n:
        def halves(t: Tensor) -> Tensor:  # [..., blocks, 2 halves, half, D]
            return t.reshape(*t.shape[:-2], n // (2 * half), 2, half, t.shape[-1])

        qs, ks, vs, gs = halves(q), halves(k), halves(v), halves(cumulative)
        ref = gs[..., 0, -1:, :]
        right = qs[..., 1, :, :] * (gs[..., 1, :, :] - ref).exp().to(q.dtype)
        left = ks[..., 0, :, :] * (ref - gs[..., 0, :, :]).exp().to(q.dtype)
        part = (right @ left.transpose(-1, -2)) @ vs[..., 0, :, :]  # to the right halves, from the left ones
        out = out + torch.stack([torch.zeros_like(part), part], dim=-3).reshape(out.shape)
        half *= 2
    return out[..., :size, :]
