"""Full (parallel) LION form: (Q K^T * M) V and its row sums (paper Eq. 13), the training form."""
from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from .masks import decay_mask


def attention_unnormalized(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor],
                           chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Numerator (Q K^T * M) V [B, H, L, Dv] and normaliser rowsum(Q K^T * M) [B, H, L].

    q, k: [B, H, L, Dk]; v: [B, H, L, Dv]; log_decay: None or [B|1, H|1, L|1].
    """
    del chunk_size  # the full form has no chunks; argument kept for a uniform signature
    if log_decay is None:
        # All-ones mask: Q (K^T V) and Q (sum_j k_j) are exact and never build an L x L matrix.
        return q @ (k.transpose(-1, -2) @ v), q @ k.sum(-2).unsqueeze(-1)
    return masked_unnormalized(q, k, v, decay_mask(log_decay, q.shape[-2]))


def masked_unnormalized(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    """(Q K^T * mask) V and its row sums, for a mask [B|1, H, L, L] in float32/64."""
    weights = (q @ k.transpose(-1, -2)).to(mask.dtype) * mask  # [B, H, L, L]
    # under autocast the matmul itself runs in bf16; the row sums stay in float32
    return weights @ v.to(weights.dtype), weights.sum(-1, keepdim=True)
