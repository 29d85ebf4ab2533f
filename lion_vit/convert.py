"""Checkpoints trained with the official LION image-classification code (LIONS-EPFL/LION, a DeiT fork).

That code computes the same function as this project's models once they are configured alike:
- a class token always; its default pooling applies the final LayerNorm to every token and averages
  all of them (`global_pool="avg_all"`), `cls_tok=True` pools the class token (`"token"`);
- positional embeddings only when trained with `pos_emb`;
- LION-lit with the ELU + 1 feature map (`feature_map="elu"`), the others with the normalised shifted
  SiLU (it normalises queries too, which the division cancels);
- decays `attn.a_i` (and `attn.a2_i`, the column-snake scan of `order='S'`): per head for
  `mask_type=Decay`, lam = sigmoid(a) as here; a Linear for `Selective`, lam = 1 - sigmoid(W x + b) =
  sigmoid(-W x - b), so the weights change sign; the class token's selective decay is 1
  (`prefix_decay_one=True`).
It scales scores by 1/sqrt(d) (cancelled by the division) and adds 1e-6 to each normaliser (not done
here: the two agree to float rounding plus that epsilon).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import timm
import torch
from torch import Tensor, nn

from .models import LionViT
from .weights import load_into, read_weights, state_dict_of, what_model

# (mask_type, order) of the official code -> this project's variant
VARIANTS = {("Lit", "Normal"): "lion_lit", ("Decay", "Normal"): "lion_d", ("Selective", "Normal"): "lion_s",
            ("Decay", "S"): "lion_d_natural", ("Selective", "S"): "lion_s_natural"}
SIZES = {192: "tiny", 384: "small", 768: "base"}  # embedding width -> size
ARGS = ("mask_type", "order", "pos_emb", "cls_tok")  # the official settings a conversion needs


class MissingSettings(ValueError):
    """Official settings that neither the checkpoint's args nor the caller's give (`missing`: their names)."""

    def __init__(self, missing: Sequence[str], how: str = "pass them, e.g. args={'mask_type': 'Selective', "
                                                          "'order': 'S', 'pos_emb': False, 'cls_tok': False}") -> None:
        self.missing = list(missing)
        super().__init__(f"the checkpoint does not say its {', '.join(self.missing)}; {how}")


def load_official(source: Union[str, Path, Mapping[str, Any]]) -> Dict[str, Any]:
    """An official checkpoint as a dict ({'model', 'model_ema', 'args', ...}), or a bare state dict
    wrapped as {'model': ...}; files load with torch's safe weights_only=True."""
    if isinstance(source, Mapping):
        checkpoint = dict(source)
    else:
        try:
            checkpoint = read_weights(source)  # (with the official code's arguments: weights.ARGUMENTS)
        except ValueError as error:
            raise ValueError(f"official checkpoint {error}") from None
    config = checkpoint.get("config")  # (only lion-vit's train.py writes one)
    trained_here = config.get("model") if isinstance(config, dict) else None
    if isinstance(trained_here, dict) and trained_here.get("name"):
        raise ValueError(f"{'the checkpoint' if isinstance(source, Mapping) else source} was written by lion-vit's "
                         f"train.py ({trained_here['name']}): it needs no conversion; use it as it is "
                         f"(checkpoint=, model.init_from=, timm's checkpoint_path=)")
    if "model" not in checkpoint:
        checkpoint = {"model": checkpoint}
    return checkpoint


