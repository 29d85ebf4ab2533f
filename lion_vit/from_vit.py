"""Start a LION model from a pretrained softmax ViT (timm vit_* / deit_* / deit3_* weights).

Everything but the attention's mixing is the same architecture: patch embedding, every block's norms,
qkv, proj and MLP, the final norm and the head are copied; what differs is adapted (positional
embeddings resampled to the model's grid, prefix-token entries kept or dropped, the final norm moved
to where the model's pooling reads it); what softmax models lack (the decays) keeps the fresh
initialisation. See docs/training.md, "Starting from a softmax ViT".
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import timm
import torch
from timm.layers import resample_abs_pos_embed
from torch import Tensor, nn

from .hub import HubUnreachable, hub_or_cache
from .weights import WEIGHT_SUFFIXES, is_url, official_lion_hint, read_weights, state_dict_of

__all__ = ["init_from_vit", "InitReport", "load_vit_weights"]
log = logging.getLogger("lion_vit")


@dataclass
class InitReport:
    """What init_from_vit did with each tensor: names of the model's tensors copied as they are, adapted
    (with how), and left fresh; and the source's tensors the model has no place for."""
    source: str
    copied: List[str] = field(default_factory=list)
    adapted: List[Tuple[str, str]] = field(default_factory=list)
    fresh: List[str] = field(default_factory=list)
    unused: List[str] = field(default_factory=list)

    def lines(self) -> List[str]:
        lines = [f"init_from {self.source}: copied {len(self.copied)} tensors ({_summary(self.copied)})"]
        if self.adapted:
            lines.append(f"init_from: adapted {'; '.join(f'{name} ({how})' for name, how in self.adapted)}")
        lines.append(f"init_from: fresh {len(self.fresh)} tensors ({_summary(self.fresh) or 'none'})")
        if self.unused:
            hint = (" (LayerScale: build the model with model.kwargs.init_values to take it)"
                    if any(".ls1." in name for name in self.unused) else "")
            lines.append(f"init_from: not used from the source: {_summary(self.unused)}{hint}")
        return lines


def _summary(names: List[str]) -> str:
    """Module names with block indices folded: blocks.*.attn.qkv, head, ..."""
    folded = dict.fromkeys(re.sub(r"\.(weight|bias|gamma)$", "", re.sub(r"^blocks\.\d+\.", "blocks.*.", n))
                           for n in names)
    return ", ".join(folded)


Source = Union[str, Path, nn.Module, Mapping[str, Any]]


def load_vit_weights(source: Source) -> Tuple[Dict[str, Tensor], Optional[int]]:
    """The state dict of a softmax ViT and its number of heads when known (None for a bare state dict).

    source: a file (a checkpoint of this project's train.py, a DeiT checkpoint {"model": ...}, a timm
    state dict, .pth or .safetensors), a timm model name, whose pretrained weights timm downloads, or
    what they hold in memory: a ViT module or a state dict (checkpoint dicts as in a file).
    """
    if isinstance(source, nn.Module):
        return source.state_dict(), _num_heads(source)
    if isinstance(source, Mapping):
        return _tensors(dict(source), "the state dict given"), None
    path = Path(source)
    if is_url(source) or path.is_file() or (path.is_dir() and not timm.is_model(source)):  # (a folder says so)
        return _load_file(source)
    if not timm.is_model(source):
        if path.suffix in WEIGHT_SUFFIXES or "/" in source:
            raise FileNotFoundError(f"init_from file {source} does not exist")
        raise ValueError(f"init_from {source!r} is neither a file nor a timm model name (e.g. deit_small_patch16_224)")
    try:
        with hub_or_cache():  # offline: the local cache or one error at once
            vit = timm.create_model(source, pretrained=True)
    except HubUnreachable as error:
        raise HubUnreachable(f"timm's weights of {source} are {error}; pass the path of a file of them instead "
                             f"(.pth, .safetensors or a checkpoint)") from None
    return vit.state_dict(), _num_heads(vit)


