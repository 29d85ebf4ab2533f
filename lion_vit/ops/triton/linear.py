"""LION-lit's attention form in two kernels of ours: Y = Scale(Q (K^T V)), its normaliser Q (K^T 1), with the feature
maps applied as q and k are read, and nothing of size L x L, or L x D but Y, written.

With q', k' the features, the state S = sum_j k'_j^T v_j [Dk, Dv] and the key sum s = sum_j k'_j [Dk] of each image
and head (one program each, over every token tile in order: no atomics), then per token tile

    n_i = q'_i S,   z_i = q'_i . s,   Y_i = n_i / divisor(z_i)   (scalings.py).

Backward, with dn_i = dY_i r_i (r the scaling's factor) and delta_i = dY_i . Y_i / z_i (zero for "none", and for
"max" where |z_i| <= 1), as the bidirectional kernel's (bidirectional.py):

    dq'_i = dn_i S^T - delta_i s,   dS = sum_i q'_i^T dn_i,   ds = -sum_i delta_i q'_i,
    dk'_j = v_j dS^T + ds,           dv_j = k'_j dS,

one program per image and head for dq and the sums dS, ds (Y recomputed from S: nothing of the forward is kept but
its inputs and S, s), then one per key tile for dk and dv. The sums run in float32 in a fixed order: the same
bits every run. The portable form (attention.py) computes the same products in torch matmuls, each elementwise step
around them a pass over memory.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .bidirectional import _features, _maps, _raw_grad, _store_tile, _strides, _tile, registered_ops
from .fla import _FirstOrderOnly, kernel_inputs, launched_on_device_of
from .operands import CONTRACTED, SCALING_CODES, _block, _divisor, cdiv, in_rows, rows_contiguous

_TOKENS = 64  # tokens per tile (a power of two of at least 16: tl.dot)
# warps of the queries' backward, which holds S and dS beside its tiles (its spills by warps: docs/benchmarks.md,
# "Kernels compiled without a GPU")
_QUERIES_BACKWARD_WARPS = 8


@triton.jit
def _state_tile(S, s, bh, DK, DV, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """One image and head's state S [Dk, Dv] and key sum s [Dk] (float32, zero past Dk and Dv)."""
    ck, cv = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    state = tl.load(S + bh.to(tl.int64) * DK * DV + ck[:, None] * DV + cv[None, :],
                    mask=(ck < DK)[:, None] & (cv < DV)[None, :], other=0.0)
    return state, tl.load(s + bh.to(tl.int64) * DK + ck, mask=ck < DK, other=0.0)


