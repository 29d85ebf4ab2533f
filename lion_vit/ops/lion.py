"""The LION op: Y = Scale(Q K^T * M) V for one scan or several, in the form and on the backend that
dispatch.plan picks (docs/design.md sections 1-2).

Every portable form returns the numerator (Q K^T * M) V and the normaliser rowsum(Q K^T * M) (summed
over the scans), divided once by dispatch.implementation; the triton backend divides as it combines
its kernels' outputs. q and k are features, or raw projections with the name of the feature map that
makes them features (which the triton backend applies as it reads them).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import dispatch


def lion_attention(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor] = None, *,
                   form: str = "attention", chunk_size: Optional[int] = None, backend: str = "auto",
                   plan: Optional[dispatch.Plan] = None, feature_map: Optional[str] = None) -> Tensor:
    """Bidirectional LION attention  Y = Scale(Q K^T * M) V.

    q, k: [B, H, L, Dk] non-negative features (or raw, with feature_map); v: [B, H, L, Dv]; log_decay:
    None (all-ones mask, LION-lit) or log(lam) <= 0 broadcastable to [B, H, L] (last dim 1: one decay per
    head, LION-d).
    form: "attention" | "rnn" | "chunk" | "auto"; chunk_size: for "chunk" on the torch backend, at most
    this many tokens per chunk (ceil(L / chunk_size) equal chunks; None = one chunk of L).
    backend: "auto" | "torch" | "triton". plan: what `inputs_plan` gives for this call, from a caller that
    planned already (a layer choosing its layout); None plans here. feature_map: None (q, k are features)
    or a FEATURE_MAPS name (q, k are raw and mapped by it). Returns [B, H, L, Dv].
    """
    dispatch.check_inputs(q, k, v, log_decay)
    log_decays = None if log_decay is None else _bhl(log_decay)[None]
    return _run(q, k, v, log_decays, None, feature_map,
                plan or inputs_plan(q, k, v, log_decays, None, form, chunk_size, backend))


def lion_attention_multiscan(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Tensor, *,
                             form: str = "attention", chunk_size: Optional[int] = None,
                             backend: str = "auto", plan: Optional[dispatch.Plan] = None,
                             feature_map: Optional[str] = None) -> Tensor:
    """Multi-scan LION:  Y = sum_s (A * M_s) V / sum_s rowsum(A * M_s).

    orders: [S, L] permutations (scan position -> token index); log_decays: None, or [S, ...] where
    entry s is broadcastable to [B, H, L] and given in token order (last dim 1: one decay per head).
    Each scan's mask is built along its order. Other arguments as lion_attention's.
    """
    dispatch.check_inputs(q, k, v, log_decays, orders)
    if log_decays is None:  # every scan's mask is all ones: the S equal terms cancel in the division
        orders = None
    else:
        log_decays = torch.stack([_bhl(a) for a in log_decays.unbind(0)])
    return _run(q, k, v, log_decays, orders, feature_map,
                plan or inputs_plan(q, k, v, log_decays, orders, form, chunk_size, backend))


def _bhl(log_decay: Tensor) -> Tensor:
    """A log decay broadcastable to [B, H, L] as a 3-d tensor."""
    return log_decay.reshape((1,) * (3 - log_decay.dim()) + tuple(log_decay.shape))


def inputs_plan(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor], form: str,
                chunk_size: Optional[int], backend: str) -> dispatch.Plan:
    """dispatch.plan for a call on these inputs: their shapes, device and dtype, and whether autograd records
    it. log_decays: None or [S, B|1, H|1, L|1] (only whether it is None counts); orders: [S, L] or None."""
    return dispatch.plan(form, chunk_size, q.shape[-2], q.shape[-1], v.shape[-1],
                         num_scans=1 if orders is None else len(orders), decayed=log_decays is not None,
                         device=q.device, dtype=q.dtype, backend=backend,
                         training=dispatch.records_autograd(q, k, v, log_decays))


def _run(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor],
         feature_map: Optional[str], run: dispatch.Plan) -> Tensor:
    """log_decays: None or [S, B|1, H|1, L|1] in token order; orders: [S, L] or None (one scan, token order).
    The plan's chunk size is the one that runs (the caller's, or the triton backend's tile)."""
    return dispatch.implementation(run)(q, k, v, log_decays, orders, feature_map=feature_map)
