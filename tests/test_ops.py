"""Every form of the op against the plain float64 oracle in tests/naive.py."""
from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from lion_vit.ops import FEATURE_MAPS, POSITIVE_FEATURE_MAPS, check_form, column_snake, get_feature_map, lion_attention, row_snake, snake_orders
from lion_vit.ops.features import query_scale
from lion_vit.ops.reference import lion_attention_reference
from naive import AtenCalls, naive_lion, naive_mask, naive_multiscan, oracle_with_grads, rel_err

# the chunk form runs its chunks even where one product over these short sequences would cost less, and
# without autograd (the CPU backend) one row per group
pytestmark = pytest.mark.usefixtures("chunks_always", "one_row_groups")

FORMS = [("attention", None), ("rnn", None), ("chunk", 1), ("chunk", 7), ("chunk", 64), ("chunk", "L")]
DECAYS = ["lit", "fixed", "selective", "near0", "near1", "underflow"]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def make_inputs(batch, heads, length, dim, decay, dtype, seed=0):
    """Positive features, random values and log decays of the requested kind."""
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(batch, heads, length, dim, generator=g, dtype=torch.float64) + 0.05
    k = torch.rand(batch, heads, length, dim, generator=g, dtype=torch.float64) + 0.05
    v = torch.randn(batch, heads, length, dim, generator=g, dtype=torch.float64)
    lam = {
        "lit": None,
        "fixed": torch.rand(1, heads, 1, generator=g, dtype=torch.float64) * 0.5 + 0.45,
        "selective": torch.rand(batch, heads, length, generator=g, dtype=torch.float64) * 0.98 + 0.01,
        "near0": torch.full((batch, heads, length), 1e-3, dtype=torch.float64),
        "near1": torch.full((batch, heads, length), 1 - 1e-6, dtype=torch.float64),
        # every product of 6 or more decays is 0 in float64 (of 2 or more, exp(-276), in float32)
        "underflow": torch.rand(batch, heads, length, generator=g, dtype=torch.float64) * 1e-60 + 1e-61,
        # decays broadcast over the batch (selective) or given per sample (fixed)
        "selective_shared": torch.rand(1, heads, length, generator=g, dtype=torch.float64) * 0.98 + 0.01,
        "fixed_per_batch": torch.rand(batch, heads, 1, generator=g, dtype=torch.float64) * 0.5 + 0.45,
    }[decay]
    return q.to(dtype), k.to(dtype), v.to(dtype), lam


def _form_id(f):
    return f"{f[0]}" if f[1] is None else f"{f[0]}{f[1]}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("length", [1, 13, 196])
@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_forms_match_naive(form, decay, length, dtype):
    name, chunk = form
    chunk = length if chunk == "L" else chunk
    q, k, v, lam = make_inputs(2, 2, length, 8, decay, dtype)
    log_decays = None if lam is None else torch.log(lam).to(dtype)[None]  # one scan
    out = lion_attention(q, k, v, log_decays, form=name, chunk_size=chunk)
    assert out.shape == v.shape and out.dtype == dtype
    assert rel_err(out, naive_lion(q, k, v, lam)) < TOL[dtype]


@pytest.mark.parametrize("length", [1, 13, 37])
@pytest.mark.parametrize("decay", DECAYS + ["selective_shared", "fixed_per_batch"])
@pytest.mark.parametrize("form", [("attention", None), ("rnn", None), ("chunk", 1), ("chunk", 5)], ids=_form_id)
def test_gradients_match_naive(form, decay, length):
    q, k, v, lam = make_inputs(2, 2, length, 6, decay, torch.float64, seed=1)
    upstream = torch.randn(v.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    _, ref_grads = oracle_with_grads(q, k, v, lam, upstream)

    fast = [t.clone().requires_grad_() for t in (q, k, v)]
    log_leaf = None if lam is None else torch.log(lam).clone().requires_grad_()
    out = lion_attention(*fast, None if log_leaf is None else log_leaf[None], form=form[0], chunk_size=form[1])
    fast_leaves = fast + ([log_leaf] if log_leaf is not None else [])
    # allow_unused: at L = 1 no decay is ever crossed, and the rnn form never touches it
    grads = torch.autograd.grad((out * upstream).sum(), fast_leaves, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, fast_leaves)]
    for name, g, r in zip("qkva", grads, ref_grads):
        assert rel_err(g, r) < 1e-9, f"grad of {name}"


@pytest.mark.parametrize("form", [("attention", None), ("rnn", None), ("chunk", 64), ("chunk", 100)], ids=_form_id)
@pytest.mark.parametrize("decay", ["near0", "near1", "moderate"])
def test_long_sequence_fp32(form, decay):
    """6,084 tokens (a 78 x 78 grid, 1248 px at patch 16): finite and exact in float32."""
    (q, k, v, lam), expected = _long_sequence(decay)
    out = lion_attention(q.float(), k.float(), v.float(), torch.log(lam).float()[None], form=form[0], chunk_size=form[1])
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < 1e-4


@functools.lru_cache(maxsize=None)
def _long_sequence(decay: str):
    """The inputs of 6,084 tokens and their float64 oracle, computed once per decay (an L x L mask)."""
    length = 6084
    g = torch.Generator().manual_seed(3)
    q = torch.rand(1, 1, length, 4, generator=g, dtype=torch.float64) + 0.05
    k = torch.rand(1, 1, length, 4, generator=g, dtype=torch.float64) + 0.05
    v = torch.randn(1, 1, length, 4, generator=g, dtype=torch.float64)
    lam = {"near0": torch.full((1, 1, length), 1e-3, dtype=torch.float64),
           "near1": torch.full((1, 1, length), 1 - 1e-6, dtype=torch.float64),
           "moderate": torch.rand(1, 1, length, generator=g, dtype=torch.float64) * 0.6 + 0.2}[decay]
    return (q, k, v, lam), naive_lion(q, k, v, lam)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("decay", ["fixed", "selective"])
@pytest.mark.parametrize("form", [("attention", None), ("rnn", None), ("chunk", 4), ("chunk", None), ("chunk", 16)],
                         ids=_form_id)
def test_multiscan_matches_naive(form, decay, dtype):
    height, width, prefix = 3, 5, 1
    length = height * width + prefix
    orders = snake_orders(height, width, prefix)
    q, k, v, _ = make_inputs(2, 2, length, 6, "lit", dtype, seed=4)
    g = torch.Generator().manual_seed(5)
    if decay == "fixed":
        lams = torch.rand(2, 1, 2, 1, generator=g, dtype=torch.float64) * 0.5 + 0.4
    else:
        lams = torch.rand(2, 2, 2, length, generator=g, dtype=torch.float64) * 0.9 + 0.05
    out = lion_attention(q, k, v, torch.log(lams).to(dtype), orders, form=form[0], chunk_size=form[1])
    assert rel_err(out, naive_multiscan(q, k, v, lams, orders)) < TOL[dtype]


@pytest.mark.parametrize("scale", ["moderate", "near0_and_near1", "underflow"])
@pytest.mark.parametrize("decay", ["fixed", "selective"])
@pytest.mark.parametrize("form", [("attention", None), ("chunk", 4), ("chunk", None)], ids=_form_id)
def test_multiscan_gradients_match_naive(form, decay, scale):
    """The hand-written backwards (masked attention, selective mask in scan order) against autograd
    through the float64 oracle; also with one scan's decays near 0 and the other's near 1 (each
    scan's share of the summed mask near 0 or 1), and with decays so small that both scans' mask
    entries underflow to 0 away from the diagonal."""
    height, width, prefix = 3, 4, 1
    length = height * width + prefix
    orders = snake_orders(height, width, prefix)
    q, k, v, _ = make_inputs(2, 2, length, 5, "lit", torch.float64, seed=6)
    g = torch.Generator().manual_seed(7)
    shape = (2, 1, 2, 1) if decay == "fixed" else (2, 2, 2, length)
    lams = torch.rand(*shape, generator=g, dtype=torch.float64) * 0.9 + 0.05
    if scale == "near0_and_near1":
        lams = torch.stack([lams[0] * 1e-3, 1 - lams[1] * 1e-6])
    elif scale == "underflow":  # 1e-60^6 = 1e-360 is 0 in float64
        lams = lams * 1e-60
    assert_multiscan_gradients_match_naive(q, k, v, lams, orders, g, form=form[0], chunk_size=form[1])


