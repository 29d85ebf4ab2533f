"""Inference in groups of (batch, head) rows: the rows of a LION layer are independent, so without
autograd they can run a cache-sized group at a time and keep temporaries a group's size."""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor

# On a CPU, without autograd, the chunk form (and each scan of a multi-scan one) runs a group of
# (batch, head) rows at a time, each group about this many bytes of [L, Dv+1] values, so that its
# temporaries (scan-ordered inputs, values with the ones column, chunk scores, per-chunk states,
# updates) are a group's size, not the whole batch's: at 1248 px, batch 1, they would otherwise
# lift the model's peak memory above that of its MLP.
INFERENCE_GROUP_BYTES = 2 << 20


def tracing() -> bool:
    """Whether torch.compile or torch.export is tracing this code. Their graphs are planned and fused
    by the compiler and may run with autograd on even when traced without it, so the eager paths'
    writes into preallocated buffers (`out=`), value-dependent Python (block bounds read from a
    tensor) and loops over cache-sized groups of the batch (which would tie the graph to the traced
    batch size) give way to plain tensor ops there."""
    return torch.compiler.is_compiling()


def fx_tracing() -> bool:
    """Whether torch.fx symbolic tracing is running this code: shapes and dtypes are then symbols, so
    Python branches on them and autograd Functions give way to plain tensor ops or leaf functions."""
    fx = torch.fx._symbolic_trace
    return getattr(fx, "is_fx_symbolic_tracing", fx.is_fx_tracing)()  # (the latter: torch < 2.6, export too)


def cpu_tuned(device: torch.device) -> bool:
    """Whether the CPU's cache-sized groups and blocks apply: on a CPU, eagerly. A GPU takes whole
    tensors (every group or block would cost a chain of kernel launches; the CPU budgets are not
    measured there), and so does a compiler. The one switch between the two, so that tests can run
    a GPU's eager branches on a CPU."""
    return device.type == "cpu" and not tracing()


def group_size(count: int, item_bytes: int, budget_bytes: int, device: torch.device) -> int:
    """How many of `count` items of item_bytes each one group takes: about budget_bytes where
    cpu_tuned (at least one), else all of them."""
    return max(1, budget_bytes // item_bytes) if cpu_tuned(device) else count


def row_groups(batch: int, heads: int, row_bytes: int, device: torch.device,
               budget_bytes: int = INFERENCE_GROUP_BYTES) -> Iterator[Tuple[slice, slice]]:
    """(batch slice, head slice) pairs covering [B, H] in groups of about budget_bytes on a CPU, for
    rows of row_bytes each; one group of all rows on a GPU."""
    if tracing():  # one group: a traced graph must not depend on the batch size it was traced with
        yield slice(None), slice(None)
        return
    rows_per_group = group_size(batch * heads, row_bytes, budget_bytes, device)
    if rows_per_group >= heads:
        per_group = rows_per_group // heads
        for b in range(0, batch, per_group):
            yield slice(b, b + per_group), slice(None)
        return
    for b in range(batch):
        for h in range(0, heads, rows_per_group):
            yield slice(b, b + 1), slice(h, h + rows_per_group)


def take_rows(t: Tensor, rows: Tuple[slice, slice]) -> Tensor:
    """A group's rows of a tensor broadcastable to [B, H, ...] (broadcast dimensions kept whole)."""
    return t[rows[0] if t.shape[0] > 1 else slice(None), rows[1] if t.shape[1] > 1 else slice(None)]


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd will record an op on these tensors."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

