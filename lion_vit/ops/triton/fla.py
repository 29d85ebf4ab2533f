"""LION's chunk and rnn forms on flash-linear-attention's causal kernels.

FLA's scalar-gated recurrence is  S_t = exp(g_t) S_{t-1} + k_t v_t^T,  o_t = q_t^T S_t  (reverse=True
runs it from the end). With a_t = log lam_t and v1 = [v, 1] (the normaliser's column):

    forward  pass:  g_t = a_{t-1}  over the sequence                S^F_t = lam_{t-1} S^F_{t-1} + k_t v1_t^T
    backward pass:  g_t = a_{t+1}  over the sequence from its end   S^B_t = lam_{t+1} S^B_{t+1} + k_t v1_t^T
    numerator, normaliser = q_t^T S^F_t + q_t^T S^B_t - (q_t . k_t) v1_t

which is docs/design.md's bidirectional RNN. The chunk kernels have no reverse mode: the backward
pass runs on the mirrored sequence, stacked with the forward one on the batch axis (one call).
"""
from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.compiler.assume_constant_result  # (a compiled model's plan calls it instead of tracing into it)
def available() -> bool:
    """Whether flash-linear-attention and Triton are installed (`pip install "lion-vit[gpu]"`)."""
    return _installed("fla") and _installed("triton")


@lru_cache(maxsize=None)
def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@torch.compiler.assume_constant_result
def chunk_backward_fails(device: torch.device) -> bool:
    """Whether FLA's gated chunk backward refuses to run on this device: on Hopper GPUs (H100, H200)
    Triton 3.4.0 to 3.7.0 miscompile it (fla-org/flash-linear-attention#640) and FLA raises instead."""
    return device.type == "cuda" and torch.cuda.is_available() and _hopper_triton_bug(
        torch.cuda.get_device_capability(device), _installed_triton_version())


def _hopper_triton_bug(capability: Tuple[int, int], triton_version: str) -> bool:
    version = tuple(int(part) for part in re.findall(r"\d+", triton_version)[:3])
    return capability[0] == 9 and (3, 4, 0) <= version < (3, 7, 1)


@lru_cache(maxsize=None)
def _installed_triton_version() -> str:
    import triton
    return triton.__version__


def _shifted(a: Tensor) -> Tensor:
    """g_t = a_{t-1} (g_0 = 0: the state before the first token is zero, so it never matters)."""
    return F.pad(a[..., :-1], (1, 0))


def _operands(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor]):
    """q, k, v1 = [v, 1] in one dtype, and log decays [B, H, L] in float32 (or None).

    Every width is made even with a zero column: FLA refuses odd key or value widths in 16-bit backward
    passes (a Triton miscompile, fla/ops/common/chunk_o.py), and the normaliser's column makes v1 odd
    for every even head width. Zero columns of q and k leave every q . k unchanged, and v1's gives an
    output column that is dropped; the kernels' tiles are powers of two, so it costs no work."""
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    if dtype == torch.float64:
        raise ValueError("the triton backend has no float64 kernels; use backend='torch' for float64")
    ones = v.new_ones(*v.shape[:-1], 1, dtype=dtype)
    v1 = torch.cat([v.to(dtype), ones] + ([torch.zeros_like(ones)] if v.shape[-1] % 2 == 0 else []), dim=-1)
    q, k = (t.to(dtype) if t.shape[-1] % 2 == 0 else F.pad(t.to(dtype), (0, 1)) for t in (q, k))
    a = None if log_decay is None else log_decay.float().expand(*q.shape[:3])
    return q, k, v1, a


def _tokens_major(t: Tensor) -> Tensor:
    """[B, H, L, ...] -> [B, L, H, ...], FLA's layout."""
    return t.transpose(1, 2)


def _combine(forward: Tensor, backward: Tensor, q: Tensor, k: Tensor, v1: Tensor,
             value_dim: int) -> Tuple[Tensor, Tensor]:
    """Both passes' [B, L, H, width of v1] outputs in token order -> numerator [B, H, L, Dv], normaliser
    [B, H, L, 1]."""
    diagonal = (q.float() * k.float()).sum(-1, keepdim=True)  # counted in both passes
    total = _tokens_major(forward.float() + backward.float()) - diagonal * v1.float()
    return total[..., :value_dim], total[..., value_dim:value_dim + 1]


