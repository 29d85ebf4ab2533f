"""LION with vector decays: one decay per token, head and key channel (GLA, HGRN-2; the paper's Table 1).

The mask is then one per key channel c, and the scores sum over the channels:

    Y_i = sum_j sum_c q_i^c k_j^c M^c_ij v_j,   M^c_ij = prod of lam^c over the path from j to i (as section 1)

which is no longer a product of matrices. With a the log decays and, inside a chunk of tokens, H their
cumulative sum and G = H - a (FLA's gated linear attention in each direction, docs/design.md "Vector decays"):

    M_ij = exp(G_i - G_j)  for j <= i,    M_ij = exp(H_j - H_i)  for j > i,

and v1 = [v, 1] carries the normaliser along. Chunk by chunk of C tokens: inside a chunk the pairs of both
directions by halves (`_pairs`: in each block, (right half, left half) pairs factor through the left half's
last token, with both exponents <= 0: two matrix products per level and direction), below `leaf` tokens one
masked product per block (exact while its exponents stay in range: `leaf_tokens`); between chunks a state
[Dk, Dv + 1] per direction, decayed per channel. One routine serves the three forms: the attention form is one
chunk (chunks of dispatch.VECTOR_ATTENTION_CHUNK above that many tokens), the rnn form chunks of one token
(states, and nothing L-sized besides autograd's), the chunk form chunks of chunk_size.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import mask_dtype
from .recurrent import STEP_BLOCK  # (the scalar rnn form's block: here, tokens written into the sum at once)
from .scalings import with_ones
from .scans import over_scans


def vector_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Tensor, orders: Optional[Tensor] = None,
                chunk_size: Optional[int] = None, chunks_at_once: Union[bool, Callable[..., Tensor]] = False,
                leaf_size: Optional[int] = 1, normalised: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """Numerator [B, H, L, Dv] and normaliser [B, H, L, 1] (None where not normalised: scaling "none" reads none)
    for vector log decays [S, B|1, H|1, L, Dk] in token order; orders [S, L] or None; chunk_size: tokens per chunk
    (None: one chunk, the attention form).
    chunks_at_once: every chunk's own pairs in one batch, only the states chunk after chunk (a few operations on
    whole-sequence temporaries, where the loop runs tens per chunk on a chunk's), or a function of `_at_once`'s
    arguments that computes the same (the cpu backend's, with a hand-written backward). leaf_size: a power of two of
    tokens per block taken in one masked product (1: the diagonal alone; None: `leaf_tokens` of the decays, call
    by call, which a compiler cannot trace). Both are the CPU backend's (lion_vit.ops.cpu)."""
    return over_scans(_one_scan, q, k, v, log_decays, orders, reads_orders=True, chunk_size=chunk_size,
                      chunks_at_once=chunks_at_once, leaf_size=leaf_size, normalised=normalised)


def _one_scan(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, chunk_size: Optional[int] = None,
              chunks_at_once: Union[bool, Callable[..., Tensor]] = False, leaf_size: Optional[int] = 1,
              normalised: bool = True, order: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """One scan along `order` (None: token order) of inputs in token order; its sums in token order. A function
    given as chunks_at_once reads along the order itself
    (`chunks_at_once(q, k, v, a, chunk, leaf_size, order, normalised)`)."""
    length = q.shape[-2]
    chunk = length if chunk_size is None else min(chunk_size, length)
    reads_itself = callable(chunks_at_once) and chunk > 1
    if order is not None and not reads_itself:  # (the decays before they are expanded: [B|1, H|1, L, Dk])
        q, k, v, log_decay = (t.index_select(-2, order) for t in (q, k, v, log_decay))
    a = log_decay.to(mask_dtype(q.dtype)).expand(*q.shape[:2], length, q.shape[-1])
    if reads_itself:
        both = chunks_at_once(q, k, v, a, chunk, leaf_size, order, normalised)
    else:
        both = (_at_once if chunks_at_once and chunk > 1 else _in_loop)(q, k, v, a, chunk, leaf_size, normalised)
        if order is not None:
            both = both.index_select(-2, torch.argsort(order))
    if not normalised:
        return both, None
    return both[..., :-1], both[..., -1:]  # views: the sum is the only L-sized result


def _cumulative(a: Tensor) -> Tuple[Tensor, Tensor]:
    """(G, H) of log decays a along the tokens (dim -2): H their cumulative sum, G = H - a."""
    total = a.cumsum(-2)
    return total - a, total


def _at_once(q: Tensor, k: Tensor, v: Tensor, a: Tensor, chunk: int, leaf_size: Optional[int],
             normalised: bool = True) -> Tensor:
    """Both directions' sums [..., L, Dv + 1] (Dv not normalised), every chunk's own pairs in one batch
    ([..., chunks, C, D]; equal chunks of at most `chunk` tokens), then the states entering each chunk from either
    side (`_states`)."""
    length = q.shape[-2]
    v1 = with_ones(v, normalised)
    count = -(-length // chunk)
    size = -(-length // count)
    if count * size > length:  # zero keys and values; zero log decays leave G and H as they are
        q, k, v1, a = (F.pad(t, (0, 0, 0, count * size - length)) for t in (q, k, v1, a))
    q, k, v1, a = (t.unflatten(-2, (count, size)) for t in (q, k, v1, a))
    out, (g, h) = _pairs(q, k, v1, a, leaf_size)
    if count > 1:
        total = h[..., -1:, :]  # [..., chunks, 1, Dk]: a whole chunk's log decay
        entering = _states(total, _keys_at_end(k, v1, g, total))
        leaving = _states(total, _keys_at_start(k, v1, h), reverse=True)
        out.add_(_from_before(q, g, entering))  # (in place: no second [..., L, Dv + 1] sum alive)
        out.add_(_from_after(q, h, total, leaving))
    return out.flatten(-3, -2)[..., :length, :]


def _states(totals: Tensor, own: Tensor, reverse: bool = False) -> Tensor:
    """The states [..., chunks, Dk, Dv + 1] (in the decays' dtype: _carried) entering each chunk along a sweep, from
    each chunk's whole log decay [..., chunks, 1, Dk] and own keys' sum [..., chunks, Dk, Dv + 1]: none before the
    first, then `_carried` chunk by chunk, from the first chunk on (reverse: from the last, the states entering from
    the chunks after). Without autograd each is written into one tensor as it comes, in one fused multiply-add: a
    list of small states, alive until stacked, fragments the heap (the peak RSS of a 1248 px forward then varies by
    several MB from run to run)."""
    count = own.shape[-3]
    order = list(range(count - 1, -1, -1) if reverse else range(count))
    if not (torch.is_grad_enabled() and (totals.requires_grad or own.requires_grad)):
        into = torch.empty_like(own, dtype=totals.dtype)  # (as _carried's)
        into[..., order[0], :, :].zero_()
        decays = totals.exp().transpose(-1, -2)
        for p, c in zip(order, order[1:]):
            torch.addcmul(own[..., p, :, :], decays[..., p, :, :], into[..., p, :, :], out=into[..., c, :, :])
        return into
    totals_of, own_of = totals.unbind(-3), own.unbind(-3)  # (unbind: its backward is one stack)
    states = [torch.zeros_like(own_of[0], dtype=totals.dtype)]
    for p in order[:-1]:
        states.append(_carried(states[-1], totals_of[p], own_of[p]))
    return torch.stack(states[::-1] if reverse else states, dim=-3)


# Between chunks, in either form (G, H a chunk's own; total its whole log decay, H's last row):
def _keys_at_end(k: Tensor, v1: Tensor, g: Tensor, total: Tensor) -> Tensor:
    """A chunk's keys summed against [v, 1], decayed to its last token: the state it adds for the chunks after."""
    return (k * (total - g).exp().to(k.dtype)).transpose(-1, -2) @ v1


def _keys_at_start(k: Tensor, v1: Tensor, h: Tensor) -> Tensor:
    """The same decayed to its first token: the state it adds for the chunks before."""
    return (k * h.exp().to(k.dtype)).transpose(-1, -2) @ v1


def _carried(state: Optional[Tensor], total: Tensor, own: Tensor) -> Tensor:
    """The state past a chunk: the state entering it (None: none) decayed per channel by its whole decay, plus
    its own keys' sum; in the decays' dtype (float32 for 16-bit inputs): rounded to 16 bits chunk after chunk, a
    state drifts, by half of the output in the rnn form's chunks of one token at 785 tokens and decays near 1."""
    return own.to(total.dtype) if state is None else total.exp().transpose(-1, -2) * state + own


def _from_before(q: Tensor, g: Tensor, state: Tensor) -> Tensor:
    """A chunk's queries against the state of the chunks before it (rounded to q's dtype for the product)."""
    return (q * g.exp().to(q.dtype)) @ state.to(q.dtype)


def _from_after(q: Tensor, h: Tensor, total: Tensor, state: Tensor) -> Tensor:
    """A chunk's queries against the state of the chunks after it (rounded to q's dtype for the product)."""
    return (q * (total - h).exp().to(q.dtype)) @ state.to(q.dtype)


def _in_loop(q: Tensor, k: Tensor, v: Tensor, a: Tensor, chunk: int, leaf_size: Optional[int],
             normalised: bool = True) -> Tensor:
    """The same sums chunk by chunk (the last one shorter), into one [..., L, Dv + 1] sum (Dv not normalised): a
    sweep forward with each chunk's own pairs and the state from the chunks before, then one back with the state
    from the chunks after, their outputs written STEP_BLOCK tokens at a time."""
    length = q.shape[-2]
    bounds = [(start, min(start + chunk, length)) for start in range(0, length, chunk)]
    total = q.new_zeros(*q.shape[:-2], length, v.shape[-1] + normalised)
    pending: List[Tensor] = []  # outputs of consecutive chunks not written yet

    def write(lo: int, hi: int, add: bool) -> None:  # the pending outputs, tokens lo..hi-1, into the sum
        block = torch.cat(pending[::-1] if add else pending, dim=-2)
        if add:
            total[..., lo:hi, :] += block
        else:
            total[..., lo:hi, :] = block
        pending.clear()

    state, first = None, 0
    for lo, hi in bounds:
        qc, kc, vc = q[..., lo:hi, :], k[..., lo:hi, :], with_ones(v[..., lo:hi, :], normalised)
        out, (g, h) = _pairs(qc, kc, vc, a[..., lo:hi, :], leaf_size)
        total_decay = h[..., -1:, :]
        if state is not None:  # the chunks before
            out = out + _from_before(qc, g, state)
        if hi < length:
            state = _carried(state, total_decay, _keys_at_end(kc, vc, g, total_decay))
        pending.append(out)
        if hi - first >= STEP_BLOCK or hi == length:
            write(first, hi, add=False)
            first = hi
    state, last = None, length  # last: where the tokens of the pending outputs end
    for lo, hi in bounds[::-1]:
        _, h = _cumulative(a[..., lo:hi, :])  # recomputed: kept, they would be two more [L, Dk] in the rnn form
        total_decay = h[..., -1:, :]
        if state is None:  # the last chunk: none after it
            last = lo
        else:  # the chunks after
            pending.append(_from_after(q[..., lo:hi, :], h, total_decay, state))
            if last - lo >= STEP_BLOCK or not lo:
                write(lo, last, add=True)
                last = lo
        if lo:
            values = with_ones(v[..., lo:hi, :], normalised)
            state = _carried(state, total_decay, _keys_at_start(k[..., lo:hi, :], values, h))
    return total


def _pairs(q: Tensor, k: Tensor, v: Tensor, a: Tensor,
           leaf_size: Optional[int]) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    """sum_j (q_i * M_ij) . k_j v_j over the pairs inside each chunk (dim -2), both directions, and the chunk's
    (G, H). By halves: in each block, the forward pairs (i in the right half, j in the left) factor through the
    left half's last token r as (q_i * exp(G_i - G_r)) . (k_j * exp(G_r - G_j)), the backward ones (i left, j
    right) as (q_i * exp(H_r - H_i)) . (k_j * exp(H_j - H_r)), every exponent <= 0, no [C, C, Dk] tensor; inside
    blocks of `leaf` tokens, one masked product (`_in_leaves`). A chunk is taken whole as one leaf where
    leaf_size allows, else padded to a power of two (zero keys, values and log decays)."""
    g, h = _cumulative(a)
    size = q.shape[-2]
    if leaf_size is None and leaf_tokens(g, h, q.dtype, [size]) == size:
        return _in_leaves(q, k, v, g, h, size), (g, h)
    n = 1 << (size - 1).bit_length()
    padded = (q, k, v, a)
    if n > size:
        padded = tuple(F.pad(t, (0, 0, 0, n - size)) for t in padded)
    q, k, v, gates = padded
    gp, hp = _cumulative(gates) if n > size else (g, h)
    half = min(leaf_size, n) if leaf_size else leaf_tokens(gp, hp, q.dtype, [1 << i for i in range(n.bit_length())])
    out = _in_leaves(q, k, v, gp, hp, half)
    while half < n:
        def halves(t: Tensor) -> Tensor:  # [..., blocks, 2 halves, half, D]
            return t.reshape(*t.shape[:-2], n // (2 * half), 2, half, t.shape[-1])

        qs, ks, vs, gs, hs = halves(q), halves(k), halves(v), halves(gp), halves(hp)
        g_ref, h_ref = gs[..., 0, -1:, :], hs[..., 0, -1:, :]
        forward = (qs[..., 1, :, :] * (gs[..., 1, :, :] - g_ref).exp().to(q.dtype)) @ \
            (ks[..., 0, :, :] * (g_ref - gs[..., 0, :, :]).exp().to(q.dtype)).transpose(-1, -2)
        backward = (qs[..., 0, :, :] * (h_ref - hs[..., 0, :, :]).exp().to(q.dtype)) @ \
            (ks[..., 1, :, :] * (hs[..., 1, :, :] - h_ref).exp().to(q.dtype)).transpose(-1, -2)
        parts = [backward @ vs[..., 1, :, :], forward @ vs[..., 0, :, :]]  # to the left halves, to the right ones
        out = out + torch.stack(parts, dim=-3).reshape(out.shape)
        half *= 2
    return out[..., :size, :], (g, h)


def _in_leaves(q: Tensor, k: Tensor, v: Tensor, g: Tensor, h: Tensor, leaf: int) -> Tensor:
    """The pairs inside blocks of `leaf` tokens (dividing the length), both directions, each block in one masked
    product through its middle token m: (q_i * exp(G_i - G_m)) . (k_j * exp(G_m - G_j)) for j <= i and
    (q_i * exp(H_m - H_i)) . (k_j * exp(H_j - H_m)) for j > i. Exact while |G - G_m| and |H - H_m| stay in range
    (leaf_tokens); leaf 1: the diagonal alone."""
    if leaf == 1:
        return (q * k).sum(-1, keepdim=True) * v
    qs, ks, vs, gs, hs = (t.unflatten(-2, (t.shape[-2] // leaf, leaf)) for t in (q, k, v, g, h))
    g_ref, h_ref = gs[..., leaf // 2:leaf // 2 + 1, :], hs[..., leaf // 2:leaf // 2 + 1, :]
    forward = (qs * (gs - g_ref).exp().to(q.dtype)) @ (ks * (g_ref - gs).exp().to(q.dtype)).transpose(-1, -2)
    backward = (qs * (h_ref - hs).exp().to(q.dtype)) @ (ks * (hs - h_ref).exp().to(q.dtype)).transpose(-1, -2)
    return ((forward.tril() + backward.triu(1)) @ vs).flatten(-3, -2)


def leaf_tokens(g: Tensor, h: Tensor, dtype: torch.dtype, sizes: List[int]) -> int:
    """The largest of `sizes` (each dividing the tokens, dim -2) such that in every block of that many tokens
    |G - G_m| and |H - H_m| stay within a quarter of log(dtype's largest value), m the block's middle token: then
    no factor of `_in_leaves` and no product of two, the masked pairs' included, leaves the dtype's range, and a
    pair's rounding stays within that many epsilons (exp's relative error grows with its argument). 1 if none."""
    bound = math.log(torch.finfo(dtype).max) / 4
    for leaf in sorted(sizes, reverse=True):
        if leaf == 1 or not g.numel():  # (no rows: nothing to read, nothing to gain)
            break
        spread = 0.0
        for t in (g, h):  # G and H do not increase: the block's ends are the extremes
            blocks = t.unflatten(-2, (t.shape[-2] // leaf, leaf))
            middle = blocks[..., leaf // 2, :]
            spread = max(spread, (blocks[..., 0, :] - middle).max().item(), (middle - blocks[..., -1, :]).max().item())
        if spread <= bound:
            return leaf
    return 1