def assert_multiscan_gradients_match_naive(q, k, v, lams, orders, generator, **form):
    """Gradients of q, k, v and the log decays from lion_attention of several scans against autograd through
    the float64 oracle, for a random upstream gradient."""
    upstream = torch.randn(v.shape, dtype=torch.float64, generator=generator)
    _, ref_grads = oracle_with_grads(q, k, v, lams, upstream, orders)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, torch.log(lams))]
    grads = torch.autograd.grad((lion_attention(*leaves, orders, **form) * upstream).sum(), leaves)
    for name, got, ref in zip("qkva", grads, ref_grads):
        assert rel_err(got, ref) < 1e-9, f"grad of {name}"


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("form", [("attention", None), ("rnn", None), ("chunk", 4), ("chunk", None)], ids=_form_id)
def test_multiscan_without_decays_matches_naive(form, grad):
    """No decays: every scan's mask is all ones, so a multi-scan layer is plain bidirectional linear
    attention (the full form and a whole-sequence chunk take the exact Q (K^T V) path)."""
    orders = snake_orders(3, 4, 1)
    q, k, v, _ = make_inputs(2, 2, 13, 5, "lit", torch.float64, seed=19)
    with torch.set_grad_enabled(grad):
        out = lion_attention(*(t.clone().requires_grad_(grad) for t in (q, k, v)), None, orders,
                                       form=form[0], chunk_size=form[1])
    assert rel_err(out, naive_multiscan(q, k, v, torch.ones(2, 1, 1, 1, dtype=torch.float64), orders)) < 1e-10


@pytest.mark.parametrize("form", [("attention", None), ("rnn", None), ("chunk", 4), ("auto", None)], ids=_form_id)
def test_three_scans_match_naive(form):
    """Any number of scans, not only the natural models' two: the snakes and a random order, outputs and
    gradients (form auto reads the thresholds of two scans)."""
    orders = torch.cat([snake_orders(3, 4, 1), torch.randperm(13, generator=torch.Generator().manual_seed(20))[None]])
    q, k, v, _ = make_inputs(2, 2, 13, 5, "lit", torch.float64, seed=21)
    g = torch.Generator().manual_seed(22)
    lams = torch.rand(3, 2, 2, 13, generator=g, dtype=torch.float64) * 0.9 + 0.05
    with torch.no_grad():
        out = lion_attention(q, k, v, torch.log(lams), orders, form=form[0], chunk_size=form[1])
    assert rel_err(out, naive_multiscan(q, k, v, lams, orders)) < 1e-10
    assert_multiscan_gradients_match_naive(q, k, v, lams, orders, g, form=form[0], chunk_size=form[1])


@pytest.mark.parametrize("decay", ["fixed", "selective"])
def test_one_scan_in_a_permuted_order_gradients(decay):
    """A multi-scan call with a single scan along a permuted order (the full form keeps no ratios
    then): its decay gradient still follows that order."""
    length = 11
    orders = torch.randperm(length, generator=torch.Generator().manual_seed(16))[None]
    q, k, v, _ = make_inputs(2, 2, length, 5, "lit", torch.float64, seed=17)
    g = torch.Generator().manual_seed(18)
    shape = (1, 1, 2, 1) if decay == "fixed" else (1, 2, 2, length)
    lams = torch.rand(*shape, generator=g, dtype=torch.float64) * 0.9 + 0.05
    assert_multiscan_gradients_match_naive(q, k, v, lams, orders, g)


def test_snake_orders():
    assert row_snake(2, 3).tolist() == [0, 1, 2, 5, 4, 3]
    assert column_snake(2, 3).tolist() == [0, 3, 4, 1, 2, 5]
    assert snake_orders(2, 3, 1).tolist() == [[0, 1, 2, 3, 6, 5, 4], [0, 1, 4, 5, 2, 3, 6]]
    for height, width in [(1, 1), (4, 7), (7, 4), (14, 14)]:
        for order in (row_snake(height, width), column_snake(height, width)):
            assert sorted(order.tolist()) == list(range(height * width))
            rows, cols = order // width, order % width
            # consecutive scan positions are grid neighbours: a snake never jumps
            assert ((rows.diff().abs() + cols.diff().abs()) == 1).all()


def test_autocast_bf16_close_to_fp32():
    q, k, v, lam = make_inputs(2, 2, 50, 16, "selective", torch.float32)
    ref = lion_attention(q, k, v, torch.log(lam).float()[None])
    for form, chunk in FORMS[:3]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = lion_attention(q, k, v, torch.log(lam).float()[None], form=form, chunk_size=chunk)
        assert torch.isfinite(out).all() and rel_err(out, ref) < 3e-2


def float16_overflowing_inputs(length: int):
    """q, k, v [1, 1, L, 16] whose normaliser without a decay passes float16's 65,504 (asserted): large
    positive queries, unit keys."""
    generator = torch.Generator().manual_seed(0)
    q = torch.rand(1, 1, length, 16, generator=generator) * 16 + 8
    k = torch.nn.functional.normalize(torch.rand(1, 1, length, 16, generator=generator) + 0.2, dim=-1)
    v = torch.randn(1, 1, length, 16, generator=generator) + 2
    assert float((q * k.sum(2, keepdim=True)).sum(-1).max()) > torch.finfo(torch.float16).max
    return q, k, v


@pytest.mark.parametrize("decay", [None, -1e-5])
def test_float16_autocast_of_long_sequences_stays_finite(decay):
    """Under float16 autocast the forms' sums come out in float16; without a decay (or with one near 1) the
    normaliser grows like L, here past 65,504 (asserted). The power-of-two scale on q keeps every form's
    numerator and normaliser finite, and the output as close as float16 allows (docs/design.md, "float16")."""
    q, k, v = float16_overflowing_inputs(1024)
    log_decay = None if decay is None else torch.full((1, 1, 1, 1), decay)  # one scan, one decay
    reference = naive_lion(q, k, v, None if decay is None else torch.full((1, 1, 1), math.exp(decay)))
    for form, chunk in [("attention", None), ("rnn", None), ("chunk", 64)]:
        with torch.autocast("cpu", dtype=torch.float16):
            out = lion_attention(q, k, v, log_decay, form=form, chunk_size=chunk)
        assert torch.isfinite(out).all() and rel_err(out, reference) < 3e-3, form


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decay", ["lit", "fixed", "vector"])
@pytest.mark.parametrize("form, chunk", [("rnn", None), ("chunk", 2)])
def test_forms_that_carry_states_in_16_bits_are_as_close_as_the_attention_form(dtype, decay, form, chunk):
    """The rnn form sums hundreds of steps into its states, the chunk form in chunks of 2 carries them past
    hundreds of chunks (more than chunk.MATMUL_CARRY_MAX_CHUNKS: a loop): both in the masks' precision for 16-bit
    inputs (docs/design.md, "Numerics"), so at 785 tokens with decays near 1 (one per head; per token and key
    channel: the vector decays' form) their outputs are as close to the float64 reference as the attention form's
    (states rounded to bfloat16 at every step were off by half of it)."""
    q, k, v, _ = make_inputs(1, 2, 785, 16, "lit", dtype)
    near_one = 1 - 1e-3 * torch.rand(1, 1, 2, 785, 16, generator=torch.Generator().manual_seed(0))
    log_decays = {"lit": None, "fixed": torch.full((1, 1, 1, 1), math.log(0.999)),  # [S, ...]: one scan
                  "vector": near_one.log()}[decay]
    reference = lion_attention_reference(q, k, v, log_decays)
    error = rel_err(lion_attention(q, k, v, log_decays, form=form, chunk_size=chunk), reference)
    assert error <= 2 * rel_err(lion_attention(q, k, v, log_decays), reference)


