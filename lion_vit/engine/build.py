"""What the recipe builds from its settings: the model (timm.create_model), its weights from a
checkpoint, and the checks that a checkpoint fits the run that loads it."""
from __future__ import annotations

import pickle
import re
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import timm
import torch
from omegaconf import DictConfig, OmegaConf
from timm.layers import resample_abs_pos_embed, to_2tuple
from timm.models import clean_state_dict
from torch import nn

from .. import models as lion_models  # registers the LION models with timm
from ..errors import UserError, first_line
from ..hub import HubUnreachable, hub_or_cache
from ..weights import load_into, read_weights, state_dict_of
from .config import Size, image_size

# timm.create_model arguments that choose initial weights, not the architecture (fine-tuning); a model whose
# weights come from a checkpoint (resume, eval_only) is built without them.
INITIAL_WEIGHT_KWARGS = ("pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path")
HUB_WEIGHTS = "timm's pretrained weights"


# timm.create_model arguments that train.py passes from settings of their own: not model.kwargs
SETTINGS_NOT_KWARGS = {"num_classes": None, "img_size": "img_size", "patch_size": "model.patch_size",
                       "drop_path_rate": "model.drop_path_rate", "attn_form": "model.attn_form",
                       "chunk_size": "model.chunk_size", "attn_backend": "model.attn_backend"}


def build_model(model_cfg: DictConfig, num_classes: int, img_size: Size, initial_weights: bool = True) -> nn.Module:
    """timm.create_model from the `model` config group, with clear errors for bad settings;
    initial_weights=False leaves out the INITIAL_WEIGHT_KWARGS (the caller loads the weights)."""
    name = model_cfg.name
    if not timm.is_model(name):
        raise UserError(f"unknown model {name!r}; LION models: {', '.join(lion_models.LION_MODEL_NAMES)} "
                        f"(or any timm name, see timm.list_models())")
    patch = model_cfg.patch_size  # (create_model_at_size refuses a size it does not divide)
    is_lion = lion_models.is_lion_model(name)
    backend = model_cfg.attn_backend  # form and backend names: engine/config.py checks them
    if not is_lion and (model_cfg.attn_form not in ("auto", "attention") or model_cfg.chunk_size or backend != "auto"):
        raise UserError(f"model.attn_form / model.chunk_size / model.attn_backend apply to LION models only, "
                        f"not {name}")
    model_kwargs = OmegaConf.to_container(model_cfg.kwargs, resolve=True)
    clashes = sorted(set(model_kwargs) & set(SETTINGS_NOT_KWARGS))  # (each would clash with, or lose to, its setting)
    if clashes:
        key, setting = clashes[0], SETTINGS_NOT_KWARGS[clashes[0]]
        raise UserError(f"model.kwargs.{key}: train.py sets it from the data ({num_classes} classes here); drop it"
                        if setting is None else f"model.kwargs.{key} is the setting {setting}; pass {setting}=<value> "
                        f"instead")
    if model_kwargs.get("in_chans", 3) != 3:  # (else the first batch's error, after the run has started)
        raise UserError(f"model.kwargs.in_chans={model_kwargs['in_chans']}: train.py's data are RGB images, grey "
                        f"ones converted (3 channels); drop it")
    if not initial_weights:
        model_kwargs = _without_initial_weights(model_kwargs)
    kwargs: Dict[str, Any] = dict(num_classes=num_classes, drop_path_rate=model_cfg.drop_path_rate, **model_kwargs)
    if is_lion:
        kwargs.update(attn_form=model_cfg.attn_form, chunk_size=model_cfg.chunk_size, attn_backend=backend)
    _keep_a_file_classifier_that_fits(name, kwargs)
    try:
        with hub_or_cache(downloads=_initial_weights_source(kwargs) == HUB_WEIGHTS):
            return _create_model(name, img_size, patch, kwargs)
    except (ValueError, TypeError) as error:
        hint = ""
        if "unexpected keyword argument" in str(error) and model_cfg.kwargs:
            hint = (f" (model.kwargs={OmegaConf.to_container(model_cfg.kwargs)} comes from the model group; "
                    f"start from model=lion or model=deit, whose kwargs are empty)")
        indivisible = re.search(r"not divisible by the patch size (\d+)x", str(error))
        if indivisible:
            patch, square = indivisible.group(1), isinstance(img_size, int)
            typed, sides = (img_size, img_size) if square else \
                ("[{},{}]".format(*img_size), "{} and {}".format(*img_size))
            raise UserError(f"cannot build model {name}: img_size={typed} is not divisible by its patch size {patch}; "
                            f"pass img_size=<a multiple of {patch}>{'' if square else ' for each side'} or "
                            f"model.patch_size=<a divisor of {sides}>") from None
        raise UserError(f"cannot build model {name}: {error}{hint}") from None
    except AssertionError as error:  # (how timm's constructors check most of their arguments)
        raise UserError(f"cannot build model {name}: timm refused its arguments (model.kwargs="
                        f"{OmegaConf.to_container(model_cfg.kwargs)} among them): {_assertion(error)}") from None
    except (OSError, RuntimeError, pickle.UnpicklingError) as error:
        source = _initial_weights_source(kwargs)
        if source is None:
            raise
        # a missing, unreadable or mismatched file of initial weights (timm's loader), or the hub out of reach
        hint = "; download them where the hub is reachable and pass the file: " \
            "+model.kwargs.pretrained_cfg_overlay.file=<path>" if isinstance(error, HubUnreachable) else ""
        # (timm's loader raises a FileNotFoundError without a word for a file that is not there)
        why = "the file does not exist; check the path" if isinstance(error, FileNotFoundError) and not str(error) \
            else first_line(error)
        raise UserError(f"cannot load the initial weights of {name} from {source}: {why}{hint}") from None


