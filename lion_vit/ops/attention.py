"""Full (parallel) LION form: (Q K^T * M) [V, 1], the fastest form for training (paper Eq. 13)."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from .masks import decay_mask


def attention_unnormalized(q: Tensor, k: Tensor, v1: Tensor, log_decay: Optional[Tensor],
                           chunk_size: Optional[int] = None) -> Tensor:
    """Return (Q K^T * M) v1 for v1 = [V, 1]: numerator and normaliser in one matmul.

    q, k: [B, H, L, Dk]; v1: [B, H, L, Dv + 1]; log_decay: None or [B|1, H|1, L|1].
    """
    del chunk_size  # the full form has no chunks; argument kept for a uniform signature
    if log_decay is None:
        # All-ones mask: Q (K^T V) is exact and never builds the L x L matrix.
        return q @ (k.transpose(-1, -2) @ v1)
    return masked_unnormalized(q, k, v1, decay_mask(log_decay, q.shape[-2]))


def masked_unnormalized(q: Tensor, k: Tensor, v1: Tensor, mask: Tensor) -> Tensor:
    """(Q K^T * mask) v1 for a given mask [B|1, H, L, L] (float32/64)."""
    scores = q @ k.transpose(-1, -2)  # [B, H, L, L]
    weights = scores.to(mask.dtype) * mask
    return weights @ v1.to(weights.dtype)  # under autocast the matmul itself runs in bf16