@pytest.mark.parametrize("form,chunk", [("softmax", None), ("chunk", 0), ("chunk", -3), ("chunk", 2.5)])
def test_bad_form_or_chunk_raises(form, chunk):
    with pytest.raises(ValueError, match="attn_form|chunk_size"):
        check_form(form, chunk)
    q = torch.rand(1, 1, 4, 2)
    with pytest.raises(ValueError):
        lion_attention(q, q, q, form=form, chunk_size=chunk)


@pytest.mark.parametrize("form", ["attention", "rnn", "chunk"])
def test_bad_shapes_and_decays_above_one_raise(form):
    """One clear line instead of an error deep inside a form, or a wrong answer: per-token decays
    above 1 break the log-space masks of the full and chunk forms (they used to return a result)."""
    q, k, v, lam = make_inputs(1, 2, 10, 4, "selective", torch.float64)
    log_lam = torch.log(lam)
    cases = [
        ((q, k[:, :, :9], v, None), r"expected q, k \[B, H, L, Dk\] and v .* got q \(1, 2, 10, 4\), k \(1, 2, 9, 4\)"),
        ((q[0], k[0], v[0], None), r"expected q, k \[B, H, L, Dk\]"),
        ((q, k, v, log_lam[None, ..., :7]), r"must broadcast to \[B, H, L\] = \[1, 2, 10\] .* got \[1, 2, 7\]"),
        ((q, k, v, log_lam[None, :, :1].expand(1, 1, 3, 10)), r"got \[1, 3, 10\]"),
        ((q, k, v, log_lam[None, None]), r"vector log decays must be \[S, B\|1, H\|1, L, Dk\] .* got \[1, 1, 1, 2, 10\]"),
        ((q, k, v, log_lam[None] + 0.5), r"log decays must be <= 0 \(decays in \(0, 1\]\), got up to 0\.\d+"),
        # one scan's decays without the scan axis, as [B, H, L] with B = 2: one line saying what to pass
        ((q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), log_lam.expand(2, -1, -1)),
         r"S = 1 \(one scan: no orders\); got 2 scans .* for one scan pass log_decay\[None\]"),
        ((q, k, v, log_lam[0, 0, 0]), r"got a scalar"),
        ((q, k.float(), v, None), r"q, k and v of one floating dtype; got torch.float64, torch.float32, torch.float64"),
        ((q.long(), k.long(), v.long(), None), r"of one floating dtype; got torch.int64"),
        ((q[:, :, :0], k[:, :, :0], v[:, :, :0], None), r"at least one token; got q \(1, 2, 0, 4\) \(L = 0\)"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            lion_attention(*args, form=form, chunk_size=3)
    # one scan's [L], [B, H, 1], [] (lam = 1, LION-lit), [B, 1, L] and [B, H, L, Dk]
    for ok in (log_lam[0, :1], log_lam[None, :, :, :1], torch.zeros(1), log_lam[None, :, :1],
               log_lam[None, ..., None].expand(1, 1, 2, 10, 4)):  # (the last: vector decays, [B, H, L, Dk])
        assert lion_attention(q, k, v, ok, form=form, chunk_size=3).shape == v.shape
    orders = snake_orders(3, 3, 1)
    with pytest.raises(ValueError, match=r"S = 2 \(the orders given\); got 3 scans"):
        lion_attention(q, k, v, torch.stack([log_lam] * 3), orders, form=form, chunk_size=3)
    with pytest.raises(ValueError, match=r"orders must be integer \[S, L\] with L = 9 \(q's tokens\); got torch.int64 "
                                         r"\[2, 10\]"):
        lion_attention(q[:, :, :9], k[:, :, :9], v[:, :, :9], None, orders, form=form, chunk_size=3)
    with pytest.raises(ValueError, match=r"got torch.float32 \[2, 10\]"):
        lion_attention(q, k, v, torch.stack([log_lam] * 2), orders.float(), form=form, chunk_size=3)
    repeated = orders.clone()
    repeated[1, 4] = repeated[1, 5]
    with pytest.raises(ValueError, match=r"^orders must be permutations: each scan's row \[L\] holds every token "
                                         r"0..9 once"):
        lion_attention(q, k, v, torch.stack([log_lam] * 2), repeated, form=form, chunk_size=3)
    with pytest.raises(ValueError, match="must be <= 0"):
        lion_attention(q, k, v, torch.stack([log_lam, -log_lam]), orders, form=form, chunk_size=3)


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
def test_feature_map_gradients(name):
    """The feature maps (one has a hand-written backward) against finite differences."""
    x = torch.randn(2, 3, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(8), requires_grad=True)
    for feature_map in get_feature_map(name):
        assert torch.autograd.gradcheck(feature_map, (x,))
        assert (feature_map(x.detach()) > 0).all() or name not in POSITIVE_FEATURE_MAPS


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("decay", ["lit", "fixed", "selective", "near0", "underflow"])
def test_every_form_one_and_two_scans(decay, dtype):
    """Outputs of every form (inference) and gradients of the attention and chunk forms, for one scan
    and for two snake scans, against the float64 oracle: the same code on every device."""
    tol = {torch.float64: (1e-10, 1e-9), torch.float32: (2e-5, 1e-4)}[dtype]
    height, width, prefix = 3, 5, 1
    length = height * width + prefix
    orders = snake_orders(height, width, prefix)
    q, k, v, lam = make_inputs(3, 3, length, 6, decay, torch.float64, seed=22)
    upstream = torch.randn(v.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(23))
    calls = [(lam, None)]  # one scan in token order: its log decays get the scan axis
    if lam is not None:
        other_lam = make_inputs(3, 3, length, 6, decay, torch.float64, seed=24)[3]
        calls.append((torch.stack([lam, other_lam]), orders))
    for lams, scan_orders in calls:
        with_lam = lams is not None
        expected, ref_grads = oracle_with_grads(q, k, v, lams, upstream, scan_orders)
        log_lams = None if lams is None else torch.log(lams).to(dtype)
        scans = 1 if scan_orders is None else 2

        def op(q, k, v, log_lams, **form):
            if log_lams is not None and scan_orders is None:
                log_lams = log_lams[None]
            return lion_attention(q, k, v, log_lams, scan_orders, **form)
        for form, chunk in [("attention", None), ("rnn", None), ("chunk", 4), ("chunk", length)]:
            with torch.no_grad():
                out = op(q.to(dtype), k.to(dtype), v.to(dtype), log_lams, form=form, chunk_size=chunk)
            assert out.dtype == dtype and rel_err(out, expected) < tol[0], (form, chunk, scans)
            if form == "rnn":
                continue
            leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + ([log_lams.requires_grad_()] if with_lam else [])
            out = op(*leaves[:3], leaves[3] if with_lam else None, form=form, chunk_size=chunk)
            grads = torch.autograd.grad((out * upstream.to(dtype)).sum(), leaves)
            for name, got, ref in zip("qkva", grads, ref_grads):
                error = rel_err(got, ref, min_scale=1e-3 if dtype == torch.float64 else 1.0)
                assert error < tol[1], (f"grad of {name}", form, chunk, scans)


@pytest.mark.parametrize("scan", ["token_order", "row_snake", "column_snake"])
@pytest.mark.parametrize("decay", ["selective", "fixed", "near0", "near1", "underflow"])
def test_decay_mask_matches_running_products(decay, scan):
    """Every entry of the mask against the oracle's running products, in token order and, for the two
    snake scans of a 3 x 13 grid after a class token, in token order from decays given in token order."""
    from lion_vit.ops import decay_mask
    *_, lam = make_inputs(2, 3, 40, 1, decay, torch.float64, seed=15)  # in token order
    order = None if scan == "token_order" else snake_orders(3, 13, 1)[int(scan == "column_snake")]
    lam_scan = lam.expand(2, 3, 40) if order is None else lam.expand(2, 3, 40)[..., order]
    expected = naive_mask(lam_scan)
    if order is not None:
        position = torch.argsort(order)
        expected = expected[..., position, :][..., position]
    # float32: the exponents are differences of float32 cumulative sums (error ~ eps * L * |log lam|)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        mask = decay_mask(torch.log(lam).to(dtype), 40, order)
        assert mask.dtype == dtype
        # relative per entry; absolute below the dtype's smallest normal number (the same on every device)
        allowed = tol * expected + torch.finfo(dtype).tiny
        assert ((mask.double() - expected).abs() <= allowed).all()
        assert torch.equal(mask.diagonal(dim1=-2, dim2=-1), torch.ones(mask.shape[:-1], dtype=dtype))


def test_selective_mask_gradient_long_fp32():
    """Above FLOAT64_CUMSUM_ABOVE tokens the exponents are formed in float64: the float32 mask's gradient
    still matches the float64 oracle."""
    import lion_vit.ops.masks as masks
    length = masks.FLOAT64_CUMSUM_ABOVE + 88
    q, k, v, lam = make_inputs(1, 2, length, 4, "selective", torch.float64, seed=13)
    lam = lam * 0.2 + 0.79  # decays in [0.79, 0.99]: entries far from the diagonal still count
    upstream = torch.randn(v.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(14))
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, lam)]
    ref_grads = torch.autograd.grad((naive_lion(*ref_leaves) * upstream).sum(), ref_leaves)
    leaves = [t.float().requires_grad_() for t in (q, k, v, torch.log(lam))]
    grads = torch.autograd.grad((lion_attention(*leaves[:3], leaves[3][None]) * upstream.float()).sum(), leaves)
    ref_grads = list(ref_grads[:3]) + [ref_grads[3] * lam]
    for name, got, ref in zip("qkva", grads, ref_grads):
        assert rel_err(got, ref) < 1e-4, f"grad of {name}"