def official_settings(checkpoint: Mapping[str, Any], args: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """mask_type, order, pos_emb and cls_tok: from `args` where given, else the checkpoint's own args; an
    unknown mask_type / order, or a setting neither gives, is a ValueError."""
    saved = checkpoint.get("args")
    saved = vars(saved) if isinstance(saved, argparse.Namespace) else dict(saved or {})
    settings = {**saved, **dict(args or {})}
    missing = [name for name in ARGS if name not in settings]
    if missing:
        raise MissingSettings(missing)
    if (settings["mask_type"], settings["order"]) not in VARIANTS:
        raise ValueError(f"unknown official mask_type={settings['mask_type']!r} / order={settings['order']!r}; "
                         f"known: {sorted(VARIANTS)}")
    return settings


def official_weights(checkpoint: Mapping[str, Any], use_ema: bool = True) -> Dict[str, Tensor]:
    """The checkpoint's `model_ema` when present and use_ema, else its `model` (lion_vit.weights.state_dict_of)."""
    return state_dict_of(dict(checkpoint), use_ema)


def to_lion_vit(weights: Mapping[str, Tensor],
                settings: Mapping[str, Any]) -> Tuple[str, Dict[str, Any], Dict[str, Tensor]]:
    """(model name, create_model kwargs, state dict) of this project for official weights and settings."""
    selective, scans = settings["mask_type"] == "Selective", 2 if settings["order"] == "S" else 1
    needed = ("cls_token", "patch_embed.proj.weight", "head.weight") + (("pos_embed",) if settings["pos_emb"] else ())
    missing = [key for key in needed if key not in weights]
    if not any(key.startswith("blocks.") for key in weights):  # (else the depth below has no maximum)
        missing.append("blocks")
    if missing:
        raise ValueError(f"the weights have no {', '.join(missing)}: not the official LION code's layout (a DeiT "
                         f"ViT, always with a class token, and with pos_emb its positional embeddings)")
    width = weights["cls_token"].shape[-1]
    if width not in SIZES:
        raise ValueError(f"an official model of width {width} has no counterpart here (widths {sorted(SIZES)})")
    name = f"{VARIANTS[(settings['mask_type'], settings['order'])]}_{SIZES[width]}"
    depth = 1 + max(int(key.split(".")[1]) for key in weights if key.startswith("blocks."))
    kwargs = dict(num_classes=weights["head.weight"].shape[0], depth=depth, class_token=True,
                  global_pool="token" if settings["cls_tok"] else "avg_all",
                  pos_embed="learn" if settings["pos_emb"] else "none",
                  feature_map="elu" if settings["mask_type"] == "Lit" else "silu_norm",
                  prefix_decay_one=selective)
    if settings["pos_emb"]:  # the grid the positional embeddings were trained on (patch 16)
        kwargs["img_size"] = 16 * round((weights["pos_embed"].shape[1] - 1) ** 0.5)
    state: Dict[str, Tensor] = {}
    decays: Dict[Tuple[str, str], Dict[str, Tensor]] = {}  # (block, ".weight" / ".bias" / "") -> scans
    for key, value in weights.items():
        block, _, leaf = key.partition(".attn.")
        scan = leaf.split(".")[0]
        if scan in ("a_i", "a2_i"):
            decays.setdefault((block, leaf[len(scan):]), {})[scan] = value
        else:
            state[key] = value
    for (block, suffix), found in decays.items():
        names = ("a_i", "a2_i")[:scans]
        if set(found) != set(names):
            raise ValueError(f"{block}.attn has {sorted(found)}, but order={settings['order']!r} has {list(names)}")
        parts = [found[name] for name in names]
        if selective:  # lam = 1 - sigmoid(W x + b) = sigmoid(-W x - b)
            state[f"{block}.attn.decay.proj{suffix}"] = -torch.cat(parts)
        else:
            state[f"{block}.attn.decay.logit"] = torch.stack(parts)
    return name, kwargs, state


def convert_official(source: Union[str, Path, Mapping[str, Any]], args: Optional[Mapping[str, Any]] = None,
                     use_ema: bool = True, **kwargs: Any) -> Tuple[str, Dict[str, Any], LionViT]:
    """(model name, create_model kwargs, model with the weights) for an official checkpoint: see from_official."""
    checkpoint = load_official(source)
    name, model_kwargs, state = to_lion_vit(official_weights(checkpoint, use_ema), official_settings(checkpoint, args))
    model = timm.create_model(name, **{**model_kwargs, **kwargs})
    load_into(model, state, "the official checkpoint")
    return name, model_kwargs, model


def from_official(source: Union[str, Path, Mapping[str, Any]], args: Optional[Mapping[str, Any]] = None,
                  use_ema: bool = True, **kwargs: Any) -> LionViT:
    """A LION model of this project with the weights of an official LION checkpoint (a path or a loaded
    checkpoint / state dict). args: mask_type, order, pos_emb, cls_tok where the checkpoint's own `args`
    lacks them (or to override them); use_ema: take `model_ema` when present, as timm does; kwargs go to
    timm.create_model (attn_form, chunk_size, ...). A checkpoint of another shape is a ValueError."""
    return convert_official(source, args, use_ema, **kwargs)[2]


def to_official(model: LionViT) -> Dict[str, Any]:
    """The official code's checkpoint, {"model": state dict, "args": {mask_type, order, pos_emb, cls_tok}},
    for a model of this project that the official code can express (from_official reads it back, with no
    settings to pass): decays back to a_i / a2_i, selective weights back to their sign. A model it cannot
    express (no class token, as this project's default; a distillation token; another feature map or
    pooling) is a ValueError naming what differs and how from_official builds such a model."""
    settings = official_args(model)
    state: Dict[str, Tensor] = {}
    heads = model.blocks[0].attn.num_heads
    for key, value in model.state_dict().items():
        if ".attn.decay.logit" in key or ".attn.decay.proj" in key:
            selective = ".decay.proj" in key
            scans = value.shape[0] // heads if selective else value.shape[0]
            for scan, name in enumerate(("a_i", "a2_i")[:scans]):
                target = key.replace("decay.proj" if selective else "decay.logit", name)
                state[target] = -value[scan * heads:(scan + 1) * heads].clone() if selective else value[scan].clone()
        else:
            state[key] = value
    return {"model": state, "args": settings}


MASK_TYPES = {"lit": "Lit", "fixed": "Decay", "selective": "Selective"}  # decay kind -> official mask_type


def official_args(model: LionViT) -> Dict[str, Any]:
    """The official settings (mask_type, order, pos_emb, cls_tok) of a model built as from_official builds
    one, or a ValueError naming every setting the official code has no counterpart for."""
    attn = model.blocks[0].attn
    mask_type = MASK_TYPES.get(attn.decay_name)
    cls_tok = model.global_pool != "avg_all"
    problems = []
    if mask_type is None:
        problems.append(f"its decay kind {attn.decay_name!r} (official: {sorted(MASK_TYPES)})")
    if model.cls_token is None:
        problems.append("it has no class token (class_token=True)")
    if model.distilled or model.reg_token is not None:
        problems.append("it has a distillation or register token")
    if cls_tok and model.global_pool != "token":
        problems.append(f"its pooling global_pool={model.global_pool!r} (global_pool='avg_all' or 'token')")
    if not isinstance(model.fc_norm, nn.Identity):
        problems.append("its norm after pooling (fc_norm=False)")
    if model.pos_embed is not None and model.no_embed_class:
        problems.append("its positional embeddings leave out the class token")
    feature_map = "elu" if mask_type == "Lit" else "silu_norm"
    if attn.feature_map_name != feature_map:
        problems.append(f"its feature map {attn.feature_map_name!r} (feature_map={feature_map!r})")
    if attn.scaling != "sum":
        problems.append(f"its scaling {attn.scaling!r} (scaling='sum')")
    if attn.prefix_decay_one != (mask_type == "Selective"):
        problems.append(f"prefix_decay_one={attn.prefix_decay_one} (prefix_decay_one={mask_type == 'Selective'})")
    if model.patch_embed.patch_size != (16, 16) or model.embed_dim not in SIZES:
        problems.append(f"patch {model.patch_embed.patch_size[0]} / width {model.embed_dim} (official: patch 16, "
                        f"widths {sorted(SIZES)})")
    if problems:
        raise ValueError(f"{what_model(model)} has no counterpart in the official LION code: "
                         f"{'; '.join(problems)}; build it as from_official does, with the settings in parentheses")
    return {"mask_type": mask_type, "order": "S" if attn.num_scans == 2 else "Normal",
            "pos_emb": model.pos_embed is not None, "cls_tok": cls_tok}
