"""The triton backend (flash-linear-attention kernels) against the float64 reference: outputs and
gradients of q, k, v and the log decays, every decay kind, one and two scans, lengths that are not a
multiple of the kernels' 64-token tile. On a CPU the kernels run under Triton's interpreter at small
shapes (tests/interpret.py); on a GPU (make gpu-check) natively, with TF32 off."""
from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from functools import partial

import pytest
import timm
import torch

import interpret
from lion_vit.ops import lion_attention, plan, snake_orders, tuned, tuning
from lion_vit.ops.reference import lion_attention_reference, lion_reference, lion_reference_multiscan
from lion_vit.testing import randomize_decays
from naive import AtenCalls, rel_err
from test_ops import float16_overflowing_inputs, make_inputs

sys.path.insert(0, str(interpret.ROOT / "scripts"))
import compile_kernels  # noqa: E402  (scripts/compile_kernels.py: the native compile check)

pytestmark = [pytest.mark.skipif(not interpret.KERNELS, reason=interpret.SKIP_REASON),
              # the interpreter evaluates exp2 on masked-out lanes too, where it may overflow (unused there)
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]
DEVICE = torch.device("cuda" if interpret.ON_GPU else "cpu")
TOL = 1e-4  # float32 inputs against the float64 reference (the kernels' own rounding)


@pytest.fixture(autouse=True)
def kernels_here(monkeypatch):
    interpret.adapt_interpreter()
    if interpret.ON_GPU:
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


BIDIRECTIONAL_KERNELS = ("_forward_kernel", "_backward_keys_kernel", "_backward_queries_kernel")


def watch_launches(monkeypatch, name: str, seen) -> None:
    """ops.triton.bidirectional.<name> launched as before, with seen(kernel, grid, args, kwargs) called at each
    launch first (for the test's duration)."""
    from lion_vit.ops.triton import bidirectional
    kernel = getattr(bidirectional, name)

    class Watched:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen(kernel, grid, args, kwargs)
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(bidirectional, name, Watched())


def _check(fn, reference, tensors, tol=TOL, value_shape=None):
    """fn's output and gradients (of every tensor given) against reference's, for one random upstream.
    value_shape: the output's, where it is not the third tensor's (v)."""
    value_shape = value_shape or tensors[2].shape
    upstream = torch.randn(value_shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    leaves = [t.to(DEVICE).requires_grad_() for t in tensors]
    out = fn(*leaves)
    assert out.dtype == tensors[0].dtype and out.device.type == DEVICE.type
    grads = torch.autograd.grad((out.double() * upstream.to(DEVICE)).sum(), leaves)
    ref_leaves = [t.double().requires_grad_() for t in tensors]
    expected = reference(*ref_leaves)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), ref_leaves)
    assert rel_err(out.cpu(), expected) < tol
    for name, got, want in zip("qkva", grads, expected_grads):
        assert rel_err(got.cpu(), want, min_scale=1.0) < tol, f"grad of {name}"


@pytest.mark.parametrize("form, decay", [("chunk", d) for d in ("lit", "fixed", "selective", "near0", "near1")]
                         + [("attention", d) for d in ("fixed", "selective", "near0", "near1")]
                         + [("rnn", d) for d in ("lit", "fixed", "selective")])
def test_triton_forms_match_the_reference(form, decay, monkeypatch):
    """(The recurrent kernel, serial over tokens, is slow under the interpreter: one image; two in the
    feature-map test below.)"""
    q, k, v, lam = make_inputs(2 if form == "chunk" else 1, 2, 70, 16, decay, torch.float32)
    tensors = [q, k, v] + ([] if lam is None else [torch.log(lam).float()])

    def triton(q, k, v, log_decay=None):
        return lion_attention(q, k, v, None if log_decay is None else log_decay[None], form=form, backend="triton")

    _check(triton, lion_reference, tensors)


def test_lion_lit_in_the_bidirectional_kernel_matches_the_reference():
    """LION-lit (no decays: every mask entry 1) through the bidirectional kernel, the route benchmark_fused.py times
    against the plan's Q (K^T V) in the linear kernels and in torch matmuls (Tuning.linear_kernels off): outputs
    and gradients of q, k, v against the float64 reference at 70 tokens (two of the kernel's 64-token tiles)."""
    from lion_vit.ops import Plan
    q, k, v, lam = make_inputs(1, 2, 70, 16, "lit", torch.float32)
    with tuned(linear_kernels=False):
        assert lam is None and plan("attention", None, 70, 16, 16, decayed=False, device=DEVICE, backend="triton",
                                    training=True) == Plan("attention", "torch", whole=True, linear=True)

    def kernel(q, k, v):
        return lion_attention(q, k, v, plan=Plan("attention", "triton", whole=True))

    _check(kernel, lion_reference, [q, k, v])


@pytest.mark.parametrize("length, feature_map, scaling, width", [
    (1, "silu_norm", "sum", 16), (70, "silu_norm", "sum", 16), (197, "silu_norm", "sum", 16), (63, "silu", "sum", 16),
    (129, "elu", "sum", 16), (70, "unfused", "sum", 16), (70, "identity", "none", 16), (70, "identity", "max", 16),
    (70, None, "sum", 16), (70, "silu_norm", "sum", 15), ("half", "silu_norm", "sum", 15)])
def test_lion_lit_in_the_linear_kernels_matches_the_reference(length, feature_map, scaling, width, monkeypatch):
    """LION-lit's attention form as its triton plan runs it, Q (K^T V) in the linear kernels (the feature maps
    applied as they read raw q and k, token-major views of one projection; a map they do not know, by torch ops
    first): outputs and gradients of q, k and v against the float64 reference, at lengths of one token, within one
    64-token tile and across two to four, with the scalings on features of both signs (None: q, k are features), an
    odd head width, and in 16-bit ("half": 70 tokens as autocast makes them, within half precision's rounding)."""
    half = length == "half"
    length = 70 if half else length
    import torch.nn.functional as F
    from lion_vit.ops import Plan
    from lion_vit.ops.features import FEATURE_MAPS, mapped
    if feature_map == "unfused":
        monkeypatch.setitem(FEATURE_MAPS, "unfused", (F.softplus, lambda x: F.softplus(x) ** 2))
    assert plan("attention", None, length, 16, 16, decayed=False, device=DEVICE, backend="triton",
                training=True) == Plan("attention", "triton", whole=True, linear=True)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, length, 3, 2, width, generator=g)  # [B, L, (q, k, v), H, D] as a projection gives them
    if feature_map is None:  # positive features
        qkv = qkv.abs() + 0.05
    elif scaling == "max":  # rows with |sum_j q_i . k_j| on both sides of 1 (asserted)
        qkv = qkv * torch.linspace(0.01, 0.3, length)[:, None, None, None]

    def split(qkv):
        return qkv.transpose(1, 3).unbind(2)

    def triton(qkv):
        return lion_attention(*split(qkv), backend="triton", feature_map=feature_map, scaling=scaling)

    def reference(qkv):
        q, k, v = split(qkv)
        return lion_reference(*mapped(q, k, feature_map), v, scaling=scaling)

    if scaling == "max":
        q, k, _ = split(qkv.double())
        rows = (q @ k.transpose(-1, -2)).sum(-1).abs()
        assert (rows < 1).any() and (rows > 1).any()
    _check(triton, reference, [qkv.to(HALF) if half else qkv], value_shape=(2, 2, length, width),
           tol=(3e-2 if interpret.ON_GPU else 3e-3) if half else TOL)


def test_the_linear_kernels_give_the_same_bits_every_run_and_refuse_double_backward():
    """LION-lit's linear kernels: two backward passes give bitwise equal gradients (each image and head's sums over
    its tokens in one program, in order: no atomics), and a second-order gradient is one clear error."""
    q, k, v, _ = make_inputs(2, 2, 197, 16, "lit", torch.float32, seed=6)
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    upstream = torch.randn(v.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    runs = [torch.autograd.grad((lion_attention(*leaves, backend="triton") * upstream).sum(), leaves)
            for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    with pytest.raises(RuntimeError, match="no double backward; for second-order gradients use attn_backend='torch'"):
        torch.autograd.grad(lion_attention(*leaves, backend="triton").square().sum(), leaves, create_graph=True)


@pytest.mark.parametrize("form, decay", [("chunk", "fixed"), ("chunk", "selective"), ("rnn", "selective"),
                                         ("attention", "fixed"), ("attention", "selective")])
def test_triton_multiscan_matches_the_reference(form, decay, monkeypatch):
    """Two snake scans over a grid with a class token: 11x18 for the chunk form (199 tokens, chunks of 64
    and 7: long enough that it runs the kernels, not one product), 7x10 for the rnn form."""
    height, width = (11, 18) if form == "chunk" else (7, 10)
    length = height * width + 1
    orders = snake_orders(height, width, num_prefix_tokens=1).to(DEVICE)
    assert plan(form, None, length, 16, 16, num_scans=2, device=DEVICE, backend="triton").backend == "triton"
    q, k, v, lam = make_inputs(1, 2, length, 16, decay, torch.float32)
    log_decays = torch.log(torch.stack([lam, lam.flip(-1) if lam.shape[-1] > 1 else lam ** 0.5])).float()

    def triton(q, k, v, log_decays):
        return lion_attention(q, k, v, log_decays, orders, form=form, backend="triton")

    _check(triton, lambda *t: lion_reference_multiscan(*t, orders.cpu()), [q, k, v, log_decays])


@pytest.mark.parametrize("form, feature_map", [("chunk", "silu_norm"), ("chunk", "silu"), ("chunk", "elu"),
                                               ("chunk", "unfused"), ("rnn", "silu_norm"), ("attention", "silu_norm"),
                                               ("attention", "elu"), ("attention", "unfused")])
def test_triton_maps_raw_queries_and_keys_as_it_reads_them(form, feature_map, monkeypatch):
    """Raw q, k (any sign, token-major views of one projection) with a feature map's name: the outputs and the
    gradients of raw q, k, v and the decays are the reference's on the mapped features. A map the fused
    step does not know is applied before it."""
    import torch.nn.functional as F
    from lion_vit.ops.features import FEATURE_MAPS
    if feature_map == "unfused":
        monkeypatch.setitem(FEATURE_MAPS, "unfused", (F.softplus, lambda x: F.softplus(x) ** 2))
    query_map, key_map = FEATURE_MAPS[feature_map]
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 70, 3, 2, 16, generator=g)  # [B, L, (q, k, v), H, D] as a projection gives them
    lam = torch.rand(2, 2, 70, generator=g) * 0.98 + 0.01

    def triton(qkv, log_decay):
        q, k, v = qkv.transpose(1, 3).unbind(2)
        return lion_attention(q, k, v, log_decay[None], form=form, backend="triton", feature_map=feature_map)

    def reference(qkv, log_decay):
        q, k, v = qkv.transpose(1, 3).unbind(2)
        return lion_reference(query_map(q), key_map(k), v, log_decay)

    _check(triton, reference, [qkv, torch.log(lam)], value_shape=(2, 2, 70, 16))


def test_triton_reads_inputs_whose_rows_are_not_contiguous():
    """q, k, v whose last dimension is strided (columns of a transposed buffer) give the reference's result."""
    q, k, v, lam = make_inputs(1, 2, 40, 16, "fixed", torch.float32)

    def triton(q, k, v, log_decay):
        q, k, v = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v))
        assert q.stride(-1) != 1
        return lion_attention(q, k, v, log_decay[None], form="rnn", backend="triton")

    _check(triton, lion_reference, [q, k, v, torch.log(lam).float()])


