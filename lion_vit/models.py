"""LION-ViT: Vision Transformers whose attention is LION bidirectional linear attention.

Paper: "LION: Linear Attention for Bidirectional Sequence Modeling" (Afzal et al.), models as in
its Table 2: LION-lit (no decay), LION-d (a learnable decay per head), LION-s (selective decay per
token) and the two-scan "natural" LION-d / LION-s, at ViT-T/S/B widths.

The backbone is timm's `VisionTransformer` with `LionAttention` as its attention layer, so the
whole timm model API (forward_features, forward_head, reset_classifier, group_matcher,
set_grad_checkpointing, forward_intermediates / features_only) comes with it. Differences:
mean pooling over patch tokens and no class token by default (global_pool="token" adds one),
learnable positional embeddings only for LION-lit (the decays give LION-d/-s their position
signal), and any input size that the patch size divides works without rebuilding the model
(timm's dynamic_img_size, always on; dynamic_img_pad=True pads any other size).
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Set, Tuple, Union

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import PatchEmbed, resample_abs_pos_embed, to_2tuple, trunc_normal_
from timm.models import build_model_with_cfg, create_model, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer
from timm.models.vision_transformer import checkpoint_filter_fn as vit_checkpoint_filter_fn
from torch import Tensor, nn

from .decays import DECAYS, Decay
from .layers import LionAttention, fx_tracing
from .ops import Plan

__all__ = ["LionViT", "LION_MODEL_NAMES", "DISTILLED_MODEL_NAMES", "FAMILY_MODEL_NAMES", "VARIANTS", "FAMILIES",
           "register_variant", "is_lion_model", "create_model_at_size"]


class DivisiblePatchEmbed(PatchEmbed):
    """timm's PatchEmbed, but a size the patch does not divide is a ValueError that says why (unless
    dynamic_img_pad=True, timm's zero padding of the input up to a multiple of the patch size)."""

    def __init__(self, img_size: Any = 224, patch_size: Any = 16, dynamic_img_pad: bool = False,
                 **kwargs: Any) -> None:
        if not dynamic_img_pad:
            _check_divisible(to_2tuple(img_size), to_2tuple(patch_size), "img_size")
        super().__init__(img_size=img_size, patch_size=patch_size, dynamic_img_pad=dynamic_img_pad, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        if not fx_tracing():  # (fx's symbols cannot be checked; torch.compile and export run the checks)
            _check_images(x, self.proj.in_channels)
            if not self.dynamic_img_pad:
                _check_divisible(tuple(x.shape[-2:]), self.patch_size, "input")
        return super().forward(x)


def create_model_at_size(name: str, img_size: Union[int, Tuple[int, int]], patch_size: Optional[int] = None,
                         **kwargs: Any) -> torch.nn.Module:
    """timm.create_model for inputs of img_size (a square's side, or (height, width)) and patch_size when given. A
    model that takes no such argument (a CNN baseline such as resnet50) is built without it: it accepts any size."""
    size_kwargs: Dict[str, Any] = dict(img_size=img_size, **({"patch_size": patch_size} if patch_size else {}))
    try:
        model = create_model(name, **kwargs, **size_kwargs)
    except TypeError as error:
        if not any(key in str(error) for key in size_kwargs):
            raise
        return create_model(name, **kwargs)
    # timm's ViTs (DeiT) built for a size their patch does not divide drop the last pixels of every
    # image without a word; LION models refuse such a size, and so do baselines built here
    patch_embed = getattr(model, "patch_embed", None)
    patch = getattr(patch_embed, "patch_size", None)
    if isinstance(patch, tuple) and not getattr(patch_embed, "dynamic_img_pad", False):
        _check_divisible(to_2tuple(img_size), patch, "img_size")
    return model


def _check_images(x: Tensor, channels: int) -> None:
    if x.dim() != 4:
        raise ValueError(f"expected a batch of images [batch, {channels}, height, width], got shape {list(x.shape)}; "
                         "add the batch dimension (x.unsqueeze(0) for one image)")
    if x.shape[1] != channels:
        raise ValueError(f"the model takes {channels}-channel images, got {x.shape[1]} channels (shape {list(x.shape)}); "
                         f"convert the images or build the model with in_chans={x.shape[1]}")


POOLS = ("avg", "avg_all", "token", "max", "avgmax", "map", "prr", "")  # timm's and the official LION code's


def _check_pool(global_pool: str) -> None:
    if global_pool not in POOLS:
        raise ValueError(f"unknown global_pool {global_pool!r}; choose one of {', '.join(map(repr, POOLS))}")


# (reset_classifier(0, "") allows it: timm's prune_intermediate_layers, for features_only, drops the heads so)
UNPOOLED_DISTILLED = ("global_pool='' keeps every token's logits, which a distillation head's logits of one token "
                      "cannot be averaged with; choose a pooling, such as 'avg' or 'token'")


def _check_divisible(size: Tuple[int, int], patch: Tuple[int, int], what: str) -> None:
    if size[0] % patch[0] or size[1] % patch[1]:
        raise ValueError(f"{what} {size[0]}x{size[1]} is not divisible by the patch size "
                         f"{patch[0]}x{patch[1]}; use a height and width that are multiples of it")


class LionViT(VisionTransformer):
    """ViT backbone with LION attention (see module docstring)."""

    def __init__(
            self,
            decay: str = "lit",
            num_scans: int = 1,
            feature_map: str = "silu_norm",
            scaling: str = "sum",
            key_gate: str = "none",
            attn_form: str = "attention",
            chunk_size: Optional[int] = None,
            attn_backend: str = "auto",
            prefix_decay_one: bool = False,
            global_pool: str = "avg",
            class_token: Optional[bool] = None,
            pos_embed: Optional[str] = None,
            patch_drop_rate: float = 0.0,
            weight_init: str = "",
            dynamic_img_size: bool = True,
            distilled: bool = False,
            **kwargs: Any,
    ) -> None:
        if not dynamic_img_size:
            raise ValueError("dynamic_img_size=False is not supported: LION layers read the patch grid of each "
                             "input, so every size the patch size divides works; leave dynamic_img_size unset")
        if patch_drop_rate:
            raise ValueError("patch_drop_rate is not supported: LION decays need the full patch grid")
        for size in ("depth", "embed_dim"):  # (timm's defaults: 12, 768)
            if kwargs.get(size, 1) < 1:
                raise ValueError(f"{size} must be a positive integer, got {kwargs[size]}")
        _check_pool(global_pool)
        if distilled and not global_pool:
            raise ValueError(UNPOOLED_DISTILLED)
        all_tokens = global_pool == "avg_all"  # the official LION code's pooling: timm builds it as "avg"
        if all_tokens:
            global_pool = "avg"
            if kwargs.get("fc_norm") is None:  # (the final norm on every token, before the mean)
                kwargs["fc_norm"] = False
        if class_token is None:  # token pooling reads the class token: add one only for it
            class_token = global_pool == "token"
        if global_pool == "token" and not class_token:
            raise ValueError("global_pool='token' pools the class token, but class_token=False; "
                             "leave class_token unset, or pool with global_pool='avg'")
        if pos_embed is None:
            pos_embed = "learn" if decay in DECAYS and not DECAYS[decay].decayed else "none"
        if pos_embed not in ("", "none", "learn"):
            raise ValueError(f"unknown pos_embed {pos_embed!r}; choose 'learn' (default for LION-lit) or 'none' "
                             "(default for the decay variants, whose masks carry position)")
        attn_layer = _partial_attention(decay=decay, num_scans=num_scans, feature_map=feature_map,
                                        scaling=scaling, key_gate=key_gate, attn_form=attn_form,
                                        chunk_size=chunk_size, attn_backend=attn_backend,
                                        prefix_decay_one=prefix_decay_one)
        super().__init__(
            global_pool=global_pool, class_token=class_token, pos_embed=pos_embed,
            dynamic_img_size=True, embed_layer=DivisiblePatchEmbed, attn_layer=attn_layer,
            weight_init=weight_init, **kwargs)
        if all_tokens:  # (pool() reads it; timm's get_model_args records it, so a saved model rebuilds as it was)
            self.global_pool = "avg_all"
        self.dist_token: Optional[nn.Parameter] = None
        self.head_dist: Optional[nn.Module] = None
        self.distilled_training = False  # set_distilled_training(True): forward returns both heads' logits
        if distilled:
            self._add_distillation_token(kwargs.get("device"), kwargs.get("dtype"), init=weight_init != "skip")
        shared_orders: dict = {}  # every layer reads the same snake orders: compute and keep them once
        for attn in self.lion_attentions():
            attn.__class__ = LionAttention  # the bound class only built it: a plain layer pickles (torch.save)
            attn.num_prefix_tokens = self.num_prefix_tokens
            attn._orders = shared_orders
            if weight_init != "skip":
                attn.reset_decay_parameters()  # timm's init zeroed the selective-decay bias

    def _add_distillation_token(self, device: Any, dtype: Any, init: bool) -> None:
        """DeiT's distillation token (after the class token, before the patches) and its head."""
        dd = {"device": device, "dtype": dtype}
        self.dist_token = nn.Parameter(torch.zeros(1, 1, self.embed_dim, **dd))
        self.num_prefix_tokens += 1
        if self.pos_embed is not None and not self.no_embed_class:  # one more prefix entry
            self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + self.num_prefix_tokens,
                                                      self.embed_dim, **dd))
        self.head_dist = nn.Linear(self.embed_dim, self.num_classes, **dd) if self.num_classes > 0 else nn.Identity()
        if init:
            trunc_normal_(self.dist_token, std=0.02)
            if self.pos_embed is not None and not self.no_embed_class:
                trunc_normal_(self.pos_embed, std=0.02)
            if isinstance(self.head_dist, nn.Linear):
                trunc_normal_(self.head_dist.weight, std=0.02)
                nn.init.zeros_(self.head_dist.bias)

    @property
    def distilled(self) -> bool:
        return self.dist_token is not None

    @torch.jit.ignore
    def set_distilled_training(self, enable: bool = True) -> None:
        """With a distillation token: in training mode, forward returns (class logits, distillation
        logits) for DeiT's distillation loss; otherwise (and in eval mode) their mean."""
        self.distilled_training = enable

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        matcher = super().group_matcher(coarse)
        return {**matcher, "stem": matcher["stem"] + "|dist_token"}

    @torch.jit.ignore
    def get_classifier(self) -> Any:
        return (self.head, self.head_dist) if self.distilled else self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """timm's, for a new number of classes and optionally pooling (also "avg_all"; the norm stays where it
        is, as timm keeps it), and with a distillation token a new distillation head too."""
        if global_pool is not None:
            _check_pool(global_pool)
            if global_pool == "token" and self.cls_token is None:
                raise ValueError("global_pool='token' pools the class token, which this model was built without "
                                 "(class_token=True adds one at build)")
        super().reset_classifier(num_classes, "avg" if global_pool == "avg_all" else global_pool)
        if global_pool == "avg_all":
            self.global_pool = global_pool
        if self.distilled:
            weight = self.head.weight if isinstance(self.head, nn.Linear) else self.dist_token
            self.head_dist = (nn.Linear(self.embed_dim, num_classes, device=weight.device, dtype=weight.dtype)
                              if num_classes > 0 else nn.Identity())
            self.head_dist.train(self.training)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Any:
        """timm's head; with a distillation token also the distillation head (on that token, normed as the
        pooled features are), averaged with the class head except in distilled training."""
        if not self.distilled:
            return super().forward_head(x, pre_logits)
        if not self.global_pool:
            raise ValueError(UNPOOLED_DISTILLED)
        x_dist = self.head_drop(self.fc_norm(x[:, 0 if self.cls_token is None else 1]))
        x = self.head_drop(self.fc_norm(self.pool(x)))
        if pre_logits:
            return (x + x_dist) / 2
        x, x_dist = self.head(x), self.head_dist(x_dist)
        if self.distilled_training and self.training:
            return x, x_dist
        return (x + x_dist) / 2

    def lion_attentions(self) -> Iterator[LionAttention]:
        """The LION layers in module order."""
        return iter(_lion_layers(self))

    def set_attn_form(self, attn_form: str, chunk_size: Optional[int] = None,
                      backend: Optional[str] = None) -> "LionViT":
        """Switch every block to "attention", "rnn", "chunk" or "auto" (same weights, same function), and
        to backend "auto", "torch" or "triton" unless backend is None (each layer checks the values before
        it changes anything, so a bad one changes no block)."""
        for attn in self.lion_attentions():
            attn.set_attn_form(attn_form, chunk_size, backend)
        return self

    def attn_plan(self, img_size: Union[None, int, Tuple[int, int]] = None,
                  device: Union[None, str, torch.device] = None, dtype: Optional[torch.dtype] = None,
                  training: Optional[bool] = None) -> Plan:
        """What every LION layer runs for an image of img_size (H, W, one int for a square, or by default the
        size the model was built for) on device ("cuda" or a torch.device) / dtype (default: the weights'), in
        training if training is True, or where it is None when the model is in training mode: form, backend,
        and chunks or one product (lion_vit.ops.dispatch.plan). print() it. A size the patch does not divide is
        the forward's ValueError."""
        img_size = to_2tuple(self.patch_embed.img_size if img_size is None else img_size)
        if not self.patch_embed.dynamic_img_pad:
            _check_divisible(img_size, self.patch_embed.patch_size, "img_size")
        height, width = self.patch_embed.dynamic_feat_size(img_size)
        return next(self.lion_attentions()).attn_plan(height * width + self.num_prefix_tokens, device, dtype,
                                                      training)

    def chunks_per_sequence(self, img_size: Union[int, Tuple[int, int]]) -> Optional[int]:
        """In the chunk form, how many chunks every layer cuts the tokens of an image of img_size (H, W, or
        one int) into: 1 where it runs one product over the whole sequence, which costs less there; None in the
        other forms."""
        run = self.attn_plan(img_size)
        return run.chunks if run.form == "chunk" else None

    @property
    def attn_form(self) -> Tuple[str, Optional[int]]:
        attn = next(self.lion_attentions())
        return attn.attn_form, attn.chunk_size

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """timm's set plus every parameter of the layers' decay kinds (lion_vit.decays)."""
        names = {f"{name}.{param}" for name, module in self.named_modules() if isinstance(module, Decay)
                 for param, _ in module.named_parameters()}
        return super().no_weight_decay() | names

    def pool(self, x: Tensor, pool_type: Optional[str] = None) -> Tensor:
        """timm's pooling; global_pool="avg_all" averages every token, prefix tokens too, as the official LION
        code does."""
        if (self.global_pool if pool_type is None else pool_type) == "avg_all":
            return x.mean(dim=1)
        return super().pool(x, pool_type)

    def __prepare_scriptable__(self) -> "LionViT":
        raise RuntimeError("LION models cannot be scripted (TorchScript is deprecated in PyTorch); use "
                           "torch.compile(model) or torch.export.export(model, (x,)) instead")

    def _pos_embed(self, x: Tensor) -> Tensor:
        """timm's dynamic-size _pos_embed (class / register tokens, resampled positional embeddings), with
        the resampling a leaf for torch.fx (its branches compare sizes) and a batch of no images allowed;
        first, every LION layer is told the grid [B, h, w, C] it is about to see."""
        batch, height, width, dim = x.shape
        # eagerly set only where it changes (a module's setattr costs host time); traced, always: a graph that
        # read the grid before would be guarded on it, and recompiled once the forward had set it
        tracing = fx_tracing() or torch.compiler.is_compiling()
        for attn in _lion_layers(self):
            if tracing or attn.grid_size != (height, width):
                attn.grid_size = (height, width)
        prefix = [token.expand(batch, -1, -1) for token in (self.cls_token, self.dist_token, self.reg_token)
                  if token is not None]
        x = x.reshape(batch, height * width, dim)  # (timm's view(B, -1, C) cannot infer -1 for 0 images)
        if self.pos_embed is None:
            return torch.cat(prefix + [x], dim=1)
        pos_embed = _resampled_pos_embed(self.pos_embed, height, width, self.patch_embed.grid_size,
                                         0 if self.no_embed_class else self.num_prefix_tokens)
        if self.no_embed_class:
            x = torch.cat(prefix + [x + pos_embed], dim=1)
        else:
            x = torch.cat(prefix + [x], dim=1) + pos_embed
        return self.pos_drop(x)


