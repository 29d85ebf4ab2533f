"""The paper's formula, plainly: the oracle every fast path is tested against (docs/design.md section 1).

    Y = Scale(Q K^T * M) V,   Scale(A)_ij = A_ij / sum_p A_ip
                              (scaling "sum"; "none": A, "max": A_ij / max(|sum_p A_ip|, 1)),
    M_ij = exp(sum of a_k over the path from key j (inclusive) to query i (exclusive))

built as a whole L x L matrix in float64 (any input dtype; the result is float64), with the
multi-scan average  Y = sum_s (A * M_s) V / sum_s rowsum(A * M_s).  O(L^2) time and memory: for
checks, not for models. tests/naive.py checks it against running products of the decays.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .features import mapped


def reference_mask(log_decay: Tensor, length: int) -> Tensor:
    """M [..., L, L] in float64 from log decays broadcastable to [..., L] (last dim 1: one per head).

    With c_i = a_0 + ... + a_i:  M_ij = exp(c_{i-1} - c_{j-1}) for i > j and exp(c_j - c_i) for i < j;
    only entries <= 0 are exponentiated, so nothing overflows.
    """
    a = log_decay.double().expand(*log_decay.shape[:-1], length)
    inclusive = a.cumsum(-1)
    exclusive = inclusive - a
    rows, cols = inclusive[..., :, None], inclusive[..., None, :]
    lower = exclusive[..., :, None] - exclusive[..., None, :]  # i > j: a_j + ... + a_{i-1}
    upper = cols - rows  # i < j: a_{i+1} + ... + a_j
    i = torch.arange(length, device=a.device)
    below = (i[:, None] > i[None, :])
    exponent = torch.where(below, lower, torch.where(i[:, None] < i[None, :], upper, torch.zeros_like(upper)))
    return torch.exp(exponent)


def lion_reference(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor] = None, scaling: str = "sum") -> Tensor:
    """Y [B, H, L, Dv] in float64; q, k [B, H, L, Dk], v [B, H, L, Dv], log_decay None (all-ones mask),
    broadcastable to [B, H, L], or [B|1, H|1, L, Dk] (vector decays: a mask per key channel, the scores
    sum_c q_i^c k_j^c M^c_ij); scaling: "sum", "none" or "max" (above)."""
    return _scale(_masked_scores(q, k, log_decay, None), scaling) @ v.double()


def _scale(scores: Tensor, scaling: str) -> Tensor:
    rows = scores.sum(-1, keepdim=True)
    return {"sum": lambda: scores / rows, "none": lambda: scores,
            "max": lambda: scores / rows.abs().clamp_min(1.0)}[scaling]()


def _masked_scores(q: Tensor, k: Tensor, log_decay: Optional[Tensor], order: Optional[Tensor]) -> Tensor:
    """Q K^T * M [B, H, L, L] in float64, the mask built along order (None: token order) from log decays in
    token order (scalar: broadcastable to [B, H, L]; vector: [B|1, H|1, L, Dk])."""
    q, k = q.double(), k.double()
    length = q.shape[-2]
    if log_decay is None:
        return q @ k.transpose(-1, -2)
    order = torch.arange(length) if order is None else order
    position = torch.argsort(order)  # token -> scan position
    back = (..., position[:, None], position[None, :])
    if log_decay.dim() == 4:  # one mask per key channel, [B, H, Dk, L, L]
        a = log_decay.double().expand(*q.shape)[..., order, :].transpose(-1, -2)
        return torch.einsum("bhic,bhjc,bhcij->bhij", q, k, reference_mask(a, length)[back])
    a = log_decay.double().expand(*q.shape[:3])[..., order]  # into scan order
    return (q @ k.transpose(-1, -2)) * reference_mask(a, length)[back]


def lion_reference_multiscan(q: Tensor, k: Tensor, v: Tensor, log_decays: Tensor, orders: Tensor,
                             scaling: str = "sum") -> Tensor:
    """Multi-scan Y in float64: log_decays[s] in token order (as lion_reference's), orders [S, L] (scan
    position -> token). Each scan's mask is built along its order and read back in token order."""
    total = sum(_masked_scores(q, k, log_decay, order) for log_decay, order in zip(log_decays, orders))
    return _scale(total, scaling) @ v.double()


def lion_attention_reference(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor] = None,
                             orders: Optional[Tensor] = None, *, feature_map: Optional[str] = None,
                             scaling: str = "sum", **settings: Any) -> Tensor:
    """The oracle with ops.lion_attention's call signature, to stand in for it (every layer of a model
    through the formula): log_decays [S, ...], orders [S, L] or None; form, backend and the other settings
    are ignored. Float64 result."""
    q, k = mapped(q, k, feature_map)
    if orders is not None and log_decays is None:
        log_decays = torch.zeros(len(orders), 1, 1, 1, dtype=torch.float64)
    if orders is None:
        return lion_reference(q, k, v, None if log_decays is None else log_decays[0], scaling)
    return lion_reference_multiscan(q, k, v, log_decays, orders, scaling)