@pytest.mark.parametrize("scans, length", [(2, 197), (1, 197), (1, 785)], ids=["natural197", "s197", "s785"])
@pytest.mark.slow
def test_fused_attention_form_at_vit_lengths(scans, length):
    """The fused attention form (the bidirectional kernel) as a ViT-S/16 runs it:
    197 tokens (224 px) whose class token has the decay 1 (prefix_decay_one), odd, across the kernels' tiles,
    two snake scans of the 14 x 14 grid or one raster scan; 785 tokens (448 px) once. Outputs and gradients of
    q, k, v and the decays against the float64 reference; the plan names the kernel."""
    q, k, v, lam = make_inputs(1, 1, length, 16, "selective", torch.float32, seed=5)
    lam[..., 0] = 1.0  # the class token
    if scans == 2:
        side = int((length - 1) ** 0.5)
        orders = snake_orders(side, side, num_prefix_tokens=1).to(DEVICE)
        log_decays = torch.log(torch.stack([lam, lam.flip(-1).roll(1, -1)])).float()
        reference = partial(lion_reference_multiscan, orders=orders.cpu())
    else:
        orders, log_decays, reference = None, torch.log(lam).float()[None], \
            lambda q, k, v, a: lion_reference(q, k, v, a[0])
    run = plan("attention", None, length, 16, 16, num_scans=scans, device=DEVICE, backend="triton", training=True)
    assert run.backend == "triton" and run.whole and str(run).endswith("(bidirectional kernel)")

    def triton(q, k, v, log_decays):
        return lion_attention(q, k, v, log_decays, orders, form="attention", backend="triton")

    _check(triton, reference, [q, k, v, log_decays])


@pytest.mark.parametrize("form", ["attention", "chunk", "rnn"])
@pytest.mark.parametrize("scaling", ["none", "max"])
def test_triton_scalings_match_the_reference(form, scaling, chunks_always, monkeypatch):
    """The finishing step's other scalings (none; max(|n|, 1)) on features of both signs, mapped by the fused
    step's identity map, two scans, 70 tokens (two tiles of the chunk kernels): outputs and gradients of q, k,
    v and the decays against the float64 reference."""
    length = 70
    orders = snake_orders(3, 23, num_prefix_tokens=1)
    g = torch.Generator().manual_seed(42)
    q = (torch.rand(1, 2, length, 16, generator=g) - 0.5) * torch.linspace(0.05, 6, length)[:, None]
    k = torch.rand(1, 2, length, 16, generator=g) - 0.4
    v = torch.randn(1, 2, length, 16, generator=g)
    log_decays = torch.log(torch.rand(2, 1, 2, length, generator=g) * 0.5 + 0.45)
    rows = (q.double() @ k.double().transpose(-1, -2)).sum(-1).abs()
    assert (rows < 1).any() and (rows > 1).any()

    def triton(q, k, v, log_decays):
        return lion_attention(q, k, v, log_decays, orders.to(DEVICE), form=form, backend="triton",
                              feature_map="identity", scaling=scaling)

    _check(triton, lambda *t: lion_attention_reference(*t, orders, scaling=scaling), [q, k, v, log_decays])


def test_the_bidirectional_kernel_reads_projection_views_of_other_widths():
    """The bidirectional kernel on q, k, v as token-major views of one projection, value width 24 beside key
    width 16, one decay per head over two snake scans: outputs and gradients of q, k, v and the decays against
    the reference. Inference plans it whole, without groups of images: it keeps no buffers."""
    form = "attention"
    orders = snake_orders(5, 6, num_prefix_tokens=1)
    g = torch.Generator().manual_seed(8)
    projection = torch.rand(2, 31, 2, 56, generator=g) + 0.05  # [B, L, H, q | k | v]
    log_decays = torch.log(torch.rand(2, 1, 2, 1, generator=g) * 0.9 + 0.05)
    run = plan(form, None, 31, 16, 24, num_scans=2, device=DEVICE, backend="triton")
    assert run.backend == "triton" and run.whole and not run.grouped

    def split(projection):
        return [part.transpose(1, 2) for part in projection.split([16, 16, 24], -1)]

    def triton(projection, log_decays):
        return lion_attention(*split(projection), log_decays, orders.to(DEVICE), form=form, backend="triton")

    _check(triton, lambda p, a: lion_reference_multiscan(*split(p), a, orders), [projection, log_decays],
           value_shape=(2, 2, 31, 24))


def test_the_bidirectional_kernels_launch_in_the_settings_in_effect(monkeypatch, knobs):
    """Tuning.bidirectional_forward, _backward, _keys_first and _factored_masks reach the kernels as they launch:
    each kernel's grid (a program per own tile and image-head), its loop's tile, its warps, the key kernel's
    orientation and the masks' factoring; in another setting the function is the same. One scan in token order
    (no orders) launches them IN_ORDER: its tiles' spans are their bounds."""
    launches = []
    for name in BIDIRECTIONAL_KERNELS:
        watch_launches(monkeypatch, name, lambda kernel, grid, args, kwargs: launches.append(
            (kernel.fn.__name__, tuple(grid), kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"],
             kwargs.get("KEYS_FIRST"), kwargs["FACTORED"], kwargs["IN_ORDER"])))
    q, k, v, lam = make_inputs(1, 2, 40, 16, "selective", torch.float32)
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v, torch.log(lam)[None])]

    def run():
        out = lion_attention(*leaves, form="attention", backend="triton")
        return [out, *torch.autograd.grad(out, leaves, torch.ones_like(out))]

    code = run()
    assert launches[1][-3] is tuning().bidirectional_keys_first
    assert [launch[-2:] for launch in launches] == [(tuning().bidirectional_factored_masks, True)] * 3
    knobs(bidirectional_forward=(16, 32, 2), bidirectional_backward=(32, 16, 1),
          bidirectional_keys_first=not tuning().bidirectional_keys_first,
          bidirectional_factored_masks=not tuning().bidirectional_factored_masks)
    launches.clear()
    other = run()
    keys_first, factored = tuning().bidirectional_keys_first, tuning().bidirectional_factored_masks
    assert launches == [("_forward_kernel", (3, 2), 16, 32, 2, None, factored, True),
                        ("_backward_keys_kernel", (2, 2), 16, 32, 1, keys_first, factored, True),
                        ("_backward_queries_kernel", (2, 2), 32, 16, 1, None, factored, True)]
    assert all(rel_err(got, want) < 1e-5 for got, want in zip(other, code))


@pytest.mark.parametrize("scans", [1, 2])
def test_the_key_kernels_two_orientations_give_the_reference_gradients(scans):
    """The backward's key kernel with its tiles [queries, keys] and [keys, queries] (Tuning.bidirectional_keys_first):
    outputs and gradients of q, k, v and per-token decays against the float64 reference, at 71 tokens (one scan)
    or a 7 x 10 grid and a class token (two snakes), decays from near 0 to near 1."""
    orders = snake_orders(7, 10, num_prefix_tokens=1) if scans == 2 else None
    q, k, v, lam = make_inputs(1, 2, 71, 16, "selective", torch.float32)
    log_decays = torch.log(torch.stack([lam, lam ** 0.5][:scans])).float()  # [S, B, H, L]

    def triton(q, k, v, log_decays):
        return lion_attention(q, k, v, log_decays, None if orders is None else orders.to(DEVICE), form="attention",
                              backend="triton")

    def reference(q, k, v, log_decays):
        return lion_reference_multiscan(q, k, v, log_decays, torch.arange(71)[None] if orders is None else orders)

    for keys_first in (False, True):
        with tuned(bidirectional_keys_first=keys_first):
            _check(triton, reference, [q, k, v, log_decays])


@pytest.mark.parametrize("scans, decay", [(1, "selective"), (1, "underflow"), (2, "near1"), (2, "selective")])
def test_bidirectional_factored_and_entrywise_mask_tiles_give_the_reference(scans, decay):
    """The bidirectional kernels' mask tiles whose keys all come before or all after their queries along the scan,
    as outer products (Tuning.bidirectional_factored_masks) and entry by entry: outputs and gradients of q, k, v
    and per-token decays against the float64 reference, at 71 tokens in tiles of 16 (20 of the 25 tile pairs
    factor along a raster scan), one scan or two snakes with a class token; decays from near 0 (and products that
    underflow) to near 1. The two ways differ in rounding, so that the factors are seen to be used (where every
    entry off the diagonal underflows to 0 both ways give the same bits)."""
    orders = snake_orders(7, 10, num_prefix_tokens=1) if scans == 2 else None
    q, k, v, lam = make_inputs(1, 2, 71, 16, decay, torch.float32)
    log_decays = torch.log(torch.stack([lam, lam.flip(-1)][:scans])).float()  # [S, B, H, L]

    def triton(q, k, v, log_decays):
        return lion_attention(q, k, v, log_decays, None if orders is None else orders.to(DEVICE), form="attention",
                              backend="triton")

    def reference(q, k, v, log_decays):
        return lion_reference_multiscan(q, k, v, log_decays, torch.arange(71)[None] if orders is None else orders)

    outputs = []
    for factored in (True, False):
        with tuned(bidirectional_factored_masks=factored, bidirectional_forward=(16, 16, 1),
                   bidirectional_backward=(16, 16, 1)):
            _check(triton, reference, [q, k, v, log_decays])
            outputs.append(triton(*(t.to(DEVICE) for t in (q, k, v, log_decays))))
    assert torch.equal(*outputs) == (decay == "underflow") and rel_err(*outputs) < 1e-5


