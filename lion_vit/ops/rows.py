"""Helpers of every form: whether a compiler or torch.fx is tracing, a group's rows of a [B, H, ...]
tensor (the rows of a LION layer are independent), whether autograd records."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

def tracing() -> bool:
    """Whether torch.compile or torch.export is tracing this code. Their graphs are planned and fused
    by the compiler and may run with autograd on even when traced without it, so the eager paths'
    writes into preallocated buffers (`out=`), value-dependent Python (block bounds read from a
    tensor) and loops over cache-sized groups of the batch (which would tie the graph to the traced
    batch size) give way to plain tensor ops there."""
    return torch.compiler.is_compiling()


def exporting() -> bool:
    """Whether torch.export is tracing this code: its program is made of torch ops, which the GPU
    kernels (opaque to its tracer) are not."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)  # (torch >= 2.5)
    return bool(is_exporting and is_exporting())


def fx_tracing() -> bool:
    """Whether torch.fx symbolic tracing is running this code: shapes and dtypes are then symbols, so
    Python branches on them and autograd Functions give way to plain tensor ops or leaf functions."""
    fx = torch.fx._symbolic_trace
    return getattr(fx, "is_fx_symbolic_tracing", fx.is_fx_tracing)()  # (the latter: torch < 2.6, export too)


def take_rows(t: Tensor, rows: Tuple[slice, slice]) -> Tensor:
    """A group's rows of a tensor broadcastable to [B, H, ...] (broadcast dimensions kept whole)."""
    return t[rows[0] if t.shape[0] > 1 else slice(None), rows[1] if t.shape[1] > 1 else slice(None)]


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd will record an op on these tensors."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