def _create_model(name: str, img_size: Size, patch: Optional[int], kwargs: Dict[str, Any]) -> nn.Module:
    """create_model_at_size; a timm model without stochastic depth (DLA, VGG) takes no drop_path_rate, and is
    built without it where it is 0."""
    try:
        return lion_models.create_model_at_size(name, img_size, patch, **kwargs)
    except TypeError as error:
        if "unexpected keyword argument 'drop_path_rate'" not in str(error):
            raise
        if kwargs["drop_path_rate"]:
            raise UserError(f"model.drop_path_rate={kwargs['drop_path_rate']}: {name} has no stochastic depth "
                            f"(timm builds it without drop_path_rate); set model.drop_path_rate=0") from None
        return lion_models.create_model_at_size(name, img_size, patch,
                                                **{k: v for k, v in kwargs.items() if k != "drop_path_rate"})


def _keep_a_file_classifier_that_fits(name: str, kwargs: Dict[str, Any]) -> None:
    """timm drops a pretrained file's classifier unless pretrained_cfg's num_classes equals the model's, and
    the registry's cfg says 1000 whatever the file holds: a file's head of the model's own size would be
    thrown away. Tell timm the file's number of classes (unless the command sets it), so that the head is
    kept where it fits and dropped only where its size differs."""
    overlay = kwargs.get("pretrained_cfg_overlay") or {}
    if not kwargs.get("pretrained") or not overlay.get("file") or "num_classes" in overlay:
        return
    classifier = timm.models.get_pretrained_cfg_value(name, "classifier")
    classifier = classifier[0] if isinstance(classifier, (tuple, list)) else classifier
    try:  # as timm's loader reads the file (its EMA weights where present)
        head = state_dict_of(read_weights(overlay["file"]), use_ema=True).get(f"{classifier}.weight")
    except ValueError:
        return  # a missing or unreadable file: timm's loader reports it
    if isinstance(head, torch.Tensor) and head.dim() >= 1:
        kwargs["pretrained_cfg_overlay"] = {**overlay, "num_classes": head.shape[0]}


