"""The timm-registered LION-ViT family: builds, forms agree, gradients reach every parameter."""
from __future__ import annotations

import copy
import re
from typing import Tuple

import pytest
import timm
import torch
import torch.nn.functional as F

import lion_vit
from lion_vit import DISTILLED_MODEL_NAMES, FAMILY_MODEL_NAMES, LION_MODEL_NAMES, LionAttention
from lion_vit.testing import randomize_decays as trained_like
from naive import naive_lion

# the chunk form runs its chunks even where one product over these short sequences would cost less
pytestmark = pytest.mark.usefixtures("chunks_always")

PARAMS_M = {"tiny": (5.0, 6.5), "small": (21.0, 23.0), "base": (85.0, 88.0)}
SIZES = [(224, 224), (160, 288)]


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_all_fifteen_registered_with_and_without_a_distillation_token():
    expected = {f"lion_{v}_{s}" for v in ("lit", "d", "s", "d_natural", "s_natural") for s in PARAMS_M}
    distilled = {f"{name}_distilled" for name in expected}
    families = {f"{name}{suffix}" for name in FAMILY_MODEL_NAMES for suffix in ("", "_distilled")}  # test_families.py
    assert set(timm.list_models("lion_*")) == expected | distilled | families
    assert set(LION_MODEL_NAMES) == expected and set(DISTILLED_MODEL_NAMES) == distilled
    model = timm.create_model("lion_d_small_distilled")
    assert model.distilled and model.pretrained_cfg["classifier"] == ("head", "head_dist")
    assert sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in timm.create_model("lion_d_small").parameters()) \
        == 384 + 384 * 1000 + 1000  # the token and its head


def test_the_packages_docstring_names_every_registered_model():
    """help(lion_vit) names the models as brace patterns (lion_{d,s}_natural_{tiny,small,base}): expanded, they
    are the registered ones, so the docstring cannot fall behind the registry."""
    def expand(pattern: str) -> set:
        match = re.search(r"\{([^}]*)\}|\[([^]]*)\]", pattern)  # {a,b}: either; [a]: with or without
        if not match:
            return {pattern}
        options = match.group(1).split(",") if match.group(1) is not None else ["", match.group(2)]
        return {name for option in options for name in expand(pattern[:match.start()] + option + pattern[match.end():])}
    patterns = [p for p in re.findall(r"lion_[\w{},\[\]]+", lion_vit.__doc__) if p != "lion_vit"]
    assert set().union(*map(expand, patterns)) == set(LION_MODEL_NAMES) | set(FAMILY_MODEL_NAMES)


@pytest.mark.parametrize("name", LION_MODEL_NAMES)
def test_build_and_parameter_count(name):
    model = timm.create_model(name)
    low, high = PARAMS_M[name.rsplit("_", 1)[1]]
    assert low <= sum(p.numel() for p in model.parameters()) / 1e6 <= high
    assert model.pretrained_cfg["input_size"] == (3, 224, 224)
    has_pos = model.pos_embed is not None
    assert has_pos == name.startswith("lion_lit"), "only LION-lit needs positional embeddings"


# every model at 224 px; the non-square grid (other snake orders) at the tiny and small widths, since a
# base model runs the same layers as a small one, only wider and on more heads. The tiny models run all
# 12 blocks (the rounding of a whole depth); small and base the same blocks wider, so two of them
@pytest.mark.parametrize("name, size", [(n, s) for n in LION_MODEL_NAMES for s in SIZES
                                        if s == SIZES[0] or not n.endswith("_base")],
                         ids=lambda v: f"{v[0]}x{v[1]}" if isinstance(v, tuple) else v)
def test_forms_agree(name, size):
    depth = {} if name.endswith("_tiny") else {"depth": 2}
    model = trained_like(timm.create_model(name, num_classes=10, **depth)).eval()
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(x)
        for form, chunk in [("rnn", None), ("chunk", 64), ("chunk", 37), ("chunk", None)]:  # None: one chunk
            model.set_attn_form(form, chunk)
            assert rel_err(model(x), reference) <= 1e-4, (form, chunk)