def _load_file(path: Union[str, Path]) -> Tuple[Dict[str, Tensor], Optional[int]]:
    state = read_weights(path)
    heads = None
    if isinstance(state.get("config"), dict):  # this project's train.py
        heads = _configured_heads(state["config"].get("model", {}))
    tensors = _tensors(state, f"file {path}")
    official = official_lion_hint(tensors, path)
    if official:  # (its attention would be copied, its trained decays dropped)
        raise ValueError(f"init_from file {path} {official}, then start from lion.pt")
    return tensors, heads


def _tensors(checkpoint: Dict[str, Any], what: str) -> Dict[str, Tensor]:
    state = state_dict_of(checkpoint)
    if not state or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"init_from {what} holds no state dict of tensors")
    return state


def _describe(source: Source) -> str:
    """How the log lines and errors name a source: its path or name, or what was passed in memory."""
    if isinstance(source, nn.Module):
        architecture = (getattr(source, "pretrained_cfg", None) or {}).get("architecture")
        return f"the {type(source).__name__} given" + (f" ({architecture})" if architecture else "")
    return "the state dict given" if isinstance(source, Mapping) else str(source)


def _configured_heads(model_settings: dict) -> Optional[int]:
    """The number of heads of a train.py checkpoint's model, built on the meta device from its settings."""
    try:
        with torch.device("meta"):
            vit = timm.create_model(model_settings["name"], **(model_settings.get("kwargs") or {}))
    except Exception:  # an architecture this timm cannot build: the shapes are checked anyway
        return None
    return _num_heads(vit)


def _num_heads(model: nn.Module) -> Optional[int]:
    blocks = getattr(model, "blocks", None)
    return getattr(blocks[0].attn, "num_heads", None) if blocks else None


def _depth(state: Dict[str, Tensor]) -> int:
    return len({k.split(".")[1] for k in state if k.startswith("blocks.")})


def _architecture(state: Dict[str, Tensor], heads: Optional[int]) -> str:
    width = state["patch_embed.proj.weight"].shape[0] if "patch_embed.proj.weight" in state else "?"
    return f"width {width}, depth {_depth(state)}, {heads if heads is not None else 'unknown'} heads"


@torch.no_grad()
def init_from_vit(model: nn.Module, source: Source) -> InitReport:
    """Copy a pretrained softmax ViT's weights into a LION model (see the module docstring); logs one
    line each for the copied, adapted and fresh tensors and returns them. source: a file, a timm name, a
    ViT module or a state dict (load_vit_weights). A model of another width, depth, number of heads or
    patch size is a ValueError naming both."""
    weights, heads = load_vit_weights(source)
    source = _describe(source)
    target = model.state_dict()
    model_heads = _num_heads(model)
    patch = "patch_embed.proj.weight"  # [width, channels, patch, patch]
    if patch not in weights:
        raise ValueError(f"init_from {source} is no ViT (it has no {patch}); give a timm vit_*, deit_* or deit3_* "
                         "model, its weights or a checkpoint of one")
    if (weights[patch].shape != target[patch].shape or _depth(weights) != _depth(target)
            or (heads is not None and heads != model_heads)):
        raise ValueError(f"init_from {source} does not fit: the source has {_architecture(weights, heads)}, "
                         f"patch embedding {list(weights[patch].shape)}; "
                         f"the model has {_architecture(target, model_heads)}, patch embedding "
                         f"{list(target[patch].shape)}; choose a LION model of the source's size")
    report = InitReport(source)
    weights, moved = _final_norm_where_pooled(weights, target, report)
    new: Dict[str, Tensor] = {}
    for name, value in target.items():
        if name == "pos_embed":
            adapted = _adapt_pos_embed(model, weights, report)
            if adapted is not None:
                new[name] = adapted
            continue
        if name not in weights:
            report.fresh.append(name)
            continue
        found = weights[name]
        if found.shape == value.shape:
            new[name] = found
            if name not in moved:  # (those are reported as adapted)
                report.copied.append(name)
        elif name.startswith(("head.", "head_dist.")):  # another number of classes: a new head
            report.fresh.append(name)
            if name.endswith(".weight"):
                report.adapted.append((name.removesuffix(".weight"),
                                       f"{found.shape[0]} classes in the source, {value.shape[0]} here: fresh"))
        else:
            raise ValueError(f"init_from {source} does not fit: {name} is {list(found.shape)} in the source and "
                             f"{list(value.shape)} in the model")
    report.unused = [name for name in weights if name not in target]
    if "pos_embed" in weights and "pos_embed" not in target:
        report.unused.remove("pos_embed")
        report.adapted.append(("pos_embed", "not used: the model's decays carry position"))
    model.load_state_dict(new, strict=False)
    for line in report.lines():
        log.info(line)
    return report


