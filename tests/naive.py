"""Test oracle written straight from the paper's formula (Eq. 13-14, docs/design.md section 1).

Deliberately plain and independent of lion_vit.ops: it multiplies decays directly (running
products in float64) instead of exponentiating differences of log-space cumulative sums, so a bug in the fast forms' helpers cannot make a test agree with itself.

rel_err and oracle_with_grads compare a fast form's outputs and gradients with it; AtenCalls records
what a form ran (operators and their operands' shapes), for tests of how it computes.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


def naive_mask(lam: Tensor) -> Tensor:
    """M_ij = prod_{k=j}^{i-1} lam_k (i > j), 1 (i == j), prod_{k=i+1}^{j} lam_k (i < j).

    lam: [..., L] decays; returns [..., L, L].
    """
    length = lam.shape[-1]
    rows = []
    for i in range(length):
        # left of the query: running products lam_{i-1}, lam_{i-1} lam_{i-2}, ... back to lam_j
        left = torch.cumprod(lam[..., :i].flip(-1), dim=-1).flip(-1)
        # right of the query: lam_{i+1}, lam_{i+1} lam_{i+2}, ... up to lam_j
        right = torch.cumprod(lam[..., i + 1:], dim=-1)
        rows.append(torch.cat([left, torch.ones_like(lam[..., :1]), right], dim=-1))
    return torch.stack(rows, dim=-2)


def naive_lion(q: Tensor, k: Tensor, v: Tensor, lam: Optional[Tensor]) -> Tensor:
    """Y = Scale(Q K^T * M) V with Scale(A)_ij = A_ij / sum_p A_ip, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2)
    if lam is not None:
        scores = scores * naive_mask(lam.double().expand(q.shape[:3]))
    return (scores / scores.sum(-1, keepdim=True)) @ v


def naive_multiscan(q: Tensor, k: Tensor, v: Tensor, lams: Tensor, orders: Tensor) -> Tensor:
    """Y = sum_s (A * M_s) V / sum_s rowsum(A * M_s); lams[s] is in token order.

    Mask s is built along scan s and written back entry by entry at token positions.
    """
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2)
    length = q.shape[2]
    total = torch.zeros_like(scores)
    for s, order in enumerate(orders.tolist()):
        lam_scan = lams[s].double().expand(q.shape[:3])[..., order]
        mask_scan = naive_mask(lam_scan)
        mask_tok = torch.empty_like(mask_scan)
        for p in range(length):
            for r in range(length):
                mask_tok[..., order[p], order[r]] = mask_scan[..., p, r]
        total = total + scores * mask_tok
    return (total / total.sum(-1, keepdim=True)) @ v


def rel_err(actual, expected, min_scale=1e-3):
    """max |actual - expected| / max |expected|, the scale at least min_scale (for exact zeros, e.g. grad of q at L=1)."""
    scale = expected.double().abs().max().clamp_min(min_scale)
    return ((actual.double() - expected.double()).abs().max() / scale).item()


def oracle_with_grads(q, k, v, lams, upstream, orders=None):
    """The float64 oracle's output (naive_lion, or naive_multiscan with orders) and its gradients for
    the upstream gradient: of q, k, v and, lams given, of the log decays (lam * d/d(lam))."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v, lams) if t is not None]
    if orders is None:
        expected = naive_lion(*leaves[:3], leaves[3] if lams is not None else None)
    else:
        expected = naive_multiscan(*leaves, orders)
    grads = list(torch.autograd.grad((expected * upstream).sum(), leaves))
    if lams is not None:
        grads[3] = grads[3] * lams
    return expected.detach(), grads


class AtenCalls(TorchDispatchMode):
    """Inside `with AtenCalls() as calls:`, every ATen operator run, forward and backward: `calls.names`
    the operators' names, `calls.shapes[name]` the shapes of their tensor operands, one list per call."""

    def __init__(self):
        super().__init__()
        self.names, self.shapes = set(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.names.add(name)
        self.shapes.setdefault(name, []).append([tuple(t.shape) for t in args if isinstance(t, torch.Tensor)])
        return func(*args, **(kwargs or {}))