@pytest.mark.parametrize("feature_map, scans", [("silu_norm", 1), ("silu_norm", 2), ("elu", 1)])
def test_the_bidirectional_kernels_map_pass_gives_the_same_bits(feature_map, scans, monkeypatch):
    """Tuning.bidirectional_map_pass: the kernels read their loops' tiles as features a pass mapped first (one pass
    forward, over k; two backward, over q and k), and map only their own tiles as they read them. On raw q, k of both
    signs (views of one projection), 71 tokens in tiles of 16, one scan or two snakes: the outputs and gradients of
    raw q, k, v and the decays are the reference's, and the same bits as with the maps in the loops (on a GPU, within
    rounding: the compiler may contract the map's arithmetic differently in the two kernels)."""
    from lion_vit.ops.features import get_feature_map
    passes = []
    watch_launches(monkeypatch, "_map_kernel", lambda kernel, grid, args, kwargs: passes.append(
        (tuple(args[0].shape), kwargs["MAP"], kwargs["NORM"])))
    orders = snake_orders(7, 10, num_prefix_tokens=1) if scans == 2 else None
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(1, 71, 3, 2, 16, generator=g)  # [B, L, (q, k, v), H, D] as a projection gives them
    log_decays = torch.log(torch.rand(scans, 1, 2, 71, generator=g) * 0.9 + 0.05)
    query_map, key_map = get_feature_map(feature_map)

    def triton(qkv, log_decays):
        q, k, v = qkv.transpose(1, 3).unbind(2)
        return lion_attention(q, k, v, log_decays, None if orders is None else orders.to(DEVICE), form="attention",
                              backend="triton", feature_map=feature_map)

    def reference(qkv, log_decays):
        q, k, v = qkv.transpose(1, 3).unbind(2)
        return lion_reference_multiscan(query_map(q), key_map(k), v, log_decays,
                                        torch.arange(71)[None] if orders is None else orders)

    results = []
    for map_pass in (True, False):
        passes.clear()
        with tuned(bidirectional_map_pass=map_pass, bidirectional_forward=(16, 16, 1),
                   bidirectional_backward=(16, 16, 1)):
            _check(triton, reference, [qkv, log_decays], value_shape=(1, 2, 71, 16))
            leaves = [t.to(DEVICE).requires_grad_() for t in (qkv, log_decays)]
            out = triton(*leaves)
            results.append([out, *torch.autograd.grad(out, leaves, torch.ones_like(out))])
        norm = feature_map == "silu_norm"
        maps = {"silu_norm": 1, "elu": 2}[feature_map]
        # _check's call and the one above: forward (keys), backward (queries, keys); on the 4 tensors [1, 2, 71, 16]
        assert passes == (2 * [((1, 2, 71, 16), maps, norm), ((1, 2, 71, 16), maps, False),
                               ((1, 2, 71, 16), maps, norm)] if map_pass else []), passes
    for with_pass, in_loops in zip(*results):
        assert torch.equal(with_pass, in_loops) if not interpret.ON_GPU else rel_err(with_pass, in_loops) < 1e-5


@pytest.mark.slow
def test_the_bidirectional_kernel_subtracts_long_sequences_sums_in_float64(monkeypatch):
    """Past FLOAT64_EXPONENTS_ABOVE tokens the cumulative log decays E, I are float64 and the kernels subtract
    them so: at 1,100 tokens whose first half decays fast (0.01) and second slowly (0.9995), the sums reach
    -2,500 while the slow half's mask entries are near 1. The output stays within 1e-6 of the float64 reference
    (gradients within the tests' bound); with the sums rounded to float32 first (the threshold raised), the same
    call errs past 1e-6."""
    from lion_vit.ops.triton import bidirectional
    form = "attention"
    length = 1100
    g = torch.Generator().manual_seed(9)
    q, k = (torch.rand(1, 1, length, 16, generator=g) + 0.1 for _ in "qk")
    v = torch.randn(1, 1, length, 16, generator=g)
    lam = torch.full((1, 1, length), 0.01)
    lam[..., length // 2:] = 0.9995
    log_decay = torch.log(lam)
    assert length > bidirectional.FLOAT64_EXPONENTS_ABOVE

    def triton(q, k, v, log_decay):
        return lion_attention(q, k, v, log_decay[None], form=form, backend="triton")

    _check(triton, lion_reference, [q, k, v, log_decay])
    expected = lion_reference(q.double(), k.double(), v.double(), log_decay.double())
    assert rel_err(triton(q, k, v, log_decay), expected) < 1e-6
    monkeypatch.setattr(bidirectional, "FLOAT64_EXPONENTS_ABOVE", 2 * length)
    assert rel_err(triton(q, k, v, log_decay), expected) > 1e-6


@pytest.mark.parametrize("form, scans, scaling, value_dim", [("attention", 1, "sum", 16), ("chunk", 2, "sum", 16),
                                                            ("rnn", 2, "sum", 16), ("chunk", 1, "none", 16),
                                                            ("chunk", 1, "none", 15)])
def test_triton_vector_decays_match_the_reference(form, scans, scaling, value_dim):
    """Vector decays (GLA's) on FLA's vector-gate kernels, every scan and direction in one launch, 70 tokens
    (two of the chunk kernels' tiles; the two scans of a 3 x 23 grid and a class token): outputs and gradients
    of q, k, v and the decays against the float64 reference, decays from near 0 to near 1. Scaling "none"
    carries no normaliser's column (an odd value width then takes a zero column)."""
    length = 70
    orders = snake_orders(3, 23, num_prefix_tokens=1) if scans == 2 else None
    g = torch.Generator().manual_seed(60)
    q, k = (torch.rand(1, 2, length, 16, generator=g) + 0.1 for _ in "qk")
    v = torch.randn(1, 2, length, value_dim, generator=g)
    log_decays = torch.log(torch.rand(scans, 1, 2, length, 16, generator=g) * 0.98 + 0.01)
    run = plan(form, None, length, 16, value_dim, num_scans=scans, device=DEVICE, backend="triton", vector=True)
    assert run.backend == "triton" and run.vector

    def triton(q, k, v, log_decays):
        return lion_attention(q, k, v, log_decays, None if orders is None else orders.to(DEVICE), form=form,
                              backend="triton", scaling=scaling)

    _check(triton, lambda *t: lion_attention_reference(*t, orders, scaling=scaling), [q, k, v, log_decays])


@contextmanager
def launch_grids():
    """The grid of every kernel launch in the block, as the interpreter runs it (FLA's kernels too)."""
    from triton.runtime import interpreter
    builder, grids = interpreter.interpreter_builder, []
    set_grid_dim = builder.set_grid_dim
    builder.set_grid_dim = lambda *grid: grids.append(grid) or set_grid_dim(*grid)
    try:
        yield grids
    finally:
        del builder.set_grid_dim


@pytest.mark.skipif(interpret.ON_GPU, reason="the interpreter reports each launch's grid")
@pytest.mark.parametrize("form, scans, decay, training", [
    ("attention", 2, "fixed", True), ("attention", 1, "lit", True), ("chunk", 1, "selective", True),
    ("chunk", 2, "fixed", False), ("rnn", 1, "selective", False), ("forward", 1, "fixed", True),
    ("vector", 1, "vector", True)])
@pytest.mark.filterwarnings("ignore:flash-linear-attention's chunk backward fails:UserWarning")  # ("forward")
def test_batches_past_the_launch_grids_limit_run_in_parts(form, scans, decay, training, knobs, chunks_always):
    """CUDA launches at most 65,535 program rows on a grid's second and third axes, where the kernels (ours and
    FLA's) put images x sequences x heads. With that limit lowered to 12, 7 images of 2 heads run in parts whose
    launches stay within it (the whole batch's would not), with the same outputs and gradients of q, k and v,
    bit for bit, and of the decays (summed over the parts where they are shared) within rounding."""
    knobs(group_share=1000)  # (inference: the batch in one group, which passes the limit)
    if form == "forward":
        knobs(chunk_backward_fails=True, chunk_backward_fallback="forward")
    height, width = (3, 4) if scans == 2 else (1, 21)
    length = height * width + (scans == 2)
    orders = snake_orders(height, width, num_prefix_tokens=1) if scans == 2 else None
    q, k, v, lam = make_inputs(7, 2, length, 16, "fixed" if decay == "vector" else decay, torch.float32)
    if decay == "vector":
        log_decays = torch.log(torch.rand(1, 7, 2, length, 16, generator=torch.Generator().manual_seed(3)) * 0.9
                               + 0.05)
    else:
        log_decays = None if lam is None else torch.log(lam).float()[None].expand(scans, *lam.shape).contiguous()
    tensors = [t for t in (q, k, v, log_decays) if t is not None]
    upstream = torch.randn(v.shape, generator=torch.Generator().manual_seed(4))

    def run(limit):
        leaves = [t.clone().requires_grad_(training) for t in tensors]
        with tuned(grid_axis_limit=limit), launch_grids() as grids, torch.set_grad_enabled(training):
            out = lion_attention(*leaves[:3], leaves[3] if len(leaves) > 3 else None, orders,
                                 form="chunk" if form in ("forward", "vector") else form, backend="triton")
            grads = torch.autograd.grad((out * upstream).sum(), leaves) if training else []
        return out, grads, grids

    whole, whole_grads, whole_grids = run(65535)
    parts, parts_grads, parts_grids = run(12)
    assert max(max(grid[1:]) for grid in whole_grids) > 12  # (the whole batch's launches would pass the limit)
    assert max(max(grid[1:]) for grid in parts_grids) <= 12
    assert torch.equal(parts, whole)
    for name, got, want in zip("qkva", parts_grads, whole_grads):
        assert torch.equal(got, want) if name != "a" else rel_err(got, want) < 1e-6, f"grad of {name}"


@pytest.mark.skipif(not interpret.ON_GPU, reason="80,000 program rows: hours under the interpreter")
@pytest.mark.parametrize("form, decay", [("attention", "selective"), ("attention", "lit"), ("chunk", "selective")])
def test_a_batch_past_cudas_grid_limit_trains(form, decay, chunks_always):
    """40,000 images of 2 heads: 80,000 program rows (160,000 for FLA's kernels) on a grid axis that CUDA caps
    at 65,535; in parts, the same function as the portable form's."""
    q, k, v, lam = make_inputs(40000, 2, 5, 16, decay, torch.float32)
    log_decays = None if lam is None else torch.log(lam).float()[None]
    tensors = [t.to(DEVICE) for t in (q, k, v, log_decays) if t is not None]
    results = []
    for backend in ("triton", "torch"):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = lion_attention(*leaves[:3], leaves[3] if len(leaves) > 3 else None, form=form, backend=backend)
        results.append([out, *torch.autograd.grad(out.square().sum(), leaves)])
    for name, got, want in zip(["y", *"qkva"], *results):
        assert rel_err(got.cpu(), want.cpu().double(), min_scale=1.0) < TOL, name


@pytest.mark.parametrize("form, keys_first", [("attention", False), ("attention", True), ("chunk", False)])
def test_triton_gradients_are_the_same_bits_every_run(form, keys_first, chunks_always):
    """Two backward passes of the same call give bitwise equal gradients of q, k, v and the decays: no
    atomics, no order of accumulation that changes from run to run (the bidirectional kernel's key kernel in
    both orientations, Tuning.bidirectional_keys_first)."""
    orders = snake_orders(7, 10, num_prefix_tokens=1).to(DEVICE)
    q, k, v, lam = make_inputs(1, 2, 71, 16, "selective", torch.float32, seed=6)
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v, torch.log(torch.stack([lam, lam.flip(-1)])))]
    upstream = torch.randn(v.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    with tuned(bidirectional_keys_first=keys_first):
        runs = [torch.autograd.grad((lion_attention(*leaves, orders, form=form, backend="triton") * upstream).sum(),
                                    leaves) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_scan_indices_are_built_once_per_orders_tensor():
    """A model hands the same orders tensor to every call: from the second call on, no index arithmetic
    runs around the kernels (the bidirectional kernel's tile spans too); another orders tensor of the same shape
    gets indices of its own."""
    orders = snake_orders(3, 4, num_prefix_tokens=1).to(DEVICE)
    q, k, v, lam = make_inputs(1, 2, 13, 16, "selective", torch.float32)
    log_decays = torch.log(torch.stack([lam, lam.flip(-1)])).float()

    def run(orders):  # (the rnn form: at 13 tokens the chunk form runs one torch product)
        return lion_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), log_decays.to(DEVICE), orders,
                              form="rnn", backend="triton").cpu()

    run(orders)
    with AtenCalls() as seen:
        run(orders)
    assert not {"arange", "argsort", "sort", "roll"} & seen.names, seen.names
    from lion_vit.ops import Plan
    attention = partial(lion_attention, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), log_decays.to(DEVICE), orders,
                        form="attention", backend="triton", plan=Plan("attention", "triton", whole=True))
    attention()
    with AtenCalls() as seen:  # (the bidirectional kernel's table of tile spans, kept as the indices are)
        attention()
    assert not {"aminmax", "cat", "argsort"} & seen.names, seen.names
    for other in (orders.flip(0), orders.flip(0).clone()):  # the scans swapped: each scan its other decays
        expected = lion_reference_multiscan(q.double(), k.double(), v.double(), log_decays.double(), other.cpu())
        assert rel_err(run(other), expected) < TOL



