"""The chunk form runs one product over the whole sequence where chunks would cost more multiply-adds
(lion_vit.ops.whole_product_is_cheaper), and its chunks elsewhere: both give the paper's function.

The other op and model tests take the `chunks_always` fixture, which keeps the chunk algorithm
running at their short lengths; these tests run the chunk form as users get it.
"""
from __future__ import annotations

import pytest
import timm
import torch

import lion_vit.ops as ops
from lion_vit.ops import chunk
from lion_vit.ops import lion_attention, snake_orders, whole_product_is_cheaper
from lion_vit.testing import randomize_decays
from naive import oracle_with_grads, rel_err


@pytest.mark.parametrize("length, chunk_size, scans, decayed, whole", [
    # head width 64 (every LION model): with decays the whole product is cheaper when
    # L < S (C + 4 * 64 * 65 / 129) = S (C + 129), C = ceil(L / ceil(L / chunk_size))
    (196, 64, 1, True, False),   # 224 px, one scan: 4 chunks of 49, 196 > 178
    (190, 64, 1, True, True),    # 3 chunks of 64: 190 < 193
    (196, 64, 2, True, True),    # 224 px, two scans: 196 < 356
    (289, 64, 2, True, True),    # 272 px: 5 chunks of 58, 289 < 374
    (400, 64, 2, True, False),   # 320 px: 7 chunks of 58, 400 > 374
    (6084, 64, 2, True, False),  # 1248 px
    (196, None, 1, True, False),  # one chunk and one scan: the same product
    (196, 196, 2, True, True),   # one chunk per scan costs a whole product each
    (6084, 64, 1, False, True),  # no decays: Q (K^T V), linear in L, beats any chunking
])
def test_whole_product_is_cheaper_where_it_takes_fewer_multiply_adds(length, chunk_size, scans, decayed, whole):
    assert whole_product_is_cheaper(length, chunk_size, 64, 64, scans, decayed) is whole


@pytest.fixture
def chunk_calls(monkeypatch):
    """Counts the calls of the chunk algorithm (directly, per scan, or per row group)."""
    calls = []
    chunk_form = ops.TORCH_FORMS["chunk"]

    def counted(*args, **kwargs):
        calls.append(1)
        return chunk_form(*args, **kwargs)

    monkeypatch.setitem(ops.TORCH_FORMS, "chunk", counted)
    monkeypatch.setattr(chunk, "chunk_form", counted)  # (what the cpu backend calls per group of rows)
    return calls


def _inputs(length, dim, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(2, 2, length, dim, generator=g, dtype=torch.float64) + 0.05 for _ in range(2))
    return q, k, torch.randn(2, 2, length, dim, generator=g, dtype=torch.float64), g


# head width 4 (Dv + 1 = 5): chunks of 4 pay from L > S (4 + 80 / 9) = 12.9 S tokens
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("length, chunked", [(12, False), (40, True)])
@pytest.mark.parametrize("decay", ["lit", "fixed", "selective"])
def test_one_scan_runs_the_cheaper_product(decay, length, chunked, grad, chunk_calls):
    q, k, v, g = _inputs(length, 4, seed=0)
    lam = {"lit": None, "fixed": torch.rand(1, 2, 1, generator=g, dtype=torch.float64) * 0.5 + 0.45,
           "selective": torch.rand(2, 2, length, generator=g, dtype=torch.float64) * 0.9 + 0.05}[decay]
    log_lam = None if lam is None else torch.log(lam)
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v, log_lam) if t is not None]
    out = lion_attention(*leaves[:3], leaves[3][None] if len(leaves) > 3 else None, form="chunk", chunk_size=4)
    assert bool(chunk_calls) is (chunked and decay != "lit")  # without decays Q (K^T V) wins at any length
    _assert_matches_oracle(out, leaves, grad, g, q, k, v, lam)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("grid, chunked", [((3, 4), False), ((5, 8), True)])  # 12 < 25.8 < 40 tokens
@pytest.mark.parametrize("decay", ["fixed", "selective"])
def test_two_scans_run_the_cheaper_product(decay, grid, chunked, grad, chunk_calls):
    length = grid[0] * grid[1]
    orders = snake_orders(*grid)
    q, k, v, g = _inputs(length, 4, seed=1)
    shape = (2, 1, 2, 1) if decay == "fixed" else (2, 2, 2, length)
    lams = torch.rand(*shape, generator=g, dtype=torch.float64) * 0.9 + 0.05
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v, torch.log(lams))]
    out = lion_attention(*leaves, orders, form="chunk", chunk_size=4)
    assert bool(chunk_calls) is chunked
    _assert_matches_oracle(out, leaves, grad, g, q, k, v, lams, orders)


def _assert_matches_oracle(out, leaves, grad, generator, q, k, v, lams, orders=None):
    """The output against the float64 oracle and, with grad, the gradients of q, k, v and the log decays
    (for leaves that require them) for a random upstream gradient."""
    upstream = torch.randn(v.shape, generator=generator, dtype=torch.float64)
    expected, expected_grads = oracle_with_grads(q, k, v, lams, upstream, orders)
    assert rel_err(out, expected) < 1e-10
    if grad:
        grads = torch.autograd.grad((out * upstream).sum(), [t for t in leaves if t.requires_grad])
        for name, got, ref in zip("qkva", grads, expected_grads):
            assert rel_err(got, ref) < 1e-9, f"grad of {name}"


@pytest.mark.parametrize("name", ["lion_d_natural_tiny", "lion_s_natural_tiny"])
def test_natural_model_at_224_px_runs_its_chunk_form_as_the_attention_form(name, chunk_calls):
    """At 224 px (196 tokens) two scans of chunks of 49 would cost more than the one summed-mask product
    of the attention form: the chunk form runs that product (the same logits, to the bit); at 448 px
    (784 tokens) it runs chunks, and agrees to float rounding."""
    model = randomize_decays(timm.create_model(name, num_classes=5)).eval()
    with torch.no_grad():
        for size, chunks in ((224, 1), (448, 13)):
            x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(size))
            reference = model.set_attn_form("attention")(x)
            out = model.set_attn_form("chunk", 64)(x)
            assert model.chunks_per_sequence((size, size)) == chunks
            assert model.attn_plan((size, size)).whole is (chunks == 1)
            if chunks == 1:
                assert not chunk_calls and torch.equal(out, reference)
            else:
                assert chunk_calls and rel_err(out, reference) < 1e-5
