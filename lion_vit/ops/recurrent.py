"""Bidirectional RNN form of LION (paper Eq. 79-80, docs/design.md section 1).

    forward:  S_t = lam_{t-1} S_{t-1} + k_t [v_t, 1]^T      y^F_t = q_t^T S_t
    backward: the same recurrence on the mirrored sequence
    output:   y^F_t + y^B_t - (q_t . k_t) [v_t, 1]            (the diagonal is counted once)

Both directions advance together, stacked on a new leading axis: one loop over the tokens, O(d^2)
state and O(L d) memory without autograd, no L x L matrix.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .scans import over_scans


def recurrent_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor],
                   orders: Optional[Tensor] = None, chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Numerator [B, H, L, Dv] and normaliser [B, H, L, 1] by the two recurrences, along each scan.

    q, k: [B, H, L, Dk]; v: [B, H, L, Dv]; log_decays: None or [S, B|1, H|1, L|1] in token order;
    orders: [S, L], or None for one scan in token order.
    """
    del chunk_size  # one token at a time
    return over_scans(_one_scan, q, k, v, log_decays, orders)


def _one_scan(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # the normaliser rides along as a column
    queries, keys, values = (torch.stack([t, t.flip(-2)]) for t in (q, k, v1))  # [2, B, H, L, D]
    steps = zip(queries.unsqueeze(-2).unbind(-3), keys.unsqueeze(-1).unbind(-3), values.unsqueeze(-2).unbind(-3))
    decays = [None] * q.shape[-2]
    if log_decay is not None:  # step t scales the state by lam_{t-1}, and by lam_{L-t} in the mirror
        lam = torch.exp(log_decay).to(q.dtype)
        decays = torch.stack([lam, lam.flip(-1)])[..., None, None].unbind(-3) if lam.shape[-1] > 1 else \
            [torch.stack([lam, lam])[..., None]] * q.shape[-2]
    state = q.new_zeros(*queries.shape[:-2], k.shape[-1], v1.shape[-1])  # [2, B, H, Dk, Dv+1]
    outputs = []
    for t, (q_t, k_t, v_t) in enumerate(steps):
        if t > 0 and log_decay is not None:
            state = state * decays[t - 1]
        state = torch.addcmul(state, k_t, v_t)
        outputs.append(q_t @ state)  # [2, B, H, 1, Dv+1]
    both = torch.cat(outputs, dim=-2)
    total = both[0] + both[1].flip(-2) - (q * k).sum(-1, keepdim=True) * v1
    return total[..., :-1], total[..., -1:]
