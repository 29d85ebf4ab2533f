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
from typing import Optional, Tuple

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


def chunk_unnormalized(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor],
                       chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Numerator [B, H, L, Dv] and normaliser [B, H, L, 1] by FLA's chunked kernels (`chunk_simple_gla`).

    chunk_size is the torch backend's; the kernels use their own tile of 64 tokens.
    """
    from fla.ops.simple_gla import chunk_simple_gla

    del chunk_size
    batch = q.shape[0]
    q, k, v1, a = _operands(q, k, v, log_decay)
    both = [_tokens_major(torch.cat([t, t.flip(2)])) for t in (q, k, v1)]  # [2B, L, H, D]
    g = None if a is None else _tokens_major(_shifted(torch.cat([a, a.flip(-1)])))  # [2B, L, H]
    out, _ = chunk_simple_gla(*both, g=g, scale=1.0)
    return _combine(out[:batch], out[batch:].flip(1), q, k, v1, v.shape[-1])


def recurrent_unnormalized(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor],
                           chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Numerator and normaliser by FLA's fused recurrent kernel, once forward and once in reverse:
    one kernel per direction instead of a chain of launches per token, O(L d) memory."""
    from fla.ops.simple_gla import fused_recurrent_simple_gla

    del chunk_size
    q, k, v1, a = _operands(q, k, v, log_decay)
    operands = [_tokens_major(t) for t in (q, k, v1)]
    g_forward = g_backward = None
    if a is not None:
        g_forward = _tokens_major(_shifted(a))
        g_backward = _tokens_major(F.pad(a[..., 1:], (0, 1)))  # g_t = a_{t+1}, g_{L-1} = 0
    forward, _ = fused_recurrent_simple_gla(*operands, g=g_forward, scale=1.0)
    backward, _ = fused_recurrent_simple_gla(*operands, g=g_backward, scale=1.0, reverse=True)
    return _combine(forward, backward, q, k, v1, v.shape[-1])
