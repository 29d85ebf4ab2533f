"""Bidirectional RNN form of LION (paper Eq. 79-80, docs/design.md section 1).

    forward:  S_i = lam_{i-1} S_{i-1} + k_i [v_i, 1]^T      y^F_i = q_i^T S_i
    backward: the same recurrence on the reversed sequence
    output:   y^F_i + y^B_i - (q_i^T k_i) [v_i, 1]            (the diagonal is counted once)

Both directions advance together in one loop over a stacked state [2, B, H, Dk, Dv+1]. The
stacked (and mirrored) inputs are built a block of steps at a time, and without autograd the
state is updated in place and each step writes straight into one output buffer, so memory is
the output plus O(d^2) state and O(block d) inputs: no L x L matrix, no copy of the sequence.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .rows import needs_grad, tracing

# Steps whose stacked [forward, backward] inputs are materialised at once.
STEP_BLOCK = 256


def recurrent_unnormalized(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor],
                           chunk_size: Optional[int] = None, order: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Numerator [B, H, L, Dv] and normaliser [B, H, L, 1] by the two recurrences.

    q, k: [B, H, L, Dk]; v: [B, H, L, Dv]; log_decay: None or broadcastable to [B, H, L].
    order: [L] scan order (scan position -> token index) to read the tokens in, a block of steps at
    a time, with log_decay given in scan order; the outputs stay in token order. A multi-scan layer
    thus needs no scan-ordered copy of q, k, v.
    """
    del chunk_size
    batch, heads, length, dk = q.shape
    dv = v.shape[-1]
    inplace = not needs_grad(q, k, v, log_decay) and not tracing()
    decays = None
    if log_decay is not None:
        lam = torch.exp(log_decay).to(q.dtype).expand(batch, heads, length)
        # step t multiplies the state by lam_{t-1} going forward and by lam_{L-t} going backward
        decays = F.pad(torch.stack([lam, lam.flip(-1)])[..., :-1], (1, 0))[..., None, None]  # [2, B, H, L, 1, 1]

    def block(t: Tensor, start: int, stop: int) -> Tensor:
        """Steps start..stop-1 of both directions: [2, B, H, stop - start, D]."""
        if order is not None:
            return torch.stack([t.index_select(2, order[start:stop]),
                                t.index_select(2, order[length - stop:length - start].flip(0))])
        return torch.stack([t[:, :, start:stop], t[:, :, length - stop:length - start].flip(2)])

    state = q.new_zeros(2, batch, heads, dk, dv + 1)
    out = q.new_empty(length, 2, batch, heads, 1, dv + 1) if inplace else None
    outputs, diagonals = [], []
    for start in range(0, length, STEP_BLOCK):
        stop = min(start + STEP_BLOCK, length)
        values = block(v, start, stop)
        values = torch.cat([values, torch.ones_like(values[..., :1])], dim=-1)  # the normaliser's column
        block_decays = [None] * (stop - start) if decays is None else decays[:, :, :, start:stop].unbind(3)
        queries, keys = block(q, start, stop), block(k, start, stop)
        diagonals.append((queries[0] * keys[0]).sum(-1))  # q_i . k_i of these scan positions, [B, H, n]
        # a step's operands shaped for it here, a block at a time: each step then costs three torch calls
        # (decay, update, read), which at thousands of steps per layer are most of the form's time
        step_outputs = out[start:stop].unbind(0) if inplace else [None] * (stop - start)
        steps = zip(queries.unsqueeze(-2).unbind(3), keys.unsqueeze(-1).unbind(3), values.unsqueeze(-2).unbind(3),
                    block_decays, step_outputs)
        for t, (q_t, k_t, v_t, decay_t, out_t) in enumerate(steps, start):
            if t > 0 and decay_t is not None:
                state = state.mul_(decay_t) if inplace else state * decay_t
            if inplace:
                state.addcmul_(k_t, v_t)
                torch.matmul(q_t, state, out=out_t)
            else:
                state = torch.addcmul(state, k_t, v_t)
                outputs.append(q_t @ state)  # [2, B, H, 1, Dv+1]
    del state
    if not inplace:
        out = torch.stack(outputs)
        del outputs
    out = out.squeeze(-2).permute(1, 2, 3, 0, 4)  # [2, B, H, L, Dv+1] (a view)
    # step t of the forward direction is scan position t, of the backward one position L-1-t
    if order is not None:  # scatter both directions to token order
        total = out.new_zeros(out.shape[1:])
        for steps, tokens in ((out[0], order), (out[1], order.flip(0))):
            total = total.index_add_(2, tokens, steps) if inplace else total.index_add(2, tokens, steps)
    elif inplace:  # add the backward direction at mirrored positions without a flipped copy
        total = out[0].index_add_(2, torch.arange(length - 1, -1, -1, device=q.device), out[1])
    else:
        total = out[0] + out[1].flip(2)
    del out
    diagonal = torch.cat(diagonals, dim=-1)  # [B, H, L], scan order: counted in both directions
    if order is not None:
        diagonal = diagonal[..., torch.argsort(order)]
    diagonal = diagonal.unsqueeze(-1)
    numerator, normaliser = total[..., :dv], total[..., dv:]
    if inplace:
        return numerator.addcmul_(diagonal, v, value=-1.0), normaliser.sub_(diagonal)
    return numerator - diagonal * v, normaliser - diagonal