@pytest.mark.parametrize("name", [n for n in LION_MODEL_NAMES if n.endswith("tiny")])
@pytest.mark.parametrize("form", [("attention", None), ("rnn", None), ("chunk", 5), ("chunk", None)],
                         ids=lambda f: f"{f[0]}{f[1] or ''}")
def test_backward_reaches_every_parameter(name, form):
    model = trained_like(timm.create_model(name, num_classes=5, attn_form=form[0], chunk_size=form[1]))
    x = torch.randn(2, 3, 64, 48)
    model(x).logsumexp(-1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient for {missing[:5]}"


@pytest.mark.parametrize("decay", ["lit", "fixed", "selective"])
def test_layer_gradients_match_plain_autograd(decay):
    """A LionAttention layer (head split, feature maps, masked product, normalisation, all with
    hand-written backwards) against the same layer written with plain autograd ops from the
    float64 oracle: output and the gradients of the input and of every parameter."""
    torch.manual_seed(0)
    layer = LionAttention(12, num_heads=3, qkv_bias=True, decay=decay).double()
    x = torch.randn(2, 7, 12, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 7, 12, dtype=torch.float64)
    out = layer(x)
    grads = torch.autograd.grad((out * upstream).sum(), [x, *layer.parameters()])

    q, k, v = layer.qkv(x).unflatten(-1, (3, 3, 4)).permute(2, 0, 3, 1, 4)  # [B, H, L, D] each
    q = torch.nn.functional.silu(q) + 0.5
    k = torch.nn.functional.silu(k) + 0.5
    k = k / k.norm(dim=-1, keepdim=True)
    lam = None
    if decay == "fixed":
        lam = torch.sigmoid(layer.decay.logit)[0][None, :, None]  # [1, H, 1]
    elif decay == "selective":
        lam = torch.sigmoid(layer.decay.proj(x)).transpose(1, 2)  # [B, H, L]
    expected = layer.proj(naive_lion(q, k, v, lam).transpose(1, 2).flatten(2))
    ref_grads = torch.autograd.grad((expected * upstream).sum(), [x, *layer.parameters()])
    assert rel_err(out, expected) < 1e-12
    for (name, _), got, ref in zip([("x", None), *layer.named_parameters()], grads, ref_grads):
        assert rel_err(got, ref) < 1e-10, f"grad of {name}"


@pytest.mark.parametrize("name", ["lion_s_tiny", "lion_d_natural_tiny", "lion_s_natural_tiny"])
def test_batch_of_one_and_single_token_chunks(name):
    model = trained_like(timm.create_model(name, num_classes=3)).eval()
    x = torch.randn(1, 3, 48, 80)
    with torch.no_grad():
        reference = model(x)
        assert reference.shape == (1, 3)
        model.set_attn_form("chunk", 1)
        assert rel_err(model(x), reference) <= 1e-4
    # one patch only: a 1-token sequence, every form
    single = torch.randn(1, 3, 16, 16)
    outs = [model.set_attn_form(f, c)(single) for f, c in [("attention", None), ("rnn", None), ("chunk", 1)]]
    assert all(torch.allclose(o, outs[0], atol=1e-5) for o in outs)


def test_class_token_and_prefix_in_scans():
    model = trained_like(timm.create_model("lion_s_natural_tiny", class_token=True, global_pool="token",
                                           num_classes=4)).eval()
    x = torch.randn(2, 3, 32, 64)
    with torch.no_grad():
        reference = model(x)
        model.set_attn_form("rnn")
        assert rel_err(model(x), reference) <= 1e-4


def test_scans_follow_the_grid():
    """A natural model must give different outputs for an image and its transpose-equivalent
    orderings, and its cached orders must follow the input grid (not one fixed square)."""
    model = timm.create_model("lion_d_natural_tiny", num_classes=2).eval()
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 64))
        model(torch.randn(1, 3, 64, 32))
    attns = [m for m in model.modules() if isinstance(m, LionAttention)]
    grids = {key[:2] for key in attns[0]._orders}
    assert grids == {(2, 4), (4, 2)}
    # one copy of each order for the whole model, not one per layer
    assert all(a._orders is attns[0]._orders for a in attns)


