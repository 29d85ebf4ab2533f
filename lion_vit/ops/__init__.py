"""LION math as pure functions on tensors (no parameters). See docs/design.md section 1.

`lion_attention` computes  Y = Scale(Q K^T * M) V  in one of three equivalent forms, on the backend
that dispatch.plan picks; every form returns the numerator (Q K^T * M) V and the normaliser
rowsum(Q K^T * M), divided here in float32.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .attention import attention_unnormalized, decay_masked_unnormalized
from .chunk import chunk_unnormalized, whole_product_is_cheaper
from .dispatch import BACKENDS, FORM_CHOICES, Plan, check_backend, check_form, plan
from .features import FEATURE_MAPS, get_feature_map
from .masks import decay_mask, mask_dtype
from .recurrent import recurrent_unnormalized
from .cpu.groups import row_groups
from .rows import needs_grad, take_rows, tracing
from .scans import column_snake, row_snake, snake_orders

# (numerator, normaliser) of each form, per backend; the triton forms are imported on first use
FORMS: Dict[str, Callable[..., Tuple[Tensor, Tensor]]] = {
    "attention": attention_unnormalized,
    "rnn": recurrent_unnormalized,
    "chunk": chunk_unnormalized,
}


def _form(form: str, backend: str) -> Callable[..., Tuple[Tensor, Tensor]]:
    if backend == "triton":
        from . import triton
        return {"rnn": triton.recurrent_unnormalized, "chunk": triton.chunk_unnormalized}[form]
    return FORMS[form]

__all__ = [
    "FORMS", "FORM_CHOICES", "BACKENDS", "FEATURE_MAPS", "Plan", "plan", "lion_attention", "lion_attention_multiscan",
    "check_form", "check_backend",
    "decay_mask", "get_feature_map", "row_snake", "column_snake", "snake_orders", "whole_product_is_cheaper",
]


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor] = None) -> None:
    """Raise ValueError for shapes the forms would otherwise fail on deep inside (or, for per-token
    decays, broadcast into a wrong result), and, on a CPU, for decays above 1: the full and chunk
    forms' log-space masks assume log(lam) <= 0. (A GPU skips the value check, which would
    synchronise every layer; so do torch.compile / torch.export.) orders: a multi-scan call's [S, L]."""
    if tracing():
        return
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"expected q, k [B, H, L, Dk] and v [B, H, L, Dv] with the same B, H, L; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    batch, heads, length = q.shape[:3]
    if orders is not None and orders.shape[-1] != length:
        raise ValueError(f"orders [S, L] has L = {orders.shape[-1]} but q has {length} tokens")
    if log_decays is None:
        return
    scans = [log_decays] if orders is None else list(log_decays)
    if orders is not None and len(scans) != len(orders):
        raise ValueError(f"log_decays has {len(scans)} scans but orders has {len(orders)}")
    for log_decay in scans:
        shape = tuple(log_decay.shape)
        if (len(shape) > 3 or shape[-1] not in (1, length)
                or any(size not in (1, full) for size, full in zip(shape[::-1][1:], (heads, batch)))):
            raise ValueError(f"log decays must broadcast to [B, H, L] = [{batch}, {heads}, {length}] with a last "
                             f"dimension of 1 (one decay per head) or L (one per token); got {list(shape)}")
    if log_decays.device.type == "cpu" and bool((log_decays > 0).any()):
        raise ValueError(f"log decays must be <= 0 (decays in (0, 1]), got up to {log_decays.max().item():.3g}; "
                         "pass log(lam), e.g. F.logsigmoid(logits)")


def _as_bhl(log_decay: Optional[Tensor]) -> Optional[Tensor]:
    """View a log decay broadcastable to [B, H, L] as a 3-d tensor."""
    if log_decay is None:
        return None
    while log_decay.dim() < 3:
        log_decay = log_decay.unsqueeze(0)
    return log_decay