def _lion_layers(module: nn.Module) -> List[LionAttention]:
    """module's LION layers in modules() order, by a walk of the children that builds no names as modules()
    does: it runs every forward, on the host's time."""
    found = []
    for child in module._modules.values():
        if isinstance(child, LionAttention):
            found.append(child)
        elif child is not None:
            found += _lion_layers(child)
    return found


def _resampled_pos_embed(pos_embed: Tensor, height: int, width: int, trained_grid: Tuple[int, int],
                         num_prefix_tokens: int) -> Tensor:
    """timm's resample_abs_pos_embed to the current grid (a leaf for torch.fx: it branches on the sizes)."""
    return resample_abs_pos_embed(pos_embed, new_size=(height, width), old_size=trained_grid,
                                  num_prefix_tokens=num_prefix_tokens)


torch.fx.wrap("_resampled_pos_embed")


def _partial_attention(**lion_kwargs: Any) -> type:
    """A LionAttention subclass with the LION arguments bound (timm's Block wants a class); LionViT turns the
    layers it built into plain LionAttention, which pickle by name as this local class cannot."""
    class BoundLionAttention(LionAttention):
        def __init__(self, dim: int, **timm_kwargs: Any) -> None:
            super().__init__(dim, **timm_kwargs, **lion_kwargs)
    BoundLionAttention.__name__ = BoundLionAttention.__qualname__ = "LionAttention"
    return BoundLionAttention