def test_selective_gate_trains():
    """The official code detached its selective gate; ours must move with the optimizer."""
    model = timm.create_model("lion_s_tiny", num_classes=2)
    attn = next(m for m in model.modules() if isinstance(m, LionAttention))
    before = attn.decay.proj.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    assert not torch.equal(before, attn.decay.proj.weight)


@pytest.mark.parametrize("size", [(225, 224), (224, 100), (17, 16)])
def test_bad_input_size_raises(size):
    model = timm.create_model("lion_d_tiny")
    with pytest.raises(ValueError, match="not divisible by the patch size"):
        model(torch.randn(1, 3, *size))


@pytest.mark.parametrize("shape, message", [
    ((3, 32, 32), r"^expected a batch of images \[batch, 3, height, width\], got shape \[3, 32, 32\]; add the batch"),
    ((2, 1, 32, 32), r"^the model takes 3-channel images, got 1 channels .*in_chans=1$"),
])
def test_input_that_is_not_a_batch_of_model_images_raises(shape, message):
    model = timm.create_model("lion_lit_tiny", depth=1)
    with pytest.raises(ValueError, match=message):
        model(torch.randn(*shape))
    assert timm.create_model("lion_lit_tiny", depth=1, in_chans=1)(torch.randn(2, 1, 32, 32)).shape == (2, 1000)


def test_dynamic_img_size_and_pad_arguments():
    """timm's ViT arguments for other input sizes: dynamic_img_size=True is what every LION model does
    (accepted, not a duplicate-argument TypeError), False is refused with a reason, and
    dynamic_img_pad=True zero-pads sizes the patch does not divide, in every form alike."""
    x = torch.randn(2, 3, 40, 56)  # 2.5 x 3.5 patches: padded to a 3 x 4 grid
    padded = F.pad(x, (0, 8, 0, 8))
    for name in ("lion_lit_tiny", "lion_s_natural_tiny"):
        model = trained_like(timm.create_model(name, dynamic_img_size=True, dynamic_img_pad=True, img_size=48,
                                               depth=2, num_classes=3)).eval()
        plain = timm.create_model(name, img_size=48, depth=2, num_classes=3).eval()
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            reference = plain(padded)  # the same weights on the zero-padded image
            for form, chunk in [("attention", None), ("rnn", None), ("chunk", 5)]:
                model.set_attn_form(form, chunk)
                assert rel_err(model(x), reference) <= 1e-4, (name, form)
    with pytest.raises(ValueError, match="dynamic_img_size=False is not supported"):
        timm.create_model("lion_d_tiny", dynamic_img_size=False)


def test_token_pooling_brings_its_class_token_and_pos_embed_is_checked():
    """Mean pooling and no class token by default; global_pool="token" (DeiT's pooling) adds the class
    token it reads instead of failing timm's assertion; an unknown pos_embed is a ValueError."""
    assert timm.create_model("lion_d_tiny", depth=1).num_prefix_tokens == 0
    model = timm.create_model("lion_s_natural_tiny", global_pool="token", depth=1, num_classes=3)
    assert model.num_prefix_tokens == 1 and model.cls_token is not None
    assert model(torch.randn(2, 3, 32, 48)).shape == (2, 3)
    with pytest.raises(ValueError, match="class token"):  # asked for token pooling and no class token: timm says why
        timm.create_model("lion_d_tiny", global_pool="token", class_token=False)
    with pytest.raises(ValueError, match="unknown pos_embed 'rope'"):
        timm.create_model("lion_d_tiny", pos_embed="rope")