def test_one_scan_in_token_order_sums_its_decays_with_no_gathers():
    """A decay per token along one scan in token order (LION-s): the bidirectional kernel's E and I are the sums
    of the log decays as they lie, with no gathers into the scan's order and back, forward and backward; outputs
    and gradients as the reference's, also with a class token whose decay is 1."""
    from lion_vit.ops import Plan
    q, k, v, lam = make_inputs(1, 2, 70, 16, "selective", torch.float32)
    log_decays = torch.log(lam)[None].float()
    log_decays[..., 0] = 0.0
    attention = partial(lion_attention, form="attention", backend="triton", plan=Plan("attention", "triton",
                                                                                     whole=True))
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v, log_decays)]
    attention(*leaves).sum().backward()  # (the first call keeps the scan's indices: _scan_indices)
    with AtenCalls() as seen:
        attention(*leaves).sum().backward()
    assert not {"gather", "scatter", "scatter_add"} & seen.names, seen.names
    _check(attention, lambda *t: lion_attention_reference(*t), [q, k, v, log_decays])


@pytest.mark.parametrize("traced", [False, True])
def test_the_bidirectional_kernels_read_positions_as_int32(traced, monkeypatch):
    """The kernels read each scan's positions, and the table of their tiles' spans, as int32 (half int64's
    registers and bytes in every loop): eagerly from the indices kept with the orders, traced (a compiler's custom
    op) from the positions it computes. Two snakes, training: forward and both backward kernels."""
    read = []
    for name in BIDIRECTIONAL_KERNELS:
        watch_launches(monkeypatch, name, lambda kernel, grid, args, kwargs: read.extend(
            args[kernel.arg_names.index(operand)].dtype for operand in "PT"))
    orders = snake_orders(3, 4, num_prefix_tokens=1).to(DEVICE)
    q, k, v = (t.to(DEVICE).requires_grad_() for t in make_inputs(1, 2, 13, 16, "fixed", torch.float32)[:3])
    log_decays = torch.full((2, 1, 2, 1), -0.5, device=DEVICE)
    if traced:  # (what bidirectional_form runs under a compiler, without compiling)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    lion_attention(q, k, v, log_decays, orders, form="attention", backend="triton").sum().backward()
    assert read == 6 * [torch.int32], read



@pytest.mark.parametrize("dtype, blocks, cap", [(torch.float16, 3, 168), (torch.float16, 2, 255),
                                                (torch.float16, 0, None), (torch.float32, 3, None)])
def test_the_bidirectional_forward_caps_its_registers_to_fit_its_blocks(dtype, blocks, cap, monkeypatch):
    """Tuning.bidirectional_forward_blocks: the forward kernel's launch caps its registers (maxnreg) so that that many
    blocks of its warps (4) fit a multiprocessor's 64 K registers, for 16-bit q, k, v with float32 sums; float32
    launches, which would spill under the cap, and 0 run as ptxas allots them."""
    caps = []
    watch_launches(monkeypatch, "_forward_kernel",
                   lambda kernel, grid, args, kwargs: caps.append(kwargs.get("maxnreg")))
    q, k, v = (t.to(DEVICE, dtype) for t in make_inputs(1, 2, 20, 16, "fixed", torch.float32)[:3])
    with tuned(bidirectional_forward=(64, 64, 4), bidirectional_forward_blocks=blocks), torch.no_grad():
        lion_attention(q, k, v, torch.full((1, 1, 2, 1), -0.5, device=DEVICE), form="attention", backend="triton")
    hopper = q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] == 9  # (the interpreter's: all)
    assert caps == [cap if hopper else None]


def test_compile_kernels_drops_the_register_cap_where_the_code_does_not_set_it():
    """The forward's register cap was measured for Hopper (sm_90); compile_kernels.py compiles the interpreter's
    launches, which record it, without it for other targets (an A100's sm_80), as the code launches there."""
    launch = {"num_warps": 4, "maxnreg": 168, "BLOCK_M": 64}
    assert compile_kernels.for_target(launch, 90) == launch
    assert compile_kernels.for_target(launch, 80) == {"num_warps": 4, "BLOCK_M": 64}


@pytest.mark.parametrize("decay", ["fixed", "selective"])
@pytest.mark.parametrize("scans", [1, 2])
def test_the_bidirectional_kernels_read_within_the_padding_of_their_operands(decay, scans):
    """E, I and the positions run past L to a multiple of every tile of the launch settings (here 128 for 71 tokens:
    the forward's own tile of 64), so that the kernels read them without masks: with NaN just past that padding the
    output is the reference's and every gradient the same bits as without, dE and dI are 0 past L (so the decays'
    gradients take nothing from the padding; past 96, the backward's key tiles of 32, filled), and a backward under
    tiles that do not divide the padding is one clear error."""
    from lion_vit.ops.triton import bidirectional
    g = torch.Generator().manual_seed(5)
    orders = snake_orders(7, 10, num_prefix_tokens=1).to(DEVICE) if scans == 2 else None
    q, k, v = (torch.rand(2, 2, 71, 16, generator=g).to(DEVICE) for _ in range(3))
    log_decays = torch.log(torch.rand(scans, 2, 2, 71 if decay == "selective" else 1, generator=g) * 0.9 + 0.05)
    expected = lion_reference_multiscan(q.double().cpu(), k.double().cpu(), v.double().cpu(), log_decays.double(),
                                        torch.arange(71)[None] if orders is None else orders.cpu())

    def poisoned(x):  # x in a buffer that is NaN past it
        buffer = torch.full((*x.shape[:-1], x.shape[-1] + 32), float("nan"), dtype=x.dtype, device=x.device)
        buffer[..., :x.shape[-1]] = x
        return buffer[..., :x.shape[-1]]

    dy = torch.randn(2, 2, 71, 16, generator=g).to(DEVICE)
    with tuned(bidirectional_forward=(64, 16, 1), bidirectional_backward=(32, 16, 1)):
        q, k, v, E, I, P, _ = bidirectional._prepared(q, k, v, log_decays.to(DEVICE), orders, None)
        assert E.shape[-1] == I.shape[-1] == P.shape[-1] == 128
        runs = []
        for E, I in [(E, I), (poisoned(E.contiguous()), poisoned(I.contiguous()))]:
            y, z = bidirectional._forward(q, k, v, E, I, P, None, "sum", orders is None)
            runs.append([y, *bidirectional._backward(dy, q, k, v, E, I, P, y, z, None, "sum", orders is None)])
    for clean, read_past in zip(*runs):
        assert torch.equal(clean, read_past)
    assert rel_err(runs[1][0].cpu(), expected) < TOL
    dE, dI = runs[1][-2:]
    assert not dE[..., 71:].any() and not dI[..., 71:].any() and dE[..., :71].any()
    with tuned(bidirectional_backward=(256, 16, 1)), pytest.raises(RuntimeError, match="padded to 128 tokens"):
        bidirectional._backward(dy, q, k, v, E, I, P, y, z, None, "sum", orders is None)

GRID = (36, 36)  # 9 x 9 patches of 4 px and a class token: 82 tokens, a chunk of 64 and one of 18 (chunks_always)


def grid_model(name: str, **kwargs) -> torch.nn.Module:
    """A one-block model of width 32 on GRID, its decays random (so the scans differ)."""
    return randomize_decays(timm.create_model(name, num_classes=3, img_size=GRID, patch_size=4, embed_dim=32,
                                              depth=1, num_heads=2, **kwargs).to(DEVICE))


def grid_images(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, *GRID, generator=torch.Generator().manual_seed(0)).to(DEVICE)


@pytest.mark.parametrize("name, forms", [("lion_s_natural_tiny", ("chunk",)), ("lion_d_tiny", ("chunk", "rnn")),
                                         ("lion_lit_tiny", ("attention",)),
                                         ("lion_xlstm_natural_tiny", ("attention",)), ("lion_mamba2_tiny", ("chunk",)),
                                         ("lion_gla_natural_tiny", ("chunk",)), ("lion_hgrn2_tiny", ("rnn",))])
def test_models_give_the_same_logits_on_both_backends(name, forms, chunks_always):
    """A small model in the chunk and rnn forms (and, for a Table 1 family, the fused attention form) on the
    triton backend agrees with the torch backend's attention form, at 82 tokens (the two-scan rnn form: above)."""
    model = grid_model(name).eval()
    x = grid_images(1)
    with torch.no_grad():
        expected = model.set_attn_form("attention", backend="torch")(x)
        for form in forms:
            model.set_attn_form(form, backend="triton")
            run = model.attn_plan(GRID, device=DEVICE)
            assert run.backend == "triton" and (form == "attention" or not run.whole), run
            assert rel_err(model(x), expected) < TOL, form


