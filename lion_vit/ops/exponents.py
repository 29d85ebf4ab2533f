"""exp of the mask's exponents (each <= 0): the one place masks are exponentiated, shared by the
portable builders (lion_vit.ops.masks) and the CPU's row blocks (lion_vit.ops.cpu.masks)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .rows import tracing

# Just above the log of float32's smallest normal number (-87.34): exp() below it gives a denormal
# or 0, which a CPU's vectorised exp computes on a slow path, 5-14x slower than the normal range
# (and so it does right at the boundary: hence a margin).
_FLOAT32_EXP_FLOOR = -87.0


def exp_nonpositive(exponent: Tensor) -> Tensor:
    """exp of a mask exponent (<= 0). In float32 on a CPU the exponent is first raised to at least
    -87, so no entry takes exp's slow underflow path: entries below exp(-87) = 1.6e-38 (next to the
    diagonal's 1, nothing a float32 sum can see) become 1.6e-38. In place when autograd does not
    need the exponent."""
    if exponent.dtype == torch.float32 and exponent.device.type == "cpu":
        exponent = exponent.clamp_min(_FLOAT32_EXP_FLOOR) if exponent.requires_grad else \
            exponent.clamp_min_(_FLOAT32_EXP_FLOOR)
    return exponent.exp() if exponent.requires_grad else exponent.exp_()


def exact_exponent_exp(before: Tensor, at: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """The mask [n, l, l] among l tokens of one scan (in any order, e.g. token order) from their
    exclusive (`before`, c_{i-1}) and inclusive (`at`, c_i) log-decay sums along the scan, [n, l].

    Below the diagonal the exponent is c_{i-1} - c_{j-1} <= 0, above it c_j - c_i <= 0; the other
    expression is >= 0 on each side (the sums are monotone), so their minimum is the exponent
    everywhere, with no position test.
    """
    upper = at[:, None, :] - at[:, :, None]
    if tracing():
        return exp_nonpositive(torch.minimum(before[:, :, None] - before[:, None, :], upper))
    lower = torch.sub(before[:, :, None], before[:, None, :], out=out)
    return exp_nonpositive(torch.minimum(lower, upper, out=lower))