@triton.jit
def _store_state(S, s, state, total, bh, DK, DV, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    ck, cv = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    tl.store(S + bh.to(tl.int64) * DK * DV + ck[:, None] * DV + cv[None, :], state,
             mask=(ck < DK)[:, None] & (cv < DV)[None, :])
    tl.store(s + bh.to(tl.int64) * DK + ck, total, mask=ck < DK)


@triton.jit
def _linear_state_kernel(k, v, S, s, skb, skh, skl, svb, svh, svl, L, H, DK, DV, MAP_K: tl.constexpr,
                         NORM_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """S and s of one image and head, over its token tiles in order."""
    bh = tl.program_id(0)
    b, h = (bh // H).to(tl.int64), bh % H
    state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    total = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, L, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        ok = t < L
        keys = _features(_tile(k, b, h, t, ok, skb, skh, skl, DK, BLOCK_K), ok, DK, BLOCK_K, MAP_K, NORM_K)
        values = _tile(v, b, h, t, ok, svb, svh, svl, DV, BLOCK_V)
        state += tl.dot(tl.trans(keys), values.to(keys.dtype))
        total += tl.sum(keys.to(tl.float32), 0)
    _store_state(S, s, state, total, bh, DK, DV, BLOCK_K, BLOCK_V)


@triton.jit
def _rows(q, state, total, b, h, t, ok, sqb, sqh, sql, DK, SCALING: tl.constexpr, MAP_Q: tl.constexpr,
          NORM_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """Query rows t, from their image and head's state and key sum: raw, their features (float32), Y (float32) and
    the normaliser."""
    raw = _tile(q, b, h, t, ok, sqb, sqh, sql, DK, BLOCK_K)
    features = _features(raw, ok, DK, BLOCK_K, MAP_Q, NORM_Q).to(tl.float32)
    normaliser = tl.where(ok, tl.sum(features * total[None, :], 1), 1.0)
    y = tl.dot(features, state) / _divisor(normaliser, SCALING)[:, None]
    return raw, features, y, normaliser


@triton.jit
def _linear_output_kernel(q, S, s, y, sqb, sqh, sql, syb, syh, syl, L, H, DK, DV, SCALING: tl.constexpr,
                          MAP_Q: tl.constexpr, NORM_Q: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_V: tl.constexpr):
    """Y of one query tile."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < L
    state, total = _state_tile(S, s, bh, DK, DV, BLOCK_K, BLOCK_V)
    _, _, out, _ = _rows(q, state, total, b, h, t, ok, sqb, sqh, sql, DK, SCALING, MAP_Q, NORM_Q, BLOCK_K)
    _store_tile(y, out, b, h, t, ok, syb, syh, syl, DV, BLOCK_V)


@triton.jit
def _linear_queries_backward_kernel(q, dy, S, s, dq, dS, ds, sqb, sqh, sql, sdb, sdh, sdl, sgb, sgh, sgl, L, H, DK,
                                    DV, SCALING: tl.constexpr, MAP_Q: tl.constexpr, NORM_Q: tl.constexpr,
                                    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """dq (strides sg*) of one image and head, and its dS and ds, over its token tiles in order."""
    bh = tl.program_id(0)
    b, h = (bh // H).to(tl.int64), bh % H
    state, total = _state_tile(S, s, bh, DK, DV, BLOCK_K, BLOCK_V)  # (read once, for every tile)
    d_state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    d_total = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, L, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        ok = t < L
        raw, features, y, normaliser = _rows(q, state, total, b, h, t, ok, sqb, sqh, sql, DK, SCALING, MAP_Q, NORM_Q,
                                             BLOCK_K)
        upstream = _tile(dy, b, h, t, ok, sdb, sdh, sdl, DV, BLOCK_V).to(tl.float32)
        dn = upstream / _divisor(normaliser, SCALING)[:, None]
        delta = tl.sum(upstream * y, 1) / normaliser
        if SCALING == 1:  # "none": Y does not depend on the normaliser
            delta = tl.zeros_like(delta)
        if SCALING == 2:  # max(|z|, 1): z's gradient only where |z| > 1
            delta = tl.where(tl.abs(normaliser) > 1.0, delta, 0.0)
        d_features = tl.dot(dn, tl.trans(state)) - delta[:, None] * total[None, :]
        _store_tile(dq, _raw_grad(raw, d_features, ok, DK, BLOCK_K, MAP_Q, NORM_Q), b, h, t, ok, sgb, sgh, sgl, DK,
                    BLOCK_K)
        d_state += tl.dot(tl.trans(features), dn)
        d_total -= tl.sum(delta[:, None] * features, 0)
    _store_state(dS, ds, d_state, d_total, bh, DK, DV, BLOCK_K, BLOCK_V)


@triton.jit
def _linear_keys_backward_kernel(k, v, dS, ds, dk, dv, skb, skh, skl, svb, svh, svl, sgb, sgh, sgl, swb, swh, swl,
                                 L, H, DK, DV, MAP_K: tl.constexpr, NORM_K: tl.constexpr, BLOCK_T: tl.constexpr,
                                 BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """dk (strides sg*) and dv (sw*) of one key tile."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < L
    raw = _tile(k, b, h, t, ok, skb, skh, skl, DK, BLOCK_K)
    keys = _features(raw, ok, DK, BLOCK_K, MAP_K, NORM_K).to(tl.float32)
    values = _tile(v, b, h, t, ok, svb, svh, svl, DV, BLOCK_V).to(tl.float32)
    d_state, d_total = _state_tile(dS, ds, bh, DK, DV, BLOCK_K, BLOCK_V)
    d_keys = tl.dot(values, tl.trans(d_state)) + d_total[None, :]
    _store_tile(dk, _raw_grad(raw, d_keys, ok, DK, BLOCK_K, MAP_K, NORM_K), b, h, t, ok, sgb, sgh, sgl, DK, BLOCK_K)
    _store_tile(dv, tl.dot(keys, d_state), b, h, t, ok, swb, swh, swl, DV, BLOCK_V)


def _sizes(q: Tensor, v: Tensor) -> Tuple[int, int, int, int, int, dict]:
    batch, heads, length, key_dim = q.shape
    value_dim = v.shape[-1]
    return batch, heads, length, key_dim, value_dim, dict(BLOCK_T=_TOKENS, BLOCK_K=_block(key_dim),
                                                          BLOCK_V=_block(value_dim))


def _forward(q: Tensor, k: Tensor, v: Tensor, feature_map: Optional[str], scaling: str
             ) -> Tuple[Tensor, Tensor, Tensor]:
    """Y [B, H, L, Dv] (a view of [B, L, H, Dv]), S [B, H, Dk, Dv] and s [B, H, Dk] (float32) of q, k [B, H, L, Dk]
    (raw, mapped by the kernels through a FUSED_MAPS name, or features: None) and v, rows contiguous."""
    batch, heads, length, key_dim, value_dim, blocks = _sizes(q, v)
    maps = _maps(feature_map)
    S = q.new_empty((batch, heads, key_dim, value_dim), dtype=torch.float32)
    s = q.new_empty((batch, heads, key_dim), dtype=torch.float32)
    _linear_state_kernel[(batch * heads,)](k, v, S, s, *_strides(k), *_strides(v), length, heads, key_dim, value_dim,
                                    MAP_K=maps["MAP_K"], NORM_K=maps["NORM_K"], **blocks, **CONTRACTED)
    y = v.new_empty(batch, length, heads, value_dim).transpose(1, 2)
    _linear_output_kernel[(cdiv(length, _TOKENS), batch * heads)](
        q, S, s, y, *_strides(q), *_strides(y), length, heads, key_dim, value_dim, SCALING=SCALING_CODES[scaling],
        MAP_Q=maps["MAP_Q"], NORM_Q=maps["NORM_Q"], **blocks, **CONTRACTED)
    return y, S, s


def _backward(dy: Tensor, q: Tensor, k: Tensor, v: Tensor, S: Tensor, s: Tensor, feature_map: Optional[str],
              scaling: str) -> Tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k, v (token-major, as a projection's are) from dY [B, H, L, Dv] and what _forward took
    and gave."""
    dy = rows_contiguous(dy)
    batch, heads, length, key_dim, value_dim, blocks = _sizes(q, v)
    maps = _maps(feature_map)
    dq, dk, dv = (x.new_empty(batch, length, heads, x.shape[-1]).transpose(1, 2) for x in (q, k, v))
    dS, ds = torch.empty_like(S), torch.empty_like(s)
    _linear_queries_backward_kernel[(batch * heads,)](
        q, dy, S, s, dq, dS, ds, *_strides(q), *_strides(dy), *_strides(dq), length, heads, key_dim, value_dim,
        SCALING=SCALING_CODES[scaling], MAP_Q=maps["MAP_Q"], NORM_Q=maps["NORM_Q"], num_warps=_QUERIES_BACKWARD_WARPS,
        **blocks, **CONTRACTED)
    _linear_keys_backward_kernel[(cdiv(length, _TOKENS), batch * heads)](
        k, v, dS, ds, dk, dv, *_strides(k), *_strides(v), *_strides(dk), *_strides(dv), length, heads, key_dim,
        value_dim, MAP_K=maps["MAP_K"], NORM_K=maps["NORM_K"], **blocks, **CONTRACTED)
    return dq, dk, dv


class _Linear(torch.autograd.Function):
    """_forward's Y, with _backward's gradients: what runs eagerly."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, feature_map: Optional[str], scaling: str) -> Tensor:
        y, S, s = _forward(q, k, v, feature_map, scaling)
        ctx.save_for_backward(q, k, v, S, s)
        ctx.feature_map, ctx.scaling = feature_map, scaling
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        return (*_backward(dy, *ctx.saved_tensors, ctx.feature_map, ctx.scaling), None, None)


def linear_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor] = None,
                orders: Optional[Tensor] = None, chunk_size: Optional[int] = None, feature_map: Optional[str] = None,
                scaling: str = "sum") -> Tensor:
    """Y [B, H, L, Dv] (a view of [B, L, H, Dv]) of LION-lit by the linear kernels: q, k [B, H, L, Dk], v [B, H, L, Dv]
    (any strides); feature_map: a FEATURE_MAPS name, which the kernels apply as they read q and k (one they do not
    know: torch ops first), or None; scaling: a scalings.SCALINGS name. Every mask entry is 1: log_decays must be
    None and orders, of scans that then all equal one, are not read; chunk_size is the portable form's (unused). A
    compiler traces the kernels as custom ops of its graph, as the bidirectional kernel's."""
    if log_decays is not None:
        raise ValueError("the linear kernels compute LION-lit, whose mask is all ones: log_decays must be None")
    from ..dispatch import records_autograd
    if torch.compiler.is_compiling() and _INFERENCE_OP is not None:
        if not records_autograd(q, k, v):
            return _INFERENCE_OP(q, k, v, feature_map, scaling).transpose(1, 2)
        q, k, v, feature_map = _prepared(q, k, v, feature_map)
        return _TRAINING_OP(q, k, v, feature_map, scaling)[0].transpose(1, 2)
    return _eagerly(q, k, v, feature_map, scaling).transpose(1, 2)


def _prepared(q: Tensor, k: Tensor, v: Tensor, feature_map: Optional[str]) -> tuple:
    """The kernels' operands: q, k, v in one dtype, rows contiguous, and the feature map they apply."""
    q, k, feature_map, dtype = kernel_inputs(q, k, v, feature_map)
    q, k, v = in_rows(dtype, q, k, v)
    return q, k, v, feature_map


@torch.compiler.disable  # (the kernels and their bookkeeping run eagerly)
@launched_on_device_of(0)  # (q)
def _eagerly(q: Tensor, k: Tensor, v: Tensor, feature_map: Optional[str], scaling: str) -> Tensor:
    """Y [B, L, H, Dv] of linear_form."""
    from ..dispatch import records_autograd
    q, k, v, feature_map = _prepared(q, k, v, feature_map)
    if not records_autograd(q, k, v):  # (inference: no autograd Functions' host time)
        return _forward(q, k, v, feature_map, scaling)[0].transpose(1, 2)
    return _FirstOrderOnly.apply(_Linear.apply(q, k, v, feature_map, scaling)).transpose(1, 2)


def _custom_ops():
    """(inference, training) as torch.library custom ops, as bidirectional._custom_ops registers its own: inference
    the whole call, training the kernels with their backward registered (a second op). (None, None) where they
    cannot be registered."""
    def inference(q: Tensor, k: Tensor, v: Tensor, feature_map: Optional[str], scaling: str) -> Tensor:
        return _eagerly(q, k, v, feature_map, scaling).contiguous()

    def inference_shape(q: Tensor, k: Tensor, v: Tensor, feature_map: Optional[str], scaling: str) -> Tensor:
        batch, heads, length, value_dim = v.shape
        return v.new_empty(batch, length, heads, value_dim)

    @launched_on_device_of(0)
    def forward(q: Tensor, k: Tensor, v: Tensor, feature_map: Optional[str], scaling: str
                ) -> Tuple[Tensor, Tensor, Tensor]:
        y, S, s = _forward(q, k, v, feature_map, scaling)
        return y.transpose(1, 2), S, s

    def forward_shape(q: Tensor, k: Tensor, v: Tensor, feature_map: Optional[str], scaling: str
                      ) -> Tuple[Tensor, Tensor, Tensor]:
        batch, heads, length, key_dim = q.shape
        value_dim = v.shape[-1]
        return (v.new_empty(batch, length, heads, value_dim),
                q.new_empty((batch, heads, key_dim, value_dim), dtype=torch.float32),
                q.new_empty((batch, heads, key_dim), dtype=torch.float32))

    @launched_on_device_of(0)
    def backward(dy: Tensor, q: Tensor, k: Tensor, v: Tensor, S: Tensor, s: Tensor, feature_map: Optional[str],
                 scaling: str) -> Tuple[Tensor, Tensor, Tensor]:
        grads = _backward(dy.transpose(1, 2), q, k, v, S, s, feature_map, scaling)
        return tuple(grad.transpose(1, 2) for grad in grads)  # (token-major: contiguous)

    def backward_shape(dy: Tensor, q: Tensor, k: Tensor, v: Tensor, S: Tensor, s: Tensor, feature_map: Optional[str],
                       scaling: str) -> Tuple[Tensor, Tensor, Tensor]:
        batch, heads, length, _ = v.shape
        return tuple(x.new_empty(batch, length, heads, x.shape[-1]) for x in (q, k, v))

    def save(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs[:3], *output[1:])
        ctx.feature_map, ctx.scaling = inputs[3:]

    def differentiate(ctx, dy: Tensor, dS: Tensor, ds: Tensor):
        dq, dk, dv = backward_op(dy, *ctx.saved_tensors, ctx.feature_map, ctx.scaling)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None

    ops = registered_ops("linear", inference, inference_shape, forward, forward_shape, backward, backward_shape)
    if ops is None:
        return None, None
    inference_op, forward_op, backward_op = ops
    forward_op.register_autograd(differentiate, setup_context=save)
    return inference_op, forward_op


_INFERENCE_OP, _TRAINING_OP = _custom_ops()