def test_grad_checkpointing_recomputes_the_fused_attention_form_to_the_same_gradients():
    """grad_checkpointing=true on the triton backend's training form (the fused kernel): the block's forward runs
    again in backward, its kernels' gradients the same bits as without checkpointing."""
    model = grid_model("lion_d_tiny").train().set_attn_form("attention", backend="triton")
    assert model.attn_plan(GRID, device=DEVICE).backend == "triton"
    x = grid_images(2)
    grads, saved = [], []
    for checkpointing in (False, True):
        model.set_grad_checkpointing(checkpointing)
        model.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((checkpointing, t.numel())) or t,
                                                      lambda t: t):
            loss = model(x).logsumexp(-1).sum()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    kept = [sum(n for flag, n in saved if flag == checkpointing) for checkpointing in (False, True)]
    assert kept[1] < kept[0] / 2  # (the one block's input kept, not its activations)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("form, scans, decay", [("chunk", 1, "selective"), ("rnn", 2, "fixed_per_batch")])
def test_inference_runs_the_batch_in_groups_of_images(form, scans, decay, knobs):
    """Without autograd the plan groups the images (Plan.grouped); one image per group (group_share 0) is
    the same function, with decays per image; a grouped call that autograd would record is an error."""
    from lion_vit.ops import dispatch
    knobs(group_share=0)
    height, width = (7, 10) if scans == 2 else (1, 70)
    length = height * width + (scans == 2)
    orders = snake_orders(height, width, num_prefix_tokens=1).to(DEVICE) if scans == 2 else None
    q, k, v, lam = make_inputs(2, 2, length, 16, decay, torch.float32)
    log_decays = torch.log(lam).float()[None].expand(scans, *lam.shape)
    args = [t.to(DEVICE) for t in (q, k, v, log_decays)]
    run = plan(form, None, length, 16, 16, num_scans=scans, device=DEVICE, backend="triton")
    assert run.grouped and not plan(form, None, length, 16, 16, num_scans=scans, device=DEVICE, backend="triton",
                                    training=True).grouped
    with torch.no_grad():
        out = dispatch.implementation(run)(*args, orders)
    expected = lion_reference_multiscan(q.double(), k.double(), v.double(), log_decays.double(),
                                        orders.cpu() if scans == 2 else torch.arange(length)[None])
    assert rel_err(out.cpu(), expected) < TOL
    with pytest.raises(RuntimeError, match="for inference"):
        dispatch.implementation(run)(args[0].requires_grad_(), *args[1:], orders)


