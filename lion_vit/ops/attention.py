"""Full (parallel) LION form: (Q K^T * M) V and its row sums (paper Eq. 13), the training form."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .cpu import attention as cpu_attention
from .masks import decay_mask, decay_mask_backward, positions_per_scan
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
    return decay_masked_unnormalized(q, k, v, log_decay[None])


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


def _masked_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """numerator (Q K^T * mask) V, normaliser rowsum(Q K^T * mask) and the weights Q K^T * mask."""
    weights = (q @ k.transpose(-1, -2)).to(mask.dtype).mul_(mask)  # [B, H, L, L], in place of the scores
    numerator = weights @ v.to(weights.dtype)  # under autocast this matmul runs in bf16
    return numerator, weights.sum(-1, keepdim=True), weights  # the row sums stay in float32


def _scan_masks(log_decays: Tensor, length: int, positions: Optional[Tensor]) -> List[Tensor]:
    """Each scan's mask in token order (called without autograd): log_decays [S, ...] in scan order,
    positions [S, L] or None for one scan in token order."""
    return [decay_mask(a, length, pos)
            for a, pos in zip(log_decays.unbind(0), positions_per_scan(positions, len(log_decays)))]


class _DecayMaskedAttention(torch.autograd.Function):
    """(Q K^T * M) V and its row sums for M = sum_s M_s, M_s = decay_mask(log_decays[s]), with a
    hand-written backward.

    Autograd would keep the scores and the weights, then allocate a fresh L x L tensor for each of
    half a dozen gradient steps; on a CPU those allocations (page faults on 30 MB tensors) cost
    more than the arithmetic. Here the forward forms the weights W = S * M in place of the scores S
    and keeps only W: the decays' gradient needs dL/d(log M_s) = dL/dM_s * M_s = dW * W * R_s with
    R_s = M_s / M (R = 1 for one scan), never S itself. The backward allocates one L x L tensor,
    dW, and updates it in place. Matmuls run in the dtype the forward's matmul produced (bf16
    under autocast), masks and weights in float32/64. On a CPU both passes walk cache-sized
    groups of (batch, head) slabs (lion_vit.ops.cpu.attention): the same
    operations per slab, and dW is then only ever a group's size.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, log_decays: Tensor,
                positions: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        masks = _scan_masks(log_decays, q.shape[-2], positions)
        mask, ratios = masks[0], []
        if len(masks) > 1:
            mask = sum(masks[1:], masks[0])  # out of place: each scan's mask becomes its ratio
            # R_s = M_s / M. Where every scan's entry underflowed to 0, M becomes the smallest normal
            # number (like the float32 CPU floor of each mask) and R_s = 0: in place, no L x L temporary
            mask.clamp_min_(torch.finfo(mask.dtype).tiny)
            ratios = [m.div_(mask) for m in masks]
        ctx.groups = cpu_attention.training_groups(q, k, v, mask)
        if len(ctx.groups) > 1:
            numerator, normaliser, weights = cpu_attention.grouped_masked_forward(q, k, v, mask, ctx.groups)
        else:
            numerator, normaliser, weights = _masked_forward(q, k, v, mask)
        ctx.compute_dtype = numerator.dtype
        ctx.save_for_backward(q, k, v, mask, weights, log_decays, positions, *ratios)
        return numerator, normaliser

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_numerator: Tensor, grad_normaliser: Tensor):
        q, k, v, mask, weights, log_decays, positions, *ratios = ctx.saved_tensors
        if len(ctx.groups) > 1:
            return (*cpu_attention.grouped_masked_backward(q, k, v, mask, weights, ratios, log_decays, positions,
                                                           grad_numerator, grad_normaliser, ctx.needs_input_grad,
                                                           ctx.groups), None)
        compute = ctx.compute_dtype
        grad_numerator = grad_numerator.to(compute)
        grad_v = None
        if ctx.needs_input_grad[2]:
            grad_v = (weights.to(compute).transpose(-1, -2) @ grad_numerator).to(v.dtype)
        # d/dW of  W V  and of rowsum(W): the one L x L allocation of this backward
        grad_weights = (grad_numerator @ v.to(compute).transpose(-1, -2)).to(weights.dtype)
        grad_weights.add_(grad_normaliser.to(weights.dtype))
        grad_log_decays = None
        if ctx.needs_input_grad[3]:  # the weights are not needed after this: dW * W is formed in them
            scans, scan_positions = log_decays.unbind(0), positions_per_scan(positions, len(log_decays))
            if not ratios:
                grads = [decay_mask_backward(weights, grad_weights, scans[0], scan_positions[0])]
            else:
                grad_log_mask = weights.mul_(grad_weights)
                grads = [decay_mask_backward(r, grad_log_mask.sum_to_size(r.shape), a, pos)
                         for a, r, pos in zip(scans, ratios, scan_positions)]
            grad_log_decays = torch.stack(grads)
        grad_scores = grad_weights.mul_(mask).to(compute)
        grad_q = (grad_scores @ k.to(compute)).to(q.dtype) if ctx.needs_input_grad[0] else None
        grad_k = (grad_scores.transpose(-1, -2) @ q.to(compute)).to(k.dtype) if ctx.needs_input_grad[1] else None
        return grad_q, grad_k, grad_v, grad_log_decays, None


def decay_masked_unnormalized(q: Tensor, k: Tensor, v: Tensor, log_decays: Tensor,
                              positions: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(Q K^T * M) V and its row sums for the summed mask M = sum_s decay_mask(log_decays[s]).

    log_decays: [S, B|1, H|1, L|1], each scan's in scan order; positions: [S, L], the scan position
    of each token, or None for one scan in token order.
    """
    if needs_grad(q, k, v, log_decays):
        return _DecayMaskedAttention.apply(q, k, v, log_decays, positions)
    masks = _scan_masks(log_decays, q.shape[-2], positions)  # every scan's mask has one shape
    mask = masks.pop(0)
    while masks:  # each added mask is freed at once: the scores then meet only the summed mask
        mask.add_(masks.pop())
    return _masked_forward(q, k, v, mask)[:2]
