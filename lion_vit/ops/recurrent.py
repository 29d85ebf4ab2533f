"""Bidirectional RNN form of LION (paper Eq. 79-80, DESIGN.md section 1).

    forward:  S_i = lam_{i-1} S_{i-1} + k_i [v_i, 1]^T      y^F_i = q_i^T S_i
    backward: the same recurrence on the reversed sequence
    output:   y^F_i + y^B_i - (q_i^T k_i) [v_i, 1]            (the diagonal is counted once)

Both directions advance together in one loop over a stacked state [2, B, H, Dk, Dv+1]. Memory is
O(L d) for the outputs plus O(d^2) state: no L x L matrix.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def recurrent_unnormalized(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor],
                           chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Numerator [B, H, L, Dv] and normaliser [B, H, L, 1] by the two recurrences.

    q, k: [B, H, L, Dk]; v: [B, H, L, Dv]; log_decay: None or broadcastable to [B, H, L].
    """
    del chunk_size
    batch, heads, length, dk = q.shape
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # the normaliser rides along as a column

    def both_directions(t: Tensor) -> Tensor:  # [B, H, L, D] -> L steps of [2, B, H, D]
        return torch.stack([t, t.flip(2)]).unbind(3)

    qs, ks, vs = both_directions(q), both_directions(k), both_directions(v1)
    decays = None
    if log_decay is not None:
        lam = torch.exp(log_decay).to(q.dtype).expand(batch, heads, length)
        # step t multiplies by lam_{t-1} going forward and by lam_{L-t} going backward
        decays = torch.stack([lam, lam.flip(-1)])[..., None, None].unbind(3)  # L x [2, B, H, 1, 1]
    state = q.new_zeros(2, batch, heads, dk, v1.shape[-1])
    outputs = []
    for t in range(length):
        if t > 0 and decays is not None:
            state = state * decays[t - 1]
        state = torch.addcmul(state, ks[t].unsqueeze(-1), vs[t].unsqueeze(-2))
        outputs.append(qs[t].unsqueeze(-2) @ state)  # [2, B, H, 1, Dv+1]
    del qs, ks, vs, decays, state
    out = torch.cat(outputs, dim=-2)  # [2, B, H, L, Dv+1]
    del outputs
    total = out[0].add_(out[1].flip(2)).sub_((q * k).sum(-1, keepdim=True) * v1)
    return total[..., :-1], total[..., -1:]
