"""Scale(): how a LION output's numerator is divided by its normaliser (the paper's Table 1).

    sum   Y = (A * M) V / rowsum(A * M)           LION (every model of the paper's Table 2)
    none  Y = (A * M) V                           RetNet, Mamba-2, GLA as Table 1 writes them
    max   Y = (A * M) V / max(|rowsum(A * M)|, 1)  xLSTM's normaliser

Only "sum" is invariant to a positive factor on q, so only it takes query_scale (features.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

SCALINGS = ("sum", "none", "max")


def check_scaling(scaling: str) -> None:
    """Raise ValueError for an unknown scaling."""
    if scaling not in SCALINGS:
        raise ValueError(f"unknown scaling {scaling!r}; choose one of {list(SCALINGS)}")


def scaled(numerator: Tensor, normaliser: Optional[Tensor], scaling: str) -> Tensor:
    """Y from a form's numerator [..., L, Dv] and normaliser [..., L, 1] (None: scaling "none" reads none)."""
    if scaling == "none":
        return numerator
    if scaling == "max":
        return numerator / normaliser.abs().clamp_min(1.0)
    return numerator / normaliser


def with_ones(v: Tensor, normalised: bool = True) -> Tensor:
    """[v, 1]: the normaliser rides along as one more value column (not normalised: v as it is)."""
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1) if normalised else v