def checkpoint_filter_fn(state_dict: Dict[str, Tensor], model: LionViT) -> Dict[str, Tensor]:
    """Unwrap training checkpoints and resample positional embeddings (timm's ViT filter)."""
    if "model" in state_dict:
        state_dict = state_dict["model"]
    return vit_checkpoint_filter_fn(state_dict, model)


def _cfg(**kwargs: Any) -> Dict[str, Any]:
    return {
        "url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": None,
        "crop_pct": 0.875, "interpolation": "bicubic", "fixed_input_size": False,
        "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj", "classifier": "head", "license": "apache-2.0", **kwargs,
    }


VARIANTS: Dict[str, Dict[str, Any]] = {  # name prefix -> LionViT settings (decay kinds: lion_vit.decays)
    "lion_lit": dict(decay="lit"),
    "lion_d": dict(decay="fixed"),
    "lion_s": dict(decay="selective"),
    "lion_d_natural": dict(decay="fixed", num_scans=2),
    "lion_s_natural": dict(decay="selective", num_scans=2),
}
SIZES = {  # ViT-T/S/B
    "tiny": dict(embed_dim=192, depth=12, num_heads=3),
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
}
LION_MODEL_NAMES = tuple(f"{variant}_{size}" for variant in VARIANTS for size in SIZES)

