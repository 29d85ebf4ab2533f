"""The paper's Table 1 families (RetNet, Mamba-2, xLSTM, GLA, HGRN-2, RWKV-6 as LION layers) against a float64 reference written
straight from the table's formulas and the families' papers' parametrisations: each layer's output and the
gradients of its input and every parameter, in every form, one scan and two, at an odd length, with decays
near 0 and near 1. The reference reads the layer's weights, not its code: its features, decays, gate and
scaling are spelt out here, and its masks are running products (tests/naive.py)."""
from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F

import lion_vit  # noqa: F401  (registers the families)
from lion_vit.models import FAMILIES
from naive import naive_mask, rel_err

GRID = (3, 4)  # and a class token: 13 tokens
FORMS = [("attention", None), ("rnn", None), ("chunk", 4)]


def family_layer(family: str, decays: str) -> torch.nn.Module:
    """The family's attention layer of a tiny model in float64, its parameters moved off their init (decays
    "near0": masks that vanish a token away, "near1": masks that barely decay, "spread": in between)."""
    model = timm.create_model(f"{family}_tiny", num_classes=3, depth=1, img_size=(12, 16), patch_size=4,
                              class_token=True, global_pool="token").double()
    attn = model.blocks[0].attn
    attn.grid_size, attn.num_prefix_tokens = GRID, 1
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in attn.parameters():  # projections of trained size: outputs far from their init
            param.add_(torch.randn(param.shape, generator=g, dtype=torch.float64) * 0.05)
        decay = attn.decay
        shift = {"near0": 1, "near1": -1, "spread": 0}[decays]
        if family.startswith("lion_mamba2"):  # lam = exp(-softplus(dt + b) A): large A vanishes, small keeps
            decay.A_log.add_(shift * 4.0)
        elif family.startswith("lion_xlstm"):  # f = sigmoid(w x + b)
            decay.proj.bias.add_(-shift * 10.0)
        elif family.startswith("lion_gla"):  # log lam = logsigmoid(z) / 16, per key channel
            decay.up.bias.add_(-shift * 100.0 if shift > 0 else 10.0 * -shift)
        elif family.startswith("lion_hgrn2"):  # lam = b + (1 - b) sigmoid(z), per key channel
            decay.proj.bias.add_(-shift * 12.0)
        elif family.startswith("lion_rwkv6"):  # log lam = -exp(w + z), per key channel
            decay.base.add_(shift * 6.0 if shift > 0 else -10.0 * -shift)
    return attn