def test_pooling_every_token_stays_the_models_pooling_for_timms_saved_arguments_and_reset():
    """global_pool="avg_all" (the official code's pooling: the final norm on every token, then their mean) is what
    the model says it pools, so timm's reconstruction arguments (save_for_hf, push_to_hf_hub) rebuild the same
    function; reset_classifier takes it and leaves it; an explicit fc_norm=True is kept."""
    model = timm.create_model("lion_d_tiny", depth=1, patch_size=8, img_size=32, num_classes=3, class_token=True,
                              global_pool="avg_all").eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    x = torch.randn(2, 3, 32, 32)
    features = model.forward_features(x)
    assert model.global_pool == "avg_all" and isinstance(model.fc_norm, torch.nn.Identity)
    torch.testing.assert_close(model.forward_head(features, pre_logits=True), features.mean(1))
    if hasattr(timm.models, "get_model_args"):  # (timm >= 1.0.31)
        args = timm.models.get_model_args(model)
        assert args["global_pool"] == "avg_all"
        rebuilt = timm.create_model("lion_d_tiny", **args).eval()
        rebuilt.load_state_dict(model.state_dict())
        torch.testing.assert_close(rebuilt(x), model(x), rtol=0, atol=0)
    pooled = {}
    for pool in ("token", "avg", "avg_all"):
        model.reset_classifier(4, pool)
        pooled[pool] = model.forward_head(features, pre_logits=True)
        assert model.global_pool == pool and model(x).shape == (2, 4)
    torch.testing.assert_close(pooled["token"], features[:, 0])
    torch.testing.assert_close(pooled["avg"], features[:, 1:].mean(1))
    torch.testing.assert_close(pooled["avg_all"], features.mean(1))
    normed = timm.create_model("lion_d_tiny", depth=1, class_token=True, global_pool="avg_all", fc_norm=True)
    assert isinstance(normed.fc_norm, torch.nn.LayerNorm) and isinstance(normed.norm, torch.nn.Identity)


def test_a_pooling_timm_does_not_know_or_none_beside_a_distillation_head_is_a_value_error():
    """An unknown pooling, at build and in reset_classifier (which then leaves the heads as they were), is not
    timm's AssertionError; no pooling beside a distillation head is refused at build, and where reset_classifier
    made it so (as timm's features_only does, which never reads the heads), by the forward: class logits of every
    token cannot be averaged with the distillation head's."""
    with pytest.raises(ValueError, match=r"^unknown global_pool 'mean'; choose one of 'avg', 'avg_all', 'token'"):
        timm.create_model("lion_d_tiny", global_pool="mean")
    unpooled = r"^global_pool='' keeps every token's logits, which a distillation head's logits of one token"
    with pytest.raises(ValueError, match=unpooled):
        timm.create_model("lion_d_tiny_distilled", global_pool="")
    model = timm.create_model("lion_d_tiny_distilled", depth=1, img_size=32, num_classes=3)
    x = torch.randn(2, 3, 32, 32)
    for pool, message in (("mean", "unknown global_pool"), ("token", "which this model was built without")):
        with pytest.raises(ValueError, match=message):
            model.reset_classifier(5, pool)
    assert model.num_classes == 3 and model.global_pool == "avg" and model(x).shape == (2, 3)
    features = timm.create_model("lion_d_tiny_distilled", depth=1, img_size=32, features_only=True, out_indices=(0,))
    assert [f.shape for f in features(x)] == [(2, 192, 2, 2)]
    model.reset_classifier(5, "")
    with pytest.raises(ValueError, match=unpooled):
        model(x)
    per_token = timm.create_model("lion_d_tiny", depth=1, img_size=32, num_classes=3, global_pool="")
    assert per_token(x).shape == (2, 4, 3)  # (timm's meaning of no pooling)


def test_bad_img_size_form_and_chunk_raise():
    with pytest.raises(ValueError, match="not divisible"):
        timm.create_model("lion_d_tiny", img_size=200)
    with pytest.raises(ValueError, match="attn_form"):
        timm.create_model("lion_d_tiny", attn_form="softmax")
    with pytest.raises(ValueError, match="chunk_size"):
        timm.create_model("lion_d_tiny", attn_form="chunk", chunk_size=0)
    model = timm.create_model("lion_s_tiny")
    with pytest.raises(ValueError, match="attn_form"):
        model.set_attn_form("recurrent")
    with pytest.raises(ValueError, match="chunk_size"):
        model.set_attn_form("chunk", -1)


@pytest.mark.parametrize("sizes, message", [(dict(depth=0), "depth must be a positive integer, got 0"),
                                            (dict(embed_dim=0), "embed_dim must be a positive integer, got 0"),
                                            (dict(num_heads=0), "num_heads must be a positive integer, got 0"),
                                            (dict(num_heads=5), "dim 192 is not divisible by num_heads 5")])