def _final_norm_where_pooled(weights: Dict[str, Tensor], target: Dict[str, Tensor],
                             report: InitReport) -> Tuple[Dict[str, Tensor], List[str]]:
    """A class-token ViT norms every token before its head reads the class token (norm); a mean-pooling
    model norms the pooled features (fc_norm). The source's final norm goes where the model has one."""
    weights, moved = dict(weights), []
    for have, want in (("norm", "fc_norm"), ("fc_norm", "norm")):
        if f"{have}.weight" in weights and f"{have}.weight" not in target and f"{want}.weight" in target \
                and f"{want}.weight" not in weights:
            for suffix in ("weight", "bias"):
                if f"{have}.{suffix}" in weights:
                    weights[f"{want}.{suffix}"] = weights.pop(f"{have}.{suffix}")
                    moved.append(f"{want}.{suffix}")
            report.adapted.append((want, f"the source's {have}: the final norm, before the pooling reads it"))
    return weights, moved


def _prefix_entries(cls_token: Optional[Tensor], dist_token: Optional[Tensor], reg_token: Optional[Tensor]
                    ) -> List[str]:
    """The names of a ViT's prefix tokens in the order its positional embeddings hold their entries (timm's and
    LionViT's _pos_embed): the class token, the distillation token, then each register token."""
    return [name for name, token in (("cls_token", cls_token), ("dist_token", dist_token)) if token is not None] + \
        [f"reg_token {j}" for j in range(0 if reg_token is None else reg_token.shape[1])]


def _adapt_pos_embed(model: nn.Module, weights: Dict[str, Tensor], report: InitReport) -> Optional[Tensor]:
    """The source's positional embeddings on the model's grid; prefix-token entries (class, distillation,
    registers) copied where both have them, dropped or left fresh otherwise."""
    if "pos_embed" not in weights:
        report.fresh.append("pos_embed")
        return None
    source = weights["pos_embed"]
    length = source.shape[1]
    source_tokens = _prefix_entries(weights.get("cls_token"), weights.get("dist_token"), weights.get("reg_token"))
    source_prefix = 0 if math.isqrt(length) ** 2 == length else len(source_tokens)  # deit3: no prefix entries
    side = math.isqrt(length - source_prefix)
    if side * side != length - source_prefix:
        raise ValueError(f"init_from: the source's pos_embed {list(source.shape)} is not a square grid")
    grid = resample_abs_pos_embed(source[:, source_prefix:], new_size=list(model.patch_embed.grid_size),
                                  old_size=(side, side), num_prefix_tokens=0)
    current = model.pos_embed.detach()
    model_tokens = _prefix_entries(*(getattr(model, t, None) for t in ("cls_token", "dist_token", "reg_token")))
    model_prefix = 0 if model.no_embed_class else current.shape[1] - grid.shape[1]
    entries, notes = [], []
    for i in range(model_prefix):
        token = model_tokens[i] if i < len(model_tokens) else None
        if source_prefix and token in source_tokens:
            entries.append(source[:, source_tokens.index(token)].unsqueeze(1))
        else:
            entries.append(current[:, i].unsqueeze(1))
            notes.append(f"{token or 'prefix'} entry fresh")
    dropped = [t for t in source_tokens[:source_prefix] if t not in model_tokens[:model_prefix]]
    notes += [f"{t} entry dropped" for t in dropped]
    how = f"{side}x{side} -> {'x'.join(map(str, model.patch_embed.grid_size))} grid" + "".join(f", {n}" for n in notes)
    report.adapted.append(("pos_embed", how))
    return torch.cat(entries + [grid.to(current.dtype)], dim=1)
