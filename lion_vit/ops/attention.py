"""Full (parallel) LION form: (Q K^T * M) V and its row sums (paper Eq. 13), the training form."""
from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from .masks import decay_mask, masked_scores


def attention_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor],
                   orders: Optional[Tensor] = None, chunk_size: Optional[int] = None,
                   normalised: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """Numerator (Q K^T * M) V [..., L, Dv] and normaliser rowsum(Q K^T * M) [..., L, 1] (None where not
    normalised).

    q, k: [..., L, Dk]; v: [..., L, Dv]; log_decays: None (all-ones mask) or [S, ...] in token order,
    one entry per scan (last dimension L or 1); orders: [S, L] scan orders, or None for one scan in
    token order. The scans' masks add up: sum_s (A * M_s) = A * sum_s M_s, one product for all scans.
    """
    del chunk_size  # one product: no chunks
    if log_decays is None:  # all-ones mask: Q (K^T V) and Q (sum_j k_j), linear in L
        # q with its batch dimensions foldable, as both matmuls fold them: a view where they fold already, else
        # one head-major copy for the two (each matmul made its own of a strided view)
        q = q.reshape(-1, *q.shape[-2:]).view(q.shape)
        return q @ (k.transpose(-1, -2) @ v), q @ k.sum(-2).unsqueeze(-1) if normalised else None
    length = q.shape[-2]
    scan_orders = [None] * len(log_decays) if orders is None else orders.unbind(0)
    masks = [decay_mask(a, length, order) for a, order in zip(log_decays.unbind(0), scan_orders)]
    weights = masked_scores(q, k, sum(masks[1:], masks[0]))
    # the row sums, not a column of ones on v: v keeps its Dv columns (a multiple of 8, as GPU matmuls
    # want; Dv + 1 is not), and compiled, the sum and its gradient join kernels that run anyway
    # (docs/design.md section 1). In the weights' dtype: CUDA's autocast would sum into float32, and
    # its backward then write the L x L gradient once more to cast it back.
    return weights @ v, weights.sum(-1, keepdim=True, dtype=weights.dtype) if normalised else None
