"""Whether the CPU tuning applies (`tuned`: on a CPU, eagerly), and the groups of (batch, head) rows it
walks; one group of every row elsewhere."""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch

from ..rows import tracing
from . import budgets


def tuned(device: torch.device) -> bool:
    """Whether the CPU's cache-sized groups and blocks apply: on a CPU, eagerly. A GPU takes whole
    tensors (every group or block would cost a chain of kernel launches; the CPU budgets are not
    measured there), and so does a compiler. The one switch between the two, so that tests can run
    a GPU's eager branches on a CPU."""
    return device.type == "cpu" and not tracing()


def group_size(count: int, item_bytes: int, budget_bytes: int, device: torch.device) -> int:
    """How many of `count` items of item_bytes each one group takes: about budget_bytes where
    tuned (at least one), else all of them."""
    return max(1, budget_bytes // item_bytes) if tuned(device) else count


def row_groups(batch: int, heads: int, row_bytes: int, device: torch.device,
               budget_bytes: Optional[int] = None) -> Iterator[Tuple[slice, slice]]:
    """(batch slice, head slice) pairs covering [B, H] in groups of about budget_bytes on a CPU, for
    rows of row_bytes each; one group of all rows on a GPU."""
    if tracing():  # one group: a traced graph must not depend on the batch size it was traced with
        yield slice(None), slice(None)
        return
    budget = budgets.INFERENCE_GROUP_BYTES if budget_bytes is None else budget_bytes
    rows_per_group = group_size(batch * heads, row_bytes, budget, device)
    if rows_per_group >= heads:
        per_group = rows_per_group // heads
        for b in range(0, batch, per_group):
            yield slice(b, b + per_group), slice(None)
        return
    for b in range(batch):
        for h in range(0, heads, rows_per_group):
            yield slice(b, b + 1), slice(h, h + rows_per_group)
