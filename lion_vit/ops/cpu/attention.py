"""The attention form's masked product on a CPU, in training: the same operations as the portable
forward and backward (lion_vit.ops.attention), one cache-sized group of (batch, head) slabs at a
time, so that the elementwise passes between the matmuls read the group from the last-level cache
and dW is only ever a group's size."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..masks import decay_mask_backward, positions_per_scan
from ..rows import take_rows
from . import budgets, groups

Rows = Tuple[slice, slice]


def _cpu_autocast() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled()


def training_groups(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> List[Rows]:
    """The (batch, head) groups the masked product walks with autograd: cache-sized on a CPU when its
    matmuls run in the masks' dtype (float32/64, no autocast), else one group of every slab (a GPU,
    torch.compile / torch.export, half precision)."""
    batch, heads, length, _ = q.shape
    if not groups.tuned(q.device) or {q.dtype, k.dtype, v.dtype} != {mask.dtype} or _cpu_autocast():
        return [(slice(None), slice(None))]
    slab_bytes = length * length * mask.element_size()
    return list(groups.row_groups(batch, heads, slab_bytes, q.device, budgets.TRAIN_GROUP_BYTES))


def grouped_masked_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor,
                            groups: List[Rows]) -> Tuple[Tensor, Tensor, Tensor]:
    """attention._masked_forward one group of slabs at a time, each group written into its rows of the outputs."""
    batch, heads, length, _ = q.shape
    weights = mask.new_empty(batch, heads, length, length)
    numerator = v.new_empty(batch, heads, length, v.shape[-1])
    normaliser = mask.new_empty(batch, heads, length, 1)
    for rows in groups:
        group_weights = torch.matmul(take_rows(q, rows), take_rows(k, rows).transpose(-1, -2),
                                     out=take_rows(weights, rows))
        group_weights.mul_(take_rows(mask, rows))
        torch.matmul(group_weights, take_rows(v, rows), out=take_rows(numerator, rows))
        torch.sum(group_weights, -1, keepdim=True, out=take_rows(normaliser, rows))
    return numerator, normaliser, weights


def grouped_masked_backward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, weights: Tensor, ratios: List[Tensor],
                             log_decays: Tensor, positions: Optional[Tensor], grad_numerator: Tensor,
                             grad_normaliser: Tensor, needs_input_grad: Tuple[bool, ...],
                             groups: List[Rows]) -> Tuple[Optional[Tensor], ...]:
    """attention._DecayMaskedAttention's backward one group of slabs at a time (all in the masks' dtype): per
    group the same steps as the whole-batch backward, with dW a group's size. A decay gradient is
    reduced per group, except that of masks shared by the batch in a multi-scan layer (fixed
    decays), whose dL/d(log M) is summed over the batch first and reduced once at the end."""
    grad_q, grad_k, grad_v = (torch.empty_like(t) if need else None for t, need in zip((q, k, v), needs_input_grad))
    scans, scan_positions = log_decays.unbind(0), positions_per_scan(positions, len(log_decays))
    grad_decays = torch.zeros_like(log_decays) if needs_input_grad[3] else None
    shared = needs_input_grad[3] and bool(ratios) and ratios[0].shape[0] == 1
    grad_log_mask_sum = torch.zeros_like(ratios[0]) if shared else None
    for rows in groups:
        group_weights, group_grad = take_rows(weights, rows), take_rows(grad_numerator, rows)
        if grad_v is not None:
            torch.matmul(group_weights.transpose(-1, -2), group_grad, out=take_rows(grad_v, rows))
        grad_weights = torch.matmul(group_grad, take_rows(v, rows).transpose(-1, -2))
        grad_weights.add_(take_rows(grad_normaliser, rows))
        if needs_input_grad[3]:  # the group's weights are not needed after this: overwritten
            if not ratios:
                take_rows(grad_decays[0], rows).add_(
                    decay_mask_backward(group_weights, grad_weights, take_rows(scans[0], rows), scan_positions[0]))
            elif shared:
                total = take_rows(grad_log_mask_sum, rows)
                total.add_(group_weights.mul_(grad_weights).sum_to_size(total.shape))
            else:
                grad_log_mask = group_weights.mul_(grad_weights)
                for grad, ratio, a, pos in zip(grad_decays, ratios, scans, scan_positions):
                    # (a multi-scan layer's ratios have every head: each group's rows are read once, then overwritten)
                    ratio = take_rows(ratio, rows)
                    take_rows(grad, rows).add_(decay_mask_backward(ratio, grad_log_mask.sum_to_size(ratio.shape),
                                                                   take_rows(a, rows), pos))
        grad_scores = grad_weights.mul_(take_rows(mask, rows))
        if grad_q is not None:
            torch.matmul(grad_scores, take_rows(k, rows), out=take_rows(grad_q, rows))
        if grad_k is not None:
            torch.matmul(grad_scores.transpose(-1, -2), take_rows(q, rows), out=take_rows(grad_k, rows))
    if shared:
        for grad, ratio, a, pos in zip(grad_decays, ratios, scans, scan_positions):
            grad.copy_(decay_mask_backward(ratio, grad_log_mask_sum, a, pos))
    return grad_q, grad_k, grad_v, grad_decays
