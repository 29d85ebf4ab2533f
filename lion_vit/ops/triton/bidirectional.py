"""The attention form fused in one bidirectional kernel of ours: both directions, every scan and the normaliser
in one pass over the key tiles, with no flips, no stacking and no normaliser scan (the chunk and rnn forms, fla.py,
run FLA's causal kernels on each scan forward and mirrored, and the normaliser apart).

Per scan s and token t (token order) the kernel reads p_t, the token's scan position, and the cumulative log
decays along the scan E_t = a(scan positions < p_t) and I_t = E_t + a_t, in base 2 (times log2 e: its exponentials
are 2^x, one instruction), from which (masks.py)

    M_ij = exp(E_i - E_j) if p_i > p_j,   exp(I_j - I_i) if p_i < p_j,   1 if i == j,

a tile whose keys all come before (or all after) its queries along the scan an outer product of two vectors
(_scan_mask; Tuning.bidirectional_factored_masks).

Forward, one program per query tile: S = q k^T and the mask tile by tile, the numerator and the normaliser (a row
sum) in float32 registers, Y scaled as it is written (scalings.py). The feature map (operands.py's fused maps) is
applied to raw q and k as the kernels load a tile, or (Tuning.bidirectional_map_pass) by a pass just before them
whose features they read as given, dropped after the launch; its gradient as they write dq and dk, from the raw
rows. Nothing mapped is kept for backward.

Backward, with dn = dY * r (r the scaling's factor) and delta_i = dY_i . Y_i / z_i (zero for "none", and for
"max" where |z_i| <= 1), dW = dn V^T - delta:

    dq = (dW * M) K,   dk = (dW * M)^T Q,   dv = (S * M)^T dn,   and per scan, with G = dW * S * M_s,
    dE_t = sum_{p_j < p_t} G_tj - sum_{p_i > p_t} G_it,   dI_t = sum_{p_i < p_t} G_it - sum_{p_j > p_t} G_tj,

a small kernel for each row's dn (in dY's dtype) and delta first, then one kernel per key tile (dk, dv and the
column sums) and one per query tile (dq, and dE, dI: the row sums added, times ln 2 for the base-2 sums): nothing
L x L in memory, no atomics, the same bits every run. The key kernel sums only dE's columns, and of two scans the
first scan's dI too, as does the query kernel with its rows: k_t . dk_t (q_t . dq_t) is the sum of G's column
(row) t over every scan, so the rest follows from it after the loop (_rest), the diagonal counted with dI's side.
E and I come from the log decays by torch ops (O(L)), through which autograd carries their gradients on. E, I,
the positions, delta and dE, dI run past L to a multiple of every tile (_padded), so that the kernels read the
per-token vectors without masks (a padding key's scores are 0, so its entries and gradients are too; a padding
query's dn and delta are 0).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ..masks import FLOAT64_CUMSUM_ABOVE
from ..tuning import tuning
from .fla import _FirstOrderOnly, _scan_indices, kept, kernel_inputs, launched_on_device_of
from .operands import (CONTRACTED, FUSED_MAPS, IDENTITY, LN2, LOG2E, SCALING_CODES, _block, _divisor, _features_grad,
                       _mapped, cdiv, in_rows, rows_contiguous)

# Above this many tokens E and I are float64, and the kernels subtract them so: an exponent E_i - E_j of two sums
# of L log decays, each rounded to float32, errs by about eps L |a|, which reaches 1e-4 for the entries that matter
# (|a| ~ 1) from about 1,700 tokens. The attention form trains below 1,024 tokens (auto_chunk_min_tokens).
FLOAT64_EXPONENTS_ABOVE = 1024

# The compute capabilities (majors) whose registers Tuning.bidirectional_forward_blocks' cap was measured for:
# Hopper's. Compiled for an A100 (8) the capped forward spills 384-432 B and issues two fifths more an iteration.
REGISTER_CAP_ARCHITECTURES = (9,)


@triton.jit
def _scan_vectors(E, I, P, s, b, h, t, ses, seb, seh, sel, sps, IN_ORDER: tl.constexpr):
    """One scan's E, I (float32, or float64 for long sequences) and positions of tokens t, read past L without
    masks (_padded): IN_ORDER (one scan in token order), the positions are t themselves, not loaded."""
    at = s * ses + b * seb + h * seh + t * sel
    if IN_ORDER:
        positions = t
    else:
        positions = tl.load(P + s * sps + t)
    return tl.load(E + at), tl.load(I + at), positions


@triton.jit
def _pairs(per_query, per_key, KEYS_FIRST: tl.constexpr):
    """A query vector and a key vector broadcast to a tile [queries, keys], or [keys, queries] (KEYS_FIRST)."""
    if KEYS_FIRST:  # (one return: the compiler types every return statement, a branch not taken too)
        queries, keys = per_query[None, :], per_key[:, None]
    else:
        queries, keys = per_query[:, None], per_key[None, :]
    return queries, keys


@triton.jit
def _span(p, ok, start, L, SIZE: tl.constexpr, IN_ORDER: tl.constexpr):
    """The first and last scan positions of a tile's tokens ok (positions p; the tile: SIZE tokens from start, of
    L): whether _scan_mask factors a tile. IN_ORDER (one scan in token order, p the tokens' own indices): its
    first and last tokens, with no reduction (one through shared memory, where the tile's tokens span the
    block's warps)."""
    if IN_ORDER:
        first, last = start, tl.minimum(start + SIZE, L) - 1
    else:
        first, last = tl.min(tl.where(ok, p, 1 << 30)), tl.max(tl.where(ok, p, -1))
    return first, last


@triton.jit
def _loop_span(T, start, L, SIZE: tl.constexpr, IN_ORDER: tl.constexpr):
    """_span of a loop's tile (SIZE tokens from start, of L) with no reduction: its first and last tokens IN_ORDER,
    else read from the table T [tiles, 2] (_tile_spans)."""
    if IN_ORDER:
        first, last = start, tl.minimum(start + SIZE, L) - 1
    else:
        at = (start // SIZE) * 2
        first, last = tl.load(T + at), tl.load(T + at + 1)
    return first, last


@triton.jit
def _factor(exponent):
    """2^exponent in float32 (E and I come in base 2: a natural exponent times log2 e), the exponent (in E's dtype)
    rounded and clamped at 0: a mask entry or factor, at most 1 (padding lanes' too). PTX ex2.approx.ftz, as
    operands._exp."""
    return tl.math.exp2(tl.minimum(exponent.to(tl.float32), 0.0))


@triton.jit
def _references(e, i, ok, KEYS: tl.constexpr):
    """A program's own tile's references R of _scan_mask's factored tiles and its factors there, (R_E, R_I, below,
    above), from the E and I of its tokens ok: computed once, outside its loop. below: where keys come before
    queries along the scan, above: after. R is a query tile's largest E and least I, a key tile's (KEYS) least E and
    largest I, so that every factor is <= 1, the tile's own and those of any tile factored against it."""
    if KEYS:
        r_e, r_i = tl.min(tl.where(ok, e, float("inf"))), tl.max(tl.where(ok, i, float("-inf")))
        below, above = r_e - e, i - r_i
    else:
        r_e, r_i = tl.max(tl.where(ok, e, float("-inf"))), tl.min(tl.where(ok, i, float("inf")))
        below, above = e - r_e, r_i - i
    return r_e, r_i, _factor(below), _factor(above)


@triton.jit
def _scan_mask(e_q, i_q, e_k, i_k, first_q, last_q, r_e, r_i, first_k, last_k, own_below, own_above,
               KEYS_FIRST: tl.constexpr, FACTORED: tl.constexpr, OWN_KEYS: tl.constexpr):
    """One scan's mask tile [queries, keys] (KEYS_FIRST: [keys, queries]), float32 (the entries of padding tokens
    finite). The exponents are differences in E's dtype (float64 for long sequences, cumulative), then rounded.
    FACTORED: a tile whose keys all come before its queries along the scan (_span's first and last positions of
    each) is the outer product exp(E_i - R) exp(R - E_j), R = r_e, and one whose keys all come after them
    exp(R - I_i) exp(I_j - R), R = r_i: an exponential per token, not per entry. The references are the program's
    own tile's, as are its factors own_below, own_above (_references: its keys' where OWN_KEYS, else its
    queries'), computed once outside its loop; each factor is <= 1 (the sums are monotone along the scan; the
    minimum keeps those of padding lanes finite too)."""
    if FACTORED:
        if last_k < first_q:
            if OWN_KEYS:
                queries, keys = _factor(e_q - r_e), own_below
            else:
                queries, keys = own_below, _factor(r_e - e_k)
            queries, keys = _pairs(queries, keys, KEYS_FIRST)
            mask = queries * keys
        elif first_k > last_q:
            if OWN_KEYS:
                queries, keys = _factor(r_i - i_q), own_above
            else:
                queries, keys = own_above, _factor(i_k - r_i)
            queries, keys = _pairs(queries, keys, KEYS_FIRST)
            mask = queries * keys
        else:
            mask = _entrywise_mask(e_q, i_q, e_k, i_k, KEYS_FIRST)
    else:
        mask = _entrywise_mask(e_q, i_q, e_k, i_k, KEYS_FIRST)
    return mask


@triton.jit
def _entrywise_mask(e_q, i_q, e_k, i_k, KEYS_FIRST: tl.constexpr):
    """_scan_mask's tile, an exponential per entry: exp(E_i - E_j) where the query comes after its key along the
    scan, exp(I_j - I_i) where before, 1 on the diagonal, with no positions: the exponent of the pair's side is
    <= 0 and the other's >= 0 (E and I fall along the scan, I_t = E_t + a_t), so it is the lesser of the two, 0 on
    the diagonal. Not clamped: where rounding leaves both above 0, by a rounding, the entry is 1 to rounding."""
    e_q, e_k = _pairs(e_q, e_k, KEYS_FIRST)  # (flat targets: Triton 3.6 cannot hash a kernel with nested ones)
    i_q, i_k = _pairs(i_q, i_k, KEYS_FIRST)
    return tl.math.exp2(tl.minimum(e_q - e_k, i_k - i_q).to(tl.float32))


@triton.jit
def _load_tile(x, b, h, t, ok, sb, sh, sl, D, BLOCK_D: tl.constexpr, EVICTION: tl.constexpr):
    c = tl.arange(0, BLOCK_D)
    return tl.load(x + b * sb + h * sh + t[:, None] * sl + c[None, :], mask=ok[:, None] & (c < D)[None, :],
                   other=0.0, eviction_policy=EVICTION)


@triton.jit
def _tile(x, b, h, t, ok, sb, sh, sl, D, BLOCK_D: tl.constexpr):
    """Rows t of one image and head of x [B, H, L, D] (last dimension contiguous), zero past L and D."""
    return _load_tile(x, b, h, t, ok, sb, sh, sl, D, BLOCK_D, "")


@triton.jit
def _tile_again(x, b, h, t, ok, sb, sh, sl, D, BLOCK_D: tl.constexpr):
    """_tile, read again after a loop by a load of its own (another eviction policy): merged with the one before the
    loop (the same address, no store between), the tile would stay in registers through the loop (a Hopper backward
    kernel's third block)."""
    return _load_tile(x, b, h, t, ok, sb, sh, sl, D, BLOCK_D, "evict_first")


@triton.jit
def _features(raw, ok, D, BLOCK_D: tl.constexpr, MAP: tl.constexpr, NORM: tl.constexpr):
    """Raw rows [T, BLOCK_D] through a fused feature map (operands.py's MAP, NORM), in their dtype."""
    if MAP == 0 and not NORM:
        return raw
    valid = ok[:, None] & (tl.arange(0, BLOCK_D) < D)[None, :]
    f = tl.where(valid, _mapped(raw.to(tl.float32), MAP), 0.0)
    if NORM:
        f = f / tl.where(ok, tl.sqrt(tl.sum(f * f, axis=1)), 1.0)[:, None]
    return f.to(raw.dtype)


@triton.jit
def _raw_grad(raw, g, ok, D, BLOCK_D: tl.constexpr, MAP: tl.constexpr, NORM: tl.constexpr):
    """The gradient of raw rows from that of their features g (float32)."""
    valid = ok[:, None] & (tl.arange(0, BLOCK_D) < D)[None, :]
    return _features_grad(raw.to(tl.float32), g, valid, ok, MAP, NORM)


@triton.jit
def _store_tile(x, value, b, h, t, ok, sb, sh, sl, D, BLOCK_D: tl.constexpr):
    c = tl.arange(0, BLOCK_D)
    tl.store(x + b * sb + h * sh + t[:, None] * sl + c[None, :], value.to(x.dtype.element_ty),
             mask=ok[:, None] & (c < D)[None, :])


@triton.jit
def _keys(k, v, b, h, cols, col_ok, skb, skh, skl, svb, svh, svl, DK, DV, MAP_K: tl.constexpr,
          NORM_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """A key tile's features and its values."""
    return (_features(_tile(k, b, h, cols, col_ok, skb, skh, skl, DK, BLOCK_K), col_ok, DK, BLOCK_K, MAP_K, NORM_K),
            _tile(v, b, h, cols, col_ok, svb, svh, svl, DV, BLOCK_V))


@triton.jit
def _map_kernel(x, f, sxb, sxh, sxl, L, H, D: tl.constexpr, MAP: tl.constexpr, NORM: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The features f [B, H, L, D] (contiguous) of raw x [B, H, L, D] (rows contiguous): _features, as the kernels
    map a tile they read (Tuning.bidirectional_map_pass)."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < L
    features = _features(_tile(x, b, h, t, ok, sxb, sxh, sxl, D, BLOCK_D), ok, D, BLOCK_D, MAP, NORM)
    _store_tile(f, features, b, h, t, ok, H * L * D, L * D, D, D, BLOCK_D)


@triton.jit
def _forward_kernel(q, k, v, E, I, P, T, y, z, sqb, sqh, sql, skb, skh, skl, svb, svh, svl, syb, syh, syl,
                    ses, seb, seh, sel, sps, L, H, DK: tl.constexpr, DV: tl.constexpr, SCANS: tl.constexpr,
                    SCALING: tl.constexpr, MAP_Q: tl.constexpr, NORM_Q: tl.constexpr, MAP_K: tl.constexpr,
                    NORM_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_V: tl.constexpr, FACTORED: tl.constexpr, IN_ORDER: tl.constexpr):
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < L
    q_tile = _features(_tile(q, b, h, rows, row_ok, sqb, sqh, sql, DK, BLOCK_K), row_ok, DK, BLOCK_K, MAP_Q, NORM_Q)
    e0, i0, p0 = _scan_vectors(E, I, P, 0, b, h, rows, ses, seb, seh, sel, sps, IN_ORDER)
    if SCANS == 2:
        e1, i1, _ = _scan_vectors(E, I, P, 1, b, h, rows, ses, seb, seh, sel, sps, IN_ORDER)
    numerator = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    normaliser = tl.zeros([BLOCK_M], dtype=tl.float32)
    first_q, last_q = _span(p0, row_ok, block * BLOCK_M, L, BLOCK_M, IN_ORDER)  # (the first scan's: the one factored)
    r_e, r_i, own_below, own_above = _references(e0, i0, row_ok, False)
    for start in range(0, L, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        k_tile, v_tile = _keys(k, v, b, h, cols, col_ok, skb, skh, skl, svb, svh, svl, DK, DV, MAP_K, NORM_K,
                               BLOCK_K, BLOCK_V)
        ek, ik, _ = _scan_vectors(E, I, P, 0, b, h, cols, ses, seb, seh, sel, sps, IN_ORDER)
        first_k, last_k = _loop_span(T, start, L, BLOCK_N, IN_ORDER)
        mask = _scan_mask(e0, i0, ek, ik, first_q, last_q, r_e, r_i, first_k, last_k, own_below, own_above,
                          False, FACTORED, False)
        if SCANS == 2:
            ek, ik, _ = _scan_vectors(E, I, P, 1, b, h, cols, ses, seb, seh, sel, sps, IN_ORDER)
            mask += _scan_mask(e1, i1, ek, ik, first_q, last_q, r_e, r_i, first_k, last_k, own_below,
                               own_above, False, False, False)  # (never factors: _masks)
        weights = tl.dot(q_tile, tl.trans(k_tile)) * mask
        normaliser += tl.sum(weights, 1)
        numerator += tl.dot(weights.to(v_tile.dtype), v_tile)
    numerator = numerator / _divisor(tl.where(row_ok, normaliser, 1.0), SCALING)[:, None]
    _store_tile(y, numerator, b, h, rows, row_ok, syb, syh, syl, DV, BLOCK_V)
    if SCALING != 1:
        tl.store(z + bh.to(tl.int64) * L + rows, normaliser, mask=row_ok)


@triton.jit
def _factors_kernel(dy, y, z, dn, delta, sdb, sdh, sdl, syb, syh, syl, snb, snh, snl, L, LP, H, DV: tl.constexpr,
                    SCALING: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    """Each row's dn = dY r (r the scaling's factor on dY; in dY's dtype) and delta (dY . Y / z where the divisor
    depends on z; float32 [B, H, LP], 0 past L), from dY, Y and the normaliser z: what both backward kernels read per
    query. Made once here, dn is read as it is by the key kernel's every iteration, which would otherwise scale dY
    again in its products' operand layout, each warp a copy. delta runs past L with zeros, as E and I do, so that
    the key kernel's loop reads it without a mask (with one, Triton 3.6 copies it element by element)."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < L
    grad = _tile(dy, b, h, rows, ok, sdb, sdh, sdl, DV, BLOCK_V).to(tl.float32)
    outer = tl.sum(grad * _tile(y, b, h, rows, ok, syb, syh, syl, DV, BLOCK_V).to(tl.float32), 1)
    normaliser = tl.load(z + bh.to(tl.int64) * L + rows, mask=ok, other=1.0)
    factor = 1.0 / _divisor(normaliser, SCALING)
    correction = outer / normaliser
    if SCALING == 2:  # max(|z|, 1): z's gradient only where |z| > 1
        correction = tl.where(tl.abs(normaliser) > 1.0, correction, 0.0)
    _store_tile(dn, grad * factor[:, None], b, h, rows, ok, snb, snh, snl, DV, BLOCK_V)
    tl.store(delta + bh.to(tl.int64) * LP + rows, tl.where(ok, correction, 0.0), mask=rows < LP)


@triton.jit
def _queries(q, dn, delta, b, h, bh, rows, row_ok, sqb, sqh, sql, snb, snh, snl, LP, DK, DV,
             NORMALISED: tl.constexpr, MAP_Q: tl.constexpr, NORM_Q: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_V: tl.constexpr):
    """A query tile's features, dn (dY itself where the scaling reads no normaliser: r 1) and delta (0 there)."""
    if NORMALISED:
        correction = tl.load(delta + bh.to(tl.int64) * LP + rows)  # (padded: _factors_kernel)
    else:
        correction = tl.zeros_like(rows).to(tl.float32)
    return _features(_tile(q, b, h, rows, row_ok, sqb, sqh, sql, DK, BLOCK_K), row_ok, DK, BLOCK_K, MAP_Q, NORM_Q), \
        _tile(dn, b, h, rows, row_ok, snb, snh, snl, DV, BLOCK_V), correction


@triton.jit
def _masks(E, I, P, T, b, h, rows, row_ok, cols, col_ok, ses, seb, seh, sel, sps, first, last, r_e, r_i, own_below,
           own_above, start, L, LOOP: tl.constexpr, SCANS: tl.constexpr, KEYS_FIRST: tl.constexpr,
           FACTORED: tl.constexpr, OWN_KEYS: tl.constexpr, IN_ORDER: tl.constexpr):
    """The mask tile [queries, keys] (KEYS_FIRST: [keys, queries]) of every scan summed, and each scan's own (the
    second: the first scan's where there is one) with its query and key positions, and the first scan's side: 1
    where the tile's keys all come before its queries, -1 where all after, else 0 (0 where not FACTORED). first,
    last, r_e, r_i, own_below, own_above: the first scan's _span and _references of the program's own tile, its
    keys where OWN_KEYS, else its queries, made once outside its loop; the loop tile's span (LOOP tokens from
    start) by _loop_span. FACTORED factors the first scan's tiles only: along the second of two (the natural
    models' column snake) a tile of consecutive tokens spans every column, so its keys are never all before or all
    after its queries, and the test costs registers."""
    e, i, p_q = _scan_vectors(E, I, P, 0, b, h, rows, ses, seb, seh, sel, sps, IN_ORDER)
    e_k, i_k, p_k = _scan_vectors(E, I, P, 0, b, h, cols, ses, seb, seh, sel, sps, IN_ORDER)
    if OWN_KEYS:
        first_q, last_q = _loop_span(T, start, L, LOOP, IN_ORDER)
        first_k, last_k = first, last
    else:
        first_q, last_q = first, last
        first_k, last_k = _loop_span(T, start, L, LOOP, IN_ORDER)
    m0 = _scan_mask(e, i, e_k, i_k, first_q, last_q, r_e, r_i, first_k, last_k, own_below, own_above,
                    KEYS_FIRST, FACTORED, OWN_KEYS)
    side = (last_k < first_q).to(tl.int32) - (first_k > last_q).to(tl.int32) if FACTORED else 0
    if SCANS == 2:
        e, i, p_q1 = _scan_vectors(E, I, P, 1, b, h, rows, ses, seb, seh, sel, sps, IN_ORDER)
        e_k, i_k, p_k1 = _scan_vectors(E, I, P, 1, b, h, cols, ses, seb, seh, sel, sps, IN_ORDER)
        m1 = _scan_mask(e, i, e_k, i_k, first_q, last_q, r_e, r_i, first_k, last_k, own_below, own_above,
                        KEYS_FIRST, False, OWN_KEYS)
        return m0 + m1, m0, p_q, p_k, m1, p_q1, p_k1, side
    return m0, m0, p_q, p_k, m0, p_q, p_k, side


@triton.jit
def _sums(tile, KEYS_FIRST: tl.constexpr, OVER_QUERIES: tl.constexpr):
    """A tile's sums over its queries (a vector over its keys) where OVER_QUERIES, else over its keys."""
    if OVER_QUERIES and not KEYS_FIRST:
        sums = tl.sum(tile, 0)
    else:  # (a [keys, queries] tile's over its queries, a [queries, keys] tile's over its keys: along its rows)
        sums = tl.sum(tile, 1)
    return sums


@triton.jit
def _split_sums(de, di, g, p_q, p_k, SIGN: tl.constexpr, KEYS_FIRST: tl.constexpr, OVER_QUERIES: tl.constexpr,
                BOTH: tl.constexpr):
    """de + SIGN (the _sums of g [queries, keys], KEYS_FIRST: [keys, queries], where the query comes after its key
    along the scan) and, where BOTH, di - SIGN (the rest, the diagonal with I's side: _rest): the parts that reach
    E and I."""
    p_q, p_k = _pairs(p_q, p_k, KEYS_FIRST)
    de += SIGN * _sums(tl.where(p_q > p_k, g, 0.0), KEYS_FIRST, OVER_QUERIES)
    if BOTH:
        di -= SIGN * _sums(tl.where(p_q <= p_k, g, 0.0), KEYS_FIRST, OVER_QUERIES)
    return de, di


@triton.jit
def _accumulate(de, di, x, y, p_q, p_k, side, SIGN: tl.constexpr, KEYS_FIRST: tl.constexpr,
                OVER_QUERIES: tl.constexpr, SIDED: tl.constexpr, BOTH: tl.constexpr):
    """_split_sums of g = x * y, made only where a sum reads it: where SIDED with no test per entry for a tile on
    one side (_masks's side): 1, every entry after, -1, every entry before (no sum there where not BOTH)."""
    if SIDED:
        if side > 0:
            de += SIGN * _sums(x * y, KEYS_FIRST, OVER_QUERIES)
        elif side < 0:
            if BOTH:
                di -= SIGN * _sums(x * y, KEYS_FIRST, OVER_QUERIES)
        else:
            de, di = _split_sums(de, di, x * y, p_q, p_k, SIGN, KEYS_FIRST, OVER_QUERIES, BOTH)
    else:
        de, di = _split_sums(de, di, x * y, p_q, p_k, SIGN, KEYS_FIRST, OVER_QUERIES, BOTH)
    return de, di


@triton.jit
def _decay_sums(de0, di0, de1, di1, dw, scores, weighted, m0, m1, p_q0, p_k0, p_q1, p_k1, side,
                SIGN: tl.constexpr, KEYS_FIRST: tl.constexpr, OVER_QUERIES: tl.constexpr, FACTORED: tl.constexpr,
                SCANS: tl.constexpr, G_FIRST: tl.constexpr):
    """An iteration's sums of each scan's G = dW * S * M_s (weighted = dW * M; one scan: M = M_0, G = weighted * S)
    into E's and I's parts: of two scans both sides of the first and E's of the second, of one E's side; _rest
    makes the others from the whole rows' (columns') sums after the loop. G_FIRST: one scan's G made before the
    branches that sum it, not in them (Triton 3.6's pipeliner fails on a product read only in a loop's branches,
    as the query kernel's scores would be)."""
    if SCANS == 2:
        ds = dw * scores
        de0, di0 = _accumulate(de0, di0, ds, m0, p_q0, p_k0, side, SIGN, KEYS_FIRST, OVER_QUERIES, FACTORED, True)
        de1, di1 = _accumulate(de1, di1, ds, m1, p_q1, p_k1, 0, SIGN, KEYS_FIRST, OVER_QUERIES, False, False)
    elif G_FIRST:
        de0, di0 = _accumulate(de0, di0, weighted * scores, 1.0, p_q0, p_k0, side, SIGN, KEYS_FIRST, OVER_QUERIES,
                               FACTORED, False)
    else:
        de0, di0 = _accumulate(de0, di0, weighted, scores, p_q0, p_k0, side, SIGN, KEYS_FIRST, OVER_QUERIES,
                               FACTORED, False)
    return de0, di0, de1, di1


@triton.jit
def _rest(features, acc, de0, di0, de1, SIGN: tl.constexpr, SCANS: tl.constexpr):
    """(di0, di1): the sums of I's side (diagonal included, as _split_sums counts it) that _decay_sums left out, from
    whole rows (columns): a token's features times its gradient's accumulator (q_t . dq_t in the query kernel,
    SIGN 1; k_t . dk_t in the key kernel, SIGN -1) is the sum of its row (column) of G over every scan, diagonals
    included. With one scan that less E's side; with two, less the first scan's both sides and the second's E."""
    whole = tl.sum(features.to(tl.float32) * acc, 1)
    if SCANS == 2:
        di1 = de1 + de0 - di0 - SIGN * whole
    else:
        di0 = de0 - SIGN * whole
        di1 = di0
    return di0, di1


@triton.jit
def _finish_sums(dE, dI, at, de, di, ok):
    """The gradients of E and I at tokens `at` (ok): the key kernel's column sums there plus a query tile's row sums
    de, di, times ln 2, since E and I come in base 2 (_factor)."""
    tl.store(dE + at, (tl.load(dE + at, mask=ok) + de) * LN2, mask=ok)
    tl.store(dI + at, (tl.load(dI + at, mask=ok) + di) * LN2, mask=ok)


@triton.jit
def _backward_keys_kernel(q, k, v, dn, delta, E, I, P, T, raw, dk, dv, dE, dI,
                          sqb, sqh, sql, skb, skh, skl, svb, svh, svl, snb, snh, snl, srb, srh, srl, sgb, sgh, sgl,
                          ses, seb, seh, sel, sps, L, LP, H, DK: tl.constexpr, DV: tl.constexpr, swb, swh, swl,
                          SCANS: tl.constexpr, NORMALISED: tl.constexpr, MAP_Q: tl.constexpr, NORM_Q: tl.constexpr,
                          MAP_K: tl.constexpr, NORM_K: tl.constexpr, RAW_MAP: tl.constexpr, RAW_NORM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                          KEYS_FIRST: tl.constexpr, FACTORED: tl.constexpr, IN_ORDER: tl.constexpr):
    """dk (strides sg*, as dq's) and dv (sw*) and the column sums of dE, dI [S, B, H, LP] of a key tile; dk through
    the map (RAW_MAP, RAW_NORM) of the raw keys raw (strides sr*), which k is or whose features it holds. KEYS_FIRST:
    its tiles are [keys, queries], the transposes of the query kernel's, so that every product's first operand
    spans the program's own keys (Hopper's wgmma wants 64 rows) and no product of registers is transposed."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < L
    k_tile, v_tile = _keys(k, v, b, h, cols, col_ok, skb, skh, skl, svb, svh, svl, DK, DV, MAP_K, NORM_K, BLOCK_K,
                           BLOCK_V)
    de0, di0 = tl.zeros([BLOCK_N], dtype=tl.float32), tl.zeros([BLOCK_N], dtype=tl.float32)
    de1, di1 = tl.zeros([BLOCK_N], dtype=tl.float32), tl.zeros([BLOCK_N], dtype=tl.float32)
    dk_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    e_own, i_own, p_own = _scan_vectors(E, I, P, 0, b, h, cols, ses, seb, seh, sel, sps, IN_ORDER)
    first_k, last_k = _span(p_own, col_ok, block * BLOCK_N, L, BLOCK_N, IN_ORDER)
    r_e, r_i, own_below, own_above = _references(e_own, i_own, col_ok, True)
    for start in range(0, L, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < L
        q_tile, dn_tile, correction = _queries(q, dn, delta, b, h, bh, rows, row_ok, sqb, sqh, sql, snb, snh, snl,
                                               LP, DK, DV, NORMALISED, MAP_Q, NORM_Q, BLOCK_K, BLOCK_V)
        mask, m0, p_q0, p_k0, m1, p_q1, p_k1, side = _masks(
            E, I, P, T, b, h, rows, row_ok, cols, col_ok, ses, seb, seh, sel, sps, first_k, last_k, r_e, r_i,
            own_below, own_above, start, L, BLOCK_M, SCANS, KEYS_FIRST, FACTORED, True, IN_ORDER)
        if KEYS_FIRST:
            scores = tl.dot(k_tile, tl.trans(q_tile))
            dv_acc += tl.dot((scores * mask).to(v_tile.dtype), dn_tile)
            dw = tl.dot(v_tile, tl.trans(dn_tile)) - correction[None, :]
            weighted = dw * mask
            dk_acc += tl.dot(weighted.to(q_tile.dtype), q_tile)
        else:
            scores = tl.dot(q_tile, tl.trans(k_tile))
            dv_acc += tl.dot(tl.trans((scores * mask).to(v_tile.dtype)), dn_tile)
            dw = tl.dot(dn_tile, tl.trans(v_tile)) - correction[:, None]
            weighted = dw * mask
            dk_acc += tl.dot(tl.trans(weighted.to(q_tile.dtype)), q_tile)
        de0, di0, de1, di1 = _decay_sums(de0, di0, de1, di1, dw, scores, weighted, m0, m1, p_q0, p_k0, p_q1, p_k1,
                                         side, -1.0, KEYS_FIRST, True, FACTORED, SCANS, False)
    _store_tile(dv, dv_acc, b, h, cols, col_ok, swb, swh, swl, DV, BLOCK_V)
    k_raw = _tile(raw, b, h, cols, col_ok, srb, srh, srl, DK, BLOCK_K)
    _store_tile(dk, _raw_grad(k_raw, dk_acc, col_ok, DK, BLOCK_K, RAW_MAP, RAW_NORM), b, h, cols, col_ok, sgb, sgh,
                sgl, DK, BLOCK_K)
    k_tile = _features(_tile_again(k, b, h, cols, col_ok, skb, skh, skl, DK, BLOCK_K), col_ok, DK, BLOCK_K, MAP_K,
                       NORM_K)
    di0, di1 = _rest(k_tile, dk_acc, de0, di0, de1, -1.0, SCANS)
    at = bh.to(tl.int64) * LP + cols  # (dE, dI: contiguous [S, B * H, LP]; padding tokens' 0)
    tl.store(dE + at, de0)
    tl.store(dI + at, di0)
    if SCANS == 2:
        at += tl.num_programs(1).to(tl.int64) * LP
        tl.store(dE + at, de1)
        tl.store(dI + at, di1)


@triton.jit
def _backward_queries_kernel(q, k, v, dn, delta, E, I, P, T, raw, dq, dE, dI,
                             sqb, sqh, sql, skb, skh, skl, svb, svh, svl, snb, snh, snl, srb, srh, srl, sgb, sgh, sgl,
                             ses, seb, seh, sel, sps, L, LP, H, DK: tl.constexpr, DV: tl.constexpr,
                             SCANS: tl.constexpr, NORMALISED: tl.constexpr, MAP_Q: tl.constexpr,
                             NORM_Q: tl.constexpr, MAP_K: tl.constexpr, NORM_K: tl.constexpr, RAW_MAP: tl.constexpr,
                             RAW_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, FACTORED: tl.constexpr,
                             IN_ORDER: tl.constexpr):
    """dq (strides sg*) of a query tile, through the map (RAW_MAP, RAW_NORM) of the raw queries raw (strides sr*),
    which q is or whose features it holds; adds its row sums to the column sums in dE, dI."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < L
    q_tile, dn_tile, correction = _queries(q, dn, delta, b, h, bh, rows, row_ok, sqb, sqh, sql, snb, snh, snl,
                                           LP, DK, DV, NORMALISED, MAP_Q, NORM_Q, BLOCK_K, BLOCK_V)
    de0, di0 = tl.zeros([BLOCK_M], dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32)
    de1, di1 = tl.zeros([BLOCK_M], dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32)
    dq_acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    e_own, i_own, p_own = _scan_vectors(E, I, P, 0, b, h, rows, ses, seb, seh, sel, sps, IN_ORDER)
    first_q, last_q = _span(p_own, row_ok, block * BLOCK_M, L, BLOCK_M, IN_ORDER)
    r_e, r_i, own_below, own_above = _references(e_own, i_own, row_ok, False)
    for start in range(0, L, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        k_tile, v_tile = _keys(k, v, b, h, cols, col_ok, skb, skh, skl, svb, svh, svl, DK, DV, MAP_K, NORM_K,
                               BLOCK_K, BLOCK_V)
        mask, m0, p_q0, p_k0, m1, p_q1, p_k1, side = _masks(
            E, I, P, T, b, h, rows, row_ok, cols, col_ok, ses, seb, seh, sel, sps, first_q, last_q, r_e, r_i,
            own_below, own_above, start, L, BLOCK_N, SCANS, False, FACTORED, False, IN_ORDER)
        scores = tl.dot(q_tile, tl.trans(k_tile))
        dw = tl.dot(dn_tile, tl.trans(v_tile)) - correction[:, None]
        weighted = dw * mask
        dq_acc += tl.dot(weighted.to(k_tile.dtype), k_tile)
        de0, di0, de1, di1 = _decay_sums(de0, di0, de1, di1, dw, scores, weighted, m0, m1, p_q0, p_k0, p_q1, p_k1,
                                         side, 1.0, False, False, FACTORED, SCANS, True)
    q_tile = _features(_tile_again(q, b, h, rows, row_ok, sqb, sqh, sql, DK, BLOCK_K), row_ok, DK, BLOCK_K, MAP_Q,
                       NORM_Q)
    di0, di1 = _rest(q_tile, dq_acc, de0, di0, de1, 1.0, SCANS)
    q_raw = _tile(raw, b, h, rows, row_ok, srb, srh, srl, DK, BLOCK_K)
    _store_tile(dq, _raw_grad(q_raw, dq_acc, row_ok, DK, BLOCK_K, RAW_MAP, RAW_NORM), b, h, rows, row_ok, sgb, sgh,
                sgl, DK, BLOCK_K)
    at = bh.to(tl.int64) * LP + rows
    _finish_sums(dE, dI, at, de0, di0, row_ok)
    if SCANS == 2:
        _finish_sums(dE, dI, at + tl.num_programs(1).to(tl.int64) * LP, de1, di1, row_ok)


def _strides(x: Tensor) -> Tuple[int, int, int]:
    """(batch, head, token) strides of x [B, H, L, D]."""
    return x.stride(0), x.stride(1), x.stride(2)


def _forward(q: Tensor, k: Tensor, v: Tensor, exclusive: Tensor, inclusive: Tensor, positions: Tensor,
             feature_map: Optional[str], scaling: str, in_order: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """Y [B, H, L, Dv] (a view of [B, L, H, Dv]) and the normaliser [B, H, L] float32 (None for scaling "none") of
    q, k [B, H, L, Dk] (raw, mapped by the kernels through a FUSED_MAPS name, or features: None) and v, from each
    scan's E, I [S, B, H, LP] float32 (broadcast views are read as they are) and positions [S, LP] int32, padded past
    L (_padded); in_order: one scan in token order (positions the tokens' indices, which the kernels take for them:
    not read), whose tiles' spans need no reduction."""
    batch, heads, length, key_dim = q.shape
    value_dim = v.shape[-1]
    y = v.new_empty(batch, length, heads, value_dim).transpose(1, 2)
    z = q.new_empty((batch, heads, length), dtype=torch.float32) if scaling != "none" else None
    own, loop, warps = _tiles("forward", exclusive.shape[-1])
    k, maps = _by_pass(k, _maps(feature_map), "K")  # (the queries, each a program's own, mapped as read)
    spans = positions if in_order else _tile_spans(positions, loop, length)  # (in order: unread)
    _forward_kernel[(cdiv(length, own), batch * heads)](
        q, k, v, exclusive, inclusive, positions, spans, y, z, *_strides(q), *_strides(k), *_strides(v), *_strides(y),
        *exclusive.stride(), positions.stride(0), length, heads, key_dim, value_dim, SCANS=len(positions),
        SCALING=SCALING_CODES[scaling], **maps, BLOCK_M=own, BLOCK_N=loop, BLOCK_K=_block(key_dim),
        BLOCK_V=_block(value_dim), FACTORED=tuning().bidirectional_factored_masks, IN_ORDER=in_order,
        num_warps=warps, **_register_cap(q, exclusive, warps), **CONTRACTED)
    return y, z


def _register_cap(q: Tensor, exclusive: Tensor, warps: int) -> dict:
    """The forward kernel's maxnreg: Tuning.bidirectional_forward_blocks blocks of `warps` warps in a
    multiprocessor's 64 K registers (8 a thread at a time), for 16-bit q with float32 sums; nothing for float32 tiles
    or float64 sums, which would spill under it, where the knob is 0, or on a GPU whose architecture is not one of
    REGISTER_CAP_ARCHITECTURES (Triton's interpreter, which ignores it, records it: compile_kernels.py drops it for
    those targets)."""
    blocks = tuning().bidirectional_forward_blocks
    if not blocks or q.element_size() != 2 or exclusive.dtype != torch.float32 or (
            q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] not in
            REGISTER_CAP_ARCHITECTURES):
        return {}
    return dict(maxnreg=min(255, 65536 // (blocks * warps * 32) // 8 * 8))


def _backward(dy: Tensor, q: Tensor, k: Tensor, v: Tensor, exclusive: Tensor, inclusive: Tensor, positions: Tensor,
              y: Tensor, z: Optional[Tensor], feature_map: Optional[str], scaling: str, in_order: bool = False
              ) -> Tuple[Tensor, ...]:
    """The gradients of q, k, v (token-major, as a projection's are) and of E and I ([S, B, H, LP] float32, 0 past L)
    from dY [B, H, L, Dv] and what _forward took and gave."""
    dy = rows_contiguous(dy)
    batch, heads, length, key_dim = q.shape
    value_dim = v.shape[-1]
    normalised = scaling != "none"
    scans, padded = positions.shape
    dn, correction = dy, None  # (dY itself where the scaling reads no normaliser)
    if normalised:
        dn, correction = torch.empty_like(dy), z.new_empty(batch, heads, padded)
        _factors_kernel[(cdiv(padded, 32), batch * heads)](
            dy, y, z, dn, correction, *_strides(dy), *_strides(y), *_strides(dn), length, padded, heads, value_dim,
            SCALING=SCALING_CODES[scaling], BLOCK_T=32, BLOCK_V=_block(value_dim), **CONTRACTED)
    # token-major [B, L, H, D] as a projection's gradient is (the inputs may be views of any strides)
    dq, dk, dv = (x.new_empty(batch, length, heads, x.shape[-1]).transpose(1, 2) for x in (q, k, v))
    dE = q.new_empty((scans, batch, heads, padded), dtype=torch.float32)
    dI = torch.empty_like(dE)
    own, loop, warps = _tiles("backward", padded)
    covered = cdiv(length, own) * own  # (the key kernel writes its tiles' every token: 0 past L)
    if covered < padded:  # (a larger tile of the forward's padded further)
        dE[..., covered:], dI[..., covered:] = 0.0, 0.0
    settings = dict(SCANS=scans, NORMALISED=normalised, BLOCK_K=_block(key_dim), BLOCK_V=_block(value_dim),
                    FACTORED=tuning().bidirectional_factored_masks, IN_ORDER=in_order, num_warps=warps)
    maps = _maps(feature_map)
    queries, loads = _by_pass(q, maps, "Q")
    keys, loads = _by_pass(k, loads, "K")
    spans = positions if in_order else _tile_spans(positions, loop, length)  # (in order: unread)
    operands = (queries, keys, v, dn, correction, exclusive, inclusive, positions, spans)
    strides = (*_strides(queries), *_strides(keys), *_strides(v), *_strides(dn))
    shared = (*_strides(dq), *exclusive.stride(), positions.stride(0), length, padded, heads, key_dim, value_dim)
    _backward_keys_kernel[(cdiv(length, own), batch * heads)](
        *operands, k, dk, dv, dE, dI, *strides, *_strides(k), *shared, *_strides(dv), BLOCK_M=loop, BLOCK_N=own,
        KEYS_FIRST=tuning().bidirectional_keys_first, RAW_MAP=maps["MAP_K"], RAW_NORM=maps["NORM_K"], **loads,
        **settings, **CONTRACTED)
    _backward_queries_kernel[(cdiv(length, own), batch * heads)](
        *operands, q, dq, dE, dI, *strides, *_strides(q), *shared, BLOCK_M=own, BLOCK_N=loop, RAW_MAP=maps["MAP_Q"],
        RAW_NORM=maps["NORM_Q"], **loads, **settings, **CONTRACTED)
    return dq, dk, dv, dE, dI


class _Bidirectional(torch.autograd.Function):
    """_forward's Y, with _backward's gradients: what runs eagerly."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, exclusive: Tensor, inclusive: Tensor, positions: Tensor,
                feature_map: Optional[str], scaling: str, in_order: bool) -> Tensor:
        y, z = _forward(q, k, v, exclusive, inclusive, positions, feature_map, scaling, in_order)
        ctx.save_for_backward(q, k, v, exclusive, inclusive, positions, y, z)
        ctx.feature_map, ctx.scaling, ctx.in_order = feature_map, scaling, in_order
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        return (*_backward(dy, *ctx.saved_tensors, ctx.feature_map, ctx.scaling, ctx.in_order), None, None, None,
                None)


def _maps(feature_map: Optional[str]) -> dict:
    """The kernels' feature-map flags for a FUSED_MAPS name (None: q and k are features)."""
    (map_q, norm_q), (map_k, norm_k) = FUSED_MAPS.get(feature_map, ((IDENTITY, False),) * 2)
    return dict(MAP_Q=map_q, NORM_Q=norm_q, MAP_K=map_k, NORM_K=norm_k)


_MAP_TOKENS = 64  # tokens per program of the map pass


def _by_pass(x: Tensor, maps: dict, operand: str) -> Tuple[Tensor, dict]:
    """x [B, H, L, D] (raw q or k: operand "Q" or "K") as the kernels read it, and the flags (_maps) they read it
    by: where Tuning.bidirectional_map_pass is on and the maps change x, its features [B, H, L, D] (contiguous) by
    _map_kernel, read as given (operand's flags cleared); else x and the flags as they are."""
    kind, norm = maps[f"MAP_{operand}"], maps[f"NORM_{operand}"]
    if not tuning().bidirectional_map_pass or (kind == IDENTITY and not norm):
        return x, maps
    batch, heads, length, width = x.shape
    features = x.new_empty(batch, heads, length, width)
    _map_kernel[(cdiv(length, _MAP_TOKENS), batch * heads)](
        x, features, *_strides(x), length, heads, width, MAP=kind, NORM=norm, BLOCK_T=_MAP_TOKENS,
        BLOCK_D=_block(width), **CONTRACTED)
    return features, {**maps, f"MAP_{operand}": IDENTITY, f"NORM_{operand}": False}


def _tile_spans(positions: Tensor, size: int, length: int) -> Tensor:
    """The first scan's first and last positions of each tile of `size` tokens, [tiles, 2], from positions
    [S, LP] of `length` tokens (past them: padding): what the kernels' loops read (_loop_span) in place of two
    reductions a tile. Kept per positions tensor (those of a model's orders are kept with them: _scan_positions)
    and size."""
    def make() -> Tensor:
        tiles, first = cdiv(length, size), positions[0, :length]
        if tiles * size > length:  # (the last tile filled with its last token's position: its span the same)
            first = torch.cat([first, first[-1:].expand(tiles * size - length)])
        return torch.stack(first.view(tiles, size).aminmax(dim=1), 1)  # (three small ops where nothing is kept)
    return kept(positions, ("tile spans", size, length), make)


def _padded(length: int) -> int:
    """The tokens the kernels' per-token operands hold (LP): `length` up to a multiple of every tile of the launch
    settings, so that the kernels read them without masks."""
    knobs = tuning()
    multiple = max(*knobs.bidirectional_forward[:2], *knobs.bidirectional_backward[:2])  # (powers of two)
    return cdiv(length, multiple) * multiple


def _tiles(which: str, padded: int) -> Tuple[int, int, int]:
    """Tuning.bidirectional_<which>, checked against the operands' padding (a setting changed between a forward and
    its backward would read past it)."""
    own, loop, warps = getattr(tuning(), f"bidirectional_{which}")
    if padded % own or padded % loop:
        raise RuntimeError(f"the bidirectional kernels' operands were padded to {padded} tokens, which the tiles of "
                           f"Tuning.bidirectional_{which} ({own}, {loop}) do not divide: keep the launch settings "
                           "of a forward for its backward")
    return own, loop, warps


class _Padded(NamedTuple):
    """Each scan's order and positions with LP - L padding tokens after the last, in token order and last along
    every scan (_padded)."""
    order: Tensor  # [S, LP]: scan position -> token
    position: Tensor  # [S, LP]: token -> scan position
    kernel_position: Tensor  # [S, LP] int32: position, as the kernels read it (half int64's registers)
    spans: Tensor  # [2, S, 1, 1, LP] float64: p and p + 1 times log2 e, from which one decay per head gives E and I
    spans32: Tensor  # spans rounded to float32


def _scan_positions(order: Tensor, position: Tensor, padded: int, keep: bool = True) -> _Padded:
    """_Padded of each scan's order and positions [S, L], to `padded` tokens. Kept per position tensor (kept with a
    model's orders: fla._scan_indices) unless keep is False (a compiler traces them)."""
    def make() -> _Padded:
        scans, length = position.shape
        past = torch.arange(length, padded, device=position.device).expand(scans, -1)
        order_, position_ = torch.cat([order, past], -1), torch.cat([position, past], -1)
        spans = torch.stack([position_, position_ + 1]).double()[:, :, None, None, :] * LOG2E.value
        return _Padded(order_, position_, position_.int(), spans, spans.float())
    return kept(position, ("padded", padded), make) if keep else make()


def cumulative(log_decays: Tensor, scans: _Padded, length: int, batch: int, heads: int, in_order: bool = False
               ) -> Tuple[Tensor, Tensor]:
    """Each scan's E and I (the module docstring) in token order and in base 2 (times log2 e: the kernels'
    exponentials are 2^x), [S, B, H, LP] (broadcast views; the padding tokens decay by 1, last along every scan),
    float32 or, above FLOAT64_EXPONENTS_ABOVE tokens, float64, from log decays [S, B|1, H|1, L|1] of `length` tokens
    in token order and the scans padded to LP (_scan_positions): one decay per head takes one product, E = p a and
    I = (p + 1) a (log2 e kept in the spans p and p + 1); one per token a sum along each scan, with no gathers for
    one scan in token order (in_order). Torch ops: autograd differentiates them."""
    count, padded = scans.order.shape
    dtype = torch.float64 if length > FLOAT64_EXPONENTS_ABOVE else torch.float32
    a = log_decays if log_decays.dtype == dtype else log_decays.to(dtype)
    if a.shape[-1] == 1:  # one decay per head: E_t = p_t a, I_t = (p_t + 1) a
        exclusive, inclusive = (a * (scans.spans32 if dtype == torch.float32 else scans.spans)).unbind(0)
    else:  # the sum along the scan (in float64 where float32's rounding would reach the entries that matter)
        a = F.pad(a, (0, padded - length))  # (after every real token along the scan: their sums are as unpadded)
        wide = (a.double() if length > FLOAT64_CUMSUM_ABOVE else a) * LOG2E.value
        if in_order:
            exclusive = (wide.cumsum(-1) - wide).to(dtype)
        else:
            along = wide.gather(-1, scans.order[:, None, None, :].expand(-1, *wide.shape[1:3], -1))
            exclusive = (along.cumsum(-1) - along).gather(-1, scans.position[:, None, None, :].expand_as(along)
                                                          ).to(dtype)
        inclusive = torch.add(exclusive, a, alpha=LOG2E.value)
    return exclusive.expand(count, batch, heads, padded), inclusive.expand(count, batch, heads, padded)


def bidirectional_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor],
                       orders: Optional[Tensor] = None, chunk_size: Optional[int] = None,
                       feature_map: Optional[str] = None, scaling: str = "sum") -> Tensor:
    """Y [B, H, L, Dv] (a view of [B, L, H, Dv]) by the bidirectional kernel: q, k [B, H, L, Dk], v [B, H, L, Dv]
    (any strides); log_decays [S, B|1, H|1, L|1] in token order (None: all ones); orders [S, L] or None; feature_map:
    a FEATURE_MAPS name, which the kernels apply as they read q and k (one they do not know: torch ops first), or
    None; scaling: a scalings.SCALINGS name. chunk_size is the portable form's (unused). One or two scans. A
    compiler traces the kernels as custom ops of its graph, not breaks: inference as one op, so that
    CUDA graphs can capture it, training as one op forward and one backward."""
    from ..dispatch import records_autograd
    if torch.compiler.is_compiling() and _INFERENCE_OP is not None:
        if not records_autograd(q, k, v, log_decays):
            return _INFERENCE_OP(q, k, v, log_decays, orders, feature_map, scaling).transpose(1, 2)
        q, k, v, exclusive, inclusive, positions, feature_map = _prepared(q, k, v, log_decays, orders, feature_map,
                                                                          traced=True)
        return _TRAINING_OP(q, k, v, exclusive, inclusive, positions, feature_map, scaling, orders is None
                            )[0].transpose(1, 2)
    return _eagerly(q, k, v, log_decays, orders, feature_map, scaling).transpose(1, 2)


def _prepared(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor],
              feature_map: Optional[str], traced: bool = False) -> tuple:
    """The kernels' operands: q, k, v in one dtype, rows contiguous; each scan's E, I and positions (int32), padded
    past L (_padded); the feature map they apply. traced: positions as torch ops (a compiler traces them), not the
    indices kept per orders tensor."""
    if log_decays is None:  # (LION-lit, where a plan forces the kernel: one scan, every decay 1)
        log_decays = q.new_zeros(1, 1, 1, 1, dtype=torch.float32)
    if len(log_decays) > 2:
        raise ValueError(f"the bidirectional kernel reads one or two scans, got {len(log_decays)}")
    q, k, feature_map, dtype = kernel_inputs(q, k, v, feature_map)
    q, k, v = in_rows(dtype, q, k, v)
    batch, heads, length, _ = v.shape
    if traced:
        order = torch.arange(length, device=q.device)[None] if orders is None else orders
        position = torch.argsort(order, dim=-1)
    else:
        indices = _scan_indices(orders, length, q.device)  # (kept with the orders)
        order, position = indices.order, indices.position
    scans = _scan_positions(order, position, _padded(length), keep=not traced)
    exclusive, inclusive = cumulative(log_decays, scans, length, batch, heads, in_order=orders is None)
    return q, k, v, exclusive, inclusive, scans.kernel_position, feature_map


@torch.compiler.disable  # (the kernels and their bookkeeping run eagerly)
@launched_on_device_of(0)  # (q)
def _eagerly(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor],
             feature_map: Optional[str], scaling: str) -> Tensor:
    """Y [B, L, H, Dv] of bidirectional_form."""
    from ..dispatch import records_autograd
    q, k, v, exclusive, inclusive, positions, feature_map = _prepared(q, k, v, log_decays, orders, feature_map)
    in_order = orders is None  # (one scan in token order)
    if not records_autograd(q, k, v, exclusive, inclusive):  # (inference: no autograd Functions' host time)
        return _forward(q, k, v, exclusive, inclusive, positions, feature_map, scaling, in_order)[0].transpose(1, 2)
    y = _Bidirectional.apply(q, k, v, exclusive, inclusive, positions, feature_map, scaling, in_order)
    return _FirstOrderOnly.apply(y).transpose(1, 2)


def _custom_ops():
    """(inference, training) as torch.library custom ops, what a compiler traces in place of _eagerly: inference,
    the whole call; training, the kernels with their backward registered (a second op), the bookkeeping around
    them traced as torch ops. (None, None) where they cannot be registered."""
    def inference(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor],
                  feature_map: Optional[str], scaling: str) -> Tensor:
        return _eagerly(q, k, v, log_decays, orders, feature_map, scaling).contiguous()

    def inference_shape(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor],
                        feature_map: Optional[str], scaling: str) -> Tensor:
        batch, heads, length, value_dim = v.shape
        return v.new_empty(batch, length, heads, value_dim)

    @launched_on_device_of(0)
    def forward(q: Tensor, k: Tensor, v: Tensor, exclusive: Tensor, inclusive: Tensor, positions: Tensor,
                feature_map: Optional[str], scaling: str, in_order: bool) -> Tuple[Tensor, Tensor]:
        y, z = _forward(q, k, v, exclusive, inclusive, positions, feature_map, scaling, in_order)
        return y.transpose(1, 2), q.new_empty(0, dtype=torch.float32) if z is None else z

    def forward_shape(q: Tensor, k: Tensor, v: Tensor, exclusive: Tensor, inclusive: Tensor, positions: Tensor,
                      feature_map: Optional[str], scaling: str, in_order: bool) -> Tuple[Tensor, Tensor]:
        batch, heads, length, value_dim = v.shape
        return (v.new_empty(batch, length, heads, value_dim),
                q.new_empty((0,) if scaling == "none" else (batch, heads, length), dtype=torch.float32))

    @launched_on_device_of(0)
    def backward(dy: Tensor, q: Tensor, k: Tensor, v: Tensor, exclusive: Tensor, inclusive: Tensor, positions: Tensor,
                 y: Tensor, z: Tensor, feature_map: Optional[str], scaling: str, in_order: bool
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        grads = _backward(dy.transpose(1, 2), q, k, v, exclusive, inclusive, positions, y.transpose(1, 2),
                          None if scaling == "none" else z, feature_map, scaling, in_order)
        return (*(grad.transpose(1, 2) for grad in grads[:3]), *grads[3:])  # (token-major: contiguous)

    def backward_shape(dy: Tensor, q: Tensor, k: Tensor, v: Tensor, exclusive: Tensor, inclusive: Tensor,
                       positions: Tensor, y: Tensor, z: Tensor, feature_map: Optional[str], scaling: str,
                       in_order: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        batch, heads, length, _ = v.shape
        tokens = [x.new_empty(batch, length, heads, x.shape[-1]) for x in (q, k, v)]
        return (*tokens, *(q.new_empty(positions.shape[:1] + (batch, heads) + positions.shape[1:],
                                       dtype=torch.float32) for _ in range(2)))

    def save(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs[:6], *output)
        ctx.feature_map, ctx.scaling, ctx.in_order = inputs[6:]

    def differentiate(ctx, dy: Tensor, dz: Tensor):
        dq, dk, dv, dE, dI = backward_op(dy, *ctx.saved_tensors, ctx.feature_map, ctx.scaling, ctx.in_order)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), dE, dI, None, None, None, None

    ops = registered_ops("bidirectional", inference, inference_shape, forward, forward_shape, backward, backward_shape)
    if ops is None:
        return None, None
    inference_op, forward_op, backward_op = ops
    forward_op.register_autograd(differentiate, setup_context=save)
    return inference_op, forward_op


def registered_ops(name: str, inference, inference_shape, forward, forward_shape, backward, backward_shape
                   ) -> Optional[tuple]:
    """(inference, forward, backward) registered as the torch.library custom ops lion_vit::<name>_inference,
    lion_vit::<name> and lion_vit::<name>_backward, each with its fake (shape) function; None where they cannot be
    registered (a torch whose schema inference does not read these annotations)."""
    try:
        ops = tuple(torch.library.custom_op(f"lion_vit::{name}{suffix}", function, mutates_args=())
                    for suffix, function in (("_inference", inference), ("", forward), ("_backward", backward)))
    except Exception:
        return None
    for op, shape in zip(ops, (inference_shape, forward_shape, backward_shape)):
        op.register_fake(shape)
    return ops


_INFERENCE_OP, _TRAINING_OP = _custom_ops()
