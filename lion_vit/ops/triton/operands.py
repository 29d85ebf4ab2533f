"""The two fused steps around FLA's kernels: building their operands, and finishing their outputs.

`operands` reads raw q, k, v once (token-major views of the projection), applies the feature maps,
and writes the stacked [B * 2S, L, H, W] operands: q and k gathered into every scan's forward and
mirrored order, each mirrored query scaled by its token's fold (lam of the next token in scan
order, 0 for the last), and v. `finish` sums every token's 2S outputs and their normalisers
(normaliser.py) and divides the one by the other, writing Y in the kernels' dtype (or, in inference,
into a slice of a whole batch's Y: `finish`).

Both are autograd Functions whose backwards are fused kernels too: that of `operands` sums every
token's 2S operand gradients, differentiates the folds and the feature maps (recomputed from raw q and
k, which are kept with the folds) and writes the gradients of raw q, k, v in their dtypes; that of
`finish` keeps Y and the normaliser and writes the gradients of every sequence's output and
normaliser. (In plain PyTorch the same steps write every intermediate, in float32, and keep the
feature maps and the kernels' outputs.)
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor


# How the kernel applies a feature map: (elementwise map, divided by its row's norm)
IDENTITY, SHIFTED_SILU, ELU_PLUS_ONE = 0, 1, 2
FUSED_MAPS = {  # FEATURE_MAPS' names -> (query, key)
    "silu": ((SHIFTED_SILU, False), (SHIFTED_SILU, False)),
    "silu_norm": ((SHIFTED_SILU, False), (SHIFTED_SILU, True)),
    "elu": ((ELU_PLUS_ONE, False), (ELU_PLUS_ONE, False)),
    "identity": ((IDENTITY, False), (IDENTITY, False)),
}


class Layout(NamedTuple):
    """Where every token goes in the kernels' 2S sequences (each scan forward, then mirrored)."""
    q: Tensor  # [2S * L]: the token of each position's query (and output)
    kv: Tensor  # [2S * L]: the token of each position's key and value
    q_positions: Tensor  # [2S, L]: each token's query (and output) position in each sequence
    kv_positions: Tensor  # [2S, L]: each token's key and value position in each sequence


LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# every launch of this package's kernels contracts multiply-adds into FMAs, as their code and its measured registers
# and timings assume; Triton 3.10 stops doing so by default (3.9 warns that it will)
CONTRACTED = dict(enable_fp_fusion=True)


@triton.jit
def _exp(x):
    """exp(x) of float32 x as 2^(x log2 e): PTX ex2.approx.ftz, whose results below 2^-126 (1e-38) are 0. tl.exp
    lowers to ex2.approx without ftz, which ptxas wraps in more instructions to keep those subnormal
    (docs/benchmarks.md, "Kernels compiled without a GPU")."""
    return tl.math.exp2(x * LOG2E)


@triton.jit
def _sigmoid(x):
    """tl.sigmoid, its exponential _exp's (-log2 e one constant: a negation apart is one more instruction)."""
    return 1.0 / (1.0 + tl.math.exp2(x * -LOG2E))


@triton.jit
def _mapped(x, kind: tl.constexpr):
    if kind == 1:  # SiLU(x) + 0.5
        x = x * _sigmoid(x) + 0.5
    elif kind == 2:  # ELU(x) + 1 (exp of the non-positive part only: no overflow where unused)
        x = tl.where(x > 0, x + 1.0, _exp(tl.minimum(x, 0.0)))
    return x


