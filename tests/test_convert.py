"""Checkpoints of the official LION code: built here from its documented key layout (a DeiT ViT with
`attn.a_i` / `attn.a2_i` decays, an argparse Namespace of settings), converted, and compared with a
forward written here from the official code's documented semantics (not its code)."""
from __future__ import annotations

import argparse
import re

import pytest
import timm
import torch
import torch.nn.functional as F

import lion_vit.testing
from lion_vit import LION_MODEL_NAMES
from lion_vit.convert import VARIANTS, from_official, to_official
from lion_vit.ops import snake_orders
from naive import naive_mask, rel_err
from runs import run_python

DEPTH, WIDTH, HEADS = 2, 192, 3


def official_checkpoint(mask_type: str, order: str, pos_emb: bool, cls_tok: bool, classes: int = 7, seed: int = 0):
    """A random official-format checkpoint: DeiT key names, decays a_i (a2_i for order='S')."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.05):
        return torch.randn(*shape, generator=g) * std

    model = {"patch_embed.proj.weight": rand(WIDTH, 3, 16, 16, std=0.02), "patch_embed.proj.bias": rand(WIDTH),
             "cls_token": rand(1, 1, WIDTH, std=0.5), "norm.weight": 1 + rand(WIDTH), "norm.bias": rand(WIDTH),
             "head.weight": rand(classes, WIDTH, std=0.2), "head.bias": rand(classes)}
    if pos_emb:
        model["pos_embed"] = rand(1, 1 + 4 * 4, WIDTH, std=0.5)  # trained at 64 px
    for b in range(DEPTH):
        p = f"blocks.{b}."
        model.update({p + "norm1.weight": 1 + rand(WIDTH), p + "norm1.bias": rand(WIDTH),
                      p + "attn.qkv.weight": rand(3 * WIDTH, WIDTH), p + "attn.qkv.bias": rand(3 * WIDTH),
                      p + "attn.proj.weight": rand(WIDTH, WIDTH), p + "attn.proj.bias": rand(WIDTH),
                      p + "norm2.weight": 1 + rand(WIDTH), p + "norm2.bias": rand(WIDTH),
                      p + "mlp.fc1.weight": rand(4 * WIDTH, WIDTH), p + "mlp.fc1.bias": rand(4 * WIDTH),
                      p + "mlp.fc2.weight": rand(WIDTH, 4 * WIDTH), p + "mlp.fc2.bias": rand(WIDTH)})
        for name in ("a_i", "a2_i")[:2 if order == "S" else 1]:
            if mask_type == "Decay":
                model[p + f"attn.{name}"] = torch.randn(HEADS, generator=g) * 2
            elif mask_type == "Selective":
                model[p + f"attn.{name}.weight"] = rand(HEADS, WIDTH, std=0.3)
                model[p + f"attn.{name}.bias"] = torch.randn(HEADS, generator=g) * 2
    args = argparse.Namespace(model="lion_tiny_patch16_224", mask_type=mask_type, order=order, pos_emb=pos_emb,
                              cls_tok=cls_tok, lr=5e-4)
    return {"model": model, "args": args, "epoch": 299}


def official_logits(checkpoint, x):
    """The official model's function as documented: a class token first; per head features ELU + 1 (Lit)
    or the normalised SiLU + 0.5 (both q and k), scores scaled by 1/sqrt(d), mask lam^|i-j| with
    lam = sigmoid(a_i) (Decay) or the product of the decays lam_t = 1 - sigmoid(a_i(x_t)) between the
    tokens (Selective, the class token's decay 1); order='S' averages the row- and column-snake masks;
    rows divided by their sums; final norm on every token, then the mean over all tokens (cls_tok: the
    class token)."""
    w, args = checkpoint["model"], checkpoint["args"]
    x = x.double()
    tokens = F.conv2d(x, w["patch_embed.proj.weight"].double(), w["patch_embed.proj.bias"].double(), stride=16)
    grid = tokens.shape[-2:]
    t = torch.cat([w["cls_token"].double().expand(x.shape[0], -1, -1), tokens.flatten(2).transpose(1, 2)], 1)
    if args.pos_emb:
        t = t + w["pos_embed"].double()
    length = t.shape[1]
    orders = snake_orders(*grid, num_prefix_tokens=1) if args.order == "S" else torch.arange(length)[None]
    ln = lambda v, p: F.layer_norm(v, (WIDTH,), w[p + ".weight"].double(), w[p + ".bias"].double(), eps=1e-6)  # noqa: E731
    lin = lambda v, p: F.linear(v, w[p + ".weight"].double(), w[p + ".bias"].double())  # noqa: E731
    for b in range(DEPTH):
        p = f"blocks.{b}."
        h = ln(t, p + "norm1")
        q, k, v = lin(h, p + "attn.qkv").unflatten(-1, (3, HEADS, -1)).permute(2, 0, 3, 1, 4)
        if args.mask_type == "Lit":
            q, k = F.elu(q) + 1, F.elu(k) + 1
        else:
            q, k = ((F.silu(z) + 0.5) / (F.silu(z) + 0.5).norm(dim=-1, keepdim=True) for z in (q, k))
        scores = q @ k.transpose(-1, -2) * (WIDTH // HEADS) ** -0.5
        mask = 0
        for scan, order in zip(("a_i", "a2_i"), orders):
            if args.mask_type == "Decay":
                lam = torch.sigmoid(w[p + "attn." + scan].double())[None, :, None].expand(x.shape[0], -1, length)
            elif args.mask_type == "Selective":
                lam = (1 - torch.sigmoid(lin(h, p + "attn." + scan))).transpose(1, 2).clone()
                lam[..., 0] = 1.0
            else:
                lam = torch.ones(x.shape[0], HEADS, length, dtype=torch.float64)
            position = torch.argsort(order)
            mask = mask + naive_mask(lam[..., order])[..., position[:, None], position[None, :]] / len(orders)
        attn = scores * mask
        attn = attn / attn.sum(-1, keepdim=True)
        t = t + lin((attn @ v).transpose(1, 2).flatten(2), p + "attn.proj")
        t = t + lin(F.gelu(lin(ln(t, p + "norm2"), p + "mlp.fc1")), p + "mlp.fc2")
    t = ln(t, "norm")
    pooled = t[:, 0] if args.cls_tok else t.mean(1)
    return lin(pooled, "head")


CASES = [(mask, order, mask == "Lit", False) for mask, order in VARIANTS] + [("Selective", "S", True, True)]


@pytest.mark.parametrize("mask_type, order, pos_emb, cls_tok", CASES)
def test_converted_model_computes_the_official_function_in_every_form(mask_type, order, pos_emb, cls_tok):
    checkpoint = official_checkpoint(mask_type, order, pos_emb, cls_tok)
    # a 4 x 5 grid, not square; with positional embeddings their own 4 x 4 grid, the only one the official
    # code takes (this project resamples them for any other)
    x = torch.randn(2, 3, 64, 64 if pos_emb else 80, generator=torch.Generator().manual_seed(1))
    expected = official_logits(checkpoint, x)
    model = from_official(checkpoint).double().eval()
    with torch.no_grad():
        for form, chunk in (("attention", None), ("rnn", None), ("chunk", 7)):
            assert rel_err(model.set_attn_form(form, chunk)(x.double()), expected) < 1e-10, form


def test_mapping_both_ways_and_the_decay_sign():
    checkpoint = official_checkpoint("Selective", "S", False, False)
    model = from_official(checkpoint)
    attn = model.blocks[1].attn
    weights = checkpoint["model"]
    assert torch.equal(attn.decay.proj.weight[:HEADS], -weights["blocks.1.attn.a_i.weight"])  # 1 - sigmoid(z) = sigmoid(-z)
    assert torch.equal(attn.decay.proj.bias[HEADS:], -weights["blocks.1.attn.a2_i.bias"])
    back = to_official(model)
    assert back["args"] == {"mask_type": "Selective", "order": "S", "pos_emb": False, "cls_tok": False}
    back = back["model"]
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
    assert model.num_prefix_tokens == 1 and model.global_pool == "avg_all" and attn.prefix_decay_one


@pytest.mark.parametrize("name", LION_MODEL_NAMES)
def test_every_registered_model_round_trips_through_the_official_layout(name):
    """to_official -> from_official, with no settings to pass: the same function, any registered variant built
    as the official code builds it (a class token; the official pooling and feature map)."""
    lit, token_pool = name.startswith("lion_lit"), name.endswith("_small")  # (both official poolings)
    model = timm.create_model(name, depth=1, num_classes=5, class_token=True,
                              global_pool="token" if token_pool else "avg_all", feature_map="elu" if lit else "silu_norm",
                              prefix_decay_one=name.startswith("lion_s"), pos_embed="learn" if lit else "none").eval()
    lion_vit.testing.randomize_decays(model)
    back = from_official(to_official(model)).eval()
    assert type(back) is type(model) and back.state_dict().keys() == model.state_dict().keys()
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


def test_a_model_the_official_code_cannot_express_is_named_not_converted():
    with pytest.raises(ValueError, match=r"^lion_s_small has no counterpart in the official LION code: it has no "
                                         r"class token \(class_token=True\); its pooling global_pool='avg'"):
        to_official(timm.create_model("lion_s_small", depth=1))
    with pytest.raises(ValueError, match="it has a distillation or register token"):
        to_official(timm.create_model("lion_d_tiny_distilled", depth=1, class_token=True, global_pool="token"))
    with pytest.raises(ValueError, match=r"official LION code: its norm after pooling \(fc_norm=False\);"):
        to_official(timm.create_model("lion_d_tiny", depth=1, class_token=True, global_pool="avg_all", fc_norm=True))


def test_class_token_decay_is_one_and_pooling_takes_every_token():
    model = from_official(official_checkpoint("Selective", "Normal", False, False)).eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 5, WIDTH)
    log_decay = attn.log_decay(x)
    assert torch.equal(log_decay[..., 0], torch.zeros_like(log_decay[..., 0])) and (log_decay[..., 1:] < 0).all()
    tokens = torch.randn(2, 5, WIDTH)
    assert torch.equal(model.forward_head(tokens, pre_logits=True), tokens.mean(1))


def test_model_ema_is_taken_when_present_unless_asked_otherwise():
    checkpoint = official_checkpoint("Decay", "Normal", False, False)
    checkpoint["model_ema"] = {k: v + 1 for k, v in checkpoint["model"].items()}
    ema, raw = from_official(checkpoint), from_official(checkpoint, use_ema=False)
    assert torch.equal(ema.head.bias, checkpoint["model_ema"]["head.bias"])
    assert torch.equal(raw.head.bias, checkpoint["model"]["head.bias"])


def test_bad_official_checkpoints_are_one_clear_error():
    checkpoint = official_checkpoint("Decay", "Normal", False, False)
    with pytest.raises(ValueError, match=r"unknown official mask_type='Gated' / order='Normal'"):
        from_official(checkpoint, args={"mask_type": "Gated"})
    with pytest.raises(ValueError, match=r"blocks.0.attn has \['a_i'\], but order='S' has \['a_i', 'a2_i'\]"):
        from_official(checkpoint, args={"order": "S"})
    del checkpoint["args"]
    with pytest.raises(ValueError, match="does not say its mask_type, order, pos_emb, cls_tok"):
        from_official(checkpoint)
    checkpoint = official_checkpoint("Decay", "Normal", False, False)
    checkpoint["model"]["blocks.0.mlp.fc1.weight"] = torch.zeros(5, WIDTH)
    with pytest.raises(ValueError, match=r"does not fit lion_d_tiny: size mismatch for blocks.0.mlp.fc1.weight"):
        from_official(checkpoint)
    checkpoint["model"] = {key: value for key, value in checkpoint["model"].items() if not key.startswith("blocks.")}
    with pytest.raises(ValueError, match=r"^the weights have no blocks: not the official LION code's layout"):
        from_official(checkpoint)
    ours = {"model": timm.create_model("lion_d_tiny").state_dict(), "config": {"model": {"name": "lion_d_tiny"}}}
    with pytest.raises(ValueError, match=r"^the checkpoint was written by lion-vit's train.py \(lion_d_tiny\): it "
                                         "needs no conversion"):
        from_official(ours)  # (the wrong way round)


def test_an_official_checkpoint_given_where_ours_belong_says_to_convert_it(tmp_path):
    """checkpoint=, resume= and model.init_from of an official checkpoint (not converted): its weights would not fit,
    or init_from would copy all but its trained decays; the line names convert_official.py."""
    import lion_vit
    from lion_vit.engine.checkpoint import load_checkpoint
    from lion_vit.errors import UserError
    path = tmp_path / "official.pth"
    torch.save(official_checkpoint("Decay", "S", False, False), path)
    convert = f"{path} holds weights of the official LION code (its decays are attn.a_i); convert them first: " \
              f"python scripts/convert_official.py {path} lion.pt"
    for setting, weights in (("checkpoint", True), ("resume", False)):
        with pytest.raises(UserError, match=f"^{setting}={re.escape(convert)} .*, then {setting}=lion.pt$"):
            load_checkpoint(path, weights=weights, setting=setting)
    with pytest.raises(ValueError, match=f"^init_from file {re.escape(convert)} .*, then start from lion.pt$"):
        lion_vit.init_from_vit(timm.create_model("lion_d_natural_tiny"), str(path))


def test_convert_script_never_overwrites_and_a_failed_write_leaves_nothing(tmp_path):
    """An existing out (the official file itself, say) is refused before anything is read; a write that fails is
    one line naming why, and leaves neither a file nor a folder it created."""
    official = tmp_path / "official.pth"
    torch.save(official_checkpoint("Decay", "Normal", False, False), official)
    before = official.read_bytes()
    for out, needle in ((official, f"{official} already exists; name a new file"),
                        (official / "x.pt", f"could not write {official / 'x.pt'} ({official}: "),
                        # a name one longer than the file system takes for its temp file: fails after the mkdir
                        (tmp_path / "new" / "sub" / ("x" * (255 - 3 - 3) + ".pt"), "(File name too long)")):
        bad = run_python("scripts/convert_official.py", str(official), str(out))
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
        assert len(bad.stderr.splitlines()) == 1 and needle in bad.stderr, bad.stderr
    assert official.read_bytes() == before and sorted(tmp_path.iterdir()) == [official]


def test_convert_script_writes_a_checkpoint_that_train_py_evaluates(tmp_path):
    """The converted file is a checkpoint of this project: its config names the architecture, and it
    loads where train.py's checkpoints load (a bad file is one error line)."""
    from lion_vit.engine.checkpoint import load_checkpoint
    from lion_vit.engine.build import build_model, trained_architecture
    from omegaconf import OmegaConf
    official = tmp_path / "official.pth"
    torch.save(official_checkpoint("Selective", "S", False, False, classes=10), official)
    out = tmp_path / "converted.pt"
    proc = run_python("scripts/convert_official.py", str(official), str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"wrote {out}: lion_s_natural_tiny, 10 classes" in proc.stdout
    assert sorted(tmp_path.iterdir()) == [out, official]  # (written through a temp file, which is gone)
    state = load_checkpoint(out)  # torch's safe load: plain data only
    arch = OmegaConf.create({"attn_form": "rnn", "attn_backend": "auto", "chunk_size": None, "drop_path_rate": 0.0,
                             **trained_architecture(state)})
    model = build_model(arch, state["num_classes"], 64, initial_weights=False)
    model.load_state_dict(state["model"])
    reference = from_official(official)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert rel_err(model.eval()(x), reference.eval()(x)) < 1e-5
    fresh = tmp_path / "fresh.pt"  # (out exists now: refused, as the test above checks)
    bad = run_python("scripts/convert_official.py", str(official), str(fresh), "--order", "Normal",
                     "--mask-type", "Lit")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
    # a checkpoint without its settings: the options that give them; this project's own weights: not official
    bare = tmp_path / "bare.pth"
    torch.save({"model": official_checkpoint("Decay", "Normal", False, False)["model"]}, bare)
    ours = tmp_path / "ours.pth"
    torch.save(timm.create_model("lion_d_tiny", depth=1).state_dict(), ours)
    for source, needles in ((bare, ["does not say its mask_type, order, pos_emb, cls_tok; pass --mask-type",
                                    "--order {Normal,S}", "--pos-emb or --no-pos-emb", "--cls-tok or --no-cls-tok"]),
                            (ours, ["the weights have no cls_token: not the official LION code's layout"])):
        bad = run_python("scripts/convert_official.py", str(source), str(fresh), *["--mask-type", "Decay", "--order",
                         "Normal", "--no-pos-emb", "--no-cls-tok"] * (source == ours))
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
        assert len(bad.stderr.splitlines()) == 1 and all(needle in bad.stderr for needle in needles), bad.stderr