@pytest.mark.parametrize("programs, images", [(1, [1, 1, 1]), (8, [1, 2]), (100, [3])])
def test_recurrent_groups_cover_the_multiprocessors(programs, images, monkeypatch, knobs):
    """The recurrent kernel's inference groups hold at least the images whose programs (2 sequences x 2 heads
    each) cover recurrent_group_programs multiprocessors, where group_share alone would give one image a
    group: each launch then takes every image its group holds, and the result is the same function."""
    from lion_vit.ops.triton import fla
    knobs(group_share=0, recurrent_group_programs=programs)
    launched = []
    recurrent = fla._recurrent
    monkeypatch.setattr(fla, "_recurrent", lambda q, *args, **kwargs: launched.append(q.shape[0] // 2)
                        or recurrent(q, *args, **kwargs))
    q, k, v, lam = make_inputs(3, 2, 21, 16, "selective", torch.float32)
    with torch.no_grad():
        out = lion_attention(*(t.to(DEVICE) for t in (q, k, v, torch.log(lam)[None])), form="rnn", backend="triton")
    assert launched == images
    assert rel_err(out.cpu(), lion_reference(q.double(), k.double(), v.double(), torch.log(lam))) < TOL


HALF = torch.bfloat16 if interpret.ON_GPU else torch.float16  # (the interpreter's numpy has no bfloat16)


@pytest.mark.parametrize("form, head_dim, decay_dtype", [("chunk", 16, torch.float32), ("chunk", 15, HALF),
                                                         ("rnn", 16, HALF), ("attention", 16, HALF),
                                                         ("attention", 15, HALF)])
def test_triton_trains_in_half_precision(form, head_dim, decay_dtype, monkeypatch):
    """16-bit q, k, v as autocast makes them, decays in float32 (LION-d's parameter) or 16-bit (LION-s's
    projection): outputs and gradients within half precision's rounding of the same inputs in float64.
    FLA's 16-bit backward refuses odd key or value widths, and the normaliser's column makes the value
    width odd for every even head width."""
    q, k, v, lam = make_inputs(1, 2, 70, head_dim, "selective", torch.float32)
    tensors = [t.to(HALF) for t in (q, k, v)] + [torch.log(lam).to(decay_dtype)]

    def triton(q, k, v, log_decay):
        return lion_attention(q, k, v, log_decay[None], form=form, backend="triton")

    _check(triton, lion_reference, tensors, tol=3e-2 if interpret.ON_GPU else 3e-3)


@pytest.mark.parametrize("name, form", [("lion_s_natural_tiny", "chunk"), ("lion_s_natural_tiny", "attention"),
                                        ("lion_s_tiny", "attention")])
@pytest.mark.slow
def test_a_compiled_mixed_precision_training_step_matches_the_torch_backend(name, form, chunks_always, monkeypatch):
    """A selective model's loss and gradients under autocast (a GPU's bfloat16; float16 on a CPU), compiled (graph
    breaks around FLA's calls; the bidirectional kernel's are custom ops of the graph), through the chunk kernels
    (with a backward of their forward pass where FLA's own fails) or the bidirectional kernel, against the torch
    backend's form, eager, on the same weights, at 82 tokens: two scans, and one in token order (its decays summed
    as they lie)."""
    model = grid_model(name)
    x = grid_images(2)
    y = torch.tensor([0, 2], device=DEVICE)
    losses, grads = [], []
    for backend in ("torch", "triton"):
        model.zero_grad()
        model.set_attn_form(form, backend=backend)
        step = torch.compile(model, backend="aot_eager") if backend == "triton" else model
        with torch.autocast(DEVICE.type, dtype=HALF):
            loss = torch.nn.functional.cross_entropy(step(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad.flatten().float() for name, p in model.named_parameters()})
    assert model.attn_plan(GRID).backend == "triton"
    # bfloat16 (a GPU's) keeps 8 bits of mantissa, float16 11: the tolerances differ by about 2^3
    tol = 3e-2 if interpret.ON_GPU else 3e-3
    assert losses[1] == pytest.approx(losses[0], rel=1e-2 if interpret.ON_GPU else 1e-3)
    assert rel_err(torch.cat(list(grads[1].values())), torch.cat(list(grads[0].values()))) < tol
    # and the gradient that reaches q, k, v through the kernels' backward on its own: the head's and the
    # MLP's, far larger, would hide an error of the attention's output of several percent in the sum
    qkv = "blocks.0.attn.qkv.weight"
    assert rel_err(grads[1][qkv], grads[0][qkv]) < tol


@pytest.mark.parametrize("name, form", [("lion_s_natural_tiny", "chunk"), ("lion_s_natural_tiny", "attention"),
                                        ("lion_lit_tiny", "attention")])
def test_compiled_inference_runs_the_kernels_as_one_op_of_the_graph(name, form, chunks_always, monkeypatch):
    """Inference on the triton backend compiles with fullgraph=True: the kernels are one custom op of the
    graph, not a break (so mode="reduce-overhead" can replay the whole forward as a CUDA graph), with
    eager's logits. Training breaks the graph around FLA's autograd Functions; the bidirectional kernel's
    training (and LION-lit's linear kernels') is a custom op with its backward, so it compiles whole too, with
    eager's loss and gradients."""
    model = grid_model(name, attn_form=form, attn_backend="triton").eval()
    bidirectional = model.attn_plan(GRID).whole  # (the attention form: the bidirectional kernel, or the linear ones)
    assert model.attn_plan(GRID).grouped or bidirectional
    x = grid_images(2)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(x)
        assert rel_err(torch.compile(model, fullgraph=True, backend="aot_eager")(x), expected) < 1e-6
    model.train()
    if not bidirectional:
        with pytest.raises(torch._dynamo.exc.Unsupported):  # training: the graph breaks at the kernels' call
            torch.compile(model, fullgraph=True, backend="aot_eager")(x)
        return
    eager = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    loss = torch.compile(model, fullgraph=True, backend="aot_eager")(x).square().sum()
    for got, want in zip(torch.autograd.grad(loss, list(model.parameters())), eager):
        assert rel_err(got, want, min_scale=1.0) < 1e-5


@pytest.mark.parametrize("fallback, scans, decay, dtype", [
    ("torch", 1, "selective", torch.float32), ("rnn", 1, "selective", torch.float32),
    ("forward", 1, "selective", torch.float32), ("forward", 1, "near1", torch.float32),
    ("forward", 2, "fixed", torch.float32), ("forward", 1, "selective", HALF)])
def test_training_where_the_chunk_backward_fails_is_still_exact(monkeypatch, knobs, fallback, scans, decay, dtype):
    """Where FLA's chunk backward fails (Hopper with Triton 3.4.0-3.7.0), training in the chunk form runs
    the portable chunk form, the fused recurrent kernels or the chunk kernels with a backward of their
    forward pass: the same outputs and gradients (two scans over an 11x18 grid and a class token)."""
    from lion_vit.ops import dispatch
    knobs(chunk_backward_fails=True, chunk_backward_fallback=fallback)
    monkeypatch.setattr(dispatch, "_warned", set())
    orders = None if scans == 1 else snake_orders(11, 18, num_prefix_tokens=1).to(DEVICE)
    q, k, v, lam = make_inputs(1, 2, 70 if scans == 1 else 199, 16, decay, torch.float32)
    log_decays = torch.log(lam if scans == 1 else torch.stack([lam, lam ** 0.5])).float()
    if scans == 1:
        def triton(q, k, v, log_decay):
            return lion_attention(q, k, v, log_decay[None], form="chunk", backend="triton")
        reference = lion_reference
    else:
        def triton(q, k, v, log_decays):
            return lion_attention(q, k, v, log_decays, orders, form="chunk", backend="triton")
        reference = partial(lion_reference_multiscan, orders=orders.cpu())
    with pytest.warns(UserWarning, match="chunk backward fails"):
        _check(triton, reference, [t.to(dtype) for t in (q, k, v)] + [log_decays],
               tol=TOL if dtype == torch.float32 else 3e-2 if interpret.ON_GPU else 3e-3)
    assert plan("chunk", None, q.shape[2], 16, 16, num_scans=scans, device=DEVICE, backend="triton",
                training=True).backward_by_forward is (fallback == "forward")


@pytest.mark.skipif(interpret.ON_GPU, reason="the proxy counts operators around the interpreter's kernel launches")
def test_the_forward_fallback_writes_its_stacked_inputs_once():
    """The "forward" fallback's backward, counted by scripts/benchmark_traffic.py (float16, 256 tokens, head
    width 16, where it writes 21.1 (q+k+v), 2.0 of it the float32 per-token scalars): the three problems'
    stacked inputs are written once each (reversed as they are copied, not flipped and then stacked: 2.7
    more), and the gates' dot products sum 16-bit products in float32 without float32 copies of q, dq, k, dk
    (5.3 more; docs/benchmarks.md, "Traffic", counts it at head width 64)."""
    import runpy
    measure = runpy.run_path(str(interpret.ROOT / "scripts" / "benchmark_traffic.py"))["measure_traffic"]
    result = measure("chunk", tokens=256, heads=1, head_dim=16, dtype=torch.float16, fallback="forward")
    assert result["backward"] <= 22 and result["float32 backward"] <= 2.5, result
    assert "flip" not in result["by operator"] and result["backward by operator"]["flip"] <= 2.0, result


@pytest.mark.parametrize("decay", ["lit", "selective", "near0", "near1"])
def test_the_normaliser_scan_matches_its_recurrence(decay):
    """The normaliser kernels (ops/triton/normaliser.py) against n_p = scale q_p . s_p, s_p = exp(g_p) s_{p-1} +
    k_p run token by token in float64, with gradients of q, k and the gates, over seven chunks of 32 tokens
    (the last one partial), one program each, whose carries read the chunk sums before them two at a time
    (Tuning.normaliser_launch, set for the forward only: the backward launches as its forward did), and a
    width that is not a power of two."""
    from lion_vit.ops.triton import normaliser
    sequences, length, heads, width, scale = 2, 200, 2, 40, 0.25
    q, k, _, lam = make_inputs(sequences, heads, length, width, decay, torch.float64)
    q, k = (t.transpose(1, 2).contiguous() for t in (q, k))  # the kernels' [N, L, H, W]
    gates = None if lam is None else torch.log(lam).expand(sequences, heads, length).transpose(1, 2).contiguous()

    def recurrence(q, k, gates=None):
        state, normalisers = torch.zeros_like(k[:, 0]), []
        for p in range(length):
            state = state * (1.0 if gates is None else gates[:, p, :, None].exp()) + k[:, p]
            normalisers.append(scale * (q[:, p] * state).sum(-1))
        return torch.stack(normalisers, 1)

    def kernel(q, k, gates=None):
        with tuned(normaliser_launch=(32, 2, 4)):
            return normaliser.Normaliser.apply(q, k, gates, scale)

    _check(kernel, recurrence, [q.float(), k.float()] + ([] if gates is None else [gates.float()]),
           value_shape=(sequences, length, heads))


@pytest.mark.skipif(interpret.ON_GPU, reason="on a GPU the sweep times every combination: run the script")
def test_the_normaliser_sweep_compares_other_launch_settings_with_the_code(capsys):
    """scripts/benchmark_normaliser.py (the GPU sweep of the scan's launch settings) under the interpreter: chunks
    of 16 tokens (three over 37 tokens) with carries read two at a time give the normalisers and gradients of
    the code's settings, which it leaves as they were."""
    import runpy
    main = runpy.run_path(str(interpret.ROOT / "scripts" / "benchmark_normaliser.py"))["main"]
    assert main(["--img-size", "96", "--batch-sizes", "1", "--tokens", "16", "--warps", "4", "--carry", "2"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert [[cell.strip() for cell in row[:4]] for row in rows] == [["1", "64", "4", "16"], ["1", "16", "4", "2"]]
    assert all(float(row[-1]) < 1e-4 for row in rows)
    assert tuning().normaliser_launch == (64, 16, 4)


@pytest.mark.skipif(interpret.ON_GPU, reason="on a GPU the script times every setting: the fused part runs it")
@pytest.mark.slow
def test_the_fused_kernels_benchmark_compares_each_setting_with_the_codes(capsys):
    """scripts/benchmark_fused.py (the GPU timing of the bidirectional kernel's launch settings) under the
    interpreter: at 37 tokens (a 6 x 6 grid and a class token, one and two scans) the bidirectional kernel in
    another setting of each kernel, with the backward's key kernel in its other orientation, with its masks
    factored the other way, with its feature map the other way (Tuning.bidirectional_map_pass), with its forward's
    registers capped the other way (Tuning.bidirectional_forward_blocks), and the portable form, match the kernel
    in the code's settings within float16's rounding, outputs and gradients, and the code's settings are left as
    they were; softmax attention as a Triton kernel in the code's settings (the "softmax kernel" row) matches
    SDPA's."""
    import runpy
    before = tuning()
    main = runpy.run_path(str(interpret.ROOT / "scripts" / "benchmark_fused.py"))["main"]
    assert main(["--img-size", "96", "--batch-size", "1", "--forward", "32,16,2", "--backward", "16,16,2",
                 "--cases", "lion_s", "lion_s_natural"]) == 0
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| lion_s")]
    forward, backward = (",".join(map(str, setting)) for setting in (before.bidirectional_forward,
                                                                      before.bidirectional_backward))
    keys_first = " keys first" if before.bidirectional_keys_first else ""
    entrywise = "" if before.bidirectional_factored_masks else " entrywise"  # (the code's, and the other way)
    in_loops = "" if before.bidirectional_map_pass else " maps in loops"
    other_keys, other_masks = " keys first" if not keys_first else "", " entrywise" if not entrywise else ""
    other_maps = " maps in loops" if not in_loops else ""
    uncapped = "" if before.bidirectional_forward_blocks else " uncapped"
    other_cap = " uncapped" if not uncapped else ""
    code = [forward + entrywise + in_loops + uncapped, backward + keys_first + entrywise + in_loops]
    for case in ("lion_s", "lion_s_natural"):
        ours = [row for row in rows if row[:2] == [case, "bidirectional"]]
        assert [row[2:4] for row in ours] == [
            code, ["32,16,2" + entrywise + in_loops + uncapped, code[1]],
            [code[0], "16,16,2" + keys_first + entrywise + in_loops],
            [code[0], backward + other_keys + entrywise + in_loops],
            [forward + other_masks + in_loops + uncapped, backward + keys_first + other_masks + in_loops],
            [forward + entrywise + other_maps + uncapped, backward + keys_first + entrywise + other_maps],
            [forward + entrywise + in_loops + other_cap, code[1]]]
        compared = ours[1:] + [row for row in rows if row[:2] == [case, "torch"]]
        assert ours[0][-1] == "" and len(compared) == 7 and all(float(row[-1]) < 3e-3 for row in compared)
        assert [row[1] for row in rows if row[0] == case] == ["sdpa", "softmax kernel"] + ["bidirectional"] * 7 + [
            "torch"]
        softmax = next(row for row in rows if row[:2] == [case, "softmax kernel"])
        assert softmax[2:4] == [forward, backward] and float(softmax[-1]) < 3e-3
    assert tuning() is before


@pytest.mark.skipif(interpret.ON_GPU, reason="on a GPU the script times every setting: the fused part runs it")
def test_the_fused_kernels_benchmark_times_lion_lits_three_routes(capsys):
    """benchmark_fused.py's LION-lit rows: its code's linear kernels ("linear kernels") and Q (K^T V) in torch matmuls
    ("linear") beside the bidirectional kernel forced with every decay 1, all within float16's rounding of it."""
    import runpy
    main = runpy.run_path(str(interpret.ROOT / "scripts" / "benchmark_fused.py"))["main"]
    codes = [",".join(map(str, setting)) for setting in (tuning().bidirectional_forward,
                                                         tuning().bidirectional_backward)]
    assert main(["--img-size", "96", "--batch-size", "1", "--forward", codes[0], "--backward", codes[1],
                 "--cases", "lion_lit"]) == 0
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| lion_lit")]
    assert [row[1] for row in rows] == ["sdpa", "softmax kernel"] + ["bidirectional"] * 5 + ["linear kernels", "linear"]
    assert all(float(row[-1]) < 3e-3 for row in rows[6:])


@pytest.mark.skipif(interpret.ON_GPU, reason="on a GPU the script times every setting: the fused part runs it")
def test_the_fused_kernels_benchmark_goes_on_past_a_kernel_that_fails(capsys, monkeypatch):
    """A launch setting that fails on a GPU (its compiler's or the driver's error) is a row of status error with its
    reason printed; the other settings' rows are still measured, and the exit code is 1."""
    import runpy
    from lion_vit.ops import triton as triton_backend
    kernel = triton_backend.bidirectional_form

    def fails_in_one_setting(*args, **kwargs):
        if tuning().bidirectional_forward == (32, 16, 2):
            raise RuntimeError("Triton Error [CUDA]: invalid argument")
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "bidirectional_form", fails_in_one_setting)
    main = runpy.run_path(str(interpret.ROOT / "scripts" / "benchmark_fused.py"))["main"]
    assert main(["--img-size", "64", "--batch-size", "1", "--forward", "32,16,2", "--backward", "16,16,2",
                 "--cases", "lion_d"]) == 1
    out = capsys.readouterr().out
    backward = ",".join(map(str, tuning().bidirectional_backward)) + (" keys first" if tuning().bidirectional_keys_first
                                                                      else "")
    assert f"lion_d bidirectional 32,16,2 {backward}: RuntimeError: Triton Error [CUDA]: invalid argument" \
        in out.splitlines()
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("| lion_d")]
    assert [row[1] for row in rows] == ["sdpa", "softmax kernel"] + ["bidirectional"] * 7 + ["torch"]
    assert [row[4] for row in rows] == ["ok", "ok", "ok", "error", "ok", "ok", "ok", "ok", "ok", "ok"]


def test_kernels_unpack_into_flat_names_only():
    """Triton 3.6 (the GPU machines', with their PyTorch 2.11) hashes a kernel's source with its callees' before the
    first launch, and a nested unpacking target there, `(a, b), (c, d) = ...`, raises TypeError: unhashable type 'list'.
    Neither the interpreter nor a newer Triton's compiler tells, so no @triton.jit function of ours has one."""
    import ast
    nested = []
    for path in sorted((interpret.ROOT / "lion_vit" / "ops" / "triton").glob("*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if isinstance(function, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in function.decorator_list):
                for node in ast.walk(function):
                    for target in getattr(node, "targets", [getattr(node, "target", None)]):
                        if isinstance(target, ast.Tuple) and any(isinstance(e, ast.Tuple) for e in target.elts):
                            nested.append(f"{path.name}:{node.lineno} {function.name}: {ast.unparse(target)}")
    assert not nested, nested


# A kernel that Triton's interpreter runs (Python's loop variable changes type freely) and its compiler refuses
NATIVE_ONLY_ERROR = """
import triton
import triton.language as tl


@triton.jit
def loop_sum(x, y, n):
    total = 0  # int32 before the loop, float32 in it
    for i in range(n):
        total += tl.load(x + i)
    tl.store(y, total)
"""


@pytest.mark.skipif(interpret.ON_GPU, reason="on a GPU the tests above compile and run every kernel natively")
@pytest.mark.slow
def test_every_kernel_compiles_for_hopper_where_the_interpreter_would_not_tell(tmp_path):
    """scripts/compile_kernels.py: --save-records writes the launches that the triton backend's calls make here
    (recorded under the interpreter, not run) and stops, for another Triton (a GPU machine's) to compile;
    --records compiles them for sm_90 as a GPU's first call would, each of the ops' fourteen kernels in float32,
    float16 and bfloat16, and data.decode=gpu's crop kernel (of uint8 pixels); a kernel that the interpreter runs
    but the compiler refuses fails the check, named with the reason."""
    script, records = str(interpret.ROOT / "scripts" / "compile_kernels.py"), tmp_path / "launches.json"
    result = subprocess.run([sys.executable, script, "--quick", "--save-records", str(records)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    launches = json.loads(records.read_text())
    assert result.stdout.splitlines()[-1] == f"{len(launches)} launches recorded into {records}"
    assert {name for _, name, _, _ in launches} >= {"_forward_kernel", "_backward_keys_kernel", "_scan_kernel"}
    # the ops' kernels contract multiply-adds (Triton 3.10's default will not); the crop kernel computes as PIL's C
    assert {(module.split(".")[1], kwargs.get("enable_fp_fusion")) for module, _, _, kwargs in launches} == \
        {("ops", True), ("data", False)}
    assert "ok   sm_" not in result.stdout  # recorded, not compiled
    if compile_kernels.nvidia_tool("ptxas") is None:
        pytest.skip("no ptxas to compile with (Triton's Linux x86-64 wheels bring one)")
    (tmp_path / "native_only.py").write_text(NATIVE_ONLY_ERROR)
    pointer = {"tensor": "float32", "aligned": True}
    launches.append(["native_only", "loop_sum", [pointer, pointer, 24], {}])
    records.write_text(json.dumps(launches))
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), str(interpret.ROOT)]),
               TRITON_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, script, "--arch", "90", "--quick", "--records", str(records)], env=env,
                            capture_output=True, text=True, timeout=600)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout + result.stderr
    ok = [line for line in lines if line.startswith("ok   sm_90 ")]
    compiled = {tuple(line.split()[2:4]) for line in ok}
    kernels = ["_operands_kernel", "_operands_backward_kernel", "_finish_kernel", "_finish_backward_kernel",
               "_sums_kernel", "_scan_kernel", "_forward_kernel", "_factors_kernel", "_backward_keys_kernel",
               "_backward_queries_kernel", "_map_kernel", "_linear_state_kernel", "_linear_output_kernel",
               "_linear_queries_backward_kernel", "_linear_keys_backward_kernel"]
    assert compiled == {(kernel, dtype) for kernel in kernels for dtype in ("float32", "float16", "bfloat16")} | \
        {("_pass_kernel", "float32")}
    # each line also names its tensor-core instructions and the blocks a multiprocessor fits: Hopper's wgmma for
    # the bidirectional forward's 64-token tiles in bfloat16
    forward = next(line for line in ok if line.split()[2:4] == ["_forward_kernel", "bfloat16"])
    assert re.search(r", wgmma [1-9]\d*, mma.sync \d+, [1-9]\d* blocks a multiprocessor$", forward), forward
    failed = [line for line in lines if line.startswith("FAIL")]
    assert failed == ["FAIL sm_90 loop_sum float32 "] and "Loop-carried variable total" in result.stdout
    assert lines[-1] == f"{len(ok)} of {len(ok) + 1} launches compiled for sm_90"