def reference(attn, x: torch.Tensor, family: str) -> torch.Tensor:
    """Table 1's Y = Scale((Q U^T) * M) V, then the output projection, in float64 from the layer's weights."""
    batch, length, dim = x.shape
    heads, scans = attn.num_heads, attn.num_scans
    q, k, v = (x @ attn.qkv.weight.T + attn.qkv.bias).unflatten(-1, (3, heads, -1)).permute(2, 0, 3, 1, 4)
    width = q.shape[-1]
    if family.startswith(("lion_mamba2", "lion_hgrn2")):  # C and B (HGRN-2: q) through SiLU
        q, k = F.silu(q), F.silu(k)
    else:  # RetNet's and xLSTM's keys scaled by 1 / sqrt(d)
        k = k / width ** 0.5
    decay = attn.decay
    if family.startswith("lion_retnet"):  # gamma_h = 1 - 2^(-5-h), fixed
        lam = (1 - 2.0 ** (-5.0 - torch.arange(heads, dtype=torch.float64)))[None, None, :, None]
        lam = lam.expand(scans, batch, heads, length)
    elif family.startswith("lion_mamba2"):  # lam_t = exp(-softplus(dt_t + dt_bias) exp(A_log))
        dt = (x @ decay.dt_proj.weight.T).unflatten(-1, (scans, heads)).permute(2, 0, 3, 1)
        lam = torch.exp(-F.softplus(dt + decay.dt_bias[:, None, :, None]) * decay.A_log.exp()[:, None, :, None])
    elif family.startswith("lion_xlstm"):  # xLSTM's forget gate f_t = sigmoid(w . x_t + b)
        lam = torch.sigmoid(x @ decay.proj.weight.T + decay.proj.bias).unflatten(-1, (scans, heads)).permute(2, 0, 3, 1)
    elif family.startswith("lion_gla"):  # GLA's gate, per key channel: sigmoid(x_t W_1 W_2 + b)^(1/16) [S, B, H, L, Dk]
        z = x @ decay.down.weight.T @ decay.up.weight.T + decay.up.bias
        lam = (torch.sigmoid(z) ** (1 / 16)).unflatten(-1, (scans, heads, width)).permute(2, 0, 3, 1, 4)
    elif family.startswith("lion_rwkv6"):  # RWKV-6's decay, per key channel: exp(-exp(w + tanh(x_t A) B))
        z = torch.tanh(x @ decay.down.weight.T) @ decay.up.weight.T + decay.base.flatten()
        lam = torch.exp(-torch.exp(z)).unflatten(-1, (scans, heads, width)).permute(2, 0, 3, 1, 4)
    else:  # HGRN-2's forget gate above its lower bound, one for both scans; its keys are 1 - lam
        bound = torch.sigmoid(decay.lower_bound_logit)
        lam = bound + (1 - bound) * torch.sigmoid(x @ decay.proj.weight.T + decay.proj.bias)
        lam = lam.unflatten(-1, (heads, width)).transpose(1, 2)[None].expand(scans, -1, -1, -1, -1)
        k = 1 - lam[0]
    if family.startswith("lion_xlstm"):  # U = i * K, xLSTM's input gate i_t = exp(w . x_t + b)
        k = k * torch.exp(x @ attn.key_gate.proj.weight.T + attn.key_gate.proj.bias).transpose(1, 2)[..., None]
    orders = attn.scan_orders(length, x.device) if scans == 2 else torch.arange(length)[None]
    weights = 0
    for s, order in enumerate(orders):
        back = torch.argsort(order)  # token -> scan position
        if lam.dim() == 5:  # a mask per key channel: sum_c q_i^c k_j^c M^c_ij
            mask = naive_mask(lam[s][..., order, :].transpose(-1, -2))[..., back[:, None], back[None, :]]
            weights = weights + torch.einsum("bhic,bhjc,bhcij->bhij", q, k, mask)
        else:
            mask = naive_mask(lam[s][..., order])[..., back[:, None], back[None, :]]
            weights = weights + (q @ k.transpose(-1, -2)) * mask
    if attn.scaling == "max":  # xLSTM: max(|n|, 1)
        weights = weights / weights.sum(-1, keepdim=True).abs().clamp_min(1.0)
    y = (weights @ v).transpose(1, 2).reshape(batch, length, dim)
    return y @ attn.proj.weight.T + attn.proj.bias


@pytest.mark.parametrize("family, decays", [(family, decays) for family in sorted(FAMILIES)
                                            for decays in ("spread", "near0", "near1")
                                            if decays == "spread" or not family.startswith("lion_retnet")])
