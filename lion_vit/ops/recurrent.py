"""Bidirectional RNN form of LION (paper Eq. 79-80, docs/design.md section 1).

    forward:  S_t = lam_{t-1} S_{t-1} + k_t [v_t, 1]^T      y^F_t = q_t^T S_t
    backward: the same recurrence on the mirrored sequence
    output:   y^F_t + y^B_t - (q_t . k_t) [v_t, 1]            (the diagonal is counted once)

Both directions advance together, stacked on a new leading axis: one loop over the tokens, O(d^2)
state and O(L d) memory without autograd, no L x L matrix; the stacked inputs are gathered, and the
outputs added to their places in one [L, Dv + 1] sum, a block of STEP_BLOCK steps at a time.

The decays, the states and the sums are in the masks' precision (masks.mask_dtype: float32 for 16-bit
inputs, a block of them converted at a time), as the other forms' masks and their products' accumulators are:
a state rounded to 16 bits at every step drifts, by half of the output at 785 tokens and decays near 1 in
bfloat16 (docs/design.md section 1).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import mask_dtype
from .scalings import with_ones
from .scans import over_scans


def recurrent_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor],
                   orders: Optional[Tensor] = None, chunk_size: Optional[int] = None,
                   normalised: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """Numerator [B, H, L, Dv] and normaliser [B, H, L, 1] (None where not normalised) by the two recurrences,
    along each scan.

    q, k: [B, H, L, Dk]; v: [B, H, L, Dv]; log_decays: None or [S, B|1, H|1, L|1] in token order;
    orders: [S, L], or None for one scan in token order.
    """
    del chunk_size  # one token at a time
    return over_scans(_one_scan, q, k, v, log_decays, orders, normalised=normalised)


# Steps whose inputs (both directions) are gathered at once: O(block d) memory for them, not O(L d).
STEP_BLOCK = 64


def _one_scan(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor],
              normalised: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    length = q.shape[-2]
    dtype = mask_dtype(q.dtype)  # (the module docstring)
    decays = None  # [2, B|1, H|1, L|1]: step t scales the state by lam_{t-1}, and by lam_{L-t} in the mirror
    if log_decay is not None:
        lam = torch.exp(log_decay.to(dtype))
        decays = torch.stack([lam, lam.flip(-1)])
        decays = F.pad(decays[..., :-1], (1, 0)) if lam.shape[-1] > 1 else decays
    width = v.shape[-1] + normalised  # [v, 1]: the normaliser's column
    state = q.new_zeros(2, *q.shape[:-2], k.shape[-1], width, dtype=dtype)  # [2, B, H, Dk, Dv+1]
    total = q.new_zeros(*q.shape[:-2], length, width, dtype=dtype)  # both directions' outputs, in token order
    for start in range(0, length, STEP_BLOCK):
        stop = min(start + STEP_BLOCK, length)

        def steps(t: Tensor) -> Tensor:
            """Steps start..stop-1 of the sequence and of its mirror: [2, B, H, stop - start, D]."""
            return torch.stack([t[..., start:stop, :], t[..., length - stop:length - start, :].flip(-2)]).to(dtype)

        values = with_ones(steps(v), normalised)
        block = zip(steps(q).unsqueeze(-2).unbind(-3), steps(k).unsqueeze(-1).unbind(-3), values.unsqueeze(-2).unbind(-3))
        outputs = []
        for t, (q_t, k_t, v_t) in enumerate(block, start):
            if t > 0 and decays is not None:
                state = state * decays[..., t if decays.shape[-1] > 1 else 0, None, None]
            state = torch.addcmul(state, k_t, v_t)
            outputs.append(q_t @ state)  # [2, B, H, 1, Dv+1]
        outputs = torch.cat(outputs, dim=-2)
        total[..., start:stop, :] += outputs[0]
        total[..., length - stop:length - start, :] += outputs[1].flip(-2)  # the mirror's steps, in token order
    diagonal = (q.unsqueeze(-2) @ k.unsqueeze(-1)).squeeze(-1)  # q_t . k_t, counted in both directions
    if not normalised:
        return total.addcmul_(diagonal, v, value=-1), None
    numerator, normaliser = total[..., :-1], total[..., -1:]  # views: the sum is the only L-sized buffer
    return numerator.addcmul_(diagonal, v, value=-1), normaliser.sub_(diagonal)
