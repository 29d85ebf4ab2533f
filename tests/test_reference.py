"""lion_vit.ops.reference (the oracle of the fast paths, in the package) against tests/naive.py, which
multiplies the decays directly instead of exponentiating differences of log-space sums."""
from __future__ import annotations

import pytest
import torch

from lion_vit.ops import snake_orders
from lion_vit.ops.reference import lion_reference, lion_reference_multiscan
from naive import naive_lion, naive_multiscan, rel_err
from test_ops import DECAYS, make_inputs


@pytest.mark.parametrize("length", [1, 13, 70])
@pytest.mark.parametrize("decay", DECAYS + ["selective_shared", "fixed_per_batch"])
def test_reference_is_the_naive_formula(decay, length):
    q, k, v, lam = make_inputs(2, 3, length, 8, decay, torch.float64)
    expected = naive_lion(q, k, v, lam)
    out = lion_reference(q, k, v, None if lam is None else torch.log(lam))
    assert out.dtype == torch.float64 and rel_err(out, expected) < 1e-12


def test_reference_is_the_naive_formula_in_float32_inputs():
    q, k, v, lam = make_inputs(2, 2, 20, 8, "selective", torch.float32)
    log_decay = torch.log(lam).float()
    out = lion_reference(q, k, v, log_decay)
    assert out.dtype == torch.float64 and rel_err(out, naive_lion(q, k, v, torch.exp(log_decay.double()))) < 1e-12


@pytest.mark.parametrize("decay", ["fixed", "selective", "near0", "near1"])
def test_reference_multiscan_is_the_naive_formula(decay):
    orders = snake_orders(3, 4, num_prefix_tokens=1)
    q, k, v, lam = make_inputs(2, 2, 13, 8, decay, torch.float64)
    lams = torch.stack([lam, lam.flip(-1) if lam.shape[-1] > 1 else lam ** 0.5])
    out = lion_reference_multiscan(q, k, v, torch.log(lams), orders)
    assert rel_err(out, naive_multiscan(q, k, v, lams, orders)) < 1e-12


def test_reference_gradients_are_the_naive_ones():
    q, k, v, lam = make_inputs(1, 2, 11, 4, "selective", torch.float64)
    upstream = torch.randn(v.shape, dtype=torch.float64)
    grads = []
    for fn, decay in ((lion_reference, torch.log(lam)), (naive_lion, lam)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, decay)]
        grads.append(torch.autograd.grad((fn(*leaves) * upstream).sum(), leaves))
    (ref_q, ref_k, ref_v, ref_a), (nq, nk, nv, nlam) = grads
    for got, want in ((ref_q, nq), (ref_k, nk), (ref_v, nv), (ref_a, nlam * lam)):
        assert rel_err(got, want) < 1e-12