def test_family_layers_match_table_1(family, decays):  # (RetNet's decays are fixed)
    attn = family_layer(family, decays)
    x = torch.randn(2, GRID[0] * GRID[1] + 1, attn.qkv.in_features, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    leaves = [x.requires_grad_()] + list(attn.parameters())
    expected = reference(attn, x, family)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), leaves, allow_unused=True)
    for form, chunk in FORMS:
        attn.set_attn_form(form, chunk, backend="torch")
        out = attn(x)
        assert rel_err(out, expected) < 1e-10, form
        grads = torch.autograd.grad((out * upstream).sum(), leaves, allow_unused=True)
        for (name, _), got, want in zip([("x", x), *attn.named_parameters()], grads, expected_grads):
            if want is None:  # (a parameter the formula does not read: none but the absent ones)
                assert got is None or not got.any(), (form, name)
                continue
            assert rel_err(got, want, min_scale=1e-6) < 1e-8, (form, name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_models_trace_with_torch_fx(family):
    """torch.fx traces every family's decays and gates as data (on every PyTorch the package allows): the graph
    agrees with eager in every form."""
    model = timm.create_model(f"{family}_tiny", num_classes=3, depth=1, img_size=(12, 16), patch_size=4).eval()
    x = torch.randn(2, 3, 12, 16, generator=torch.Generator().manual_seed(0))
    for form, chunk in FORMS:
        graph = torch.fx.symbolic_trace(model.set_attn_form(form, chunk))
        with torch.no_grad():
            assert rel_err(graph(x), model(x)) < 1e-5, form


def test_families_are_registered_at_every_size_with_their_settings():
    names = set(timm.list_models("lion_*"))
    for family, settings in FAMILIES.items():
        assert {f"{family}_{size}" for size in ("tiny", "small", "base")} <= names
        attn = next(timm.create_model(f"{family}_tiny").lion_attentions())
        assert (attn.decay_name, attn.scaling, attn.num_scans) == (settings["decay"], settings["scaling"],
                                                                   settings.get("num_scans", 1))
    assert set(lion_vit.FAMILY_MODEL_NAMES) == {f"{family}_{size}" for family in FAMILIES
                                                for size in ("tiny", "small", "base")}


def test_mamba2_and_xlstm_initial_decays_follow_their_papers():
    """Mamba-2: A in [1, 16], softplus(dt_bias) in [0.001, 0.1]; xLSTM: forget gate biases from 3 to 6 over the
    heads, zero weights; its input gate's weights zero."""
    mamba = next(timm.create_model("lion_mamba2_small").lion_attentions()).decay
    assert 1 <= mamba.A_log.exp().min() and mamba.A_log.exp().max() <= 16
    dt = F.softplus(mamba.dt_bias)
    assert 1e-3 * 0.999 <= dt.min() and dt.max() <= 0.1 * 1.001
    xlstm = next(timm.create_model("lion_xlstm_small").lion_attentions())
    assert torch.allclose(xlstm.decay.proj.bias, torch.linspace(3, 6, 6))
    assert not xlstm.decay.proj.weight.any() and not xlstm.key_gate.proj.weight.any()


def test_rwkv6_initial_decays_follow_its_paper():
    """RWKV-6: the decay projection's first matrix zero, its second within 0.01, the bases rising over the layer's
    channels from -6 to -1 (lam from exp(-exp(-6)) to exp(-exp(-1))), the same for each scan."""
    decay = next(timm.create_model("lion_rwkv6_natural_small").lion_attentions()).decay
    assert not decay.down.weight.any() and decay.up.weight.abs().max() <= 0.01
    base = decay.base
    assert base.shape == (2, 384) and torch.equal(base[0], base[1])
    assert base[0, 0] == -6 and abs(base[0, -1] + 1) < 1e-6 and (base[0].diff() > 0).all()
    lam = decay(torch.randn(2, 5, 384)).exp()
    assert lam.shape == (2, 2, 6, 5, 64)
    assert torch.allclose(lam, torch.exp(-base.exp()).unflatten(-1, (6, 64))[:, None, :, None])


def test_gla_plans_its_vector_decays_in_every_form():
    model = timm.create_model("lion_gla_natural_tiny", num_classes=3, depth=1, img_size=(32, 48)).eval()
    assert str(model.attn_plan((32, 48))) == "attention form, cpu backend: one chunk in groups of rows, vector decays"
    model.set_attn_form("attention", backend="torch")
    assert str(model.attn_plan((32, 48))) == "attention form, torch backend: one masked product, vector decays"
    model.set_attn_form("attention", backend="auto")
    assert str(model.set_attn_form("chunk", 4).attn_plan((32, 48))) == \
        "chunk form, cpu backend: 2 chunks in groups of rows, vector decays"


def test_keys_made_of_decays_need_decays_every_scan_shares():
    """HGRN-2's keys 1 - lam are one set: a decay kind that gives each scan its own (or none) is one line."""
    with pytest.raises(ValueError, match="gives each scan its own; use a decay kind that every scan shares"):
        timm.create_model("lion_gla_natural_tiny", key_gate="one_minus_decay")
    with pytest.raises(ValueError, match="makes the keys of the decays; decay='lit' has none"):
        timm.create_model("lion_lit_tiny", key_gate="one_minus_decay", feature_map="swish", scaling="none")
    attn = next(timm.create_model("lion_hgrn2_natural_tiny").lion_attentions())
    log_decays = attn.log_decay(torch.randn(2, 5, attn.qkv.in_features))
    assert log_decays.shape == (2, 2, 3, 5, 64) and torch.equal(log_decays[0], log_decays[1])


def test_keys_made_of_decays_leave_the_projected_keys_unread():
    """HGRN-2's layer projects queries and values alone: the keys' rows of qkv change nothing, in training and
    inference (and take no gradient)."""
    attn = family_layer("lion_hgrn2", "spread")
    x = torch.randn(2, 13, attn.qkv.in_features, dtype=torch.float64, requires_grad=True)
    before = attn(x)
    before.sum().backward()
    dim = attn.qkv.in_features
    assert attn.qkv.weight.grad[dim:2 * dim].abs().max() == 0 and attn.qkv.weight.grad[:dim].abs().max() > 0
    with torch.no_grad():
        unchanged = attn(x)  # (without autograd: the form that inference runs)
        attn.qkv.weight[dim:2 * dim].normal_()
        attn.qkv.bias[dim:2 * dim].normal_()
        assert torch.equal(attn(x), unchanged) and rel_err(unchanged, before) < 1e-12
        assert rel_err(attn.eval()(x), before) < 1e-12