@pytest.mark.parametrize("decay", ["lit", "fixed", "selective", "per_batch"])
def test_chunk_form_with_broadcast_decays(decay):
    """The chunk form with decays broadcast over batch, heads or tokens and a short last chunk, one
    scan and two, against the float64 oracle."""
    q, k, v, lam = make_inputs(3, 2, 13, 6, "selective" if decay == "per_batch" else decay, torch.float64, seed=15)
    if decay == "per_batch":  # one decay per batch entry, shared by heads and tokens
        lam = lam[:, :1, :1]
    log_decay = None if lam is None else torch.log(lam)
    out = lion_attention(q, k, v, None if log_decay is None else log_decay[None], form="chunk", chunk_size=5)
    assert rel_err(out, naive_lion(q, k, v, None if lam is None else lam.expand(3, 2, 13))) < 1e-10
    if lam is None:
        return
    orders = snake_orders(3, 4, 1)
    lams = torch.stack([lam, lam.flip(-1) if lam.shape[-1] > 1 else lam.sqrt()])  # two scans, different decays
    for chunk_size in (5, None):
        out = lion_attention(q, k, v, torch.log(lams), orders, form="chunk", chunk_size=chunk_size)
        assert rel_err(out, naive_multiscan(q, k, v, lams.expand(2, 3, 2, 13), orders)) < 1e-10


TRAINING_FORMS = [("attention", None), ("rnn", None), ("chunk", 4)]


def _second_order(op, leaves, upstream, weights):
    """Gradients of sum(w * dL/dleaf) for L = sum(out * upstream): double backward through op."""
    first = torch.autograd.grad((op(*leaves) * upstream).sum(), leaves, create_graph=True)
    penalty = sum((g * w).sum() for g, w in zip(first, weights))
    return torch.autograd.grad(penalty, leaves, allow_unused=True)


@pytest.mark.parametrize("decay, scans", [("lit", 1), ("fixed", 1), ("selective", 1), ("fixed", 2), ("selective", 2)])
@pytest.mark.parametrize("form", TRAINING_FORMS, ids=_form_id)
def test_double_backward_matches_naive(form, decay, scans):
    """torch.autograd.grad(..., create_graph=True) then backward again, as gradient penalties do: the
    second-order gradients of q, k, v and the log decays equal the float64 oracle's."""
    grid = (3, 4)
    length = grid[0] * grid[1] + 1
    orders = snake_orders(*grid, 1)
    q, k, v, lam = make_inputs(2, 2, length, 4, decay, torch.float64, seed=30)
    if scans == 2:
        lam = torch.stack([lam, make_inputs(2, 2, length, 4, decay, torch.float64, seed=31)[3]])
    g = torch.Generator().manual_seed(32)
    upstream = torch.randn(v.shape, dtype=torch.float64, generator=g)
    inputs = [q, k, v] + ([] if lam is None else [torch.log(lam)])
    weights = [torch.randn(t.shape, dtype=torch.float64, generator=g) for t in inputs]

    def fast(q, k, v, log_lam=None):
        if scans == 1:
            return lion_attention(q, k, v, None if log_lam is None else log_lam[None], form=form[0], chunk_size=form[1])
        return lion_attention(q, k, v, log_lam, orders, form=form[0], chunk_size=form[1])

    def oracle(q, k, v, log_lam=None):
        lams = None if log_lam is None else torch.exp(log_lam)
        return naive_lion(q, k, v, lams) if scans == 1 else naive_multiscan(q, k, v, lams, orders)

    got = _second_order(fast, [t.clone().requires_grad_() for t in inputs], upstream, weights)
    expected = _second_order(oracle, [t.clone().requires_grad_() for t in inputs], upstream, weights)
    for name, a, b in zip("qkva", got, expected):
        a = torch.zeros_like(inputs[0]) if a is None else a
        assert rel_err(a, b) < 1e-8, f"second-order grad of {name}"


@pytest.mark.parametrize("decay", ["lit", "fixed", "selective"])
@pytest.mark.parametrize("scans", [1, 2])
def test_cpu_backend_matches_the_portable_chunk_form(scans, decay):
    """The CPU backend (the portable chunk form in groups of rows) against the portable form itself and the
    float64 oracle: outputs, gradients and second-order gradients, decays broadcast over the batch too."""
    from lion_vit.ops import dispatch
    if scans == 2 and decay == "lit":
        return
    orders = snake_orders(3, 4, 1) if scans == 2 else None
    q, k, v, lam = make_inputs(3, 2, 13, 4, decay, torch.float64, seed=34)
    log_decays = None if lam is None else torch.log(lam)[:, :1].expand(scans, -1, -1, -1)  # shared by heads
    g = torch.Generator().manual_seed(35)
    upstream, weights = torch.randn(v.shape, dtype=torch.float64, generator=g), None
    results = []
    for backend in ("cpu", "torch"):
        run = dispatch.implementation(dispatch.Plan("chunk", backend, chunks=3, chunk_size=5))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([] if lam is None else [log_decays.clone().requires_grad_()])
        out = run(*leaves[:3], leaves[3] if lam is not None else None, orders)
        first = torch.autograd.grad((out * upstream).sum(), leaves, create_graph=True)
        weights = weights or [torch.randn(t.shape, dtype=torch.float64, generator=g) for t in first]
        second = torch.autograd.grad(sum((f * w).sum() for f, w in zip(first, weights)), leaves, allow_unused=True)
        results.append([out, *first, *second])
    expected = naive_lion(q, k, v, None if lam is None else lam[:, :1]) if scans == 1 else \
        naive_multiscan(q, k, v, lam[:, :1].expand(2, 3, 1, 13), orders)
    assert rel_err(results[0][0], expected) < 1e-10
    for got, ref in zip(*results):
        assert (got is None) == (ref is None) and (got is None or rel_err(got, ref) < 1e-10)