DISTILLED_MODEL_NAMES = tuple(f"{name}_distilled" for name in LION_MODEL_NAMES)  # DeiT's distillation token

# The paper's Table 1 as LION-ViT models: other linear transformers' decays, key gates and scalings in the
# same layer (docs/models.md, "Table 1 families"), each also with the two snake scans
_TABLE_1 = {
    "lion_retnet": dict(decay="retnet", feature_map="scaled", scaling="none"),
    "lion_mamba2": dict(decay="mamba2", feature_map="swish", scaling="none"),
    "lion_xlstm": dict(decay="xlstm", key_gate="input", feature_map="scaled", scaling="max"),
    "lion_gla": dict(decay="gla", feature_map="scaled", scaling="none"),
    "lion_hgrn2": dict(decay="hgrn2", key_gate="one_minus_decay", feature_map="swish", scaling="none"),
    "lion_rwkv6": dict(decay="rwkv6", feature_map="scaled", scaling="none"),
}
FAMILIES: Dict[str, Dict[str, Any]] = {**_TABLE_1, **{f"{prefix}_natural": dict(settings, num_scans=2)
                                                       for prefix, settings in _TABLE_1.items()}}
FAMILY_MODEL_NAMES = tuple(f"{family}_{size}" for family in FAMILIES for size in SIZES)

