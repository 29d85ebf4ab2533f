"""lion_vit.ops.dispatch.plan: which form and backend run, decided in one place."""
from __future__ import annotations

import importlib.util
import re
import sys
import warnings

import pytest
import timm
import torch

import lion_vit  # noqa: F401
from lion_vit.ops import dispatch, plan, tuned, tuning

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def kernels(monkeypatch):
    """Pretend flash-linear-attention is (True) or is not (False) installed, with a chunk backward that
    runs (the fallback where it fails has its own tests); the plan never imports it."""
    def set_available(value: bool):
        monkeypatch.setattr(dispatch.triton_backend, "available", lambda: value)
        monkeypatch.setattr(dispatch.triton_backend, "chunk_backward_fails", lambda device: False)
        monkeypatch.setattr(dispatch, "_warned", set())
    return set_available


def test_auto_backend_is_torch_on_cpu_and_triton_on_cuda_with_kernels(kernels):
    """On a CPU the chunk form runs in groups of rows without autograd (the cpu backend), the portable
    form with it or where "torch" is asked for."""
    kernels(True)
    assert plan("chunk", 64, 3136, 64, 64, device=CPU, training=True).backend == "torch"
    assert plan("chunk", 64, 3136, 64, 64, device=CPU) == dispatch.Plan("chunk", "cpu", chunks=49, chunk_size=64)
    assert plan("chunk", 64, 3136, 64, 64, device=CPU, backend="torch").backend == "torch"
    assert plan("rnn", None, 3136, 64, 64, device=CPU).backend == "torch"
    assert plan("chunk", 64, 3136, 64, 64, device=CUDA).backend == "triton"
    assert plan("rnn", None, 3136, 64, 64, device=CUDA).backend == "triton"
    assert plan("chunk", 64, 3136, 64, 64, device=CUDA, dtype=torch.float64).backend == "torch"
    for form in ("attention", "rnn", "chunk"):  # the kernels compute in float32 at most: asked for float64, one error
        with pytest.raises(ValueError, match="^attn_backend='triton' has no float64 kernels; use attn_backend='torch' "
                                             "for float64$"):
            plan(form, None, 3136, 64, 64, device=CUDA, dtype=torch.float64, backend="triton")
    assert plan("chunk", 64, 3136, 64, 64, device=CUDA, backend="torch").backend == "torch"


def test_attention_form_is_fused_on_triton_and_lit_products_run_linear_kernels(kernels, knobs):
    """On the triton backend the attention form (and the chunk form's one-product case) of one or two scans is the
    bidirectional kernel, without groups of images (it keeps no buffers); past two scans, which it does not read,
    the portable product. LION-lit's Q (K^T V) is its linear kernels there (torch matmuls with
    Tuning.linear_kernels off), torch matmuls elsewhere; the portable product elsewhere."""
    kernels(True)
    for training in (True, False):
        for scans in (1, 2):
            assert plan("attention", None, 197, 64, 64, num_scans=scans, device=CUDA, training=training) == \
                dispatch.Plan("attention", "triton", whole=True)
        assert plan("attention", None, 197, 64, 64, num_scans=3, device=CUDA, training=training) == \
            dispatch.Plan("attention", "torch", whole=True)
    assert plan("chunk", 64, 196, 64, 64, num_scans=2, device=CUDA, training=True) == \
        dispatch.Plan("chunk", "triton", whole=True)
    assert str(plan("attention", None, 197, 64, 64, device=CUDA, training=True)) == \
        "attention form, triton backend: one fused masked product (bidirectional kernel)"
    assert plan("attention", None, 3136, 64, 64, device=CUDA, backend="torch") == \
        dispatch.Plan("attention", "torch", whole=True)
    assert plan("attention", None, 197, 64, 64, device=CPU) == dispatch.Plan("attention", "torch", whole=True)
    for form in ("attention", "chunk"):  # Q (K^T V): linear in L, and reported as such
        for training in (True, False):
            lit = plan(form, 64, 3136, 64, 64, decayed=False, device=CUDA, training=training)
            assert lit == dispatch.Plan(form, "triton", whole=True, linear=True)
        assert str(lit) == f"{form} form, triton backend: Q (K^T V), linear in the tokens (linear kernels)"
        lit = plan(form, 64, 3136, 64, 64, decayed=False, device=CPU)
        assert lit.whole and lit.backend == "torch" and lit.linear
        assert str(lit) == f"{form} form, torch backend: Q (K^T V), linear in the tokens"
    knobs(linear_kernels=False)
    assert plan("attention", None, 197, 64, 64, decayed=False, device=CUDA, training=True) == \
        dispatch.Plan("attention", "torch", whole=True, linear=True)
    assert not plan("chunk", 64, 196, 64, 64, device=CPU).linear