@pytest.mark.parametrize("decay", ["lit", "fixed", "selective"])
@pytest.mark.parametrize("form", TRAINING_FORMS, ids=_form_id)
def test_backward_twice(form, decay):
    """loss.backward(retain_graph=True) twice accumulates the same gradient twice (nothing the backward
    needs is overwritten by the first one)."""
    q, k, v, lam = make_inputs(2, 2, 11, 4, decay, torch.float64, seed=33)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([] if lam is None else [torch.log(lam).requires_grad_()])
    out = lion_attention(*leaves[:3], leaves[3][None] if lam is not None else None, form=form[0], chunk_size=form[1])
    loss = out.square().sum()
    loss.backward(retain_graph=True)
    once = [t.grad.clone() for t in leaves]
    loss.backward()
    for name, leaf, first in zip("qkva", leaves, once):
        assert torch.allclose(leaf.grad, 2 * first, rtol=1e-12, atol=0), f"grad of {name}"


@pytest.mark.parametrize("carry_max", [2, 256], ids=["loop", "matmul"])
@pytest.mark.parametrize("decay", ["lit", "fixed", "selective"])
def test_chunk_tail_and_carry_paths(decay, carry_max, monkeypatch):
    """A chunk size that leaves a short last chunk, with the carried states from the [N, N] matmul
    and from the loop over chunks (used above MATMUL_CARRY_MAX_CHUNKS), forward and gradients."""
    import lion_vit.ops.chunk as chunk
    monkeypatch.setattr(chunk, "MATMUL_CARRY_MAX_CHUNKS", carry_max)
    q, k, v, lam = make_inputs(2, 2, 23, 5, decay, torch.float64, seed=11)
    upstream = torch.randn(v.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    log_leaf = None if lam is None else torch.log(lam).clone().requires_grad_()
    out = lion_attention(*leaves, None if log_leaf is None else log_leaf[None], form="chunk", chunk_size=5)  # 4 chunks of 5 and one of 3
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    lam_leaf = None if lam is None else lam.clone().requires_grad_()
    expected = naive_lion(*ref_leaves, lam_leaf)
    assert rel_err(out, expected) < 1e-10
    fast_leaves = leaves + ([log_leaf] if log_leaf is not None else [])
    grads = torch.autograd.grad((out * upstream).sum(), fast_leaves)
    ref_grads = torch.autograd.grad((expected * upstream).sum(), ref_leaves + ([lam_leaf] if lam is not None else []))
    if lam is not None:
        ref_grads = list(ref_grads[:3]) + [ref_grads[3] * lam]
    for name, got, ref in zip("qkva", grads, ref_grads):
        assert rel_err(got, ref) < 1e-9, f"grad of {name}"


@pytest.mark.parametrize("decay", ["lit", "fixed", "selective"])
def test_autocast_bf16_backward(decay):
    """The forms' backward under bf16 autocast: gradients in the inputs' dtypes, finite, and close to the
    float32 ones."""
    q, k, v, lam = make_inputs(2, 2, 50, 16, decay, torch.float32, seed=13)
    upstream = torch.randn(v.shape, generator=torch.Generator().manual_seed(14))

    def grads(autocast: bool):
        inputs = (q, k, v) if lam is None else (q, k, v, torch.log(lam).float())
        leaves = [t.clone().requires_grad_() for t in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = lion_attention(*leaves[:3], *(log_decay[None] for log_decay in leaves[3:]))
        return torch.autograd.grad((out.float() * upstream).sum(), leaves)

    for got, ref in zip(grads(True), grads(False)):
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert rel_err(got, ref) < 5e-2


@pytest.mark.parametrize("form, decay", [("attention", "fixed"), ("chunk", "fixed"), ("attention", "selective")])
def test_autocast_keeps_the_masked_products_in_its_dtype(form, decay):
    """Under bf16 autocast the L x L products a mask multiplies stay bf16, forward and backward
    (masks.masked_scores). Counted by the traffic proxy (scripts/benchmark_traffic.py, torch backend) on a
    training step of 8 images of 97 tokens, where one float32 L x L pass per image is 4 (q+k+v). A per-head
    decay's mask is float32 once for the batch: float32 stays a tenth of the forward's bytes (the mask, the
    input's cast back) and the backward's float32 within 3 (q+k+v) (the mask's gradient, the input's and
    weights'). A per-token decay's mask is float32 per image; its backward writes fewer than five float32
    L x L passes (the exponential's, the where's two, the cast's), no negated copies of its gradient."""
    import runpy
    measure = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "benchmark_traffic.py"))
    tokens, heads, head_dim = 97, 2, 16
    result = measure["measure_traffic"](form, tokens=tokens, heads=heads, head_dim=head_dim, dtype=torch.bfloat16,
                                        decay=decay, batch=8, backend="torch", autocast=True)
    # the counting itself: qkv and proj in bf16 (and a per-token decay's projection, H values per token)
    assert result["by operator"]["addmm"] == pytest.approx(4 / 3 + (decay == "selective") / (3 * head_dim))
    if decay == "fixed":
        assert result["float32 share"] < 0.15 and result["float32 backward"] < 3, result
    else:
        square = tokens * heads * 4 / (3 * heads * head_dim * 2)  # one float32 L x L pass, per q+k+v in bf16
        assert result["float32 backward"] < 5 * square, result


@pytest.mark.parametrize("decay, scans", [("fixed", 1), ("selective", 2)])
def test_attention_form_multiplies_v_as_it_is(decay, scans):
    """The attention form's normaliser is its weights' row sums: no matrix product of a training call, forward
    or backward, has an operand of Dv + 1 columns or rows (a column of ones on V; GPU matmuls want widths
    that are multiples of 8, as Dv is, docs/design.md section 1)."""
    length, dim = 13, 8
    q, k, v, lam = make_inputs(2, 2, length, dim, decay, torch.float32)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    log_decay = torch.log(lam)
    with AtenCalls() as calls:
        if scans == 1:
            out = lion_attention(q, k, v, log_decay[None])
        else:
            out = lion_attention(q, k, v, torch.stack([log_decay, log_decay.flip(-1)]), snake_orders(3, 4, 1))
        torch.autograd.grad(out.square().sum(), leaves)
    widths = {size for name in ("bmm", "mm", "baddbmm") for call in calls.shapes.get(name, [])
              for shape in call for size in shape[-2:]}
    assert widths and {length, dim} >= widths, calls.shapes


@pytest.mark.parametrize("batch, copies", [(2, 3), (1, 1)])
def test_lit_attention_form_copies_each_input_once(batch, copies):
    """LION-lit's Q (K^T V) and Q (K^T 1) on q, k, v as a layer hands them over (views of one projection
    [B, L, 3, H, D]): the op copies each at most once head-major, v for its matmuls and q and k where their
    batch dimensions do not fold (q was copied by each of its two products); at batch 1 they fold, and only v
    is copied. The same bits as the two products on the views."""
    heads, length, dim = 2, 13, 8
    projection = torch.rand(batch, length, 3, heads, dim, generator=torch.Generator().manual_seed(0))
    q, k, v = projection.permute(2, 0, 3, 1, 4).unbind(0)
    with AtenCalls() as calls:
        out = lion_attention(q, k, v, feature_map="silu_norm")
    copied = sum(math.prod(call[0]) for call in calls.shapes.get("clone", []))  # (contiguous() dispatches clone)
    assert copied == copies * q.numel(), calls.shapes.get("clone")
    features_q, features_k = (f(x) for f, x in zip(get_feature_map("silu_norm"), (q, k)))
    features_q = features_q * query_scale(length)
    expected = features_q @ (features_k.transpose(-1, -2) @ v) / (features_q @ features_k.sum(-2).unsqueeze(-1))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("decay", ["lit", "fixed", "selective"])
