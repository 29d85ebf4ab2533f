"""Full (parallel) LION form: (Q K^T * M) V and its row sums (paper Eq. 13), the training form."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .masks import decay_mask_backward, decay_mask_values
from .rows import needs_grad


def attention_unnormalized(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor],
                           chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Numerator (Q K^T * M) V [B, H, L, Dv] and normaliser rowsum(Q K^T * M) [B, H, L].

    q, k: [B, H, L, Dk]; v: [B, H, L, Dv]; log_decay: None or [B|1, H|1, L|1].
    """
    del chunk_size  # the full form has no chunks; argument kept for a uniform signature
    if log_decay is None:
        # All-ones mask: Q (K^T V) and Q (sum_j k_j) are exact and never build an L x L matrix.
        return q @ _KeyValueProduct.apply(k, v), q @ k.sum(-2).unsqueeze(-1)
    if needs_grad(q, k, v, log_decay):
        return _DecayMaskedAttention.apply(q, k, v, log_decay)
    return masked_unnormalized(q, k, v, decay_mask_values(log_decay, q.shape[-2]))


class _KeyValueProduct(torch.autograd.Function):
    """K^T V [..., Dk, Dv] (its forward is also the no-grad path), with both gradients in the inputs' [L, D] layout.

    Autograd's backward of `k.transpose(-1, -2) @ v` returns dK as a transposed view, and every
    later pass over it (feature-map backward, stacking q/k/v gradients) then runs strided, several
    times slower on a CPU than on a contiguous tensor.
    """

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor) -> Tensor:
        out = k.transpose(-1, -2) @ v
        ctx.save_for_backward(k, v)
        ctx.compute_dtype = out.dtype  # bf16 under autocast
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        k, v = ctx.saved_tensors
        grad = grad.to(ctx.compute_dtype)
        grad_k = (v.to(grad.dtype) @ grad.transpose(-1, -2)).to(k.dtype) if ctx.needs_input_grad[0] else None
        grad_v = (k.to(grad.dtype) @ grad).to(v.dtype) if ctx.needs_input_grad[1] else None
        return grad_k, grad_v


def _masked_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, keep_scores: bool) -> Tuple[Tensor, ...]:
    """numerator (Q K^T * mask) V, normaliser rowsum(Q K^T * mask), the weights Q K^T * mask and,
    if keep_scores, the scores Q K^T (else formed in place into the weights)."""
    scores = (q @ k.transpose(-1, -2)).to(mask.dtype)  # [B, H, L, L]
    weights = scores * mask if keep_scores else scores.mul_(mask)
    numerator = weights @ v.to(weights.dtype)  # under autocast this matmul runs in bf16
    return numerator, weights.sum(-1, keepdim=True), weights, scores if keep_scores else None


def _grad_v_and_weights(ctx, v: Tensor, weights: Tensor, grad_numerator: Tensor,
                        grad_normaliser: Tensor) -> Tuple[Optional[Tensor], Tensor]:
    """dV = W^T dN and dW = dN V^T + dn (the one L x L allocation of a masked backward)."""
    grad_numerator = grad_numerator.to(ctx.compute_dtype)
    grad_v = None
    if ctx.needs_input_grad[2]:
        grad_v = (weights.to(ctx.compute_dtype).transpose(-1, -2) @ grad_numerator).to(v.dtype)
    # d/dW of  W V  and of rowsum(W)
    grad_weights = (grad_numerator @ v.to(ctx.compute_dtype).transpose(-1, -2)).to(weights.dtype)
    return grad_v, grad_weights.add_(grad_normaliser.to(weights.dtype))


def _grad_q_k(ctx, q: Tensor, k: Tensor, grad_weights: Tensor, mask: Tensor) -> Tuple[Optional[Tensor], ...]:
    """dQ and dK from dS = dW * mask (formed in place into dW)."""
    grad_scores = grad_weights.mul_(mask).to(ctx.compute_dtype)
    grad_q = (grad_scores @ k.to(ctx.compute_dtype)).to(q.dtype) if ctx.needs_input_grad[0] else None
    grad_k = (grad_scores.transpose(-1, -2) @ q.to(ctx.compute_dtype)).to(k.dtype) if ctx.needs_input_grad[1] else None
    return grad_q, grad_k


class _MaskedAttention(torch.autograd.Function):
    """(Q K^T * mask) V and its row sums, with a hand-written backward.

    Autograd would keep the scores and the weights, then allocate a fresh L x L tensor for each of
    half a dozen gradient steps; on a CPU those allocations (page faults on 30 MB tensors) cost
    more than the arithmetic. Here the backward allocates one L x L tensor and updates it in place.
    Matmuls run in the dtype the forward's matmul produced (bf16 under autocast), the mask and the
    weights in float32/64. A mask that needs a gradient (dL/dM = dW * S) makes the forward keep the
    scores as well; `_DecayMaskedAttention` avoids that for a mask built from log decays.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
        numerator, normaliser, weights, scores = _masked_forward(q, k, v, mask, ctx.needs_input_grad[3])
        ctx.compute_dtype = numerator.dtype
        ctx.save_for_backward(q, k, v, mask, weights, scores)
        return numerator, normaliser

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_numerator: Tensor, grad_normaliser: Tensor):
        q, k, v, mask, weights, scores = ctx.saved_tensors
        grad_v, grad_weights = _grad_v_and_weights(ctx, v, weights, grad_numerator, grad_normaliser)
        grad_mask = None
        if scores is not None:  # scores are not needed after this: reuse their storage
            grad_mask = scores.mul_(grad_weights).sum_to_size(mask.shape)
        return (*_grad_q_k(ctx, q, k, grad_weights, mask), grad_v, grad_mask)


class _DecayMaskedAttention(torch.autograd.Function):
    """(Q K^T * M) V and its row sums for the mask M = decay_mask(log_decay), built inside.

    The log decays' gradient needs only dL/d(log M) = dL/dM * M = dW * W, so unlike
    `_MaskedAttention` with a mask that needs a gradient, the forward forms the weights in place
    of the scores and keeps one L x L tensor (W) per layer instead of two.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor) -> Tuple[Tensor, Tensor]:
        mask = decay_mask_values(log_decay, q.shape[-2])
        numerator, normaliser, weights, _ = _masked_forward(q, k, v, mask, keep_scores=False)
        ctx.compute_dtype = numerator.dtype
        ctx.save_for_backward(q, k, v, mask, weights, log_decay)
        return numerator, normaliser

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_numerator: Tensor, grad_normaliser: Tensor):
        q, k, v, mask, weights, log_decay = ctx.saved_tensors
        grad_v, grad_weights = _grad_v_and_weights(ctx, v, weights, grad_numerator, grad_normaliser)
        grad_log_decay = None
        if ctx.needs_input_grad[3]:  # weights are not needed after this: G = dW * W is formed in them
            grad_log_decay = decay_mask_backward(weights, grad_weights, log_decay)
        return (*_grad_q_k(ctx, q, k, grad_weights, mask), grad_v, grad_log_decay)


def masked_unnormalized(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    """(Q K^T * mask) V and its row sums, for a mask [B|1, H, L, L] in float32/64."""
    if needs_grad(q, k, v, mask):
        return _MaskedAttention.apply(q, k, v, mask)
    return _masked_forward(q, k, v, mask, keep_scores=False)[:2]