def test_sizes_that_build_no_lion_layer_raise(sizes, message):
    """Sizes that leave no LION layer, or none that works, are one ValueError at construction (train.py's
    "cannot build model" line), not a StopIteration or ZeroDivisionError later."""
    with pytest.raises(ValueError, match=message):
        timm.create_model("lion_d_tiny", **sizes)


@pytest.mark.parametrize("kwargs, message", [
    (dict(decay="fast"), r"^unknown decay 'fast'; choose one of \[.*\] \(lion_vit.decays.register_decay adds one\)$"),
    (dict(key_gate="sigmoid"), r"^unknown key_gate 'sigmoid'; choose one of \[.*\] \(lion_vit.gates.register_key_gate"),
    (dict(decay="fixed", num_scans=3), r"^num_scans must be 1 \(raster\) or 2 \(row and column snakes\), got 3$"),
    (dict(num_scans=2), "^multi-scan needs a decay: with an all-ones mask every scan is the same$"),
    (dict(attn_drop=0.1), "^attn_drop is not supported: the rnn and chunk forms never form attention weights$")])
def test_lion_attention_refuses_what_it_cannot_compute(kwargs, message):
    """LionAttention's arguments (timm's Attention's, and its own) that no form computes: one ValueError at
    construction."""
    with pytest.raises(ValueError, match=message):
        LionAttention(64, num_heads=4, **kwargs)


def test_lion_attention_calls_it_cannot_serve_are_named():
    """Two scans need the model's grid; a mask or causality argument has no meaning here (the decays are the mask);
    the model keeps every patch (the decays read the full grid)."""
    layer = LionAttention(64, num_heads=4, decay="fixed", num_scans=2)
    x = torch.randn(1, 5, 64)
    with pytest.raises(ValueError, match="^LionAttention with num_scans=2 needs grid_size set by the model$"):
        layer(x)
    with pytest.raises(ValueError, match="^LionAttention takes no attn_mask / is_causal: its mask comes from the "
                                         "decays$"):
        LionAttention(64, num_heads=4)(x, attn_mask=torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="^patch_drop_rate is not supported: LION decays need the full patch grid$"):
        timm.create_model("lion_d_tiny", patch_drop_rate=0.5)


def test_timm_api():
    model = timm.create_model("lion_lit_tiny", num_classes=7, img_size=96, drop_path_rate=0.1,
                              attn_form="chunk", chunk_size=8)
    assert model.attn_form == ("chunk", 8)
    x = torch.randn(2, 3, 96, 96)
    features = model.forward_features(x)
    assert features.shape == (2, 36, 192)
    assert model.forward_head(features, pre_logits=True).shape == (2, 192)
    assert model(torch.randn(2, 3, 128, 64)).shape == (2, 7)  # pos embed resampled on the fly
    model.reset_classifier(3)
    assert model(x).shape == (2, 3)
    assert "pos_embed" in model.no_weight_decay()
    decay_model = timm.create_model("lion_d_tiny")
    assert all(f"blocks.{i}.attn.decay.logit" in decay_model.no_weight_decay() for i in range(12))
    assert model.group_matcher()["blocks"]
    model.set_grad_checkpointing(True)
    model.train()
    model(x).sum().backward()
    intermediates = timm.create_model("lion_s_natural_tiny", features_only=True, out_indices=(5, 11))
    assert [t.shape for t in intermediates(torch.randn(1, 3, 64, 96))] == [(1, 192, 4, 6)] * 2


def test_state_dict_roundtrip_across_forms(tmp_path):
    model = trained_like(timm.create_model("lion_s_natural_tiny", num_classes=4)).eval()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    restored = timm.create_model("lion_s_natural_tiny", num_classes=4, attn_form="rnn").eval()
    restored.load_state_dict(torch.load(tmp_path / "weights.pt"))
    ema = copy.deepcopy(restored)
    x = torch.randn(1, 3, 48, 48)
    with torch.no_grad():
        assert rel_err(ema(x), model(x)) <= 1e-4