class _Divide(torch.autograd.Function):
    """numerator / normaliser (normaliser [..., 1]) with a two-pass backward: autograd's division
    backward takes four passes over the [B, H, L, D] output."""

    @staticmethod
    def forward(ctx, numerator: Tensor, normaliser: Tensor) -> Tensor:
        out = numerator / normaliser
        ctx.save_for_backward(out, normaliser)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> Tuple[Tensor, Tensor]:
        out, normaliser = ctx.saved_tensors
        # written contiguous: the incoming gradient is usually a [B, L, H, D]-strided view (from the
        # heads' transpose), and the matmuls of the backward below would each copy it
        if tracing():  # a traced out= loses the requested layout; the compiler fuses the copy instead
            grad_numerator = torch.div(grad, normaliser).contiguous()
        else:
            grad_numerator = torch.div(grad, normaliser,
                                       out=torch.empty_like(out, memory_format=torch.contiguous_format))
        return grad_numerator, -(grad_numerator * out).sum(-1, keepdim=True)


def _normalize(numerator: Tensor, normaliser: Tensor, dtype: torch.dtype) -> Tensor:
    """Divide in float32 (or float64), return in the input dtype."""
    work = mask_dtype(dtype)
    return _Divide.apply(numerator.to(work), normaliser.to(work)).to(dtype)


def lion_attention(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor] = None, *,
                   form: str = "attention", chunk_size: Optional[int] = None, backend: str = "auto") -> Tensor:
    """Bidirectional LION attention  Y = Scale(Q K^T * M) V.

    q, k: [B, H, L, Dk] non-negative features; v: [B, H, L, Dv]; log_decay: None (all-ones mask,
    LION-lit) or log(lam) <= 0 broadcastable to [B, H, L] (last dim 1: one decay per head, LION-d).
    form: "attention" | "rnn" | "chunk" | "auto"; chunk_size: for "chunk" on the torch backend, at most
    this many tokens per chunk (ceil(L / chunk_size) equal chunks; None = one chunk of L).
    backend: "auto" | "torch" | "triton". What runs for these (one product where it is cheaper than
    chunks, which backend) is dispatch.plan's choice. Returns [B, H, L, Dv].
    """
    _check_inputs(q, k, v, log_decay)
    run = plan(form, chunk_size, q.shape[-2], q.shape[-1], v.shape[-1], decayed=log_decay is not None,
               device=q.device, dtype=q.dtype, backend=backend, training=needs_grad(q, k, v, log_decay))
    form = "attention" if run.whole else run.form
    numerator, normaliser = _form(form, run.backend)(q, k, v, _as_bhl(log_decay), chunk_size=chunk_size)
    return _normalize(numerator, normaliser, v.dtype)


def lion_attention_multiscan(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor],
                             orders: Tensor, *, form: str = "attention",
                             chunk_size: Optional[int] = None, backend: str = "auto") -> Tensor:
    """Multi-scan LION:  Y = sum_s (A * M_s) V / sum_s rowsum(A * M_s).

    orders: [S, L] permutations (scan position -> token index); log_decays: None, or [S, ...]
    where entry s is broadcastable to [B, H, L] and given in token order (last dim 1 for a fixed
    decay). Each scan's mask is built in its own order. The full form runs one masked product with
    the scans' masks summed, and so does the chunk form where dispatch.plan finds that cheaper than
    chunking every scan; the rnn form and the chunk form otherwise run each scan in its order (on the
    triton backend all scans in one call, stacked on the batch axis) and sum the results.
    """
    _check_inputs(q, k, v, log_decays, orders)
    num_scans, length = orders.shape
    batch, heads = q.shape[:2]
    run = plan(form, chunk_size, length, q.shape[-1], v.shape[-1], num_scans=num_scans,
               decayed=log_decays is not None, device=q.device, dtype=q.dtype, backend=backend,
               training=needs_grad(q, k, v, log_decays))
    a = None
    if log_decays is not None:  # [S, B|1, H, L|1]
        a = torch.stack([_as_bhl(d).expand(-1, heads, -1) for d in log_decays.unbind(0)])
        if a.shape[-1] != 1:  # per-token decays follow their tokens into scan order
            a = torch.gather(a, -1, orders[:, None, None, :].expand_as(a))
    inverse = torch.argsort(orders, dim=-1)  # token index -> scan position

    if run.whole and a is None:  # every scan's mask is all ones: the S equal terms cancel in the division
        return _normalize(*attention_unnormalized(q, k, v, None), v.dtype)
    if run.backend == "torch" and not needs_grad(q, k, v, a) and run.form != "attention":
        return _normalize(*_multiscan_inference(q, k, v, a, orders, inverse, run.form, chunk_size,
                                                summed=run.whole), v.dtype)
    if run.whole:
        # Masks add up, so the full form needs one summed mask in token order and no permutation
        # of q, k, v:  sum_s (A * M_s) = A * sum_s M_s.
        return _normalize(*decay_masked_unnormalized(q, k, v, a, inverse), v.dtype)

    def to_scans(t: Tensor) -> Tensor:  # [B, H, L, D] -> [S * B, H, L, D], each scan in its order
        return t.index_select(2, orders.flatten()).unflatten(2, (num_scans, length)).movedim(2, 0).flatten(0, 1)

    if a is not None:
        a = a.expand(num_scans, batch, heads, a.shape[-1]).flatten(0, 1)
    parts = _form(run.form, run.backend)(to_scans(q), to_scans(k), to_scans(v), a, chunk_size=chunk_size)
    # back to token order and summed over scans: [S * B, H, L, D] -> [B, H, L, D]
    numerator, normaliser = (sum(t.unflatten(0, (num_scans, batch))[s].index_select(2, inverse[s])
                                 for s in range(num_scans)) for t in parts)
    return _normalize(numerator, normaliser, v.dtype)


