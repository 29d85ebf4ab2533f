"""LION's chunk and rnn forms on flash-linear-attention's causal kernels, token-major end to end.

FLA's scalar-gated recurrence is  S_p = exp(g_p) S_{p-1} + k_p v_p^T,  o_p = scale q_p^T S_p,  over
[B, L, H, D] tensors. With a_t = log lam_t, v1 = [v, 1] (the normaliser's column) and a scan order o
(o[p]: the token at scan position p), every scan is two such sequences, stacked on the batch axis so
that one kernel launch runs all of them (docs/design.md section 3):

    forward:   q, k, v1 at o[p],  g_p = a(o[p-1])                     -> token o[p] gets o_p
    mirrored:  k, v1 at u[p] = o[L-1-p],  q at u[p+1],  g_p = a(u[p-1]) -> token u[p+1] gets lam(u[p]) o_p

The mirrored sequence is strictly causal: its query runs one token ahead of its keys, so it sums the
tokens after t in scan order without t itself, and the factor lam(u[p]) = lam of the token after t
(0 for the scan's last token) completes the mask. The diagonal is counted once, by the forward pass,
so no copy of q, k or v is kept for it: autograd keeps the kernels' own inputs, and of their outputs
the gathered mirrored ones and their sum (for the folds and the division). Numerator and normaliser
come back as views of one [B, L, H, Dv + 1] buffer in the kernels' dtype.

q is scaled by 2^-round(log2(L) / 2) inside the kernels (their `scale`): exact in binary, cancelled by
the division, and it keeps float16 normalisers of long sequences finite (docs/design.md, "float16").
"""
from __future__ import annotations

import importlib.util
import math
import re
import weakref
from functools import lru_cache
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.compiler.assume_constant_result  # (a compiled model's plan calls it instead of tracing into it)
def available() -> bool:
    """Whether flash-linear-attention's kernels import (`pip install "lion-vit[gpu]"`)."""
    return not isinstance(_kernels(), str)


def unavailable_reason() -> str:
    """Why the kernels are not available ("" where they are): not installed, or installed but failing to
    import (a missing dependency, a mismatched Triton), with the error's first line."""
    kernels = _kernels()
    return kernels if isinstance(kernels, str) else ""


@lru_cache(maxsize=None)
def _kernels():
    """FLA's two entry points used here, or the reason they do not import."""
    if importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None:
        return "is not installed"
    try:
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
    except Exception as error:  # any failure of a third-party import
        return f"is installed but does not import ({type(error).__name__}: {str(error).partition(chr(10))[0]})"
    return chunk_simple_gla, fused_recurrent_simple_gla


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


class _Indices(NamedTuple):
    """Where every token goes in the kernels' sequences, for S scans of L tokens."""
    order: Tensor  # [S, L]: scan position -> token
    position: Tensor  # [S, L]: token -> scan position
    kv: Tensor  # [2S * L]: the token of each kernel position's key and value (each scan forward, then mirrored)
    q: Tensor  # [2S * L]: the token of each kernel position's query
    mirror: Tensor  # [S, L]: token -> the position of its output in the mirrored sequence
    following: Tensor  # [S, L]: token -> the next token in scan order
    last: Tensor  # [S, 1, L, 1, 1]: whether a token is its scan's last


_kept: Dict[tuple, Tuple[Optional[weakref.ref], _Indices]] = {}


def _scan_indices(orders: Optional[Tensor], length: int, device: torch.device) -> _Indices:
    """The indices of S scans (orders [S, L], or None: one scan in token order), built once per orders
    tensor (a model keeps one per grid) or length and kept, so that a call launches no index arithmetic."""
    key = (length, device) if orders is None else (id(orders), length, device)
    kept = _kept.get(key)
    if kept is not None and (orders is None or kept[0]() is orders):
        return kept[1]
    order = torch.arange(length, device=device)[None] if orders is None else orders
    mirrored = order.flip(-1)
    position = torch.argsort(order, dim=-1)
    indices = _Indices(order, position, torch.stack([order, mirrored], 1).flatten(),
                       torch.stack([order, mirrored.roll(-1, -1)], 1).flatten(), (length - 2 - position) % length,
                       order.roll(-1, -1).gather(-1, position), (position == length - 1)[:, None, :, None, None])
    if len(_kept) >= 64:
        _kept.clear()
    _kept[key] = (None if orders is None else weakref.ref(orders), indices)
    return indices