@pytest.mark.parametrize("form", [("attention", None), ("rnn", None), ("chunk", 5)], ids=lambda f: f[0])
def test_grad_checkpointing_keeps_less_for_backward_and_gives_the_same_gradients(form):
    """timm's set_grad_checkpointing (train.py's grad_checkpointing=true) in every form: the blocks' activations
    are recomputed in backward, drop path's draws included, for the same bits."""
    model = trained_like(timm.create_model("lion_s_natural_tiny", num_classes=5, drop_path_rate=0.2,
                                           attn_form=form[0], chunk_size=form[1]))
    x = torch.randn(2, 3, 64, 48)
    grads, saved = [], []
    for checkpointing in (False, True):
        model.set_grad_checkpointing(checkpointing)
        numels = []
        torch.manual_seed(1)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: numels.append(t.numel()) or t, lambda t: t):
            loss = model(x).logsumexp(-1).sum()
        model.zero_grad()
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
        saved.append(sum(numels))
    assert saved[1] < saved[0] / 5
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("name", ["lion_lit_tiny", "lion_s_natural_tiny_distilled", "lion_gla_tiny"])
def test_a_whole_model_pickles(name, tmp_path):
    """torch.save(model) and multiprocessing pickle a model by its classes' names: every layer is a plain
    LionAttention, in the form it was set to."""
    model = trained_like(timm.create_model(name, num_classes=4, depth=2)).eval()
    model.set_attn_form("chunk", chunk_size=4)
    torch.save(model, tmp_path / "model.pt")
    restored = torch.load(tmp_path / "model.pt", weights_only=False)
    assert all(type(layer) is LionAttention for layer in restored.lion_attentions())
    x = torch.randn(1, 3, 48, 48)
    with torch.no_grad():
        assert torch.equal(restored(x), model(x))
        assert rel_err(restored.set_attn_form("rnn")(x), model(x)) <= 1e-4

def test_autocast_bf16_forward():
    model = trained_like(timm.create_model("lion_s_tiny", num_classes=4)).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        reference = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
    assert torch.isfinite(out).all() and rel_err(out.float(), reference) < 0.1


TINY_NAMES = [n for n in LION_MODEL_NAMES if n.endswith("tiny")]
FORMS = [("attention", None), ("rnn", None), ("chunk", 5)]


@pytest.mark.parametrize("name", ["lion_lit_tiny", "lion_d_tiny", "lion_s_natural_tiny"])
def test_device_and_dtype_factory_arguments(name):
    """timm's device= / dtype= reach every tensor: a meta-device model (how large models are built and
    sharded) runs a meta forward in every form, and a bfloat16-built one a bfloat16 forward."""
    meta = timm.create_model(name, num_classes=5, depth=1, device="meta")
    assert {t.device.type for t in [*meta.parameters(), *meta.buffers()]} == {"meta"}
    x = torch.randn(2, 3, 32, 48, device="meta")
    built = trained_like(timm.create_model(name, num_classes=5, depth=1, dtype=torch.bfloat16)).eval()
    assert {p.dtype for p in built.parameters()} == {torch.bfloat16}
    image = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = copy.deepcopy(built).float()(image)
        for form, chunk in FORMS:
            assert meta.set_attn_form(form, chunk)(x).shape == (2, 5)
            out = built.set_attn_form(form, chunk)(image.to(torch.bfloat16))
            assert out.dtype == torch.bfloat16 and rel_err(out.float(), reference) < 0.1, form


def _one_block_model(name: str, img_size: Tuple[int, int] = (32, 48)) -> torch.nn.Module:
    """A tiny model of one block (by default on a 2 x 3 patch grid): small graphs for torch.compile / export."""
    return trained_like(timm.create_model(name, num_classes=5, depth=1, img_size=img_size))


@pytest.mark.parametrize("name", TINY_NAMES)
def test_empty_batch_gives_empty_logits_in_every_form(name):
    """A batch of no images gives [0, num_classes] logits and a backward that runs, as timm's DeiT does
    (timm's ViT with a dynamic image size failed reshaping 0 elements: LION models always use one)."""
    model = _one_block_model(name)
    for form, chunk in FORMS:
        model.set_attn_form(form, chunk)
        logits = model(torch.randn(0, 3, 32, 48))
        assert logits.shape == (0, 5)
        logits.sum().backward()
        assert float(model.head.weight.grad.abs().sum()) == 0.0
        with torch.no_grad():
            assert model.eval()(torch.randn(0, 3, 32, 48)).shape == (0, 5)
        model.train().zero_grad()