def test_rnn_across_step_blocks(decay, monkeypatch):
    """The rnn form gathers its inputs a block of steps at a time: blocks that do not divide L give the
    exact outputs and gradients."""
    import lion_vit.ops.recurrent as recurrent
    monkeypatch.setattr(recurrent, "STEP_BLOCK", 4)
    q, k, v, lam = make_inputs(2, 2, 13, 6, decay, torch.float64, seed=9)
    upstream = torch.randn(v.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    expected, ref_grads = oracle_with_grads(q, k, v, lam, upstream)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([] if lam is None else [torch.log(lam).requires_grad_()])
    out = lion_attention(*leaves[:3], leaves[3][None] if lam is not None else None, form="rnn")
    assert rel_err(out, expected) < 1e-10
    for name, got, ref in zip("qkva", torch.autograd.grad((out * upstream).sum(), leaves), ref_grads):
        assert rel_err(got, ref) < 1e-9, f"grad of {name}"


def scaling_inputs(batch: int, length: int, width: int, dtype: torch.dtype, seed: int = 40):
    """q, k, v of both signs (the identity feature map's), decays, for two scans of a 3 x 4 grid after a class
    token, with normalisers on both sides of 1 in absolute value (asserted): what scaling "max" tells apart."""
    q, k, v, lam = make_inputs(batch, 2, length, width, "selective", torch.float64, seed=seed)
    q = (q - 0.5) * torch.linspace(0.1, 30, length, dtype=torch.float64)[:, None]  # small and large rows
    k = k - 0.4
    log_decays = torch.log(torch.stack([lam, lam.flip(-1)]))
    rows = (q @ k.transpose(-1, -2)).sum(-1).abs()
    assert (rows < 1).any() and (rows > 1).any()
    return [t.to(dtype) for t in (q, k, v, log_decays)]


@pytest.mark.parametrize("scans", [1, 2])
@pytest.mark.parametrize("scaling", ["none", "max"])
@pytest.mark.parametrize("form", TRAINING_FORMS, ids=_form_id)
def test_scalings_match_the_reference(form, scaling, scans):
    """Scale() other than the row sum (RetNet's and Mamba-2's none, xLSTM's max(|n|, 1)) on features of both
    signs: outputs and gradients of q, k, v and the decays against the float64 reference, one scan and two,
    in every form."""
    from lion_vit.ops.reference import lion_attention_reference
    orders = snake_orders(3, 4, 1) if scans == 2 else None
    q, k, v, log_decays = scaling_inputs(2, 13, 6, torch.float64)
    log_decays = log_decays[:scans]
    upstream = torch.randn(v.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(41))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, log_decays)]
    out = lion_attention(*leaves, orders, form=form[0], chunk_size=form[1], scaling=scaling)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, log_decays)]
    expected = lion_attention_reference(*ref_leaves, orders, scaling=scaling)
    assert rel_err(out, expected) < 1e-10
    grads = torch.autograd.grad((out * upstream).sum(), leaves)
    for name, got, want in zip("qkva", grads, torch.autograd.grad((expected * upstream).sum(), ref_leaves)):
        assert rel_err(got, want) < 1e-9, f"grad of {name}"


@pytest.mark.parametrize("decay", [None, "selective", "vector"])
def test_forms_make_no_normaliser_where_none_is_read(decay):
    """normalised=False (what scaling "none" asks of a form): every portable form returns the same numerator and
    None for the normaliser, one scan and two, with and without autograd."""
    from lion_vit.ops import vector
    from lion_vit.ops import TORCH_FORMS
    from lion_vit.ops.cpu import trained_vector_form
    orders = snake_orders(3, 4, 1)
    if decay == "vector":
        q, k, v, lams = vector_inputs(13, "spread", torch.float64, scans=2)
        log_decays = torch.log(lams)
        forms = {"vector": vector.vector_form, "vector chunks": functools.partial(vector.vector_form, chunk_size=5),
                 "cpu chunks": functools.partial(trained_vector_form, chunk_size=5)}
    else:
        q, k, v, log_decays = scaling_inputs(2, 13, 6, torch.float64)
        log_decays = None if decay is None else log_decays
        forms = {"attention": TORCH_FORMS["attention"], "rnn": TORCH_FORMS["rnn"],
                 "chunk": functools.partial(TORCH_FORMS["chunk"], chunk_size=5)}
    for name, form in forms.items():
        for scans in (None, orders):
            leaves = [t.clone().requires_grad_(name == "cpu chunks") for t in (q, k, v)]
            numerator, normaliser = form(*leaves, log_decays, scans)
            assert normaliser is not None and normaliser.shape[-1] == 1, name
            alone, none = form(*leaves, log_decays, scans, normalised=False)
            assert none is None and rel_err(alone, numerator) < 1e-12, name


def test_two_scans_without_decays_add_up_unless_divided():
    """Without decays S scans are S equal terms: the row sum divides them away, "none" keeps S times one."""
    q, k, v, _ = scaling_inputs(1, 13, 6, torch.float64)
    orders = snake_orders(3, 4, 1)
    one = lion_attention(q, k, v, scaling="none")
    assert rel_err(lion_attention(q, k, v, None, orders, scaling="none"), 2 * one) < 1e-12
    q = q.abs()
    assert rel_err(lion_attention(q, k.abs(), v, None, orders), lion_attention(q, k.abs(), v)) < 1e-12


def test_unknown_scaling_is_one_line():
    q = torch.rand(1, 1, 4, 2)
    with pytest.raises(ValueError, match=r"unknown scaling 'softmax'; choose one of \['sum', 'none', 'max'\]"):
        lion_attention(q, q, q, scaling="softmax")


def naive_vector(q, k, v, lams, orders=None, scaling="sum"):
    """The float64 oracle for vector decays lams [S, B, H, L, Dk] (token order): a running-product mask per key
    channel (naive_mask), the scores sum_c q_i^c k_j^c M^c_ij summed over the scans, then Scale()."""
    length = q.shape[-2]
    orders = torch.arange(length)[None] if orders is None else orders
    total = 0
    for lam, order in zip(lams, orders):
        back = torch.argsort(order)
        masks = naive_mask(lam.double()[..., order, :].transpose(-1, -2))[..., back[:, None], back[None, :]]
        total = total + torch.einsum("bhic,bhjc,bhcij->bhij", q.double(), k.double(), masks)
    if scaling == "sum":
        total = total / total.sum(-1, keepdim=True)
    return total @ v.double()