default_cfgs: Dict[str, Any] = {}  # name -> timm DefaultCfg, filled by register_variant before timm reads it


def _create_lion_vit(variant: str, pretrained: bool = False, **kwargs: Any) -> LionViT:
    if variant.endswith("_distilled"):
        kwargs["distilled"] = True
    prefix, size = variant.removesuffix("_distilled").rsplit("_", 1)
    model_args = dict(patch_size=16, **VARIANTS[prefix], **SIZES[size])
    return build_model_with_cfg(
        LionViT, variant, pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=3, feature_cls="getter"),
        **dict(model_args, **kwargs),
    )


def _register(name: str) -> None:
    """timm's @register_model for one name, as a function of this module (where timm reads default_cfgs)."""
    def create(pretrained: bool = False, **kwargs: Any) -> LionViT:
        return _create_lion_vit(name, pretrained, **kwargs)
    create.__name__ = create.__qualname__ = name
    default_cfgs.update(generate_default_cfgs({f"{name}.untrained": _cfg(
        classifier=("head", "head_dist") if name.endswith("_distilled") else "head")}))
    globals()[name] = register_model(create)


def register_variant(prefix: str, **settings: Any) -> Tuple[str, ...]:
    """Register <prefix>_{tiny,small,base} and their <name>_distilled twins with timm: a LION variant is
    its LionViT settings (decay kind, scans, feature map, ...). Returns the names."""
    VARIANTS[prefix] = settings
    names = tuple(f"{prefix}_{size}{suffix}" for size in SIZES for suffix in ("", "_distilled"))
    for name in names:
        _register(name)
    return names


for _prefix, _settings in [*VARIANTS.items(), *FAMILIES.items()]:
    register_variant(_prefix, **_settings)


def is_lion_model(name: str) -> bool:
    """Whether a timm model name is a LionViT registered by register_variant (a size, distilled or not)."""
    prefix, _, size = name.removesuffix("_distilled").rpartition("_")
    return prefix in VARIANTS and size in SIZES