# aot_eager traces the forward and backward graphs as inductor does, without generating code (seconds
# instead of tens of seconds); one model runs through inductor in the training form (train.py's
# compile=true). On the 2 x 3 grid the chunk form is the attention form's one product, so it compiles
# where chunks run: one scan with per-head decays, two scans with per-token decays. The rnn form compiles
# for LION-lit (no decays) and the two-scan selective model (the most the loop does); every model compiles
# the attention form.
CHUNKED = [("lion_d_tiny", "aot_eager", ("chunk", 16), (208, 208)),
           ("lion_s_natural_tiny", "aot_eager", ("chunk", 16), (288, 288))]


@pytest.mark.parametrize("name, backend, form, img_size",
                         [(n, "aot_eager", f, (32, 48)) for n in TINY_NAMES for f in FORMS if f[0] == "attention"
                          or f[0] == "rnn" and n in ("lion_lit_tiny", "lion_s_natural_tiny")]
                         + CHUNKED + [pytest.param("lion_s_natural_tiny", "inductor", FORMS[0], (32, 48),
                                                   marks=pytest.mark.slow)],
                         ids=lambda value: (value[0] if isinstance(value[0], str) else "x".join(map(str, value)))
                         if isinstance(value, tuple) else None)
def test_compile_fullgraph_trains_like_eager(name, backend, form, img_size):
    """torch.compile(fullgraph=True), so with no graph break, gives eager's outputs and gradients, and
    eager's outputs without autograd (the inference paths: in-place sums, row groups), in every form.
    (LION-lit failed while its backward was traced, and the selective masks of the two-scan models
    broke the graph on block bounds read from a tensor.)"""
    torch._dynamo.reset()
    model = _one_block_model(name, img_size)
    model.set_attn_form(*form)
    assert form[0] != "chunk" or model.attn_plan(img_size).chunks > 1  # chunks, not the one product
    x = torch.randn(2, 3, *img_size, generator=torch.Generator().manual_seed(0))
    reference = model(x)
    reference.logsumexp(-1).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out = compiled(x)
    out.logsumexp(-1).sum().backward()
    assert rel_err(out, reference) <= 1e-5
    for n, p in model.named_parameters():
        assert rel_err(p.grad, expected[n]) <= 1e-4, n
    model.eval()
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) <= 1e-5


@pytest.mark.parametrize("name", ["lion_d_tiny", "lion_s_natural_tiny"])
def test_a_compiled_model_is_traced_once(name):
    """torch.compile traces a model once for its input size, in training and in evaluation: no later call, nor an
    eager forward between compiled ones, fails a guard of the first trace (the patch grid the forward gives every
    layer, the snake orders the two-scan models keep: reading either as the forward changes it recompiled on the
    second call)."""
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    model, traces = _one_block_model(name), CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=traces)
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        compiled(x).sum().backward()
    model(x)
    compiled(x).sum().backward()
    assert traces.frame_count == 1
    model.eval()
    with torch.no_grad():
        expected = model(x)
        for _ in range(2):
            assert rel_err(compiled(x), expected) <= 1e-5
    assert traces.frame_count == 2  # (evaluation: one trace without autograd)


@pytest.mark.parametrize("name, grad", [(n, False) for n in TINY_NAMES] + [(n, True) for n in TINY_NAMES if "_s_" in n])
def test_torch_export_every_form(name, grad):
    """torch.export (what ONNX and deployment build on) traces every form with a dynamic batch size and
    the exported program gives eager's outputs, traced without autograd (and with it for the selective
    models): no group of rows (the CPU backend's) that would tie the graph to the traced batch size
    reaches the trace."""
    model = _one_block_model(name).eval()
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    other_batch = torch.randn(3, 3, 32, 48, generator=torch.Generator().manual_seed(1))
    batch = {"x": {0: torch.export.Dim("batch", min=1, max=64)}}
    for form, chunk in FORMS:
        model.set_attn_form(form, chunk)
        with torch.no_grad():
            reference = model(other_batch)
        with torch.set_grad_enabled(grad):
            exported = torch.export.export(model, (x,), dynamic_shapes=batch)
        # run as users do, with autograd on, on a batch size other than the traced one
        assert rel_err(exported.module()(other_batch).detach(), reference) <= 1e-5, form