def test_auto_form_picks_chunk_kernels_for_long_decayed_sequences_on_triton(kernels, knobs):
    """One threshold per (training, number of scans), each read where it applies."""
    kernels(True)
    thresholds = {(False, 1): 1024, (False, 2): 1500, (True, 1): 2000, (True, 2): 2500}
    knobs(auto_chunk_min_tokens=thresholds)
    for (training, scans), long in thresholds.items():
        assert plan("auto", None, long, 64, 64, num_scans=scans, device=CUDA, training=training) == \
            dispatch.Plan("chunk", "triton", chunks=-(-long // 64), chunk_size=64, grouped=not training), \
            (training, scans)
        assert plan("auto", None, long - 1, 64, 64, num_scans=scans, device=CUDA, training=training).form == \
            "attention", (training, scans)
        if scans == 2:  # more scans than two: two's threshold
            assert plan("auto", None, long, 64, 64, num_scans=3, device=CUDA, training=training).form == "chunk"
            assert plan("auto", None, long - 1, 64, 64, num_scans=3, device=CUDA, training=training).form == \
                "attention"
    assert plan("auto", None, 1024, 64, 64, decayed=False, device=CUDA).form == "attention"


def test_auto_form_picks_the_chunk_form_for_long_decayed_sequences_on_a_cpu(kernels, knobs):
    """On a CPU, form auto runs the chunk form from Tuning.cpu_auto_chunk_min_tokens on (by training and number of
    scans), in chunks of the call's chunk size or else Tuning.default_chunk_size: in groups of rows without
    autograd, the portable chunk form with it. Each device reads its own thresholds, and CUDA without the kernels
    runs the portable attention form at any length."""
    kernels(True)
    thresholds = {(False, 1): 300, (False, 2): 400, (True, 1): 500, (True, 2): 600}
    knobs(cpu_auto_chunk_min_tokens=thresholds, auto_chunk_min_tokens={key: 5000 for key in thresholds})
    for (training, scans), long in thresholds.items():
        assert plan("auto", None, long, 64, 64, num_scans=scans, device=CPU, training=training) == \
            dispatch.Plan("chunk", "torch" if training else "cpu", chunks=-(-long // 64), chunk_size=64), \
            (training, scans)
        assert plan("auto", None, long - 1, 64, 64, num_scans=scans, device=CPU, training=training) == \
            dispatch.Plan("attention", "torch", whole=True), (training, scans)
        assert plan("auto", None, long, 64, 64, num_scans=scans, device=CUDA, training=training).form == \
            "attention", (training, scans)
        if scans == 2:  # more scans than two: two's threshold
            assert plan("auto", None, long, 64, 64, num_scans=3, device=CPU, training=training).form == "chunk"
            assert plan("auto", None, long - 1, 64, 64, num_scans=3, device=CPU, training=training).form == \
                "attention"
    assert plan("auto", None, 5000, 64, 64, device=CUDA).form == "chunk"
    assert plan("auto", 100, 600, 64, 64, device=CPU) == dispatch.Plan("chunk", "cpu", chunks=6, chunk_size=100)
    assert plan("auto", None, 5000, 64, 64, decayed=False, device=CPU) == \
        dispatch.Plan("attention", "torch", whole=True, linear=True)
    knobs(default_chunk_size=32)
    assert plan("auto", None, 600, 64, 64, device=CPU, training=True) == \
        dispatch.Plan("chunk", "torch", chunks=19, chunk_size=32)
    kernels(False)
    with pytest.warns(UserWarning, match="portable PyTorch forms on CUDA"):
        assert plan("auto", None, 5000, 64, 64, device=CUDA) == dispatch.Plan("attention", "torch", whole=True)


def test_auto_form_on_a_cpu_by_default_and_what_it_computes():
    """The code's thresholds: a small model runs the attention form at 224 px and the chunk form (chunks of 64) from
    320 px in evaluation and 448 px in training; the same function as the attention form, gradients too."""
    model = timm.create_model("lion_s_tiny", attn_form="auto", img_size=64)
    for size, evaluating, training in [(224, "attention", "attention"), (304, "attention", "attention"),
                                       (320, "chunk", "attention"), (432, "chunk", "attention"),
                                       (448, "chunk", "chunk")]:
        assert model.eval().attn_plan((size, size)).form == evaluating, size
        assert model.train().attn_plan((size, size)).form == training, size
        # (the mode asked for by name, whatever the model's)
        assert model.attn_plan((size, size), training=False).form == evaluating, size
        assert model.eval().attn_plan((size, size), training=True).form == training, size
    assert str(model.eval().attn_plan((320, 320))) == "chunk form, cpu backend: 7 chunks in groups of rows"
    assert str(model.train().attn_plan((448, 448))) == "chunk form, torch backend: 13 chunks"


def test_auto_form_on_a_gpu_by_default_from_the_sizes_timed(kernels):
    """The code's triton thresholds, as the GPU timings chose them for LION-d and LION-d-natural (no class token):
    the chunk kernels from 896 px in evaluation (where they won, against 448 px where they lost) and 512 px in
    training; a model with a class token, one token more, too."""
    kernels(True)
    for name in ("lion_d_small", "lion_d_natural_small"):
        model = timm.create_model(name, attn_form="auto")
        for size, evaluating, training in [(496, "attention", "attention"), (512, "attention", "chunk"),
                                           (880, "attention", "chunk"), (896, "chunk", "chunk")]:
            assert model.attn_plan((size, size), CUDA, training=False).form == evaluating, (name, size)
            assert model.attn_plan((size, size), CUDA, training=True).form == training, (name, size)
    token = timm.create_model("lion_d_small", attn_form="auto", global_pool="token")
    assert token.attn_plan((896, 896), CUDA, training=False).form == "chunk"
    torch.manual_seed(0)
    model = timm.create_model("lion_s_tiny", attn_form="auto", img_size=448, dynamic_img_size=True,
                              drop_path_rate=0.0).double()
    images = torch.randn(1, 3, 448, 448, dtype=torch.float64)
    outputs, grads = [], []
    for form in ("auto", "attention"):
        model.zero_grad()
        model.set_attn_form(form)
        logits = model(images)
        logits.square().sum().backward()
        outputs.append(logits)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-9)
    with torch.no_grad():
        evaluated = model.eval().set_attn_form("auto")(images)
    torch.testing.assert_close(evaluated, outputs[1].detach(), rtol=1e-10, atol=1e-10)


def test_chunk_form_runs_one_product_where_cheaper(kernels):
    kernels(True)
    assert plan("chunk", 64, 196, 64, 64, num_scans=2).whole  # natural models at 224 px
    assert plan("chunk", 64, 196, 64, 64, num_scans=2, device=CUDA).whole  # (fused: above)
    assert plan("chunk", 64, 784, 64, 64, num_scans=2) == dispatch.Plan("chunk", "cpu", chunks=13, chunk_size=64)
    assert plan("chunk", 64, 784, 64, 64, num_scans=2, device=CUDA) == \
        dispatch.Plan("chunk", "triton", chunks=13, chunk_size=64, grouped=True)


def test_chunk_form_without_a_chunk_size_runs_chunks_of_the_default(kernels, knobs):
    """chunk_size None is Tuning.default_chunk_size, not one chunk of the whole sequence: that is the attention
    form's time and memory (docs/benchmarks.md, "The chunk form without a chunk size")."""
    kernels(True)
    assert plan("chunk", None, 600, 64, 64, training=True) == dispatch.Plan("chunk", "torch", chunks=10, chunk_size=64)
    assert plan("chunk", None, 600, 64, 64, vector=True, backend="torch") == \
        dispatch.Plan("chunk", "torch", chunks=10, chunk_size=64, vector=True)
    assert plan("chunk", None, 600, 64, 64, device=CUDA).chunk_size == dispatch.TRITON_CHUNK  # (the kernels' tile)
    knobs(default_chunk_size=32)
    assert plan("chunk", None, 600, 64, 64, training=True) == dispatch.Plan("chunk", "torch", chunks=19, chunk_size=32)
    assert plan("chunk", 600, 600, 64, 64, training=True).chunks == 1  # one chunk of all the tokens, where asked for
    model = timm.create_model("lion_d_small").eval().set_attn_form("chunk")
    assert model.attn_form == ("chunk", None) and model.chunks_per_sequence(1248) == 191  # 78 x 78 + 1 tokens / 32


def test_triton_off_cuda_is_an_error_unless_interpreted(kernels, monkeypatch):
    """Triton launches on CUDA devices only; its interpreter (the tests' way on a CPU) runs the kernels anywhere."""
    kernels(True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert plan("chunk", 64, 3136, 64, 64, device=CPU, backend="triton").backend == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="^the triton backend runs Triton kernels, which need a CUDA GPU, and this "
                                         "call is on cpu; choose the backend auto"):
        plan("chunk", 64, 3136, 64, 64, device=CPU, backend="triton")
    assert plan("chunk", 64, 3136, 64, 64, device=CUDA, backend="triton").backend == "triton"


def test_triton_without_kernels_is_an_error_and_auto_warns_once_on_cuda(kernels):
    kernels(False)
    with pytest.raises(ValueError, match=r'pip install "lion-vit\[gpu\]"'):
        plan("chunk", 64, 3136, 64, 64, device=CUDA, backend="triton")
    with pytest.warns(UserWarning, match=r"lion-vit\[gpu\]") as record:
        assert plan("chunk", 64, 3136, 64, 64, device=CUDA).backend == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process
        assert plan("rnn", None, 3136, 64, 64, device=CUDA).backend == "torch"
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and never on a CPU
        plan("chunk", 64, 3136, 64, 64, device=CPU)


def test_bad_form_and_backend_are_one_line_errors():
    with pytest.raises(ValueError, match="attn_backend 'cuda'"):
        plan("chunk", 64, 10, 8, 8, backend="cuda")
    with pytest.raises(ValueError, match="attn_backend"):
        timm.create_model("lion_d_tiny", attn_backend="fla")
    with pytest.raises(ValueError, match="attn_form"):
        plan("flash", None, 10, 8, 8)


def test_model_reports_its_plan_and_switches_backend(kernels):
    kernels(True)
    model = timm.create_model("lion_d_natural_tiny", attn_form="chunk", chunk_size=64, attn_backend="torch")
    assert str(model.attn_plan((224, 224))) == "chunk form, torch backend: one masked product"
    assert model.attn_plan(896) == model.attn_plan((896, 896))  # one int: a square, as timm's img_size
    assert model.attn_plan() == model.attn_plan(224)  # the size it was built for
    assert model.attn_plan(896, "cuda") == model.attn_plan(896, CUDA)  # a device's name, as .to() takes
    assert model.attn_plan((896, 448)) != model.attn_plan((896, 896))
    with pytest.raises(ValueError, match="img_size 900x896 is not divisible by the patch size 16x16"):
        model.attn_plan((900, 896))  # as the forward would say, not the plan of the cropped image
    assert str(model.attn_plan((896, 896))) == "chunk form, torch backend: 49 chunks"
    model.set_attn_form("chunk", 64, backend="auto")
    assert str(model.eval().attn_plan((896, 896))) == "chunk form, cpu backend: 49 chunks in groups of rows"
    model.train().set_attn_form("chunk", 64, backend="torch")
    one_scan = timm.create_model("lion_d_tiny", attn_form="chunk", chunk_size=5000, attn_backend="torch")
    assert str(one_scan.attn_plan((896, 896))) == "chunk form, torch backend: one chunk"
    assert model.attn_plan((896, 896), device=CUDA).backend == "torch"  # asked for torch
    model.set_attn_form("chunk", 64, backend="auto")
    assert str(model.attn_plan((896, 896), device=CUDA)) == "chunk form, triton backend: 49 chunks (FLA kernels)"
    assert all(attn.attn_backend == "auto" for attn in model.lion_attentions())
    model.set_attn_form("rnn")  # backend None: kept
    assert str(model.attn_plan((896, 896), device=CUDA)) == "rnn form, triton backend: fused recurrent kernels"
    assert str(model.eval().attn_plan((896, 896), device=CUDA)) == \
        "rnn form, triton backend: fused recurrent kernels, in groups of images"


@pytest.mark.parametrize("name, inference", [("lion_s_tiny", "cpu"), ("lion_d_natural_tiny", "torch")])
def test_a_layer_plans_once_per_forward_and_runs_that_plan(name, inference, monkeypatch):
    """The layer's plan picks its layout and is the one the op runs: one dispatch.plan per layer and call,
    in inference and in training (where autograd changes the plan on a CPU)."""
    model = timm.create_model(name, depth=2, attn_form="chunk", chunk_size=16, img_size=256, patch_size=16)
    calls, ran = [], []
    planned, implementation = dispatch.plan, dispatch.implementation
    monkeypatch.setattr(dispatch, "plan", lambda *a, **kw: calls.append(planned(*a, **kw)) or calls[-1])
    monkeypatch.setattr(dispatch, "implementation", lambda run: ran.append(run) or implementation(run))
    x = torch.randn(2, 3, 256, 256)
    with torch.no_grad():
        model.eval()(x)
    model.train()(x).sum().backward()
    assert [run.backend for run in calls] == [inference] * 2 + ["torch"] * 2 and ran == calls


def test_chunk_backward_fails_on_hopper_with_triton_3_4_to_3_7_0(monkeypatch):
    from lion_vit.ops.triton import fla
    for capability, version, fails in [((9, 0), "3.6.0", True), ((9, 0), "3.4.0", True), ((9, 0), "3.7.0", True),
                                       ((9, 0), "3.7.1", False), ((9, 0), "3.3.1", False), ((10, 0), "3.6.0", False),
                                       ((8, 0), "3.6.0", False), ((9, 0), "3.8.0+git1a2b", False)]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(fla, "_installed_triton_version", lambda: version)
        assert fla.chunk_backward_fails(CUDA) is fails, (capability, version)
    assert not fla.chunk_backward_fails(CPU)


@pytest.mark.parametrize("fallback", ["torch", "rnn", "forward"])
def test_training_where_the_chunk_backward_fails_runs_the_fallback(kernels, monkeypatch, knobs, fallback):
    """Inference keeps the chunk kernels; training runs Tuning.chunk_backward_fallback (the portable chunk form,
    the fused recurrent kernels, or by default the chunk kernels with a backward of their forward pass: the
    same function) and says once why and how to get the chunk kernels' own backward back."""
    kernels(True)
    monkeypatch.setattr(dispatch.triton_backend, "chunk_backward_fails", lambda device: device.type == "cuda")
    knobs(chunk_backward_fallback=fallback)
    expected = {"torch": dispatch.Plan("chunk", "torch", chunks=49, chunk_size=64),
                "rnn": dispatch.Plan("rnn", "triton"),
                "forward": dispatch.Plan("chunk", "triton", chunks=49, chunk_size=64,
                                         backward_by_forward=True)}[fallback]
    assert plan("chunk", 64, 3136, 64, 64, device=CUDA) == \
        dispatch.Plan("chunk", "triton", chunks=49, chunk_size=64, grouped=True)
    said = {"torch": "portable chunk form", "rnn": "fused recurrent kernels",
            "forward": "their forward passes"}[fallback]
    with pytest.warns(UserWarning, match=f"Triton 3.4.0 to 3.7.0.*{said}.*3.7.1 or later"):
        assert plan("chunk", 64, 3136, 64, 64, device=CUDA, training=True) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        # the form "auto" asks for no chunk size: the fallback runs the kernels' tile, not one chunk of L
        assert plan("auto", None, 3136, 64, 64, num_scans=2, device=CUDA, training=True) == expected
    assert plan("chunk", 64, 196, 64, 64, num_scans=2, device=CUDA, training=True).whole  # torch matmuls
    if fallback == "torch":  # the plan's chunk size is the one the portable form runs
        from lion_vit.ops.chunk import chunk_form
        sizes = []
        monkeypatch.setitem(dispatch.TORCH_FORMS, "chunk", lambda *inputs, chunk_size, **kw: sizes.append(chunk_size)
                            or chunk_form(*inputs, chunk_size=chunk_size, **kw))
        q, k, v = torch.rand(3, 1, 1, 130, 4).unbind(0)
        dispatch.implementation(expected)(q, k, v, None, None)
        assert sizes == [64]
    assert plan("chunk", 64, 3136, 64, 64, device=CPU, training=True).form == "chunk"
    model = timm.create_model("lion_d_small", attn_form="chunk")
    assert model.attn_plan((896, 896), device=CUDA) == expected  # a model in training mode
    assert model.eval().attn_plan((896, 896), device=CUDA).backend == "triton"


def test_tuned_sets_knobs_for_its_block_and_refuses_bad_ones(kernels):
    """tuned(...) sets the knobs named for its block (nested blocks too) and restores them on the way out, an error
    included; an unknown name or a bad value is one ValueError naming it, and changes nothing. A plan reads the
    knobs in effect as it is made."""
    kernels(True)
    code = tuning()
    with tuned(auto_chunk_min_tokens={(False, 1): 10, (False, 2): 10, (True, 1): 10, (True, 2): 10}) as outer:
        assert tuning() is outer and outer.chunk_backward_fallback == code.chunk_backward_fallback
        assert plan("auto", None, 10, 64, 64, device=CUDA).form == "chunk"
        with pytest.raises(RuntimeError, match="inside"), tuned(group_share=0):
            assert tuning().group_share == 0 and tuning().auto_chunk_min_tokens[False, 1] == 10
            raise RuntimeError("inside")
        assert tuning() is outer
    assert tuning() is code and plan("auto", None, 10, 64, 64, device=CUDA).form == "attention"
    for changes, message in [
            (dict(chunk_backward_falback="rnn"), r"unknown tuning knob\(s\) \['chunk_backward_falback'\]"),
            (dict(chunk_backward_fallback="slow"), "unknown chunk_backward_fallback 'slow'; choose one of"),
            (dict(chunk_backward_fallback=["rnn"]), r"unknown chunk_backward_fallback \['rnn'\]; choose one of"),
            (dict(chunk_backward_fails="yes"), "chunk_backward_fails must be None"),
            (dict(group_share=-1), "group_share must be a number >= 0"),
            (dict(recurrent_group_programs=0), "recurrent_group_programs must be a positive integer"),
            (dict(auto_chunk_min_tokens={(True, 1): 1}), "auto_chunk_min_tokens must give"),
            (dict(cpu_auto_chunk_min_tokens={key: 0 for key in code.auto_chunk_min_tokens}),
             "cpu_auto_chunk_min_tokens must give"),
            (dict(default_chunk_size=0), "default_chunk_size must be a positive integer"),
            (dict(bidirectional_forward=(64, 48, 4)), r"bidirectional_forward must be \(own tile, loop tile, warps\)"),
            (dict(bidirectional_backward=(8, 16, 4)), "bidirectional_backward must be"),
            (dict(bidirectional_backward=(64, 32)), "bidirectional_backward must be"),
            (dict(bidirectional_keys_first=1), "bidirectional_keys_first must be True or False"),
            (dict(bidirectional_forward_blocks=-1), "bidirectional_forward_blocks must be a positive integer, or 0"),
            (dict(bidirectional_factored_masks="no"), "bidirectional_factored_masks must be True or False")]:
        with pytest.raises(ValueError, match=message):
            with tuned(**changes):
                pass
        assert tuning() is code, changes
    thresholds = dict(code.auto_chunk_min_tokens)
    with tuned(auto_chunk_min_tokens=thresholds) as knobs:
        thresholds[True, 1] = 1  # the knobs keep a copy: the caller's dict changes nothing
        assert knobs.auto_chunk_min_tokens[True, 1] == code.auto_chunk_min_tokens[True, 1]
    with tuned(bidirectional_forward=[32, 16, 2]) as knobs:  # (a list from a command line: kept as a tuple)
        assert knobs.bidirectional_forward == (32, 16, 2)


def test_torch_export_gets_the_pytorch_forms(kernels, monkeypatch):
    """torch.export's programs are torch ops, which the kernels are not: "auto" exports the PyTorch forms,
    and "triton" while exporting is one clear error instead of a failure deep inside the tracer. torch.compile
    is not exporting (on torch 2.11, torch.compiler.is_exporting() says it is)."""
    from lion_vit.ops.dispatch import exporting

    class Probe(torch.nn.Module):
        def forward(self, x):
            return x + 1 if exporting() else x - 1

    assert torch.export.export(Probe(), (torch.zeros(1),)).module()(torch.zeros(1)).item() == 1
    assert Probe()(torch.zeros(1)).item() == -1
    torch._dynamo.reset()
    assert torch.compile(Probe(), backend="eager")(torch.zeros(1)).item() == -1
    kernels(True)
    monkeypatch.setattr(dispatch, "exporting", lambda: True)
    assert plan("chunk", 64, 3136, 64, 64, device=CUDA).backend == "torch"
    with pytest.raises(ValueError, match="torch.export cannot trace the triton kernels; export with attn_backend='torch'"):
        plan("chunk", 64, 3136, 64, 64, device=CUDA, backend="triton")


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention is not installed")
def test_kernels_that_do_not_import_are_one_warning_and_the_torch_backend(monkeypatch):
    """available() imports the kernels it uses: installed but broken (here: the module refuses to import)
    is one warning that says why, and the torch backend; asked for by name, one error that says why."""
    from lion_vit.ops.triton import fla
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla", None)  # `import` of it raises ImportError
    monkeypatch.setattr(dispatch, "_warned", set())
    fla._kernels.cache_clear()
    try:
        with pytest.warns(UserWarning) as said:
            assert not fla.available()
            assert plan("chunk", 64, 3136, 64, 64, device=CUDA).backend == "torch"
        assert len(said) == 1 and re.search(r"PyTorch forms on CUDA \(flash-linear-attention is installed but does not "
                                            r"import \(\w*Error: .*\)\); for the GPU kernels: pip install",
                                            str(said[0].message)), [str(w.message) for w in said]
        with pytest.raises(ValueError, match="needs flash-linear-attention, which is installed but does not import"):
            plan("chunk", 64, 3136, 64, 64, device=CUDA, backend="triton")
    finally:
        fla._kernels.cache_clear()


def test_a_full_store_of_kept_values_keeps_what_the_same_call_just_made():
    """ops.kept: a call that keeps two values of its orders tensor makes them once, wherever the store's limit
    falls (after any number of other tensors' values); the next call makes none, as the triton backend's calls
    rely on (tests/test_triton.py, the scan indices)."""
    from lion_vit.ops.kept import kept
    others = [torch.zeros(1) for _ in range(150)]  # (alive: their values may not be dropped as those of gone tensors)
    for count, other in enumerate(others):
        kept(other, ("another call's",), lambda: None)
        orders, made = torch.zeros(1), []
        for _ in range(2):
            kept(orders, ("indices",), lambda: made.append("indices"))
            kept(orders, ("tile spans",), lambda: made.append("tile spans"))
        assert made == ["indices", "tile spans"], count
