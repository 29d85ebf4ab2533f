"""Vector decays (one per key channel: GLA's) on flash-linear-attention's vector-gate kernels.

Each scan is two causal gated linear attentions (`chunk_gla`, or `fused_recurrent_gla` for the rnn form), as
the portable vector forms compute them (ops/vector.py): the sequence read along the scan with gates
g_p = a_{p-1}, and its mirror the same, both counting the diagonal, which is then taken off once per scan.
Every scan and direction runs in one launch, stacked on the batch axis; v carries a column of ones for the
normaliser where the scaling reads one (and a zero column where its width is odd: FLA's 16-bit backward wants even
widths).
The glue is torch ops under autograd around FLA's kernels and their hand-written backwards.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..features import mapped, query_scale
from ..scalings import scaled


def vector_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Tensor, orders: Optional[Tensor] = None,
                chunk_size: Optional[int] = None, feature_map: Optional[str] = None, scaling: str = "sum",
                recurrent: bool = False) -> Tensor:
    """Y [B, H, L, Dv] (a view of [B, L, H, Dv]) for q, k [B, H, L, Dk], v [B, H, L, Dv] and vector log decays
    [S, B|1, H|1, L, Dk] in token order; orders [S, L] or None; recurrent: the fused recurrent kernel (rnn
    form) rather than the chunked one. chunk_size is the portable form's: the kernels tile on their own."""
    from .fla import _FirstOrderOnly, _vector_kernels
    chunked, fused_recurrent = _vector_kernels()
    q, k = mapped(q, k, feature_map)
    batch, heads, length, value_dim = v.shape
    scans = len(log_decays)
    orders = torch.arange(length, device=q.device)[None] if orders is None else orders
    normalised = scaling != "none"  # ("none" reads no normaliser: no column of ones)
    extra = [torch.ones_like(v[..., :1])] * normalised
    extra += [torch.zeros_like(v[..., :1])] * ((value_dim + normalised) % 2)
    v1 = torch.cat([v, *extra], dim=-1) if extra else v
    tokens = [t.transpose(1, 2) for t in (q, k, v1)]  # [B, L, H, D]
    a = log_decays.float().expand(scans, batch, heads, length, q.shape[-1]).transpose(2, 3)  # [S, B, L, H, Dk]
    sequences = torch.cat([torch.stack([order, order.flip(0)]) for order in orders.unbind(0)])  # [2S, L]
    q2, k2, v2 = (torch.cat([t.index_select(1, order) for order in sequences]) for t in tokens)
    gates = torch.cat([a[s // 2].index_select(1, order) for s, order in enumerate(sequences)])
    gates = F.pad(gates[:, :-1], (0, 0, 0, 0, 1, 0))  # g_p = a(previous token along the sequence)
    scale = query_scale(length) if scaling == "sum" else 1.0
    kernel = fused_recurrent if recurrent else chunked
    out, _ = kernel(q2, k2, v2.to(q2.dtype), gates, scale=scale)  # [B * 2S, L, H, Dv1]
    parts = out.float().unflatten(0, (2 * scans, batch))
    back = torch.argsort(sequences, dim=-1)  # token -> position in each sequence
    total = sum(parts[index].index_select(1, back[index]) for index in range(2 * scans))
    diagonal = scale * (q.float() * k.float()).sum(-1).transpose(1, 2)[..., None] * v1.float().transpose(1, 2)
    total = total - scans * diagonal  # each mirrored sequence counted its diagonal again
    y = scaled(total[..., :value_dim], total[..., value_dim:value_dim + 1] if normalised else None, scaling).to(v.dtype)
    return _FirstOrderOnly.apply(y).transpose(1, 2)
