"""The LION op: Y = Scale(sum_s Q K^T * M_s) V for one scan or several, in the form and on the backend
that dispatch.plan picks, planned once per call (docs/design.md sections 1-2).

Every portable form returns the numerator (Q K^T * M) V and the normaliser rowsum(Q K^T * M) (summed
over the scans), divided once by dispatch.implementation; the triton backend divides as it combines
its kernels' outputs. q and k are features, or raw projections with the name of the feature map that
makes them features (which the triton backend applies as it reads them).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from . import dispatch
from .masks import mask_dtype
from .scalings import check_scaling


def lion_attention(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor] = None,
                   orders: Optional[Tensor] = None, *, form: str = "attention", chunk_size: Optional[int] = None,
                   backend: str = "auto", feature_map: Optional[str] = None, scaling: str = "sum",
                   plan: Optional[dispatch.Plan] = None) -> Tensor:
    """Bidirectional LION attention of S scans,  Y = sum_s (A * M_s) V / sum_s rowsum(A * M_s),  A = Q K^T.

    q, k: [B, H, L, Dk] non-negative features (or raw, with feature_map); v: [B, H, L, Dv].
    log_decays: None (all-ones mask, LION-lit) or log(lam) <= 0 as [S, ...], entry s broadcastable to
    [B, H, L] in token order (last dim 1: one decay per head, LION-d; L: one per token, LION-s), or
    [B|1, H|1, L, Dk] (vector decays, one per token and key channel: GLA, HGRN-2; ops/vector.py).
    orders: None (one scan in token order: S = 1) or [S, L] permutations (scan position -> token); each
    scan's mask is built along its order.
    form: "attention" | "rnn" | "chunk" | "auto"; chunk_size: for "chunk" on the torch backend, at most
    this many tokens per chunk (ceil(L / chunk_size) equal chunks; None: Tuning.default_chunk_size, 64).
    backend: "auto" | "torch" | "triton"; feature_map: None (q, k are features) or a FEATURE_MAPS name
    (q, k are raw and mapped by it); scaling: "sum" (the division above), "none" (no division) or "max"
    (by max(|rowsum|, 1), xLSTM's), scalings.py. plan: a dispatch.Plan to run instead of the one these inputs and
    settings give (form, chunk_size and backend are then not read): for scripts that force a route.
    Returns [B, H, L, Dv].
    """
    dispatch.check_inputs(q, k, v, log_decays, orders)
    check_scaling(scaling)
    if log_decays is None and orders is not None and scaling != "sum":  # S all-ones masks add up
        log_decays = q.new_zeros(len(orders), 1, 1, 1, dtype=mask_dtype(q.dtype))
    if log_decays is None:  # every scan's mask is all ones: the S equal terms cancel in the division
        orders = None
    elif log_decays.dim() < 4:  # as [S, B|1, H|1, L|1] (vector decays stay [S, B|1, H|1, L, Dk])
        log_decays = log_decays.reshape(log_decays.shape[:1] + (1,) * (4 - log_decays.dim()) + log_decays.shape[1:])
    run = plan or inputs_plan(q, k, v, log_decays, orders, form, chunk_size, backend)
    return dispatch.implementation(run)(q, k, v, log_decays, orders, feature_map=feature_map, scaling=scaling)


def inputs_plan(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor], form: str,
                chunk_size: Optional[int], backend: str) -> dispatch.Plan:
    """dispatch.plan for a call on these inputs: their shapes, device and dtype, and whether autograd records
    it. log_decays: None or [S, B|1, H|1, L|1] (only whether it is None counts); orders: [S, L] or None."""
    return dispatch.plan(form, chunk_size, q.shape[-2], q.shape[-1], v.shape[-1],
                         num_scans=1 if orders is None else len(orders), decayed=log_decays is not None,
                         device=q.device, dtype=q.dtype, backend=backend,
                         training=dispatch.records_autograd(q, k, v, log_decays),
                         vector=log_decays is not None and log_decays.dim() == 5)