def vector_inputs(length: int, decay: str, dtype: torch.dtype, scans: int = 1, seed: int = 50):
    """q, k, v [2, 2, L, 4] and vector decays [S, 2, 2, L, 4]: spread over (0.05, 0.95), near 0 or near 1."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(2, 2, length, 4, generator=g, dtype=torch.float64) + 0.1 for _ in "qk")
    v = torch.randn(2, 2, length, 3, generator=g, dtype=torch.float64)
    u = torch.rand(scans, 2, 2, length, 4, generator=g, dtype=torch.float64)
    lams = {"spread": u * 0.9 + 0.05, "near0": u * 1e-3 + 1e-6, "near1": 1 - u * 1e-5}[decay]
    return [t.to(dtype) for t in (q, k, v)] + [lams]


@pytest.mark.parametrize("scaling", ["sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("decay", ["spread", "near0", "near1"])
@pytest.mark.parametrize("form", [("attention", None), ("rnn", None), ("chunk", 4), ("chunk", 5)], ids=_form_id)
def test_vector_decays_match_naive(form, decay, dtype, scaling):
    """Vector decays (one per token, head and key channel: GLA, HGRN-2) in every form, one scan at an odd
    length and two snake scans, divided by the normaliser or not (the forms then make none): outputs, and the
    gradients of q, k, v and the log decays, against per-channel running products."""
    tol = {torch.float64: (1e-10, 1e-9), torch.float32: (1e-5, 1e-4)}[dtype]
    for scans, orders in ((1, None), (2, snake_orders(3, 4, 1))):
        q, k, v, lams = vector_inputs(13, decay, dtype, scans)
        upstream = torch.randn(v.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(51))
        expected, ref_grads = _naive_vector_grads(q, k, v, lams, orders, upstream, scaling)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, torch.log(lams).to(dtype))]
        out = lion_attention(*leaves, orders, form=form[0], chunk_size=form[1], scaling=scaling)
        assert out.dtype == dtype and rel_err(out, expected) < tol[0], scans
        grads = torch.autograd.grad((out * upstream.to(dtype)).sum(), leaves)
        for name, got, want in zip("qkva", grads, ref_grads):
            assert rel_err(got, want, min_scale=1e-3 if dtype == torch.float64 else 1.0) < tol[1], (scans, name)


@pytest.mark.parametrize("rows", ["one_row_groups", "whole_batch"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("decay", ["spread", "near0", "near1"])
def test_vector_chunk_form_in_row_groups_matches_naive(decay, dtype, rows, request):
    """Without autograd on a CPU the chunk form of vector decays runs the cpu backend: groups of (batch, head)
    rows, each group's chunks at once. One scan and two, chunk sizes that divide the length or not."""
    from lion_vit.ops import dispatch
    if rows == "one_row_groups":
        request.getfixturevalue("one_row_groups")
    tol = {torch.float64: 1e-10, torch.float32: 1e-5}[dtype]
    for scans, orders in ((1, None), (2, snake_orders(3, 4, 1))):
        q, k, v, lams = vector_inputs(13, decay, dtype, scans)
        expected = naive_vector(*(t.double() for t in (q, k, v, lams)), orders)
        for chunk in (4, 5):
            run = dispatch.plan("chunk", chunk, 13, 4, 3, vector=True, num_scans=scans)
            assert run.backend == "cpu", str(run)
            with torch.no_grad():
                out = lion_attention(q, k, v, torch.log(lams).to(dtype), orders, form="chunk", chunk_size=chunk)
            assert out.dtype == dtype and rel_err(out, expected) < tol, (scans, chunk)


@pytest.mark.parametrize("group_rows", [1, 3, 8, 12], ids=["one_row", "heads_of_an_image", "two_images", "whole_batch"])
@pytest.mark.parametrize("decay", ["selective", "vector"])
def test_cpu_backend_runs_whole_calls_on_groups_of_rows(decay, group_rows, monkeypatch):
    """The cpu backend maps the features, runs the form and divides, group of rows by group: one row, heads of an
    image (3 of 4: groups that do not divide the heads), two images of three, the whole batch. q, k, v are views
    of one token-major projection, as a layer hands them over, q and k raw (feature_map): output against the
    float64 oracle, and for vector decays (which the backend trains) the gradients of q, k, v and the decays."""
    from lion_vit.ops import dispatch
    from lion_vit.ops.cpu import rows
    from lion_vit.ops.reference import lion_attention_reference
    batch, heads, length, dim = 3, 4, 13, 4
    monkeypatch.setattr(rows, "GROUP_BYTES", group_rows * length * (dim + 1) * 8)  # float64: group_rows rows
    g = torch.Generator().manual_seed(56)
    projection = torch.randn(batch, length, 3, heads, dim, generator=g, dtype=torch.float64)
    shape = (1, batch, heads, length) + ((dim,) if decay == "vector" else ())
    log_decays = torch.log(torch.rand(shape, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    upstream = torch.randn(batch, heads, length, dim, generator=g, dtype=torch.float64)

    def call(op, projection, log_decays):
        q, k, v = projection.permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, L, D] views
        return op(q, k, v, log_decays, feature_map="silu_norm", form="chunk", chunk_size=5)

    leaves = [t.clone().requires_grad_(decay == "vector") for t in (projection, log_decays)]
    assert str(dispatch.plan("chunk", 5, length, dim, dim, vector=decay == "vector",
                             training=decay == "vector")).startswith("chunk form, cpu backend"), decay
    out = call(lion_attention, *leaves)
    expected = call(lion_attention_reference, projection, log_decays)
    assert rel_err(out, expected) < 1e-10
    if decay == "vector":
        ref_leaves = [t.clone().requires_grad_() for t in (projection, log_decays)]
        ref_grads = torch.autograd.grad((call(lion_attention_reference, *ref_leaves) * upstream).sum(), ref_leaves)
        for name, got, want in zip(("projection", "log decays"), torch.autograd.grad((out * upstream).sum(), leaves),
                                   ref_grads):
            assert rel_err(got, want) < 1e-9, name


def test_queries_only_feature_map_leaves_the_keys_as_given():
    """A feature map name with QUERIES_ONLY maps the queries alone: the keys are features a layer has made (a key
    gate's), on every backend that maps as it reads (here the cpu backend, per group of rows, and the torch one)."""
    from lion_vit.ops.features import QUERIES_ONLY, identity, shifted_silu
    assert get_feature_map("silu" + QUERIES_ONLY) == (shifted_silu, identity)
    with pytest.raises(ValueError, match="unknown feature_map"):
        get_feature_map("nope" + QUERIES_ONLY)
    q, k, v, lam = make_inputs(2, 2, 13, 4, "selective", torch.float64, seed=57)
    expected = naive_lion(shifted_silu(q), k, v, lam)
    for backend in ("auto", "torch"):
        with torch.no_grad():
            out = lion_attention(q, k, v, torch.log(lam)[None], form="chunk", chunk_size=5, backend=backend,
                                 feature_map="silu" + QUERIES_ONLY)
        assert rel_err(out, expected) < 1e-10, backend


def mixed_vector_decays(length: int, dtype: torch.dtype, seed: int = 52):
    """q, k, v as vector_inputs and decays near 1 with every tenth token's near 0: long blocks of tokens stay in
    exp's range, the blocks around a steep token do not."""
    q, k, v, lams = vector_inputs(length, "near1", dtype, seed=seed)
    steep = torch.arange(length) % 10 == 3
    lams = torch.where(steep[:, None], lams * 1e-8, 1 - (1 - lams) * 5e3)  # near 0 / within 0.05 of 1
    return q, k, v, lams


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("decay", ["spread", "near0", "near1", "mixed"])
def test_vector_leaves_match_naive(decay, dtype):
    """The vector forms' masked products inside blocks (leaves): every leaf size, and the largest the decays allow
    (leaf_size=None, the cpu backend's), in a loop over chunks (the rnn form's of one token too) and at once, at 70
    tokens: outputs and gradients of q, k, v and the log decays against per-channel running products."""
    from lion_vit.ops import vector
    tol = {torch.float64: (1e-10, 1e-9), torch.float32: (1e-5, 1e-4)}[dtype]
    if decay == "mixed":
        q, k, v, lams = mixed_vector_decays(70, dtype)
    else:
        q, k, v, lams = vector_inputs(70, decay, dtype)
    upstream = torch.randn(v.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(53))
    expected, ref_grads = _naive_vector_grads(q, k, v, lams, None, upstream)
    for chunk, at_once, leaf in [(None, False, None), (16, False, None), (16, True, None), (None, True, 4),
                                 (32, False, 2), (70, True, 1), (1, False, 1), (5, True, 2)]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v, torch.log(lams).to(dtype))]
        numerator, normaliser = vector.vector_form(*leaves, chunk_size=chunk, chunks_at_once=at_once, leaf_size=leaf)
        out = numerator / normaliser
        assert rel_err(out, expected) < tol[0], (chunk, at_once, leaf)
        grads = torch.autograd.grad((out * upstream.to(dtype)).sum(), leaves)
        for name, got, want in zip("qkva", grads, ref_grads):
            assert rel_err(got, want, min_scale=1e-3 if dtype == torch.float64 else 1.0) < tol[1], (chunk, leaf, name)