def _multiscan_inference(q: Tensor, k: Tensor, v: Tensor, a: Optional[Tensor], orders: Tensor, inverse: Tensor,
                         form: str, chunk_size: Optional[int], summed: bool = False) -> Tuple[Tensor, Tensor]:
    """Without autograd: one scan at a time (for the chunk form, of one group of (batch, head) rows
    at a time), summed into token order in place, so that no scan-ordered copy of the whole q, k, v
    for every scan is ever made: the rnn and chunk forms keep their memory at any resolution.
    summed (the chunk form with decays, where one product over the whole sequence is cheaper): per
    group the full form's single summed-mask product instead of chunks in every scan, and no permutations;
    when one group holds every row, that product's result is returned as is, with no buffer.

    a: None or [S, B|1, H, L|1] log decays in scan order; inverse: [S, L], each token's scan position.
    """
    batch, heads, length, dv = v.shape
    work_dtype = mask_dtype(v.dtype)
    # the rnn form walks the tokens one by one: more rows per step cost it nothing, more groups a loop each
    groups = list(row_groups(batch, heads, length * (dv + 1) * torch.finfo(work_dtype).bits // 8, v.device)) \
        if form == "chunk" else [(slice(None), slice(None))]
    if summed and len(groups) == 1:  # all rows at once: the full form itself, with no buffer to copy into
        return decay_masked_unnormalized(q, k, v, a, inverse)
    total = v.new_zeros(batch, heads, length, dv + 1, dtype=work_dtype)  # [numerator, normaliser]
    for rows in groups:
        group_total = take_rows(total, rows)
        group = [take_rows(t, rows) for t in (q, k, v)]
        if summed:
            parts = decay_masked_unnormalized(*group, torch.stack([take_rows(scan, rows) for scan in a]), inverse)
            group_total[..., :dv].copy_(parts[0])
            group_total[..., dv:].copy_(parts[1])
            continue
        for s, order in enumerate(orders):
            scan_decay = None if a is None else take_rows(a[s], rows)
            if form == "rnn":  # reads its steps through the order; returns token order
                parts = recurrent_unnormalized(*group, scan_decay, order=order)
                group_total[..., :dv].add_(parts[0])
                group_total[..., dv:].add_(parts[1])
            else:  # scan position p holds token order[p]
                parts = FORMS[form](*(t.index_select(2, order) for t in group), scan_decay, chunk_size=chunk_size)
                group_total[..., :dv].index_add_(2, order, parts[0].to(total.dtype))
                group_total[..., dv:].index_add_(2, order, parts[1].to(total.dtype))
            del parts  # free this scan's output before the next scan allocates its own
    return total[..., :dv], total[..., dv:]
