"""A variant is data: a decay kind defined outside the package (fixed per-head decays, 1 - 2^(-4-h)) with one
class and one registration, and every form, torch.fx and the float64 reference agree."""
from __future__ import annotations

import copy

import pytest
import timm
import torch

import lion_vit.layers
import lion_vit.models
from lion_vit.decays import DECAYS, Decay, register_decay
from lion_vit.models import register_variant
from lion_vit.ops.reference import lion_attention_reference
from naive import rel_err


class HalvingDecay(Decay):
    """gamma_h = 1 - 2^(-4-h), fixed: no parameters."""

    def forward(self, x):  # (heads 0..H-1 from x: torch.fx before PyTorch 2.9 cannot trace arange(device=x.device))
        gamma = 1 - 2.0 ** (-4.0 - (x.new_ones(self.num_heads, dtype=torch.float64).cumsum(0) - 1))
        return gamma.log().expand(self.num_scans, self.num_heads)[:, None, :, None]


def test_a_kind_is_registered_as_its_class():
    with pytest.raises(TypeError, match="takes a subclass of lion_vit.decays.Decay"):
        register_decay("halving", HalvingDecay(8, 2))


@pytest.fixture
def registries_restored():
    """timm's model registry and lion_vit's tables as they were before the test, for the tests that list every
    LION model. timm has no public way to unregister a model, and its private tables differ between releases
    (1.0.31 added a function that clears one name): each table is copied, one level deep, and put back."""
    from timm.models import _registry
    tables = [table for name, table in vars(_registry).items() if isinstance(table, (dict, set))
              and not name.startswith("__")]
    tables += [DECAYS, lion_vit.models.VARIANTS, lion_vit.models.default_cfgs, lion_vit.models.__all__]
    saved = [copy.copy(table) if isinstance(table, (set, list))
             else {key: copy.copy(value) if isinstance(value, (dict, set, list)) else value
                   for key, value in table.items()} for table in tables]
    yield
    for table, before in zip(tables, saved):
        if isinstance(table, list):
            table[:] = before
        else:
            table.clear()
            table.update(before)
    assert not timm.list_models("lion_halving_*")


def test_a_kind_defined_outside_the_package(monkeypatch, registries_restored):
    register_decay("halving", HalvingDecay)
    names = register_variant("lion_halving", decay="halving")
    assert "lion_halving_small" in names and "lion_halving_small" in timm.list_models("lion_halving_*")
    model = timm.create_model("lion_halving_tiny", num_classes=4, img_size=32, patch_size=8, depth=2).double().eval()
    assert not any(".decay." in name for name, _ in model.named_parameters())  # nothing learnable
    assert isinstance(next(model.lion_attentions()).decay, HalvingDecay)  # each layer owns its own
    assert model.pos_embed is None  # decayed: the mask carries position
    attn = next(model.lion_attentions())
    log_decay = attn.log_decay(torch.zeros(1, 17, model.embed_dim, dtype=torch.float64))
    assert torch.allclose(log_decay.exp().flatten(), 1 - 2.0 ** -torch.arange(4.0, 7.0, dtype=torch.float64))

    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with monkeypatch.context() as patch:  # every layer through the paper's formula
        patch.setattr(lion_vit.layers, "lion_attention", lion_attention_reference)
        expected = model(x)
    with torch.no_grad():
        for form, chunk in [("attention", None), ("rnn", None), ("chunk", 3)]:
            assert rel_err(model.set_attn_form(form, chunk)(x), expected) < 1e-10, form
            assert rel_err(torch.fx.symbolic_trace(model)(x), expected) < 1e-10, form  # traced through the kind


class ScanlessDecay(HalvingDecay):
    """A slip: per token and head, [B, H, L], without the scan dimension."""

    def forward(self, x):
        return super().forward(x)[0, :, :].expand(x.shape[0], self.num_heads, x.shape[1])


class TokensBeforeHeadsDecay(HalvingDecay):
    """A slip: [S, B, L, H]."""

    def forward(self, x):
        return super().forward(x).expand(self.num_scans, x.shape[0], self.num_heads, x.shape[1]).transpose(-1, -2)