@triton.jit
def _operands_kernel(q, k, v, folds, q_index, kv_index, q2, k2, v2,
                     sqb, sql, sqh, skb, skl, skh, svb, svl, svh, sfs, sfb, sfl, sfh,
                     L, H, DK, DV, KW, VW, SEQS,
                     MAP_Q: tl.constexpr, NORM_Q: tl.constexpr, MAP_K: tl.constexpr, NORM_K: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    block, sequence, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, j = (sequence // SEQS).to(tl.int64), sequence % SEQS  # (batch offsets may pass 2^31 elements)
    p = block * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = p < L
    tq = tl.load(q_index + j * L + p, mask=rows, other=0).to(tl.int64)
    tkv = tl.load(kv_index + j * L + p, mask=rows, other=0).to(tl.int64)
    ck, cv = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    keys = rows[:, None] & (ck[None, :] < DK)
    out = (sequence * L + p[:, None]).to(tl.int64) * H + h

    x = tl.load(q + b * sqb + tq[:, None] * sql + h * sqh + ck[None, :], mask=keys, other=0.0).to(tl.float32)
    x = tl.where(keys, _mapped(x, MAP_Q), 0.0)
    if NORM_Q:
        x = x / tl.where(rows, tl.sqrt(tl.sum(x * x, axis=1)), 1.0)[:, None]
    # a mirrored query carries its token's fold (tl.where, not rows & a scalar: Triton 3.9's interpreter makes that
    # an int32 mask, which its loads refuse)
    mirrored = tl.where(j % 2 == 1, rows, False)
    fold = tl.load(folds + (j // 2) * sfs + b * sfb + tq * sfl + h * sfh, mask=mirrored, other=1.0)
    x = x * fold[:, None]
    tl.store(q2 + out * KW + ck[None, :], x.to(q2.dtype.element_ty), mask=rows[:, None] & (ck[None, :] < KW))

    x = tl.load(k + b * skb + tkv[:, None] * skl + h * skh + ck[None, :], mask=keys, other=0.0).to(tl.float32)
    x = tl.where(keys, _mapped(x, MAP_K), 0.0)
    if NORM_K:
        x = x / tl.where(rows, tl.sqrt(tl.sum(x * x, axis=1)), 1.0)[:, None]
    tl.store(k2 + out * KW + ck[None, :], x.to(k2.dtype.element_ty), mask=rows[:, None] & (ck[None, :] < KW))

    values = rows[:, None] & (cv[None, :] < DV)
    x = tl.load(v + b * svb + tkv[:, None] * svl + h * svh + cv[None, :], mask=values, other=0.0)
    tl.store(v2 + out * VW + cv[None, :], x.to(v2.dtype.element_ty), mask=rows[:, None] & (cv[None, :] < VW))


@triton.jit
def _token_block(L, H, BLOCK_T: tl.constexpr):
    """A token-major program's image b, head h, tokens t, which of them exist, and their flat index in a
    contiguous [B, L, H] tensor (grid: token blocks, B, H)."""
    b, h = tl.program_id(1).to(tl.int64), tl.program_id(2)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    return b, h, t, t < L, (b * L + t.to(tl.int64)) * H + h


@triton.jit
def _row(positions, b, j, t, rows, L, H, SEQS):
    """Where image b's tokens t sit in sequence j of the stacked [B * SEQS, L, H] tensors (positions: [SEQS, L]),
    as a flat index less the head's."""
    return ((b * SEQS + j) * L + tl.load(positions + j * L + t, mask=rows, other=0).to(tl.int64)) * H


@triton.jit
def _divisor(normaliser, SCALING: tl.constexpr):
    """What Y's rows are divided by (scalings.py): the normaliser (0, "sum"), 1 (1, "none"), or max(|n|, 1) (2)."""
    if SCALING == 0:
        return normaliser
    if SCALING == 1:
        return tl.full(normaliser.shape, 1.0, tl.float32)
    return tl.maximum(tl.abs(normaliser), 1.0)


@triton.jit
def _finish_kernel(out, normalisers, outputs, y, den, L, H, DV, W, SEQS, syb, syl, syh,
                   SCALING: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    b, h, t, rows, token = _token_block(L, H, BLOCK_T)
    cv = tl.arange(0, BLOCK_V)
    read = rows[:, None] & (cv[None, :] < DV)
    total = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    normaliser = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in range(SEQS):
        at = _row(outputs, b, j, t, rows, L, H, SEQS) + h
        total += tl.load(out + at[:, None] * W + cv[None, :], mask=read, other=0.0).to(tl.float32)
        normaliser += tl.load(normalisers + at, mask=rows, other=0.0)
    normaliser = tl.where(rows, normaliser, 1.0)
    tl.store(y + b * syb + t[:, None].to(tl.int64) * syl + h * syh + cv[None, :],
             (total / _divisor(normaliser, SCALING)[:, None]).to(y.dtype.element_ty), mask=read)
    tl.store(den + token, normaliser, mask=rows)


@triton.jit
def _features_grad(x, g, valid, rows, kind: tl.constexpr, norm: tl.constexpr):
    """The gradient of raw rows x [T, D] from that of their features g: through the row's norm (norm),
    then the elementwise map."""
    if norm:
        f = tl.where(valid, _mapped(x, kind), 0.0)
        n = tl.where(rows, tl.sqrt(tl.sum(f * f, axis=1)), 1.0)[:, None]
        f = f / n
        g = (g - f * tl.sum(f * g, axis=1)[:, None]) / n
    if kind == 1:  # d/dx (x sigmoid(x)) = sigmoid(x) (1 + x (1 - sigmoid(x)))
        s = _sigmoid(x)
        g = g * s * (1.0 + x * (1.0 - s))
    elif kind == 2:
        g = tl.where(x > 0, g, g * _exp(tl.minimum(x, 0.0)))
    return tl.where(valid, g, 0.0)


@triton.jit
def _operands_backward_kernel(q, k, folds, q_positions, kv_positions, dq2, dk2, dv2, gq, gk, gv, gfolds,
                              sqb, sql, sqh, skb, skl, skh, sfs, sfb, sfl, sfh, sgs,
                              L, H, DK, DV, KW, VW, SEQS,
                              MAP_Q: tl.constexpr, NORM_Q: tl.constexpr, MAP_K: tl.constexpr, NORM_K: tl.constexpr,
                              FOLD_GRAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_V: tl.constexpr):
    b, h, t, rows, token = _token_block(L, H, BLOCK_T)
    ck, cv = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    keys = rows[:, None] & (ck[None, :] < DK)
    values = rows[:, None] & (cv[None, :] < DV)

    xq = tl.load(q + b * sqb + t[:, None] * sql + h * sqh + ck[None, :], mask=keys, other=0.0).to(tl.float32)
    fq = tl.where(keys, _mapped(xq, MAP_Q), 0.0)
    if NORM_Q:
        fq = fq / tl.where(rows, tl.sqrt(tl.sum(fq * fq, axis=1)), 1.0)[:, None]
    grad_q = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    grad_k = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    grad_v = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    for j in range(SEQS):  # every sequence's rows of this token, summed
        at = _row(q_positions, b, j, t, rows, L, H, SEQS) + h
        g = tl.load(dq2 + at[:, None] * KW + ck[None, :], mask=keys, other=0.0).to(tl.float32)
        mirrored = tl.where(j % 2 == 1, rows, False)  # a mirrored query carries its token's fold
        fold = tl.load(folds + (j // 2) * sfs + b * sfb + t * sfl + h * sfh, mask=mirrored, other=1.0)
        grad_q += g * fold[:, None]
        if FOLD_GRAD:
            tl.store(gfolds + (j // 2) * sgs + token, tl.sum(g * fq, axis=1), mask=mirrored)
        at = _row(kv_positions, b, j, t, rows, L, H, SEQS) + h
        grad_k += tl.load(dk2 + at[:, None] * KW + ck[None, :], mask=keys, other=0.0).to(tl.float32)
        grad_v += tl.load(dv2 + at[:, None] * VW + cv[None, :], mask=values, other=0.0).to(tl.float32)
    grad_q = _features_grad(xq, grad_q, keys, rows, MAP_Q, NORM_Q)
    tl.store(gq + token[:, None] * DK + ck[None, :], grad_q.to(gq.dtype.element_ty), mask=keys)
    xk = tl.load(k + b * skb + t[:, None] * skl + h * skh + ck[None, :], mask=keys, other=0.0).to(tl.float32)
    grad_k = _features_grad(xk, grad_k, keys, rows, MAP_K, NORM_K)
    tl.store(gk + token[:, None] * DK + ck[None, :], grad_k.to(gk.dtype.element_ty), mask=keys)
    tl.store(gv + token[:, None] * DV + cv[None, :], grad_v.to(gv.dtype.element_ty), mask=values)


@triton.jit
def _finish_backward_kernel(dy, y, den, positions, grad_out, grad_normalisers, L, H, DV, W, SEQS, sdb, sdl, sdh,
                            SCALING: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    b, h, t, rows, token = _token_block(L, H, BLOCK_T)
    cv = tl.arange(0, BLOCK_V)
    read = rows[:, None] & (cv[None, :] < DV)
    normaliser = tl.load(den + token, mask=rows, other=1.0)
    grad = tl.load(dy + b * sdb + t[:, None].to(tl.int64) * sdl + h * sdh + cv[None, :], mask=read,
                   other=0.0).to(tl.float32) / _divisor(normaliser, SCALING)[:, None]
    grad_normaliser = -tl.sum(grad * tl.load(y + token[:, None] * DV + cv[None, :], mask=read,
                                             other=0.0).to(tl.float32), axis=1)  # d/d(divisor)
    if SCALING == 1:
        grad_normaliser = tl.zeros_like(grad_normaliser)
    if SCALING == 2:  # d max(|n|, 1) / dn = sign(n) where |n| > 1
        grad_normaliser = tl.where(tl.abs(normaliser) > 1.0, tl.where(normaliser > 0, grad_normaliser,
                                                                       -grad_normaliser), 0.0)
    for j in range(SEQS):  # the same gradients for every sequence's row of this token
        at = _row(positions, b, j, t, rows, L, H, SEQS) + h
        tl.store(grad_out + at[:, None] * W + cv[None, :], grad.to(grad_out.dtype.element_ty),
                 mask=rows[:, None] & (cv[None, :] < W))
        tl.store(grad_normalisers + at, grad_normaliser, mask=rows)


def even(width: int) -> int:
    """The operands' width for a head width: even, since FLA refuses odd widths in 16-bit backward passes
    (fla/ops/common/chunk_o.py); the extra column is zero."""
    return width + width % 2


def _block(width: int) -> int:
    return max(16, 1 << (width - 1).bit_length())  # (the next power of 2)


def cdiv(length: int, tile: int) -> int:
    """Tiles of `tile` that cover `length`: triton.cdiv in plain Python, as Triton's is a constexpr function whose
    calls from host code cost each launch more (docs/benchmarks.md, "Host time per forward")."""
    return -(-length // tile)


def rows_contiguous(x: Tensor) -> Tensor:
    """x, or a copy whose last dimension is contiguous: the kernels read rows."""
    return x if x.stride(-1) == 1 else x.contiguous()


def in_rows(dtype: torch.dtype, *tensors: Tensor) -> Tuple[Tensor, ...]:
    """The tensors in dtype, rows contiguous (rows_contiguous), each cast or copied only where it is not already."""
    return tuple(rows_contiguous(t if t.dtype == dtype else t.to(dtype)) for t in tensors)


_TOKENS = 16  # tokens per program


class Operands(torch.autograd.Function):
    """(q, k, v [B, L, H, D] raw, any strides; folds [S, B, L, H] float32, any strides; feature_map: a
    FUSED_MAPS name, or None for features given) -> q2, k2, v2 [B * 2S, L, H, W] in dtype."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, folds: Tensor, layout: Layout, feature_map: Optional[str],
                dtype: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
        q, k, v = (rows_contiguous(t) for t in (q, k, v))
        batch, length, heads, key_dim = q.shape
        value_dim, sequences = v.shape[-1], len(layout.kv) // length
        key_width, value_width = even(key_dim), even(value_dim)
        q2 = q.new_empty(batch * sequences, length, heads, key_width, dtype=dtype)
        k2 = torch.empty_like(q2)
        v2 = q.new_empty(batch * sequences, length, heads, value_width, dtype=dtype)
        (map_q, norm_q), (map_k, norm_k) = FUSED_MAPS.get(feature_map, ((IDENTITY, False),) * 2)
        _operands_kernel[(cdiv(length, _TOKENS), batch * sequences, heads)](
            q, k, v, folds, layout.q, layout.kv, q2, k2, v2,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), *folds.stride(),
            length, heads, key_dim, value_dim, key_width, value_width, sequences,
            MAP_Q=map_q, NORM_Q=norm_q, MAP_K=map_k, NORM_K=norm_k,
            BLOCK_T=_TOKENS, BLOCK_K=_block(key_width), BLOCK_V=_block(value_width), **CONTRACTED)
        ctx.save_for_backward(q, k, folds)
        ctx.layout, ctx.feature_map, ctx.value_dim, ctx.value_dtype = layout, feature_map, value_dim, v.dtype
        return q2, k2, v2

    @staticmethod
    def backward(ctx, dq2: Tensor, dk2: Tensor, dv2: Tensor):
        q, k, folds = ctx.saved_tensors
        layout = ctx.layout
        batch, length, heads, key_dim = q.shape
        grad_q, grad_k = q.new_empty(q.shape), k.new_empty(k.shape)  # (contiguous)
        grad_v = q.new_empty(batch, length, heads, ctx.value_dim, dtype=ctx.value_dtype)
        fold_grad = ctx.needs_input_grad[3]
        grad_folds = folds.new_empty(folds.shape) if fold_grad else grad_q  # (unused without fold_grad)
        (map_q, norm_q), (map_k, norm_k) = FUSED_MAPS.get(ctx.feature_map, ((IDENTITY, False),) * 2)
        _operands_backward_kernel[(cdiv(length, _TOKENS), batch, heads)](
            q, k, folds, layout.q_positions, layout.kv_positions, dq2.contiguous(), dk2.contiguous(),
            dv2.contiguous(), grad_q, grad_k, grad_v, grad_folds,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), *folds.stride(),
            grad_folds.stride(0), length, heads, key_dim, ctx.value_dim, dq2.shape[-1], dv2.shape[-1],
            len(layout.kv) // length, MAP_Q=map_q, NORM_Q=norm_q, MAP_K=map_k, NORM_K=norm_k, FOLD_GRAD=fold_grad,
            BLOCK_T=_TOKENS, BLOCK_K=_block(dq2.shape[-1]), BLOCK_V=_block(dv2.shape[-1]), **CONTRACTED)
        return grad_q, grad_k, grad_v, grad_folds if fold_grad else None, None, None, None


SCALING_CODES = {"sum": 0, "none": 1, "max": 2}  # scalings.py's names -> _divisor's SCALING


def finish(out: Tensor, normalisers: Tensor, layout: Layout, y: Tensor, scaling: str = "sum") -> Tensor:
    """Writes Y into y [B, L, H, Dv] (any strides but the last; its dtype) from the kernels' outputs
    [B * 2S, L, H, W] and normalisers [B * 2S, L, H], by the scaling (scalings.py); returns every token's
    normaliser [B, L, H] float32."""
    sequences, length = layout.q_positions.shape
    batch, _, heads, value_dim = y.shape
    normaliser = out.new_empty(batch, length, heads, dtype=torch.float32)
    _finish_kernel[(cdiv(length, _TOKENS), batch, heads)](
        out, normalisers, layout.q_positions, y, normaliser, length, heads, value_dim, out.shape[3], sequences,
        y.stride(0), y.stride(1), y.stride(2), SCALING=SCALING_CODES[scaling], BLOCK_T=_TOKENS,
        BLOCK_V=_block(value_dim), **CONTRACTED)
    return normaliser


class Finish(torch.autograd.Function):
    """The kernels' outputs [B * 2S, L, H, W] and normalisers [B * 2S, L, H] (float32, normaliser.py) ->
    Y [B, L, H, Dv] in dtype: every token's outputs and normalisers summed, the one divided by the other."""

    @staticmethod
    def forward(ctx, out: Tensor, normalisers: Tensor, layout: Layout, batch: int, value_dim: int,
                dtype: torch.dtype, scaling: str = "sum") -> Tensor:
        y = out.new_empty(batch, layout.q_positions.shape[1], out.shape[2], value_dim, dtype=dtype)
        normaliser = finish(out, normalisers, layout, y, scaling)
        ctx.save_for_backward(y, normaliser)
        ctx.layout, ctx.width, ctx.out_dtype, ctx.scaling = layout, out.shape[3], out.dtype, scaling
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        y, normaliser = ctx.saved_tensors
        batch, length, heads, value_dim = y.shape
        layout = ctx.layout
        sequences = len(layout.q) // length
        dy = rows_contiguous(dy)
        grad_out = y.new_empty(batch * sequences, length, heads, ctx.width, dtype=ctx.out_dtype)
        grad_normalisers = normaliser.new_empty(batch * sequences, length, heads)
        _finish_backward_kernel[(cdiv(length, _TOKENS), batch, heads)](
            dy, y, normaliser, layout.q_positions, grad_out, grad_normalisers, length, heads, value_dim, ctx.width,
            sequences, dy.stride(0), dy.stride(1), dy.stride(2), SCALING=SCALING_CODES[ctx.scaling], BLOCK_T=_TOKENS,
            BLOCK_V=_block(ctx.width), **CONTRACTED)
        return grad_out, grad_normalisers, None, None, None, None, None
