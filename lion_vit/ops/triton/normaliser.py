"""The normaliser of every kernel sequence, by a scan of our own (docs/design.md section 3, "Normaliser").

With the kernels' gates g, each sequence's normaliser is  n_p = scale q_p . s_p,  s_p = exp(g_p) s_{p-1} + k_p:
a decayed running sum of the keys, a vector per token, not a matrix. FLA's kernels could compute it as a
column of ones beside v, but at head width 64 that column needs a second value tile in their state and
recurrent kernels, which re-read k for one useful column.

Here the sequence is cut into chunks (Tuning.normaliser_launch: tokens per chunk, chunk sums per carry tile,
warps), and every chunk is a program of its own, so that even one image fills the GPU: one launch sums each
chunk's keys, decayed to its end; a second one gives every chunk its carry (the decayed sum of the chunk sums
before it, read a carry tile at a time), adds the chunk's own decayed sum (one masked product; a cumulative
sum without decays) and writes q . s. All in float32.

Backward (dn the normaliser's gradient):  dq_p = scale dn_p s_p;  dk_j = r_j with r_j = exp(g_{j+1}) r_{j+1}
+ scale dn_j q_j, the same scan in reverse;  dG_j = dn_j n_j - k_j . r_j for the cumulative gate G, so dg is
its reverse cumulative sum, on per-token scalars.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..tuning import LaunchSetting, tuning
from .operands import CONTRACTED, _block, cdiv


@triton.jit
def _chunk(x, x_factor, gates, chunk, n, h, L, H, W,
           HAS_X_FACTOR: tl.constexpr, HAS_GATES: tl.constexpr, REVERSE: tl.constexpr,
           BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """One chunk of a sequence (in reverse: of the sequence read backwards): its rows' offsets in [N, L, H],
    which rows exist, f_p x_p [BLOCK_T, BLOCK_K] in float32, and the gates' cumulative sum inside the chunk
    (in reverse each position's gate is the next one's, g_{p+1}: the gate that carries the state into p)."""
    i = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
    p = L - 1 - i if REVERSE else i
    rows = i < L
    row = (n * L + p) * H + h
    c = tl.arange(0, BLOCK_K)
    xs = tl.load(x + row[:, None] * W + c[None, :], mask=rows[:, None] & (c[None, :] < W), other=0.0).to(tl.float32)
    if HAS_X_FACTOR:
        xs = xs * tl.load(x_factor + row, mask=rows, other=0.0)[:, None]
    if HAS_GATES:
        gated = rows & (p + 1 < L) if REVERSE else rows
        g = tl.cumsum(tl.load(gates + (row + H if REVERSE else row), mask=gated, other=0.0), 0)
    else:
        g = tl.zeros([BLOCK_T], dtype=tl.float32)
    return row, rows, xs, g


@triton.jit
def _sums_kernel(x, x_factor, gates, sums, log_decays, L, H, W, NT,
                 HAS_X_FACTOR: tl.constexpr, HAS_GATES: tl.constexpr, REVERSE: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each chunk's sum of f_p x_p decayed to its end, and its gates' sum (the log of its total decay): sums
    [N, H, NT, W], log_decays [N, H, NT], float32."""
    chunk, sequence_head = tl.program_id(0), tl.program_id(1)
    n, h = (sequence_head // H).to(tl.int64), sequence_head % H
    _, _, xs, g = _chunk(x, x_factor, gates, chunk, n, h, L, H, W, HAS_X_FACTOR, HAS_GATES, REVERSE,
                         BLOCK_T, BLOCK_K)
    at = sequence_head.to(tl.int64) * NT + chunk
    c = tl.arange(0, BLOCK_K)
    if HAS_GATES:  # (rows past the end have no key and gate 0: the last row's sum is the chunk's)
        total = tl.sum(tl.where(tl.arange(0, BLOCK_T) == BLOCK_T - 1, g, 0.0), 0)
        xs = xs * tl.exp(total - g)[:, None]
        tl.store(log_decays + at, total)
    tl.store(sums + at * W + c, tl.sum(xs, 0), mask=c < W)


@triton.jit
def _scan_kernel(x, x_factor, gates, sums, log_decays, y, dots, vectors, out_factor, scale, L, H, W, NT,
                 HAS_X_FACTOR: tl.constexpr, HAS_GATES: tl.constexpr, DOTS: tl.constexpr, VECTORS: tl.constexpr,
                 HAS_OUT_FACTOR: tl.constexpr, REVERSE: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """s_p = exp(g_p) s_{p-1} + f_p x_p (in reverse s_p = exp(g_{p+1}) s_{p+1} + f_p x_p), one chunk per program
    from the chunks' sums; writes scale y_p . s_p to dots [N, L, H] float32 and c_p s_p to vectors, like x."""
    chunk, sequence_head = tl.program_id(0), tl.program_id(1)
    n, h = (sequence_head // H).to(tl.int64), sequence_head % H
    c = tl.arange(0, BLOCK_K)
    cols = c < W
    first = sequence_head.to(tl.int64) * NT
    carry = tl.zeros([BLOCK_K], dtype=tl.float32)
    for tile in range(0, chunk, BLOCK_C):  # the state at the chunk's start, from the chunks before, BLOCK_C at a time
        before = tile + tl.arange(0, BLOCK_C)
        earlier = before < chunk
        e = tl.load(sums + (first + before)[:, None] * W + c[None, :], mask=earlier[:, None] & cols[None, :], other=0.0)
        if HAS_GATES:  # each chunk's sum decays through the tile's chunks after it
            a = tl.load(log_decays + first + before, mask=earlier, other=0.0)
            total = tl.sum(a, 0)
            carry = carry * tl.exp(total) + tl.sum(tl.exp(total - tl.cumsum(a, 0))[:, None] * e, 0)
        else:
            carry += tl.sum(e, 0)
    row, rows, xs, g = _chunk(x, x_factor, gates, chunk, n, h, L, H, W, HAS_X_FACTOR, HAS_GATES, REVERSE,
                              BLOCK_T, BLOCK_K)
    if HAS_GATES:  # s_i = sum_{j <= i} exp(G_i - G_j) x_j + exp(G_i) carry
        steps = tl.arange(0, BLOCK_T)
        mask = tl.exp(tl.where(steps[None, :] <= steps[:, None], g[:, None] - g[None, :], float("-inf")))
        s = tl.dot(mask, xs) + tl.exp(g)[:, None] * carry[None, :]
    else:
        s = tl.cumsum(xs, 0) + carry[None, :]
    cells = rows[:, None] & cols[None, :]
    if DOTS:
        ys = tl.load(y + row[:, None] * W + c[None, :], mask=cells, other=0.0).to(tl.float32)
        tl.store(dots + row, scale * tl.sum(ys * s, 1), mask=rows)
    if VECTORS:
        if HAS_OUT_FACTOR:
            s = s * tl.load(out_factor + row, mask=rows, other=0.0)[:, None]
        tl.store(vectors + row[:, None] * W + c[None, :], s.to(vectors.dtype.element_ty), mask=cells)


class _Chunks(NamedTuple):
    """Each chunk's decayed sum [N, H, NT, W] and log total decay [N, H, NT] (None without gates), float32."""
    sums: Tensor
    log_decays: Optional[Tensor]


def _launch(kernel, launch: LaunchSetting, x: Tensor, gates: Optional[Tensor], *args,
            x_factor: Optional[Tensor] = None, reverse: bool = False, **flags) -> None:
    sequences, length, heads, width = x.shape
    chunk_tokens, _, warps = launch
    chunks = cdiv(length, chunk_tokens)
    kernel[(chunks, sequences * heads)](
        x, x_factor, gates, *args, length, heads, width, chunks,
        HAS_X_FACTOR=x_factor is not None, HAS_GATES=gates is not None, REVERSE=reverse, **flags,
        BLOCK_T=chunk_tokens, BLOCK_K=_block(width), num_warps=warps, **CONTRACTED)


def _chunk_sums(launch: LaunchSetting, x: Tensor, gates: Optional[Tensor], **options) -> _Chunks:
    sequences, length, heads, width = x.shape
    sums = x.new_empty(sequences, heads, cdiv(length, launch[0]), width, dtype=torch.float32)
    log_decays = None if gates is None else sums.new_empty(sums.shape[:-1])
    _launch(_sums_kernel, launch, x, gates, sums, log_decays, **options)
    return _Chunks(sums, log_decays)


def _scan(launch: LaunchSetting, x: Tensor, gates: Optional[Tensor], chunks: _Chunks, *, y: Optional[Tensor] = None,
          scale: float = 1.0, out_factor: Optional[Tensor] = None, vectors: bool = False, **options
          ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(scale y . s [N, L, H] float32 where y is given, the states s (times out_factor) like x where vectors)."""
    dots = x.new_empty(x.shape[:-1], dtype=torch.float32) if y is not None else None
    out = torch.empty_like(x) if vectors else None
    _launch(_scan_kernel, launch, x, gates, chunks.sums, chunks.log_decays, y, dots, out, out_factor, scale,
            **options, DOTS=y is not None, VECTORS=vectors, HAS_OUT_FACTOR=out_factor is not None, BLOCK_C=launch[1])
    return dots, out


class Normaliser(torch.autograd.Function):
    """(q, k [N, L, H, W], the kernels' operands; gates [N, L, H] float32 or None; scale), all contiguous ->
    every position's normaliser, [N, L, H] float32. The backward launches as the forward did (its chunk sums)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, gates: Optional[Tensor], scale: float) -> Tensor:
        launch = tuning().normaliser_launch
        chunks = _chunk_sums(launch, k, gates)
        normaliser, _ = _scan(launch, k, gates, chunks, y=q, scale=scale)
        ctx.save_for_backward(q, k, gates, normaliser, *chunks)
        ctx.scale, ctx.launch = scale, launch
        return normaliser

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, gates, normaliser, *chunks = ctx.saved_tensors
        factor = (grad * ctx.scale).contiguous()  # scale dn
        launch = ctx.launch
        _, grad_q = _scan(launch, k, gates, _Chunks(*chunks), out_factor=factor, vectors=True)
        reverse = _chunk_sums(launch, q, gates, x_factor=factor, reverse=True)
        key_dots, grad_k = _scan(launch, q, gates, reverse, y=k, x_factor=factor, vectors=True, reverse=True)
        grad_gates = None
        if gates is not None and ctx.needs_input_grad[2]:
            grad_cumulative = grad * normaliser - key_dots  # dL/dG, G = cumsum(g) over positions
            grad_gates = grad_cumulative.flip(1).cumsum(1).flip(1)
        return grad_q, grad_k, grad_gates, None