@pytest.mark.parametrize("kind", [ScanlessDecay, TokensBeforeHeadsDecay])
@pytest.mark.parametrize("scans", [1, 2])
def test_a_kind_of_the_wrong_shape_is_named_not_broadcast(registries_restored, kind, scans):
    """A kind's log decays of another shape than [S, B|1, H, L|1] are one ValueError naming the kind, where the op
    alone would read a batch of 2 as two scans (or refuse in its own terms)."""
    register_decay("slip", kind)
    model = timm.create_model("lion_d_tiny", decay="slip", num_scans=scans,
                              num_classes=4, img_size=32, patch_size=8, depth=1)
    with pytest.raises(ValueError, match=rf"^decay kind {kind.__name__} returned log decays \[.*\]; a Decay's "
                                         rf"forward returns \[S, B\|1, H, L\|1\] = \[{scans}, 2\|1, 3, 16\|1\]"):
        model(torch.randn(2, 3, 32, 32))


def test_scaling_is_a_model_setting_that_every_form_follows():
    """LionViT(scaling=...) with the identity feature map runs each form alike; "sum" with features that may
    sum to zero is one line."""
    model = timm.create_model("lion_d_natural_tiny", num_classes=4, img_size=32, patch_size=8, depth=2,
                              scaling="max", feature_map="identity").double().eval()
    assert "scaling=max" in repr(next(model.lion_attentions()))
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.set_attn_form("attention")(x)
        for form, chunk in [("rnn", None), ("chunk", 3)]:
            assert rel_err(model.set_attn_form(form, chunk)(x), expected) < 1e-10, form
    with pytest.raises(ValueError, match="scaling='sum' divides by sum_j q_i . k_j, which needs positive features"):
        timm.create_model("lion_d_tiny", feature_map="identity")


def test_a_key_gate_defined_outside_the_package():
    """One class, one registration: a constant gate of 1/2 on every key leaves LION's row-sum scaling unchanged
    and halves an unscaled output; registering an instance is one TypeError, a gate of another shape one
    ValueError."""
    from lion_vit.gates import KEY_GATES, KeyGate, register_key_gate

    class Half(KeyGate):
        def forward(self, x, log_decays=None):
            return torch.full((1, self.num_heads, x.shape[1], 1), 0.5, dtype=torch.float64, device=x.device)

    with pytest.raises(TypeError, match="takes a subclass of lion_vit.gates.KeyGate"):
        register_key_gate("half", Half(8, 2))
    register_key_gate("half", Half)
    try:
        x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        for scaling, feature_map, factor in (("sum", "silu_norm", 1.0), ("none", "identity", 0.5)):
            settings = dict(num_classes=4, img_size=32, patch_size=8, depth=1, scaling=scaling, feature_map=feature_map)
            plain = timm.create_model("lion_d_tiny", **settings).double().eval()
            gated = timm.create_model("lion_d_tiny", key_gate="half", **settings).double().eval()
            gated.load_state_dict(plain.state_dict())
            attn = next(gated.lion_attentions())
            tokens = torch.randn(2, 16, 192, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
            attn.grid_size = next(plain.lion_attentions()).grid_size = (4, 4)
            with torch.no_grad():
                got, want = attn(tokens), next(plain.lion_attentions())(tokens)
                assert rel_err(got - attn.proj.bias, factor * (want - attn.proj.bias)) < 1e-12, scaling
                assert gated(x).shape == (2, 4)
        # a gate without its last dimension, [B, H, L]: one line naming the kind, where the keys [B, H, L, Dk] would
        # broadcast against it wherever L = Dk
        register_key_gate("flat", type("Flat", (KeyGate,), {"forward": lambda self, x, log_decays=None: torch.ones(
            x.shape[0], self.num_heads, x.shape[1], dtype=x.dtype)}))
        flat = timm.create_model("lion_d_tiny", key_gate="flat", num_classes=4, img_size=32, patch_size=8, depth=1)
        with pytest.raises(ValueError, match=r"^key gate kind Flat returned a gate \[2, 3, 16\]; a KeyGate's forward "
                                             r"returns \[B\|1, H, L, 1\|Dk\] = \[2\|1, 3, 16, 1\|64\]$"):
            flat(x.float())
    finally:
        KEY_GATES.pop("half")
        KEY_GATES.pop("flat", None)