@pytest.mark.parametrize("name", TINY_NAMES)
def test_fx_symbolic_trace_in_every_form(name):
    """torch.fx traces the patch grid as data: the graph agrees with eager at the traced size and at another
    one, and no traced symbol is left on the model."""
    model = _one_block_model(name).eval()
    for form, chunk in FORMS:
        graph = torch.fx.symbolic_trace(model.set_attn_form(form, chunk))
        assert not any(isinstance(a.grid_size, torch.fx.Proxy) for a in model.lion_attentions())
        with torch.no_grad():
            for size in ((32, 48), (64, 16)):
                x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(size[1]))
                assert rel_err(graph(x), model(x)) < 1e-5, (form, size)


@pytest.mark.parametrize("name", ["lion_lit_tiny", "lion_s_natural_tiny"])
def test_fx_feature_extraction_gives_the_eager_features(name):
    """timm's features_only=True, feature_cls="fx" and torchvision's create_feature_extractor."""
    from torchvision.models.feature_extraction import create_feature_extractor
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)  # the same initial weights for both
    model = timm.create_model(name, num_classes=5, depth=3, img_size=(32, 48)).eval()
    torch.manual_seed(0)
    timm_fx = timm.create_model(name, num_classes=5, features_only=True, feature_cls="fx", out_indices=(1, 2),
                                depth=3, img_size=(32, 48)).eval()
    eager = {}
    for index in (1, 2):
        model.blocks[index].register_forward_hook(lambda module, args, out, i=index: eager.__setitem__(i, out))
    torchvision_fx = create_feature_extractor(model, {"blocks.1": "1", "blocks.2": "2"})
    with torch.no_grad():
        model(x)
        ours = timm_fx(x)
        theirs = torchvision_fx(x)
    for position, index in enumerate((1, 2)):
        assert rel_err(ours[position], eager[index]) < 1e-5
        assert rel_err(theirs[str(index)], eager[index]) < 1e-5


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_torchscript_says_what_to_use_instead():
    with pytest.raises(RuntimeError, match=r"cannot be scripted .*use torch.compile\(model\) or torch.export"):
        torch.jit.script(timm.create_model("lion_d_tiny", depth=1))


@pytest.mark.usefixtures("chunks_always")
@pytest.mark.parametrize("name", TINY_NAMES)
def test_backward_twice_and_double_backward(name, monkeypatch):
    """With default settings (attention form, torch backend on a CPU), and in the other forms that train,
    every variant does what a timm ViT does: loss.backward(retain_graph=True) twice, and a gradient
    penalty on the input gradient (double backward), with the gradients of a model whose every layer is
    the float64 reference."""
    from lion_vit.ops.reference import lion_attention_reference
    model = _one_block_model(name).double()
    x = torch.randn(2, 3, 32, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    params = [p for p in model.parameters()]

    def gradients():
        model.zero_grad()
        loss = model(x).square().sum()
        loss.backward(retain_graph=True)
        once = [p.grad.clone() for p in params]
        loss.backward()
        assert all(torch.allclose(p.grad, 2 * g, rtol=1e-12, atol=0) for p, g in zip(params, once))
        (grad_x,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
        second = torch.autograd.grad(grad_x.square().sum(), params, allow_unused=True)
        return once + [torch.zeros_like(p) if g is None else g for p, g in zip(params, second)]

    results = {}
    for form, chunk in FORMS:
        model.set_attn_form(form, chunk)
        results[form] = gradients()
    monkeypatch.setattr(lion_vit.layers, "lion_attention", lion_attention_reference)
    expected = gradients()
    for form, got in results.items():
        for g, e in zip(got, expected):
            assert rel_err(g, e) < 1e-9, form