def test_compile_kernels_counts_the_code_of_a_kernels_loops_in_its_sass():
    """compile_kernels.loop_code (--loops): the instructions from the lowest target of a backward branch to the last
    backward branch before the kernel's last EXIT (the latch, predicated or not), predicated ones and every branch
    inside included, and the special-function ones and barriers among them; not the epilogue, nor the out-of-line
    blocks after that EXIT that branch back into the loop (a reduction's divergence path, as ptxas places them); a
    forward branch (an if) opens no loop, and a kernel without a backward branch has no loop. loop_paths: the
    fewest and the most of them an iteration issues, the if taken or not, the divergence branch falling through."""
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   MUFU.RCP R2, R3 ;
        /*0020*/                   FMUL R4, R2, R2 ;
        /*0030*/               @P0 BRA 0x70 ;
        /*0040*/                   MUFU.EX2 R5, R4 ;
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0060*/                   BRA.DIV UR6, 0xd0 ;
        /*0070*/                   MUFU.EX2 R6, R4 ;
        /*0080*/              @!P1 BRA 0x20 ;
        /*0090*/                   MUFU.RCP R7, R6 ;
        /*00a0*/                   MUFU.EX2 R8, R7 ;
        /*00b0*/                   STG.E [R2.64], R8 ;
        /*00c0*/                   EXIT ;
        /*00d0*/                   SHFL.BFLY PT, R9, R6, 0x1, 0x1f ;
        /*00e0*/                   BRA 0x70 ;
        /*00f0*/                   BRA 0xf0;
"""
    assert compile_kernels.loop_code(sass) == (7, 2, 1)  # 0x20-0x80: FMUL, BRA, MUFU, BAR, BRA.DIV, MUFU, BRA
    assert compile_kernels.loop_code(sass.replace("@!P1 BRA 0x20", "BRA 0x20")) == (7, 2, 1)
    assert compile_kernels.loop_paths(sass) == (4, 7)  # the if taken: FMUL, BRA, MUFU, BRA
    assert compile_kernels.loop_paths(sass.replace("@P0 BRA 0x70", "BRA 0x70")) == (4, 4)
    assert compile_kernels.loop_paths(sass.replace("@P0 BRA 0x70", "@P0 BRA 0x50")) == (6, 7)
    assert compile_kernels.loop_code(sass.replace("BRA 0x20", "BRA 0xc0").replace("BRA 0x70 ;\n        /*00f0",
                                                                                  "EXIT ;\n        /*00f0")) is None


def test_compile_kernels_records_the_bidirectional_kernels_in_a_launch_setting_given(tmp_path, capsys):
    """--bidirectional-backward (and -forward) record the bidirectional kernels' launches in that setting, and
    --bidirectional-keys-first (or -queries-first), --bidirectional-entrywise-masks, --bidirectional-maps-in-loops
    with those knobs (the last: no map pass), so that a setting's registers and tensor-core instructions can be read
    without a GPU; a setting the kernels cannot run is the parser's one-line error."""
    own, loop, warps = tuning().bidirectional_forward
    for orientation, keys_first in (("--bidirectional-keys-first", True), ("--bidirectional-queries-first", False)):
        records = tmp_path / f"launches{orientation}.json"
        assert compile_kernels.main(["--quick", "--save-records", str(records), "--bidirectional-backward", "32,32,4",
                                     orientation, "--bidirectional-entrywise-masks",
                                     "--bidirectional-maps-in-loops"]) == 0
        settings = {(name, *(kwargs.get(key) for key in ("BLOCK_M", "BLOCK_N", "num_warps", "KEYS_FIRST",
                                                         "FACTORED")))
                    for module, name, _, kwargs in json.loads(records.read_text()) if module.endswith("bidirectional")}
        assert settings == {("_forward_kernel", own, loop, warps, None, False), ("_factors_kernel", *[None] * 5),
                            ("_backward_keys_kernel", 32, 32, 4, keys_first, False),
                            ("_backward_queries_kernel", 32, 32, 4, None, False)}
    for bad in ("64,24,4", "64,x,4"):
        with pytest.raises(SystemExit) as stopped:
            compile_kernels.main(["--bidirectional-forward", bad])
        said = capsys.readouterr().err
        assert stopped.value.code == 2 and f"'{bad}' must be (own tile, loop tile, warps)" in said, said


def test_softmax_baseline_is_softmax_attention():
    """scripts/benchmark_issue.py's baseline computes softmax attention: its output and the gradients of q, k, v
    against the float64 reference, at a length past a multiple of its tiles."""
    from benchmark_issue import softmax_attention
    g = torch.Generator().manual_seed(0)
    projection = torch.randn(2, 37, 3, 3, 16, generator=g)  # q, k, v [B, H, L, D]: views of it, as benchmark_fused's
    upstream = torch.randn(2, 3, 37, 16, generator=g)
    leaf = projection.to(DEVICE).requires_grad_()
    out = softmax_attention(*leaf.permute(2, 0, 3, 1, 4).unbind(0), forward=(16, 16, 1), backward=(32, 16, 1))
    (grad,) = torch.autograd.grad(out, leaf, upstream.to(DEVICE))
    reference = projection.double().requires_grad_()
    q, k, v = reference.permute(2, 0, 3, 1, 4).unbind(0)
    expected = torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ v
    (expected_grad,) = torch.autograd.grad(expected, reference, upstream.double())
    assert rel_err(out.cpu(), expected) < TOL
    for name, at in zip("qkv", range(3)):
        assert rel_err(grad[:, :, at].cpu(), expected_grad[:, :, at]) < TOL, f"grad of {name}"