def _scans_on_batch(one_scan: Callable[..., Tuple[Tensor, Tensor]], q: Tensor, k: Tensor, v: Tensor,
                    log_decays: Optional[Tensor], orders: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Every scan in one kernel call: q, k, v and decays gathered into each scan's order and stacked on the
    batch axis, the results put back in token order and summed. log_decays: None or [S, B|1, H|1, L|1] in
    token order; orders: [S, L], or None for one scan in token order."""
    if orders is None:
        return one_scan(q, k, v, None if log_decays is None else log_decays[0])
    (num_scans, length), (batch, heads) = orders.shape, q.shape[:2]

    def to_scans(t: Tensor) -> Tensor:  # [B, H, L, D] -> [S * B, H, L, D], each scan in its order
        return t.index_select(2, orders.flatten()).unflatten(2, (num_scans, length)).movedim(2, 0).flatten(0, 1)

    a = None
    if log_decays is not None:
        a = log_decays.expand(num_scans, batch, heads, log_decays.shape[-1])
        if a.shape[-1] != 1:  # per-token decays follow their tokens into scan order
            a = torch.gather(a, -1, orders[:, None, None, :].expand_as(a))
        a = a.flatten(0, 1)
    parts = one_scan(to_scans(q), to_scans(k), to_scans(v), a)
    inverse = torch.argsort(orders, dim=-1)
    numerator, normaliser = (sum(t.unflatten(0, (num_scans, batch))[s].index_select(2, inverse[s])
                                 for s in range(num_scans)) for t in parts)
    return numerator, normaliser


class _FirstOrderOnly(torch.autograd.Function):
    """The identity, whose backward refuses to be differentiated: FLA's hand-written backwards have no
    double backward, and without this a second-order gradient fails deep inside autograd or comes
    back silently missing."""

    @staticmethod
    def forward(ctx, numerator: Tensor, normaliser: Tensor) -> Tuple[Tensor, Tensor]:
        return numerator.view_as(numerator), normaliser.view_as(normaliser)

    @staticmethod
    def backward(ctx, grad_numerator: Tensor, grad_normaliser: Tensor) -> Tuple[Tensor, Tensor]:
        if torch.is_grad_enabled():  # create_graph=True: a second derivative is wanted
            raise RuntimeError("the triton backend (flash-linear-attention) has no double backward; for "
                               "second-order gradients use attn_backend='torch'")
        return grad_numerator, grad_normaliser


def chunk_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor] = None,
               chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Numerator [B, H, L, Dv] and normaliser [B, H, L, 1] by FLA's chunked kernels (`chunk_simple_gla`),
    every scan in one call. chunk_size is the torch backend's; the kernels use their own tile of 64 tokens."""
    del chunk_size
    return _FirstOrderOnly.apply(*_scans_on_batch(_chunk_one_scan, q, k, v, log_decays, orders))


def recurrent_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor] = None,
                   chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Numerator and normaliser by FLA's fused recurrent kernel, once forward and once in reverse:
    one kernel per direction instead of a chain of launches per token, O(L d) memory."""
    del chunk_size
    return _FirstOrderOnly.apply(*_scans_on_batch(_recurrent_one_scan, q, k, v, log_decays, orders))


def _chunk_one_scan(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    from fla.ops.simple_gla import chunk_simple_gla

    batch = q.shape[0]
    q, k, v1, a = _operands(q, k, v, log_decay)
    both = [_tokens_major(torch.cat([t, t.flip(2)])) for t in (q, k, v1)]  # [2B, L, H, D]
    g = None if a is None else _tokens_major(_shifted(torch.cat([a, a.flip(-1)])))  # [2B, L, H]
    out, _ = chunk_simple_gla(*both, g=g, scale=1.0)
    return _combine(out[:batch], out[batch:].flip(1), q, k, v1, v.shape[-1])


def _recurrent_one_scan(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    from fla.ops.simple_gla import fused_recurrent_simple_gla

    q, k, v1, a = _operands(q, k, v, log_decay)
    operands = [_tokens_major(t) for t in (q, k, v1)]
    g_forward = g_backward = None
    if a is not None:
        g_forward = _tokens_major(_shifted(a))
        g_backward = _tokens_major(F.pad(a[..., 1:], (0, 1)))  # g_t = a_{t+1}, g_{L-1} = 0
    forward, _ = fused_recurrent_simple_gla(*operands, g=g_forward, scale=1.0)
    backward, _ = fused_recurrent_simple_gla(*operands, g=g_backward, scale=1.0, reverse=True)
    return _combine(forward, backward, q, k, v1, v.shape[-1])