def _gates_and_folds(log_decays: Optional[Tensor], indices: _Indices, batch: int, heads: int
                     ) -> Tuple[Optional[Tensor], Tensor]:
    """The kernels' gates [B * 2S, L, H] in float32 (None without decays) and each token's factor on its
    mirrored output, [S, B|1, L, H|1, 1] in token order: lam of the next token in scan order, 0 for the
    scan's last token."""
    scans, length = indices.order.shape
    last = indices.last
    if log_decays is None:
        return None, (~last).float()
    a = log_decays.float()  # [S, B|1, H|1, L|1] in token order
    if a.shape[-1] == 1:  # one decay per head: every gate is it (the first one meets a zero state)
        gates = a.expand(scans, batch, heads, 1).permute(1, 0, 3, 2).expand(batch, scans, 2 * length, heads)
        fold = a.exp().permute(0, 1, 3, 2)[..., None]
    else:
        a = a.expand(scans, a.shape[1], a.shape[2], length)
        sequences = a.unflatten(-1, (1, length)).expand(-1, -1, -1, 2, -1).gather(
            -1, indices.kv.view(scans, 1, 1, 2, length).expand(-1, *a.shape[1:3], -1, -1))
        gates = F.pad(sequences[..., :-1], (1, 0)).flatten(-2).permute(1, 0, 3, 2)  # g_p = a(previous token)
        gates = gates.expand(batch, scans, 2 * length, heads)
        fold = a.gather(-1, indices.following[:, None, None].expand_as(a)).exp().permute(0, 1, 3, 2)[..., None]
    return gates.reshape(batch * scans * 2, length, heads), fold.masked_fill(last, 0.0)


def _stacked(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor]):
    """The kernels' operands: q, k, v1 as [B * 2S, L, H, D] (one gather each from token-major views of
    the inputs), gates, folds, and where tokens find their forward outputs (None: in token order) and
    their mirrored ones."""
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    if dtype == torch.float64:
        raise ValueError("the triton backend has no float64 kernels; use backend='torch' for float64")
    batch, heads, length, value_dim = v.shape
    indices = _scan_indices(orders, length, q.device)
    sequences = len(indices.kv) // length

    def gather(t: Tensor, index: Tensor, width: int, value: float = 0.0) -> Tensor:
        """[B, H, L, D] (any strides) -> [B * 2S, L, H, width]: padded with `value`, gathered along tokens."""
        t = t.to(dtype).transpose(1, 2)
        if width > t.shape[-1]:
            t = F.pad(t, (0, width - t.shape[-1]), value=value)
        return t.index_select(1, index).view(batch * sequences, length, heads, width)

    # Every width is made even: FLA refuses odd key or value widths in 16-bit backward passes (a Triton
    # miscompile, fla/ops/common/chunk_o.py). Zero columns of q and k leave every q . k unchanged; the
    # value columns past v are all ones, each a copy of the normaliser.
    key_width = q.shape[-1] + q.shape[-1] % 2
    q2, k2 = gather(q, indices.q, key_width), gather(k, indices.kv, key_width)
    v2 = gather(v, indices.kv, value_dim + 1 + (value_dim + 1) % 2, value=1.0)
    gates, folds = _gates_and_folds(log_decays, indices, batch, heads)
    return q2, k2, v2, gates, folds, None if orders is None else indices.position, indices.mirror


def _combined(out: Tensor, folds: Tensor, position: Optional[Tensor], mirror: Tensor, batch: int,
              value_dim: int) -> Tuple[Tensor, Tensor]:
    """The kernels' outputs [B * 2S, L, H, W] -> numerator [B, H, L, Dv] and normaliser [B, H, L, 1]: each
    token's forward output plus its folded mirrored output, summed over the scans, in the kernels' dtype."""
    scans, length = mirror.shape
    out = out.view(batch, scans, 2, length, *out.shape[2:])
    total = None
    for s in range(scans):
        forward = out[:, s, 0] if position is None else out[:, s, 0].index_select(1, position[s])
        term = torch.addcmul(forward, out[:, s, 1].index_select(1, mirror[s]), folds[s].to(out.dtype))
        total = term if total is None else total + term
    total = total.transpose(1, 2)  # [B, H, L, W], token-major in memory
    return total[..., :value_dim], total[..., value_dim:value_dim + 1]


def _scale(length: int) -> float:
    """2^-round(log2(L) / 2): about 1 / sqrt(L), a power of two."""
    return 2.0 ** -round(math.log2(length) / 2)


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
    every scan and direction in one call. chunk_size is the torch backend's; the kernels use their own
    tile of 64 tokens. log_decays: None or [S, B|1, H|1, L|1] in token order; orders: [S, L] or None."""
    return _run(_kernels()[0], q, k, v, log_decays, orders)


def recurrent_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor] = None,
                   chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Numerator and normaliser by FLA's fused recurrent kernel: every scan and direction in one launch,
    O(L d) memory. Arguments as chunk_form's."""
    return _run(_kernels()[1], q, k, v, log_decays, orders)


@torch.compiler.disable  # (a compiler breaks its graph here: the kernels and their bookkeeping run eagerly)
def _run(kernel: Callable[..., Tuple[Tensor, Tensor]], q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor],
         orders: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    q2, k2, v2, gates, folds, position, mirror = _stacked(q, k, v, log_decays, orders)
    out, _ = kernel(q2, k2, v2, g=gates, scale=_scale(q.shape[2]))
    return _FirstOrderOnly.apply(*_combined(out, folds, position, mirror, q.shape[0], v.shape[-1]))