def _grad_functions(out):
    """The names of the autograd nodes behind out."""
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("decay", ["spread", "near0", "near1", "mixed"])
def test_cpu_backend_trains_vector_decays_through_its_own_backward(decay, dtype):
    """Training on the cpu backend, vector decays run chunks with a hand-written backward (ops/cpu/chunks.py): in
    chunks of the plan's size where their decays keep the exponents in range, halves of it where not (mixed, near
    0), at 70 tokens, one scan and two: outputs and the gradients of q, k, v and the log decays against the float64
    oracle; twice the same gradients; second-order gradients (create_graph) as the oracle's."""
    from lion_vit.ops import dispatch
    tol = {torch.float64: (1e-10, 1e-9), torch.float32: (1e-5, 1e-4)}[dtype]
    assert not dispatch.plan("attention", None, 70, 4, 3, dtype=torch.bfloat16, training=True,
                             vector=True).hand_backward
    assert not dispatch.plan("chunk", 1, 70, 4, 3, training=True, vector=True).hand_backward  # (a loop)
    for scans, orders in ((1, None), (2, torch.stack([torch.arange(70), torch.arange(70).flip(0)]))):
        run = dispatch.plan("attention", None, 70, 4, 3, num_scans=scans, dtype=dtype, training=True, vector=True)
        assert str(run) == "attention form, cpu backend: 3 chunks in groups of rows, hand-written backward, vector " \
            "decays", str(run)
        if decay == "mixed":
            q, k, v, lams = mixed_vector_decays(70, dtype)
            lams = lams.expand(scans, *lams.shape[1:])
        else:
            q, k, v, lams = vector_inputs(70, decay, dtype, scans)
        upstream = torch.randn(v.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(58))
        expected, ref_grads = _naive_vector_grads(q, k, v, lams, orders, upstream)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, torch.log(lams).to(dtype))]
        assert lion_attention(*(t.detach() for t in leaves), orders).grad_fn is None
        out = lion_attention(*leaves, orders)
        assert "_ChunksBackward" in _grad_functions(out), "the hand-written backward did not run"
        assert rel_err(out, expected) < tol[0], scans
        grads = torch.autograd.grad((out * upstream.to(dtype)).sum(), leaves, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad((out * upstream.to(dtype)).sum(),
                                                                                 leaves)))
        for name, got, want in zip("qkva", grads, ref_grads):
            assert rel_err(got, want, min_scale=1e-3 if dtype == torch.float64 else 1.0) < tol[1], (scans, name)
    if dtype == torch.float64:  # second order, two scans
        weights = [torch.randn(t.shape, dtype=dtype, generator=torch.Generator().manual_seed(59)) for t in leaves]
        inputs = [t.detach() for t in leaves]
        got = _second_order(lambda *t: lion_attention(*t, orders), [t.clone().requires_grad_() for t in inputs],
                            upstream, weights)
        expected = _second_order(lambda *t: naive_vector(*t[:3], t[3].exp(), orders),
                                 [t.clone().requires_grad_() for t in inputs], upstream, weights)
        for name, a, b in zip("qkva", got, expected):
            assert rel_err(a, b) < 1e-8, f"second-order grad of {name}"


def test_vector_leaves_are_as_large_as_the_decays_allow():
    """leaf_tokens: the whole chunk for decays near 1, pairs of tokens for decays near 0 in float32, blocks with
    one steep token in each half for mixed decays, larger ones in float64 (its exp reaches further)."""
    from lion_vit.ops import vector

    def leaf(lams, dtype):
        g, h = vector._cumulative(torch.log(lams).to(dtype))
        return vector.leaf_tokens(g, h, dtype, [1 << i for i in range(7)])

    lams = {decay: vector_inputs(64, decay, torch.float32)[3][0] for decay in ("near0", "near1")}
    assert leaf(lams["near1"], torch.float32) == 64 and leaf(lams["near0"], torch.float32) == 2
    mixed = mixed_vector_decays(64, torch.float32)[3]
    assert leaf(mixed, torch.float32) == 16 and leaf(mixed, torch.float64) == 64


@pytest.mark.parametrize("form", [("attention", None), ("rnn", None), ("chunk", 4)], ids=_form_id)
def test_vector_decays_of_an_empty_batch(form):
    """No images: every form returns no rows, in inference and training (the cpu backend reads no decays)."""
    q = torch.rand(0, 2, 13, 4, requires_grad=True)
    out = lion_attention(q, q, q, -torch.rand(1, 0, 2, 13, 4), form=form[0], chunk_size=form[1])
    out.sum().backward()
    assert out.shape == (0, 2, 13, 4) and q.grad.shape == q.shape


def _naive_vector_grads(q, k, v, lams, orders, upstream, scaling="sum"):
    leaves = [t.double().clone().requires_grad_() for t in (q, k, v, lams)]
    expected = naive_vector(*leaves, orders, scaling=scaling)
    grads = list(torch.autograd.grad((expected * upstream).sum(), leaves))
    grads[3] = grads[3] * lams  # d/d(log lam)
    return expected.detach(), grads


def test_vector_decays_plan_the_portable_forms_and_other_scalings():
    """Vector decays run the portable forms (their plan says so), with any scaling, eagerly on a CPU in groups of
    rows (training too); the rnn form keeps chunks of one token."""
    from lion_vit.ops import dispatch
    from lion_vit.ops.reference import lion_attention_reference
    q, k, v, lams = vector_inputs(13, "spread", torch.float64)
    log_decays = torch.log(lams)
    ran = []
    implementation = dispatch.implementation
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dispatch, "implementation", lambda run: ran.append(run) or implementation(run))
        for form, chunk in [("auto", None), ("rnn", None), ("chunk", 4)]:
            out = lion_attention(q - 0.6, k, v, log_decays, form=form, chunk_size=chunk, scaling="none")
            assert rel_err(out, lion_attention_reference(q - 0.6, k, v, log_decays, scaling="none")) < 1e-10
    assert [str(run) for run in ran] == ["attention form, cpu backend: one chunk in groups of rows, vector decays",
                                         "rnn form, torch backend: recurrence loop, vector decays",
                                         "chunk form, cpu backend: 4 chunks in groups of rows, vector decays"]
    # above dispatch.VECTOR_ATTENTION_CHUNK tokens the attention form runs chunks of it: the same function
    q, k, v, lams = vector_inputs(dispatch.VECTOR_ATTENTION_CHUNK + 6, "spread", torch.float64)
    run = dispatch.plan("attention", None, q.shape[-2], 4, 3, vector=True, training=True)
    assert str(run) == "attention form, cpu backend: 2 chunks in groups of rows, hand-written backward, vector decays"
    run = dispatch.plan("attention", None, q.shape[-2], 4, 3, vector=True, training=True, backend="torch")
    assert str(run) == "attention form, torch backend: 2 chunks, vector decays"
    assert rel_err(lion_attention(q, k, v, torch.log(lams)), naive_vector(q, k, v, lams)) < 1e-10