def changed_architecture(model_cfg: DictConfig, model: nn.Module) -> List[str]:
    """The settings by which `model` is not the architecture its name builds in timm: a patch size other
    than the name's, and every architecture argument in model.kwargs (the digits group's embed_dim, depth,
    num_heads, say), as model.* overrides."""
    changes = []
    patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    if isinstance(patch, tuple):
        try:
            with torch.device("meta"):  # the name's own architecture: shapes only, no memory, no weights
                named = timm.create_model(model_cfg.name)
        except (RuntimeError, TypeError, ValueError):  # a model whose constructor reads tensor values
            named = None
        if named is not None and getattr(getattr(named, "patch_embed", None), "patch_size", None) != patch:
            changes.append(f"model.patch_size={patch[0]}")
    kwargs = _without_initial_weights(OmegaConf.to_container(model_cfg.kwargs, resolve=True))
    return changes + [f"model.kwargs.{key}={value}" for key, value in kwargs.items()]


def _without_initial_weights(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    return {key: value for key, value in kwargs.items() if key not in INITIAL_WEIGHT_KWARGS}


def _assertion(error: AssertionError) -> str:
    """A failed assert's message, or without one the statement and where it is."""
    if str(error).strip():
        return first_line(error)
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"{frame.line} ({Path(frame.filename).name}, line {frame.lineno})"


def _initial_weights_source(kwargs: Dict[str, Any]) -> Optional[str]:
    """Where timm.create_model takes a model's initial weights from, or None (random initialisation)."""
    if kwargs.get("checkpoint_path"):
        return f"model.kwargs.checkpoint_path={kwargs['checkpoint_path']}"
    if kwargs.get("pretrained"):
        file = (kwargs.get("pretrained_cfg_overlay") or {}).get("file")
        return f"model.kwargs.pretrained_cfg_overlay.file={file}" if file else HUB_WEIGHTS
    return None


def load_weights(model: nn.Module, state_dict: Dict[str, torch.Tensor], trained_size: Optional[Size] = None) -> None:
    """Load weights (without DDP's or torch.compile's prefixes), positional embeddings resampled to the grid:
    from the grid of trained_size (a train.py checkpoint's img_size) where given, as timm's filter cannot tell
    a grid that is not square (it takes one of the token count's square root, or of the model's default size)."""
    state_dict = clean_state_dict(state_dict)
    if "pos_embed" in state_dict and hasattr(model, "pos_embed"):
        pos_embed = state_dict.pop("pos_embed") if trained_size is not None else None
        state_dict = lion_models.checkpoint_filter_fn(state_dict, model)
        if pos_embed is not None:
            state_dict["pos_embed"] = _on_model_grid(pos_embed, model, trained_size)
    try:
        load_into(model, state_dict, "checkpoint")
    except ValueError as error:
        raise UserError(str(error)) from None


def _on_model_grid(pos_embed: torch.Tensor, model: nn.Module, trained_size: Size) -> torch.Tensor:
    """Positional embeddings of a model trained at trained_size, resampled to model's grid (as they are where the
    grids agree, or where their tokens are not that grid's: loading then names the mismatch)."""
    patch_embed = getattr(model, "patch_embed", None)
    if getattr(model, "pos_embed", None) is None or not hasattr(patch_embed, "grid_size"):
        return pos_embed
    prefix = 0 if getattr(model, "no_embed_class", False) else getattr(model, "num_prefix_tokens", 1)
    trained = tuple(side // patch for side, patch in zip(to_2tuple(trained_size), patch_embed.patch_size))
    grid = tuple(patch_embed.grid_size)
    if trained == grid or trained[0] * trained[1] != pos_embed.shape[1] - prefix:
        return pos_embed
    return resample_abs_pos_embed(pos_embed, new_size=grid, old_size=trained, num_prefix_tokens=prefix,
                                  verbose=True)


def trained_size(state: Dict[str, Any]) -> Optional[Size]:
    """The img_size a train.py checkpoint was trained at (None for another trainer's checkpoint)."""
    size = state.get("config", {}).get("img_size") if isinstance(state.get("config"), dict) else None
    return None if size is None else image_size(size)


def architecture(model_settings: Dict[str, Any]) -> Dict[str, Any]:
    """The model settings that fix an architecture: name, patch_size and kwargs (less initial weights')."""
    settings = {key: model_settings[key] for key in ("name", "patch_size", "kwargs") if key in model_settings}
    if settings.get("kwargs"):
        settings["kwargs"] = _without_initial_weights(settings["kwargs"])
    return settings


def trained_architecture(state: Dict[str, Any]) -> Dict[str, Any]:
    """A checkpoint's architecture settings, as saved."""
    return architecture(state.get("config", {}).get("model", {}))


def trained_model_settings(state: Dict[str, Any], model_settings: Dict[str, Any]) -> Dict[str, Any]:
    """The model settings a checkpoint's model is built with: its architecture over model_settings (which give
    the form, backend and chunk size)."""
    return {**model_settings, **trained_architecture(state)}


def model_from_checkpoint(state: Dict[str, Any], model_settings: Dict[str, Any], img_size: Size, classes: list,
                          data: str, fix: str, weights: Dict[str, torch.Tensor]) -> nn.Module:
    """A checkpoint's model at img_size with `weights` loaded: the checkpoint's architecture, the other
    settings (form, backend, chunk size) from model_settings. The checkpoint's classes must be `classes`
    (those of `data`; fix: what to do if not)."""
    num_classes = state.get("num_classes", len(classes))
    if "classes" in state:
        check_same_classes(state["classes"], classes, data, fix)
    elif num_classes != len(classes):  # a checkpoint of another trainer (DeiT's) names no classes
        raise UserError(f"{data} has {len(classes)} classes, the checkpoint {num_classes}; {fix}")
    # The architecture replaces the settings' whole, not merged: kwargs of this command's model group must
    # not leak into the trained architecture (nor can a merge add kwargs to Hydra's struct config).
    model = build_model(OmegaConf.create(trained_model_settings(state, model_settings)), num_classes, img_size,
                        initial_weights=False)
    load_weights(model, weights, trained_size(state))
    return model


def check_model_group(group: Optional[str], name: str) -> None:
    """model=deit is the softmax baseline; an experiment's model.name, merged after the group's, would make it a LION
    model all the same (experiment=deit_small_imagenet model=deit trained LION-d-natural)."""
    if group != "deit" or not lion_models.is_lion_model(name):
        return
    size = name.removesuffix("_distilled").rpartition("_")[2]
    twin = f"deit_{size}{'_distilled' if name.endswith('_distilled') else ''}_patch16_224"
    raise UserError(f"model=deit trains the softmax baseline, but model.name={name} (an experiment's, which it keeps) "
                    f"is a LION model; add model.name={twin}")


# the quickstart's default groups, each sized or tuned for the 8 px digits: what each does there, and its group for
# any other data (DeiT's recipe, as the ImageNet experiments set them)
DIGITS_GROUPS = {"model": ("sizes {name} down, as the line above says", "lion"),
                 "optim": ("keeps the digits' fixed lr, unscaled by the batch, and short warm-up", "adamw"),
                 "aug": ("augments nothing", "deit")}


def digits_groups_warning(choices: Dict[str, Any], chosen: List[str], cfg: DictConfig) -> Optional[str]:
    """On data other than the digits, the default groups of DIGITS_GROUPS that were not asked for by name
    (`chosen`): a user who set data and model.name alone meant the model as registered and a recipe for images."""
    groups = [group for group in DIGITS_GROUPS if choices.get(group) == "digits" and group not in chosen]
    if not groups or choices.get("data") in (None, "digits") or cfg.eval_only:
        return None
    them = "them" if len(groups) > 1 else "it"
    what = "; ".join(f"{group}=digits {DIGITS_GROUPS[group][0].format(name=cfg.model.name)}" for group in groups)
    purposes = [purpose for purpose, groups_for in (("the model as timm builds it", {"model"}),
                                                    ("DeiT's recipe", {"optim", "aug"})) if groups_for & set(groups)]
    return (f"the quickstart's default{'s' if len(groups) > 1 else ''} {', '.join(f'{g}=digits' for g in groups)} "
            f"{'are' if len(groups) > 1 else 'is'} for the 8 px digits ({what}); add "
            f"{' '.join(f'{group}={DIGITS_GROUPS[group][1]}' for group in groups)} for {' and '.join(purposes)} "
            f"(the ImageNet experiments set {them}), or name {them} to keep {them}")


# optimizer settings that shape its saved state (its parameter groups and per-parameter buffers)
OPTIMIZER_STATE_SETTINGS = ("opt", "layer_decay")
RESUME_SAME_OPTIMIZER = ("resume with the same optimizer, or fine-tune its weights in a new output_dir "
                          "(+model.kwargs.pretrained=true +model.kwargs.pretrained_cfg_overlay.file=<checkpoint>)")


def check_resumable(cfg: DictConfig, state: Dict[str, Any]) -> None:
    """Resuming continues the checkpoint's run: another architecture, or another optimizer (which cannot
    take the saved optimizer state), is a mistake to name, not a wall of missing keys or a traceback."""
    if "args" in state and "config" not in state:  # DeiT's main.py or timm's train.py: their state is not ours
        raise UserError(f"resume={cfg.resume} is a checkpoint of DeiT's or timm's own training script (it holds "
                        f"their args, not train.py's config), whose run cannot continue here; start from its "
                        f"weights with model.init_from={cfg.resume}, or evaluate it with eval_only=true "
                        f"checkpoint={cfg.resume}")
    _require_same("model", trained_architecture(state), architecture(OmegaConf.to_container(cfg.model, resolve=True)),
                  "resume with the same model settings or choose a new output_dir")
    trained_optim = state.get("config", {}).get("optim", {})
    _require_same("optim", {key: trained_optim[key] for key in OPTIMIZER_STATE_SETTINGS if key in trained_optim},
                  {key: OmegaConf.select(cfg, f"optim.{key}") for key in OPTIMIZER_STATE_SETTINGS},
                  RESUME_SAME_OPTIMIZER)
    if state.get("model_ema") is not None and not cfg.ema.enabled:  # the EMA weights would be dropped
        raise UserError("the checkpoint to resume holds its run's EMA weights (ema.enabled=true), this run has "
                        "ema.enabled=false and would not keep them; resume with ema.enabled=true")


def _require_same(group: str, trained: Dict[str, Any], current: Dict[str, Any], fix: str) -> None:
    """A UserError naming the first of the checkpoint's `group` settings that this run sets otherwise."""
    for key, value in trained.items():
        if value != current.get(key):
            trained, now = ("null" if x is None else x for x in (value, current.get(key)))
            raise UserError(f"the checkpoint to resume was trained with {group}.{key}={trained}, this run has "
                            f"{group}.{key}={now}; {fix}")


def check_same_classes(expected: list, found: list, what: str, fix: str) -> None:
    """Labels are class indices: a class missing from one split shifts every later label silently."""
    if list(expected) == list(found):
        return
    differences = []
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing:
        differences.append(f"missing {missing[:3]}")
    if extra:
        differences.append(f"extra {extra[:3]}")
    detail = "; ".join(differences) or "in a different order"
    count = f"{len(found)} classes, not the {len(expected)} expected" if len(found) != len(expected) else \
        f"other classes than the {len(expected)} expected"
    raise UserError(f"{what} has {count} ({detail}); {fix}")