@pytest.mark.skipif(interpret.ON_GPU, reason="a compile check for machines without a GPU")
@pytest.mark.slow
def test_benchmark_issue_sets_each_kernel_against_softmax_in_its_setting(tmp_path):
    """scripts/benchmark_issue.py: each of the three bidirectional kernels of a training step, one scan and two, in
    the launch settings given (else the code's), beside softmax's kernel of the same role with the same tiles and
    warps; an iteration's instructions per pair of tokens, the fewest no more than the most, and the ratios printed
    from them."""
    if compile_kernels.nvidia_tool("cuobjdump") is None:
        pytest.skip("no cuobjdump to read the SASS with (Triton's Linux x86-64 wheels bring one)")
    out = tmp_path / "issue.json"
    script = str(interpret.ROOT / "scripts" / "benchmark_issue.py")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    result = subprocess.run([sys.executable, script, "--bidirectional-backward", "32,32,4", "--out", str(out)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())
    own, loop, warps = tuning().bidirectional_forward
    assert [(row["scans"], row["kernel"], tuple(row["tiles"]), row["warps"]) for row in rows] == [
        (scans, kernel, tiles, warp_count) for scans in (1, 2) for kernel, tiles, warp_count in
        (("forward", (own, loop), warps), ("keys", (32, 32), 4), ("queries", (32, 32), 4))]
    for row in rows:
        for side in ("ours", "softmax"):
            fewest, most = row[side]["per_pair"]
            assert 0 < fewest <= most and row[side]["registers"] > 0 and row[side]["blocks"] >= 1
            assert fewest == row[side]["iteration"][0] * row["warps"] / (row["tiles"][0] * row["tiles"][1])
    forward = rows[0]
    ratio = forward["ours"]["per_pair"][0] / forward["softmax"]["per_pair"][0]
    assert f"| forward | {own}x{loop}, {warps} |" in result.stdout and f"x{ratio:.2f}-" in result.stdout


def test_quick_compiles_each_kernels_code_once_and_each_kernel_in_every_dtype():
    """--quick: launches that differ only in their 16-bit dtype or their arguments' values compile once, in
    bfloat16 where they read 16-bit tensors; each kernel also once in float32 and in float16. A launch that
    reads another dtype (float64) is other code."""
    def launch(name, dtype, flag, n=20, other="float32"):
        return ["m", name, [{"tensor": dtype, "aligned": True}, {"tensor": other, "aligned": True}, n], {"FLAG": flag}]

    recorded = [launch("a", dtype, flag, n) for dtype in ("float32", "float16") for flag in (0, 1) for n in (20, 32)]
    recorded += [launch("a", "float16", 0, other="float64"), launch("b", "float32", 0)]
    assert len(compile_kernels.to_compile(recorded, quick=False)) == 10 + 5  # each float16 launch also in bfloat16
    quick = [(name, args[0]["tensor"], flags["FLAG"], args[1]["tensor"], args[2])
             for _, name, args, flags in compile_kernels.to_compile(recorded, quick=True)]
    assert quick == [("a", "float32", 0, "float32", 20), ("a", "float16", 0, "float32", 20),
                     ("a", "bfloat16", 0, "float32", 20), ("a", "bfloat16", 1, "float32", 20),
                     ("a", "bfloat16", 0, "float64", 20), ("b", "float32", 0, "float32", 20)]


@pytest.mark.parametrize("where, entered", [(("cuda", 1), [torch.device("cuda", 1)]), (("cuda", 0), []),
                                            (("cpu",), [])])
def test_kernels_launch_with_their_inputs_device_current(where, entered, monkeypatch):
    """Triton launches on the current CUDA device: a call on tensors of another device (a model on cuda:1,
    current device 0) runs with theirs current; on the current device or a CPU nothing is entered."""
    from lion_vit.ops.triton.fla import launched_on_device_of
    seen = []

    class Device:  # torch.cuda.device's stand-in: no GPU needed
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            seen.append(self.device)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    tensor = type("Tensor", (), {"device": torch.device(*where), "is_cuda": where[0] == "cuda"})()
    assert launched_on_device_of(1)(lambda kernel, q, *rest: (kernel, rest))("kernel", tensor, 2) == ("kernel", (2,))
    assert seen == entered


def test_triton_refuses_float64():
    q, k, v, lam = make_inputs(1, 1, 8, 16, "fixed", torch.float64)
    with pytest.raises(ValueError, match="float64.*backend='torch'"):
        lion_attention(q, k, v, torch.log(lam)[None], form="chunk", backend="triton")


@pytest.mark.skipif(not interpret.ON_GPU, reason="bfloat16 kernels need a GPU (the interpreter computes through numpy)")
@pytest.mark.parametrize("form", ["chunk", "rnn", "attention"])
def test_triton_bfloat16_is_within_its_rounding(form, monkeypatch):
    q, k, v, lam = make_inputs(2, 4, 1000, 64, "selective", torch.float32)
    log_decay = torch.log(lam).float()
    out = lion_attention(*(t.to(DEVICE, torch.bfloat16) for t in (q, k, v)), log_decay[None].to(DEVICE),
                         form=form, backend="triton")
    assert out.dtype == torch.bfloat16
    assert rel_err(out.cpu(), lion_reference(q, k, v, log_decay)) < 3e-2


@pytest.mark.parametrize("form", ["chunk", "rnn", "attention"])
def test_triton_backend_refuses_double_backward_in_one_line(form, monkeypatch):
    """The kernels' hand-written backwards have no double backward: a second-order gradient is one clear
    error, while first-order gradients (and backward twice) still work."""
    q, k, v, lam = make_inputs(1, 1, 20, 16, "selective", torch.float32)
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v, torch.log(lam)[None])]
    out = lion_attention(*leaves, form=form, backend="triton")
    if plan(form, None, 20, 16, 16, device=DEVICE, backend="triton", training=True).backend != "triton":
        # where FLA's chunk backward fails and the portable chunk form is the fallback: it has double backward
        assert torch.isfinite(torch.autograd.grad(out.square().sum(), leaves[0], create_graph=True)[0]).all()
        return
    with pytest.raises(RuntimeError, match="no double backward; for second-order gradients use attn_backend='torch'"):
        torch.autograd.grad(out.square().sum(), leaves, create_graph=True)
    out = lion_attention(*leaves, form=form, backend="triton")
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.square().sum(), leaves))


@pytest.mark.parametrize("form", ["chunk", "rnn", "attention", "linear"])
def test_float16_normalisers_of_long_sequences_stay_finite(form, monkeypatch):
    """Decays near 1 make the normaliser grow like L (here past float16's 65,504, asserted below); the
    kernels' power-of-two scale on q keeps numerator and normaliser finite (docs/design.md, "float16").
    1,024 tokens is what the interpreter affords (seconds), with queries large enough to overflow float16
    there; the bound covers 12,544. (The bidirectional kernel keeps both in float32 registers, and LION-lit's linear
    kernels ("linear": no decay) their state and sums.)"""
    q, k, v = float16_overflowing_inputs(1024)
    log_decay = None if form == "linear" else torch.full((1, 1, 1), -1e-5)
    out = lion_attention(*(t.to(DEVICE, torch.float16) for t in (q, k, v)),
                         None if log_decay is None else log_decay[None].to(DEVICE),
                         form="attention" if form == "linear" else form, backend="triton")
    assert torch.isfinite(out).all()
    assert rel_err(out.cpu(), lion_reference(q.double(), k.double(), v.double(),
                                             None if log_decay is None else log_decay.double())) < 3e-3


@pytest.mark.skipif(interpret.ON_GPU, reason="the proxy counts operators around the interpreter's kernel launches")
@pytest.mark.parametrize("form, tokens, dtype, written, saved, backward", [
    ("chunk", 256, torch.float16, 6.5, 3.5, 13.5), ("rnn", 128, torch.float32, 4.5, 4.2, 10.5),
    ("attention", 197, torch.float16, 2.1, 1.5, 5.6)])
@pytest.mark.slow
def test_memory_traffic_proxy_around_the_kernels(form, tokens, dtype, written, saved, backward):
    """scripts/benchmark_traffic.py on one attention module (qkv, LION op, proj) at 256 tokens (rnn: 128, where
    its forward multiples are the same), head width 64, training: bytes written by PyTorch operators and saved
    for backward, and written by the backward, as multiples of |q| + |k| + |v|, meet the goals
    docs/benchmarks.md ("Traffic") records; in float16 the backward writes no more than 3.5 (q+k+v) in float32
    (FLA's chunk states, the normalisers' gradients). In a float16 evaluation forward only per-token, per-head
    scalars around the kernels are float32 (gates, folds, normalisers) and the normaliser scan's chunk sums (a
    vector per 64 tokens: about one more scalar per token), and the peak of what the call allocates, three
    images run in groups, stays within the projection, Y and the kernels' share (group_share; 4.4 for one image
    in one call, docs/benchmarks.md, "Peak"). The attention form on the bidirectional kernel, at 197 tokens, keeps
    about what DeiT-S's attention does (1.3 at one head) and writes a third of (q+k+v) more forward than it (1.7)
    and a little over one more backward (4.4): the map pass's features of k forward, of q and k backward
    (Tuning.bidirectional_map_pass), and backward dn = dY r, which the key kernel reads in every iteration."""
    import runpy
    measure = runpy.run_path(str(interpret.ROOT / "scripts" / "benchmark_traffic.py"))["measure_traffic"]
    result = measure(form, tokens=tokens, heads=1, head_dim=64, dtype=dtype)
    assert result["written"] <= written and result["saved"] <= saved and result["backward"] <= backward, result
    assert result["by operator"]["addmm"] == pytest.approx(4 / 3)  # the counting itself: qkv and proj outputs
    if dtype == torch.float16:
        assert result["float32 backward"] <= 3.5, result
    if form == "chunk":  # an evaluation forward in float16: the same operators, no autograd
        inference = measure(form, tokens=256, heads=1, head_dim=64, dtype=torch.float16, training=False, batch=3)
        assert inference["float32 share"] < 0.03 and inference["saved"] == 0, inference
        assert inference["peak"] <= 1 + 1 / 3 + tuning().group_share + 0.05, inference
        assert inference["at peak"]["addmm"] == pytest.approx(1.0)  # qkv, alive while the op runs; proj not yet


@pytest.mark.skipif(interpret.ON_GPU, reason="the proxy counts operators around the interpreter's kernel launches")
def test_lion_lits_linear_kernels_write_and_keep_about_what_deit_s_attention_does():
    """scripts/benchmark_traffic.py on LION-lit's attention module at 197 tokens, 6 heads of 64, training under
    bfloat16 autocast (a GPU's), batch 8: around its linear kernels PyTorch writes, keeps and writes in backward
    within 0.3 (q+k+v) of what it does around DeiT-S's SDPA (the kernels' float32 state, 0.2), where Q (K^T V) in
    torch matmuls wrote 5.8, kept 3.8 and wrote 12.8 in backward (docs/benchmarks.md, "LION-lit's linear kernels")."""
    import runpy
    measure = runpy.run_path(str(interpret.ROOT / "scripts" / "benchmark_traffic.py"))["measure_traffic"]
    common = dict(tokens=197, batch=8, dtype=torch.bfloat16, autocast=True)
    deit, lit = measure("deit", **common), measure("attention", decay="lit", **common)
    for key in ("written", "saved", "backward"):
        assert lit[key] <= deit[key] + 0.3, (key, lit, deit)


@pytest.mark.skipif(interpret.ON_GPU, reason="the proxy counts operators around the interpreter's kernel launches")
def test_the_traffic_proxys_peak_does_not_wait_for_the_garbage_collector():
    """The interpreter's argument copies hold each launch's storages in reference cycles; the proxy collects
    them after each launch, so its peak is the call's own whenever Python's collector would run (before, it
    depended on the Python version, and with the collector off was all that was written: docs/benchmarks.md,
    "Python versions")."""
    import runpy
    measure = runpy.run_path(str(interpret.ROOT / "scripts" / "benchmark_traffic.py"))["measure_traffic"]
    settings = dict(form="chunk", tokens=256, heads=1, head_dim=64, dtype=torch.float16, training=False, batch=3)
    gc.disable()
    try:
        without_collector = measure(**settings)
    finally:
        gc.enable()
    assert without_collector["peak"] < without_collector["written"] - 2
    assert without_collector["peak"] == pytest.approx(measure(**settings)["peak"])
