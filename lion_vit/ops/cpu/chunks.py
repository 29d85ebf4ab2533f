"""Vector decays' chunks at once with a hand-written backward: the cpu backend's training path.

The same function as vector._at_once (docs/design.md, "Vector decays"), in chunks whose decays keep the exponents
in exp's range (vector.leaf_tokens; halves of the plan's chunk where not), each with one reference token m (its
middle) for everything: inside a chunk q~ = q exp(G - G_m), k~ = k exp(G_m - G) (forward pairs) and
q^ = q exp(H_m - H), k^ = k exp(H - H_m) (backward pairs), and the states between chunks read and made of the
same factors, scaled per key channel by one vector a chunk. Autograd's backward of the portable form makes tens
of elementwise passes over [L, Dk] tensors per direction; this one a few. The decays' gradient comes from the
factors' (FLA's identity, docs/design.md): dG = q~ dq~ - k~ dk~, dH = k^ dk^ - q^ dq^, then
da = (reverse cumulative sum of dG + dH) - dG. A second derivative (create_graph) differentiates the portable
form again, recomputed from the inputs.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import vector
from ..scalings import with_ones


def at_once(q: Tensor, k: Tensor, v: Tensor, a: Tensor, chunk: int, leaf_size: Optional[int],
            order: Optional[Tensor] = None, normalised: bool = True) -> Tensor:
    """vector._at_once's sums [..., L, Dv + 1] (Dv not normalised) for float32 or float64 q, k, v and log decays a
    of q's dtype, through `_Chunks` in the largest of `chunk` tokens and its halves whose chunks are one leaf each
    (vector.leaf_tokens: their exponents stay in exp's range; one token always is). order: the scan's [L] (None:
    token order), along which `_Chunks` reads the inputs, given and returned in token order. leaf_size:
    _at_once's, unread."""
    length = q.shape[-2]
    count = -(-length // chunk)
    with torch.no_grad():  # (the chunks' cumulative log decays: read here, handed to _Chunks)
        gates = a if order is None else a.index_select(-2, order)
        while True:
            size = -(-length // count)
            g, h = vector._cumulative(_in_chunks(gates, None, size))
            if size == 1 or vector.leaf_tokens(g, h, a.dtype, [size]) == size:
                break
            count *= 2
    return _Chunks.apply(q, k, v, a, order, size, g, h, normalised)


def _in_chunks(t: Tensor, order: Optional[Tensor], size: int) -> Tensor:
    """t [..., L, D] read along order (None: as it is), zero-padded to whole chunks: [..., chunks, size, D]."""
    if order is not None:
        t = t.index_select(-2, order)
    pad = -t.shape[-2] % size
    return (F.pad(t, (0, 0, 0, pad)) if pad else t).unflatten(-2, (-1, size))


class _Chunks(torch.autograd.Function):
    """(q, k, v, a [..., L, D] in token order, the scan's order [L] or None, chunk size, the chunks' cumulative log
    decays G and H [..., chunks, size, Dk] along the order, whether normalised) -> both directions' sums against
    [v, 1] ([..., L, Dv + 1]; against v, Dv, not normalised) in token order. It keeps its inputs for a second
    derivative (`_differentiated_again`), and the factors, pairs and states for the first."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, a: Tensor, order: Optional[Tensor], size: int, g: Tensor,
                h: Tensor, normalised: bool) -> Tensor:
        length = q.shape[-2]
        qs, ks, vs = (_in_chunks(t, order, size) for t in (q, k, with_ones(v, normalised)))
        m = size // 2
        # [..., chunks, 1, Dk]; total a copy: kept for the backward, a view would keep all of H alive
        g_m, h_m, total = g[..., m:m + 1, :], h[..., m:m + 1, :], h[..., -1:, :].clone()
        fq = (g - g_m).exp_()
        bq = (h_m - h).exp_()
        qf, kf, qb, kb = qs * fq, ks / fq, qs * bq, ks / bq
        pairs = (qf @ kf.mT).tril_().add_((qb @ kb.mT).triu_(1))
        out = pairs @ vs
        # the states' scales per chunk and key channel [..., chunks, Dk, 1]: a state is read by q~ at G_m, q^ at
        # T - H_m, and made of k~ at T - G_m, k^ at H_m (T: `total`, the chunk's whole log decay)
        scales = [t.exp().mT for t in (g_m, total - h_m, total - g_m, h_m)]
        states = [torch.zeros(())] * 2
        if out.shape[-3] > 1:
            read_f, read_b, made_f, made_b = scales
            states = [vector._states(total, (kf.mT @ vs).mul_(made_f)).mul_(read_f),
                      vector._states(total, (kb.mT @ vs).mul_(made_b), reverse=True).mul_(read_b)]
            out.add_(qf @ states[0]).add_(qb @ states[1])
        ctx.size, ctx.length, ctx.normalised = size, length, normalised
        inverse = None if order is None else torch.argsort(order)  # token -> scan position
        ctx.save_for_backward(q, k, v, a, order, inverse, qf, kf, qb, kb, fq, bq, vs, pairs, total, *states, *scales)
        return _in_token_order(out.flatten(-3, -2)[..., :length, :], inverse)

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, a, order, inverse, qf, kf, qb, kb, fq, bq, vs, pairs, total, state_f, state_b, *scales = \
            ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the portable form's graph, which has second derivatives
            return _differentiated_again(ctx, grad, q, k, v, a, order, inverse)
        size, length = ctx.size, ctx.length
        dout = _in_chunks(grad, order, size)
        dpairs = dout @ vs.mT
        dpf, dpb = dpairs.tril(), dpairs.triu_(1)
        dv = pairs.mT @ dout
        dqf, dqb = dpf @ kf, dpb @ kb
        dkf, dkb = dpf.mT @ qf, dpb.mT @ qb
        if dout.shape[-3] > 1:
            read_f, read_b, made_f, made_b = scales
            dqf.add_(dout @ state_f.mT)
            dqb.add_(dout @ state_b.mT)
            # the gradients of the chunks' own sums: the later (earlier) chunks' readers, swept back
            own_f = vector._states(total, (qf.mT @ dout).mul_(read_f), reverse=True).mul_(made_f)
            own_b = vector._states(total, (qb.mT @ dout).mul_(read_b)).mul_(made_b)
            dkf.add_(vs @ own_f.mT)
            dkb.add_(vs @ own_b.mT)
            dv.add_(kf @ own_f).add_(kb @ own_b)
        dg = (qf * dqf).sub_(kf * dkf)
        dh = (kb * dkb).sub_(qb * dqb)
        dq = dqf.mul_(fq).addcmul_(dqb, bq)
        dk = dkf.div_(fq).add_(dkb.div_(bq))
        dg, dh, dq, dk = (t.flatten(-3, -2)[..., :length, :] for t in (dg, dh, dq, dk))
        da = (dg + dh).flip(-2).cumsum(-2).flip(-2) - dg
        grads = (dq, dk, dv.flatten(-3, -2)[..., :length, :v.shape[-1]], da)
        return tuple(_in_token_order(t, inverse) for t in grads) + (None,) * 5


def _in_token_order(t: Tensor, inverse: Optional[Tensor]) -> Tensor:
    """t [..., L, D] along a scan's order put back in token order (inverse: the order's, None: already)."""
    return t if inverse is None else t.index_select(-2, inverse)


def _differentiated_again(ctx, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, a: Tensor, order: Optional[Tensor],
                          inverse: Optional[Tensor]):
    """The first derivatives as a graph (for a second one): the portable form's, recomputed."""
    wanted = [t for t, needed in zip((q, k, v, a), ctx.needs_input_grad) if needed]
    with torch.enable_grad():
        scan = (q, k, v, a) if order is None else (t.index_select(-2, order) for t in (q, k, v, a))
        both = _in_token_order(vector._at_once(*scan, ctx.size, None, ctx.normalised), inverse)
        grads = iter(torch.autograd.grad(both, wanted, grad, create_graph=True))
    return tuple(next(grads) if needed else None for needed in ctx.needs_input_grad[:4]) + (None,) * 5
