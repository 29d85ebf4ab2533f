"""The training entry point behind train.py: `train(cfg)` runs a whole DeiT-style job.

Order follows DeiT: data -> sampler -> timm.create_model -> EMA before DDP -> lr scaled by
global batch / 512 -> resume -> epochs of train_one_epoch / evaluate. Only rank 0 writes.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import pickle
import random
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import numpy as np
import timm
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from timm.data import Mixup
from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2, list_optimizers
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import models as lion_models  # registers the LION models with timm
from ..data import build_dataset, build_loader, build_transform, num_classes_of
from ..errors import UserError, first_line
from ..ops import BACKENDS, FORM_CHOICES
from . import checkpoint as ckpt
from . import interrupts, rundir
from .allocator import keep_freed_memory
from .distributed import DistInfo, broadcast_object, cleanup, init_distributed
from .loop import NonFiniteLoss, Precision, evaluate, train_one_epoch, updates_per_epoch
from .memory import memory_warning

log = logging.getLogger("lion_vit")
# ${pid:} in the default output_dir: runs started in the same second get folders of their own
OmegaConf.register_new_resolver("pid", os.getpid, replace=True)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible; use device=cpu or device=auto")
    if name not in ("cpu", "cuda"):
        raise UserError(f"unknown device {name!r}; choose auto, cpu or cuda")
    return torch.device(name)


def configure_cuda(tf32: bool) -> None:
    """GPU defaults of DeiT / timm training: cuDNN picks the fastest convolution for the fixed input size,
    and float32 matmuls and convolutions (those outside bf16 autocast) may use TF32 (tf32=true)."""
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


WANDB_MODES = ("online", "offline", "disabled")
METRICS = "metrics.jsonl"


def _require(value: Any, ok: bool, name: str, expected: str) -> None:
    if not ok:
        raise UserError(f"{name}={value} is not allowed; set {name} to {expected}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float (inf and nan are never a setting's value)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_fraction(value: Any) -> bool:
    return _is_number(value) and 0 <= value <= 1


def _is_pair(value: Any, test: Callable[[Any], bool]) -> bool:
    return isinstance(value, (list, tuple, ListConfig)) and len(value) == 2 and all(test(x) for x in value)


def _is_timm_optimizer(value: Any) -> bool:
    """A name timm's create_optimizer_v2 takes: any case, optionally with its lookahead_ prefix."""
    name = str(value).lower()
    return name.removeprefix("lookahead_") in list_optimizers()


_AUGMENT_OPTION = re.compile(r"[a-z]+\d[\d.]*")  # a letter key and its number: m9, mstd0.5, inc1


def _is_timm_auto_augment(value: Any) -> bool:
    """null / '' (off), or a policy timm builds with every option read: its parsers assert on an
    unknown policy or option deep inside create_transform, and silently skip an option that has no
    number (rand-mfoo would train with the default magnitude)."""
    if value is None or value == "":
        return True
    if not isinstance(value, str):
        return False
    name, *options = value.split("-")
    # RandAugment's t<choices> option names its op set instead of a number
    if not all(_AUGMENT_OPTION.fullmatch(o) or (name == "rand" and o.startswith("t")) for o in options):
        return False
    parse = {"rand": rand_augment_transform, "augmix": augment_and_mix_transform}.get(name, auto_augment_transform)
    try:
        parse(value, {})
    except (AssertionError, ValueError, KeyError, TypeError):
        return False
    return True


AMP_DTYPES = ("bfloat16", "float16")
# timm's schedules that step per update (plateau needs a validation metric each epoch)
SCHEDULES = ("cosine", "tanh", "step", "multistep", "poly", "constant", "wsd", "rsqrt")
MIXUP_MODES = ("batch", "pair", "elem")
SWITCHES = ("eval_only", "amp", "compile", "tf32", "cpu_keep_freed_memory", "progress", "ema.enabled", "ema.eval_ema")

# (setting, test, what it must be) for every run, then for training runs only
_SETTINGS = (
    ("img_size", lambda v: _is_int(v) and v > 0, "a positive integer"),
    ("batch_size", lambda v: _is_int(v) and v > 0, "a positive integer"),
    ("grad_accum_steps", lambda v: _is_int(v) and v > 0, "a positive integer (1: no accumulation)"),
    ("num_workers", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    ("seed", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    ("log_interval", lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0: no progress lines)"),
    ("amp_dtype", lambda v: v in AMP_DTYPES, " | ".join(AMP_DTYPES)),
    ("logger.wandb.mode", lambda v: v in WANDB_MODES, " | ".join(WANDB_MODES)),
    ("model.name", lambda v: isinstance(v, str) and bool(v), "a timm model name such as lion_s_small"),
    ("model.patch_size", lambda v: v is None or (_is_int(v) and v > 0),
     "a positive integer that divides img_size (null for timm models without patches)"),
    ("data.crop_pct", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    # `compile=ture` would otherwise count as true
    *((switch, lambda v: isinstance(v, bool), "true or false") for switch in SWITCHES),
)
_TRAINING_SETTINGS = (
    ("epochs", lambda v: _is_int(v) and v > 0, "a positive integer"),
    ("model.drop_path_rate", lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1) (stochastic depth)"),
    ("optim.opt", lambda v: _is_timm_optimizer(v),
     "a timm optimizer name such as adamw, sgd or lamb (timm.optim.list_optimizers())"),
    ("optim.sched", lambda v: v in SCHEDULES, " | ".join(SCHEDULES)),
    ("optim.lr", lambda v: _is_number(v) and v > 0, "a finite positive number"),
    ("optim.weight_decay", lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    ("optim.betas", lambda v: _is_pair(v, lambda x: _is_number(x) and 0 <= x < 1), "two numbers in [0, 1)"),
    ("optim.eps", lambda v: _is_number(v) and v > 0, "a positive number"),
    ("optim.layer_decay", lambda v: v is None or (_is_number(v) and 0 < v <= 1),
     "null (off) or a number in (0, 1], e.g. 0.75 for fine-tuning"),
    ("optim.min_lr", lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    ("optim.warmup_lr", lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    ("optim.warmup_epochs", lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    ("optim.clip_grad", lambda v: v is None or (_is_number(v) and v > 0), "null or a positive max norm"),
    ("aug.mixup", lambda v: _is_number(v) and v >= 0, "a number >= 0 (0: off)"),
    ("aug.cutmix", lambda v: _is_number(v) and v >= 0, "a number >= 0 (0: off)"),
    ("aug.mixup_prob", _is_fraction, "a probability in [0, 1]"),
    ("aug.mixup_switch_prob", _is_fraction, "a probability in [0, 1]"),
    ("aug.mixup_mode", lambda v: v in MIXUP_MODES, " | ".join(MIXUP_MODES)),
    ("aug.smoothing", lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    ("aug.reprob", _is_fraction, "a probability in [0, 1]"),
    ("aug.hflip", _is_fraction, "a probability in [0, 1]"),
    ("aug.color_jitter", lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    ("aug.scale", lambda v: _is_pair(v, lambda x: _is_number(x) and 0 < x <= 1) and v[0] <= v[1],
     "[low, high] with 0 < low <= high <= 1 (RandomResizedCrop's area range)"),
    ("aug.repeated_aug", lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0 or 1: off)"),
    ("aug.auto_augment", _is_timm_auto_augment,
     "null (off) or a timm policy whose options are each a key and a number: rand-m9-mstd0.5-inc1 (RandAugment, "
     "DeiT's), augmix-m5-w3-d2, original, v0 or 3a"),
)
_ABSENT = object()


def check_settings(cfg: DictConfig) -> None:
    """One clear line for a setting out of range, an unknown name or a switch that is not true/false,
    before any data or model is built (torch, timm and the DataLoader would otherwise fail deep
    inside with their own assertion, or take the value silently). Settings a config does not have
    are left to the code that reads them."""
    for name, test, expected in _SETTINGS + (() if cfg.eval_only is True else _TRAINING_SETTINGS):
        value = OmegaConf.select(cfg, name, default=_ABSENT)
        if value is not _ABSENT:
            _require(value, test(value), name, expected)
    if cfg.eval_only:
        return
    if cfg.aug.mixup > 0 or cfg.aug.cutmix > 0:  # timm's Mixup asserts on an odd batch, deep in the first step
        _require(cfg.batch_size, cfg.batch_size % 2 == 0, "batch_size",
                 "an even number while mixup or cutmix is on (timm's Mixup mixes each image with its mirror in "
                 "the batch), or turn them off with aug.mixup=0 aug.cutmix=0")
    if cfg.ema.enabled:
        _require(cfg.ema.decay, _is_number(cfg.ema.decay) and 0 < cfg.ema.decay < 1, "ema.decay",
                 "a number between 0 and 1")


_REQUESTED = re.compile(r"[Tt]ried to allocate ([0-9.]+) ?([A-Za-z]+)")


def _out_of_memory(error: BaseException, cfg: DictConfig) -> Optional[UserError]:
    """A UserError for an allocation failure (CUDA's OutOfMemoryError, the CPU allocator's
    RuntimeError), saying how much was asked for and what to lower; None for any other error."""
    message = str(error)
    if not isinstance(error, torch.cuda.OutOfMemoryError) and "can't allocate memory" not in message:
        return None
    found = _REQUESTED.search(message)
    size = ""
    if found:
        amount, unit = found.groups()
        size = f" ({float(amount) / 1e9:.1f} GB requested)" if unit == "bytes" else f" ({amount} {unit} requested)"
    return UserError(f"out of memory at img_size {cfg.img_size}, batch_size {cfg.batch_size} per process{size}; "
                     f"lower batch_size or img_size (the attention form's memory grows with the square of the "
                     f"tokens per image; to evaluate at high resolution use model.attn_form=chunk)")


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch: called per epoch so a resumed run sees the same randomness."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    return seed * 1_000_003 + epoch * 1_009 + rank


# timm.create_model arguments that choose a model's initial weights, not its architecture (fine-tuning:
# model.kwargs.pretrained=true, model.kwargs.pretrained_cfg_overlay.file=<checkpoint>). A model whose
# weights come from a checkpoint (resume, eval_only) is built without them.
INITIAL_WEIGHT_KWARGS = ("pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path")


def build_model(model_cfg: DictConfig, num_classes: int, img_size: int, initial_weights: bool = True) -> nn.Module:
    """timm.create_model from the `model` config group, with clear errors for bad settings.

    initial_weights=False leaves out the INITIAL_WEIGHT_KWARGS (the caller loads the weights).
    """
    name = model_cfg.name
    if not timm.is_model(name):
        raise UserError(f"unknown model {name!r}; LION models: {', '.join(lion_models.LION_MODEL_NAMES)} "
                        f"(or any timm name, see timm.list_models())")
    patch = model_cfg.patch_size
    if patch and img_size % patch:
        raise UserError(f"img_size {img_size} is not divisible by model.patch_size {patch}; "
                        f"use a multiple of {patch}")
    is_lion = name in lion_models.LION_MODEL_NAMES
    if model_cfg.attn_form not in FORM_CHOICES:
        raise UserError(f"unknown model.attn_form {model_cfg.attn_form!r}; choose one of {sorted(FORM_CHOICES)}")
    backend = model_cfg.get("attn_backend", "auto")
    if backend not in BACKENDS:
        raise UserError(f"unknown model.attn_backend {backend!r}; choose one of {list(BACKENDS)}")
    if not is_lion and (model_cfg.attn_form not in ("auto", "attention") or model_cfg.chunk_size or backend != "auto"):
        raise UserError(f"model.attn_form / model.chunk_size / model.attn_backend apply to LION models only, "
                        f"not {name}")
    model_kwargs = OmegaConf.to_container(model_cfg.kwargs, resolve=True)
    if not initial_weights:
        model_kwargs = _without_initial_weights(model_kwargs)
    kwargs: Dict[str, Any] = dict(num_classes=num_classes, drop_path_rate=model_cfg.drop_path_rate, **model_kwargs)
    if is_lion:
        kwargs.update(attn_form=model_cfg.attn_form, chunk_size=model_cfg.chunk_size, attn_backend=backend)
    try:
        return lion_models.create_model_at_size(name, img_size, patch, **kwargs)
    except (ValueError, TypeError) as error:
        hint = ""
        if "unexpected keyword argument" in str(error) and model_cfg.kwargs:
            hint = (f" (model.kwargs={OmegaConf.to_container(model_cfg.kwargs)} comes from the model group; "
                    f"start from model=lion or model=deit, whose kwargs are empty)")
        raise UserError(f"cannot build model {name}: {error}{hint}") from None
    except (OSError, RuntimeError, pickle.UnpicklingError) as error:
        source = _initial_weights_source(kwargs)
        if source is None:
            raise
        # a missing, unreadable or mismatched file of initial weights (timm's loader)
        raise UserError(f"cannot load the initial weights of {name} from {source}: {first_line(error)}") from None


def _without_initial_weights(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    return {key: value for key, value in kwargs.items() if key not in INITIAL_WEIGHT_KWARGS}


def _initial_weights_source(kwargs: Dict[str, Any]) -> Optional[str]:
    """Where timm.create_model takes a model's initial weights from, or None (random initialisation)."""
    if kwargs.get("checkpoint_path"):
        return f"model.kwargs.checkpoint_path={kwargs['checkpoint_path']}"
    if kwargs.get("pretrained"):
        file = (kwargs.get("pretrained_cfg_overlay") or {}).get("file")
        return f"model.kwargs.pretrained_cfg_overlay.file={file}" if file else "timm's pretrained weights"
    return None


def load_weights(model: nn.Module, state_dict: Dict[str, torch.Tensor]) -> None:
    """Load weights, resampling positional embeddings to the model's grid when needed."""
    state_dict = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in state_dict.items()}
    if "pos_embed" in state_dict and hasattr(model, "pos_embed"):
        state_dict = lion_models.checkpoint_filter_fn(state_dict, model)
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as error:
        # torch's first line only says "Error(s) in loading state_dict for ...": name the first problem
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        first = lines[1] if len(lines) > 1 else lines[0]
        first = first if len(first) <= 200 else first[:200] + " ..."
        raise UserError(f"checkpoint does not fit model {type(model).__name__}: {first}") from None


def _architecture(model_settings: Dict[str, Any]) -> Dict[str, Any]:
    """The model settings that fix an architecture: name, patch_size and kwargs (without the ones that
    only choose initial weights)."""
    settings = {key: model_settings[key] for key in ("name", "patch_size", "kwargs") if key in model_settings}
    if settings.get("kwargs"):
        settings["kwargs"] = _without_initial_weights(settings["kwargs"])
    return settings


def _trained_architecture(state: Dict[str, Any]) -> Dict[str, Any]:
    """A checkpoint's architecture settings, as saved."""
    return _architecture(state.get("config", {}).get("model", {}))


# optimizer settings that shape its saved state (its parameter groups and per-parameter buffers)
OPTIMIZER_STATE_SETTINGS = ("opt", "layer_decay")
_RESUME_SAME_OPTIMIZER = ("resume with the same optimizer, or fine-tune its weights in a new output_dir "
                          "(+model.kwargs.pretrained=true +model.kwargs.pretrained_cfg_overlay.file=<checkpoint>)")


def _check_resumable(cfg: DictConfig, state: Dict[str, Any]) -> None:
    """Resuming continues the checkpoint's run: another architecture, or another optimizer (which cannot
    take the saved optimizer state), is a mistake to name, not a wall of missing keys or a traceback."""
    _require_same("model", _trained_architecture(state), _architecture(OmegaConf.to_container(cfg.model, resolve=True)),
                  "resume with the same model settings or choose a new output_dir")
    trained_optim = state.get("config", {}).get("optim", {})
    _require_same("optim", {key: trained_optim[key] for key in OPTIMIZER_STATE_SETTINGS if key in trained_optim},
                  {key: OmegaConf.select(cfg, f"optim.{key}") for key in OPTIMIZER_STATE_SETTINGS},
                  _RESUME_SAME_OPTIMIZER)


def _require_same(group: str, trained: Dict[str, Any], current: Dict[str, Any], fix: str) -> None:
    """A UserError naming the first of the checkpoint's `group` settings that this run sets otherwise."""
    for key, value in trained.items():
        if value != current.get(key):
            raise UserError(f"the checkpoint to resume was trained with {group}.{key}={_as_override(value)}, "
                            f"this run has {group}.{key}={_as_override(current.get(key))}; {fix}")


def _as_override(value: Any) -> str:
    return "null" if value is None else str(value)


def _check_same_classes(expected: list, found: list, what: str, fix: str) -> None:
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


def _warn_if_too_large(model: nn.Module, cfg: DictConfig, device: torch.device, precision: Precision,
                       training: bool, is_main: bool) -> None:
    """A one-line warning, before anything runs, where a step will not fit in the free memory."""
    value_bytes = 4 if precision.dtype is None or precision.dtype == torch.float32 else 2
    warning = memory_warning(model, cfg.img_size, cfg.batch_size, training, device, value_bytes)
    if warning and is_main:
        log.warning(warning)


def _precision(cfg: DictConfig, device: torch.device) -> Precision:
    if not cfg.amp or device.type != "cuda":
        return Precision(device)
    return Precision(device, getattr(torch, cfg.amp_dtype))


def _write_json(path: Path, payload: Dict[str, Any]) -> None:
    _write_atomic(path, json.dumps(payload, indent=2) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    """path's new content, or (a full disk) the old one and no temp file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _append_line(path: Path, line: str) -> None:
    """Append one line to path, or (a full disk) leave the file as it was, without half a line."""
    with open(path, "a") as f:
        size = f.tell()
        try:
            f.write(line + "\n")
            f.flush()
        except OSError:
            f.truncate(size)
            raise


def _setup_logging(output_dir: Optional[Path], is_main: bool) -> None:
    """Console and (rank 0) train.log; the "lion_vit.file" logger writes to train.log alone."""
    handlers: list = [logging.StreamHandler(sys.stdout)]
    if output_dir is not None and is_main:
        handlers.append(logging.FileHandler(output_dir / "train.log"))
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    file_log = logging.getLogger("lion_vit.file")
    file_log.handlers = handlers[1:]
    file_log.propagate = False


class WandbLogger:
    """wandb on rank 0 only; mode=disabled makes every call a no-op (tests, no account).

    run_id: the wandb run of the checkpoint being resumed, continued so that a killed and resumed
    training run keeps one set of curves.
    """

    def __init__(self, cfg: DictConfig, output_dir: Path, enabled: bool, run_id: Optional[str] = None) -> None:
        self.run = None
        if not enabled or cfg.logger.wandb.mode == "disabled":
            return
        import wandb
        wb = cfg.logger.wandb
        try:
            self.run = wandb.init(project=wb.project, entity=wb.entity, name=wb.name or output_dir.name,
                                  group=OmegaConf.select(wb, "group"),
                                  mode=wb.mode, tags=list(wb.tags), dir=str(output_dir),
                                  config=OmegaConf.to_container(cfg, resolve=True),
                                  id=run_id, resume="allow" if run_id else None,
                                  settings=wandb.Settings(quiet=True))  # the run's history stays in wandb
        except wandb.errors.Error as error:  # no API key, no network, an unknown project or entity
            raise UserError(f"wandb could not start in mode={wb.mode} ({first_line(error)}); run `wandb login` or set "
                            f"WANDB_API_KEY, or use logger.wandb.mode=offline (no account needed)") from None

    @property
    def run_id(self) -> Optional[str]:
        return None if self.run is None else self.run.id

    def log(self, metrics: Dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


def run_eval_only(cfg: DictConfig, dist_info: DistInfo, device: torch.device, output_dir: Path) -> Dict[str, Any]:
    """Evaluate `checkpoint` in the requested attn_form / chunk_size / img_size; write eval.json."""
    if not cfg.checkpoint:
        raise UserError("eval_only=true needs checkpoint=<path to a checkpoint-*.pt>")
    state = ckpt.load_checkpoint(Path(cfg.checkpoint))
    # The architecture is the checkpoint's; the form and resolution are this command's.
    # Replaced whole, not merged: kwargs of this command's model group must not leak into the trained
    # architecture (nor can a merge add the checkpoint's kwargs to Hydra's struct config).
    with_arch = OmegaConf.create({**OmegaConf.to_container(cfg.model, resolve=True), **_trained_architecture(state)})
    val_set = build_dataset(cfg.data, "val", build_transform(cfg.data, cfg.aug, cfg.img_size, train=False))
    num_classes = state.get("num_classes", num_classes_of(val_set))
    if "classes" in state:
        _check_same_classes(state["classes"], val_set.classes, f"the {cfg.data.name} validation split",
                           "evaluate on data with the classes the checkpoint was trained on")
    elif num_classes_of(val_set) != num_classes:
        raise UserError(f"the validation split has {num_classes_of(val_set)} classes, the checkpoint "
                        f"{num_classes}; evaluate on data with the classes it was trained on")
    model = build_model(with_arch, num_classes, cfg.img_size, initial_weights=False)
    use_ema = cfg.ema.eval_ema
    if use_ema and ckpt.ema_weights(state) is None:
        raise UserError(f"ema.eval_ema=true, but {cfg.checkpoint} holds no EMA weights (its run had "
                        f"ema.enabled=false); drop ema.eval_ema to evaluate its model weights")
    load_weights(model, ckpt.ema_weights(state) if use_ema else state["model"])
    _warn_if_too_large(model, cfg, device, _precision(cfg, device), training=False, is_main=dist_info.is_main)
    model.to(device)
    loader = build_loader(val_set, train=False, batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                          rank=dist_info.rank, world_size=dist_info.world_size, seed=cfg.seed)
    with interrupts.stop_between_steps(announce=dist_info.is_main):
        stats = evaluate(model, loader, device, _precision(cfg, device),
                         show_progress=cfg.progress and dist_info.is_main, log_interval=cfg.log_interval)
    form = cfg.model.attn_form  # a chunk size set for a sweep over forms means nothing to the others
    result = {"acc1": stats["acc1"], "acc5": stats["acc5"], "loss": stats["loss"], "attn_form": form,
              "chunk_size": cfg.model.chunk_size if form == "chunk" else None, "img_size": cfg.img_size,
              "num_images": stats["num_images"], "model": with_arch.name, "checkpoint": str(cfg.checkpoint),
              "weights": "ema" if use_ema else "model"}
    if dist_info.is_main:
        _write_json(output_dir / "eval.json", result)
        log.info("eval: %s", json.dumps(result))
        log.info("wrote %s", output_dir / "eval.json")
    return result


def train(cfg: DictConfig) -> Dict[str, Any]:
    """Run training (or evaluation with eval_only=true) as configured; returns the final metrics."""
    check_settings(cfg)
    device = resolve_device(cfg.device)
    if device.type == "cpu" and cfg.cpu_keep_freed_memory:
        keep_freed_memory()
    if device.type == "cuda":
        configure_cuda(cfg.tf32)
    dist_info = init_distributed(device)
    output_dir, created = None, False
    try:
        if device.type == "cuda":
            device = torch.device("cuda", dist_info.local_rank)
            torch.cuda.set_device(device)
        output_dir = Path(broadcast_object(str(cfg.output_dir)))  # rank 0's timestamp for everyone
        if dist_info.is_main:
            created = not output_dir.exists()
            _claim(output_dir)
        _setup_logging(output_dir, dist_info.is_main)
        seed_everything(epoch_seed(cfg.seed, 0, dist_info.rank))
        if cfg.eval_only:
            return run_eval_only(cfg, dist_info, device, output_dir)
        return _fit(cfg, dist_info, device, output_dir)
    except RuntimeError as error:  # torch.cuda.OutOfMemoryError is one
        out_of_memory = _out_of_memory(error, cfg)
        if out_of_memory is None:
            raise
        raise out_of_memory from None
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" writing {error.filename}" if error.filename else ""
        raise UserError(f"no space left on the device{where}; free space there, then continue with resume=auto "
                        f"(the files already written are kept)") from None
    except UserError:
        if created:  # a run that failed before its first epoch's files leaves no folder behind
            for logger in (logging.getLogger(), logging.getLogger("lion_vit.file")):  # train.log's handlers
                for handler in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
                    logger.removeHandler(handler)
                    handler.close()
            rundir.release_all()
            rundir.remove_if_unused(output_dir)
        raise
    finally:
        rundir.release_all()
        cleanup()


def _claim(output_dir: Path) -> None:
    """Create output_dir, check that it is writable, and lock it for this run (rank 0)."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file of that name, no permission, a read-only disk
        raise UserError(f"cannot create output_dir {output_dir} ({error.strerror}); choose another "
                        f"output_dir") from None
    problem = rundir.writable(output_dir)
    if problem:
        raise UserError(f"cannot write in output_dir {output_dir} ({problem}); choose a writable output_dir")
    rundir.lock(output_dir)


def _fit(cfg: DictConfig, dist_info: DistInfo, device: torch.device, output_dir: Path) -> Dict[str, Any]:
    is_main = dist_info.is_main
    resume_state = _resume_state(cfg, output_dir, is_main)
    if is_main:
        _write_atomic(output_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))

    train_set = build_dataset(cfg.data, "train", build_transform(cfg.data, cfg.aug, cfg.img_size, train=True))
    val_set = build_dataset(cfg.data, "val", build_transform(cfg.data, cfg.aug, cfg.img_size, train=False))
    num_classes = num_classes_of(train_set)
    _check_same_classes(train_set.classes, val_set.classes, "the validation split",
                       "give train and val the same class folders")
    loader_args = dict(batch_size=cfg.batch_size, num_workers=cfg.num_workers, rank=dist_info.rank,
                       world_size=dist_info.world_size, seed=cfg.seed, pin_memory=device.type == "cuda")
    train_loader = build_loader(train_set, train=True, repeated_aug=cfg.aug.repeated_aug, **loader_args)
    val_loader = build_loader(val_set, train=False, **loader_args)
    if len(train_loader) == 0:
        raise UserError(f"{len(train_set)} training images are fewer than one batch of {cfg.batch_size} per "
                        f"process; lower batch_size")

    model = build_model(cfg.model, num_classes, cfg.img_size, initial_weights=resume_state is None).to(device)
    ema = ModelEmaV3(model, decay=cfg.ema.decay) if cfg.ema.enabled else None
    accum = OmegaConf.select(cfg, "grad_accum_steps", default=1)
    updates = updates_per_epoch(len(train_loader), accum)
    global_batch = cfg.batch_size * dist_info.world_size * accum
    lr = cfg.optim.lr * global_batch / cfg.optim.lr_base_batch if cfg.optim.lr_base_batch else cfg.optim.lr
    optimizer = create_optimizer_v2(model, opt=cfg.optim.opt, lr=lr, weight_decay=cfg.optim.weight_decay,
                                    betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                                    layer_decay=OmegaConf.select(cfg, "optim.layer_decay"))
    scheduler, _ = create_scheduler_v2(optimizer, sched=cfg.optim.sched, num_epochs=cfg.epochs,
                                       warmup_epochs=cfg.optim.warmup_epochs, warmup_lr=cfg.optim.warmup_lr,
                                       min_lr=cfg.optim.min_lr, step_on_epochs=False,
                                       updates_per_epoch=updates)
    precision = _precision(cfg, device)
    _warn_if_too_large(model, cfg, device, precision, training=True, is_main=is_main)
    scaler = torch.amp.GradScaler(device.type) if precision.dtype == torch.float16 else None
    mixup_fn = None
    if cfg.aug.mixup > 0 or cfg.aug.cutmix > 0:
        mixup_fn = Mixup(mixup_alpha=cfg.aug.mixup, cutmix_alpha=cfg.aug.cutmix, prob=cfg.aug.mixup_prob,
                         switch_prob=cfg.aug.mixup_switch_prob, mode=cfg.aug.mixup_mode,
                         label_smoothing=cfg.aug.smoothing, num_classes=num_classes)
        criterion: nn.Module = SoftTargetCrossEntropy()
    elif cfg.aug.smoothing > 0:
        criterion = LabelSmoothingCrossEntropy(smoothing=cfg.aug.smoothing)
    else:
        criterion = nn.CrossEntropyLoss()

    start_epoch, best_acc1, best_epoch = 0, -1.0, None
    if resume_state is not None:
        _check_resumable(cfg, resume_state)
        load_weights(model, resume_state["model"])
        try:
            optimizer.load_state_dict(resume_state["optimizer"])
        except (ValueError, KeyError) as error:  # a checkpoint older than the checks above
            raise UserError(f"the checkpoint's optimizer state does not fit this run's optimizer "
                            f"({first_line(error)}); {_RESUME_SAME_OPTIMIZER}") from None
        # The schedule is rebuilt from this command's settings, not loaded: its state is only those
        # settings in units of updates, stale once the number of processes, batch_size or epochs changed.
        scheduler.step_update(num_updates=(resume_state["epoch"] + 1) * updates)
        if scaler is not None and resume_state.get("scaler"):
            scaler.load_state_dict(resume_state["scaler"])
        if ema is not None:
            trained_ema = ckpt.ema_weights(resume_state)
            if trained_ema is not None:
                load_weights(ema.module, trained_ema)
            else:  # EMA turned on for a run that trained without it: start from its weights
                ema.set(model)
        start_epoch, best_acc1 = resume_state["epoch"] + 1, resume_state.get("best_acc1", -1.0)
        best_epoch = resume_state.get("best_epoch")
        log.info("resumed after epoch %d of %s", resume_state["epoch"] + 1, output_dir)
        if is_main:
            _drop_metrics_after(output_dir / METRICS, resume_state["epoch"] + 1)
        if start_epoch >= cfg.epochs:
            log.info("the checkpoint has finished all %d epochs of epochs=%d: nothing left to train (with a "
                     "larger epochs, training goes on along that longer schedule)",
                     start_epoch, cfg.epochs)

    train_model: nn.Module = model
    if cfg.compile:
        train_model = torch.compile(train_model)
    if dist_info.enabled:
        train_model = DistributedDataParallel(train_model, device_ids=[device.index] if device.type == "cuda" else None)

    n_params = sum(p.numel() for p in model.parameters())
    log.info("model %s (%.2fM params) at %d px, %d train / %d val images, %d classes, lr %.2e, global batch %d, "
             "%d process(es), %s", cfg.model.name, n_params / 1e6, cfg.img_size, len(train_set), len(val_set),
             num_classes, lr, global_batch, dist_info.world_size, device)
    if hasattr(model, "attn_plan"):  # what every LION layer runs (lion_vit.ops.dispatch)
        log.info("attention: %s", model.attn_plan((cfg.img_size, cfg.img_size)))
    if is_main and cfg.optim.warmup_epochs >= cfg.epochs:  # timm's scheduler takes it: a smoke test, or a mistake
        log.warning("optim.warmup_epochs=%s is not below epochs=%d: the learning rate never leaves warm-up "
                    "(it ends below %.2e and the cosine decay never starts); lower optim.warmup_epochs for a "
                    "full schedule", cfg.optim.warmup_epochs, cfg.epochs, lr)
    logger = WandbLogger(cfg, output_dir, is_main, run_id=(resume_state or {}).get("wandb_run_id"))
    metrics: Dict[str, Any] = {}
    show = cfg.progress and is_main
    try:
        # the first Ctrl-C stops the run before its next step: see interrupts.py
        with interrupts.stop_between_steps(announce=is_main):
            for epoch in range(start_epoch, cfg.epochs):
                seed_everything(epoch_seed(cfg.seed, epoch, dist_info.rank))
                train_loader.sampler.set_epoch(epoch)
                try:
                    stats = train_one_epoch(train_model, train_loader, optimizer, criterion, scheduler, epoch, device,
                                            precision, scaler, mixup_fn, ema, cfg.optim.clip_grad, show, accum,
                                            cfg.log_interval)
                except NonFiniteLoss as error:
                    kept = (f"The last good checkpoint is kept in {output_dir}" if (output_dir / ckpt.LAST).exists()
                            else "No epoch finished, so there is no checkpoint")
                    raise UserError(f"{error}; stopped. {kept} (lower optim.lr or set optim.clip_grad)") from None
                # a Ctrl-C from here on stops the run after this epoch's checkpoint, not before it: the
                # evaluation takes a small part of an epoch, whose training would be lost (as in torchrun
                # runs, whose ranks stop only before an agreed training step)
                val = evaluate(model, val_loader, device, precision, show, cfg.log_interval, interruptible=False)
                metrics = {"epoch": epoch + 1, "train_loss": stats["train_loss"], "val_loss": val["loss"],
                           "val_acc1": val["acc1"], "val_acc5": val["acc5"], "lr": stats["lr"],
                           "epoch_time_s": stats["epoch_time_s"], "imgs_per_s": stats["imgs_per_s"]}
                if ema is not None:
                    metrics["val_acc1_ema"] = evaluate(ema.module, val_loader, device, precision, show,
                                                       cfg.log_interval, interruptible=False)["acc1"]
                is_best = val["acc1"] > best_acc1
                if is_best:
                    best_acc1, best_epoch = val["acc1"], epoch + 1
                if is_main:
                    state = {"model": model.state_dict(), "model_ema": ema.module.state_dict() if ema else None,
                             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                             "scaler": scaler.state_dict() if scaler else None, "epoch": epoch,
                             "best_acc1": best_acc1, "best_epoch": best_epoch, "num_classes": num_classes,
                             "classes": list(train_set.classes),
                             "config": OmegaConf.to_container(cfg, resolve=True), "wandb_run_id": logger.run_id}
                    # metrics first: a run killed in between re-trains this epoch and drops its line on resume;
                    # a Ctrl-C meanwhile waits until the epoch's line and checkpoints are all written
                    with interrupts.deferred():
                        _append_line(output_dir / METRICS, json.dumps(metrics))
                        ckpt.save_together([(state, output_dir / ckpt.LAST, output_dir / ckpt.PREVIOUS)]
                                           + ([(state, output_dir / ckpt.BEST, None)] if is_best else []))
                    log.info("epoch %d/%d  train_loss %.4f  val_loss %.4f  acc1 %.2f  acc5 %.2f  lr %.2e  %.1fs "
                             "(%.0f img/s)", epoch + 1, cfg.epochs, metrics["train_loss"], metrics["val_loss"],
                             metrics["val_acc1"], metrics["val_acc5"], metrics["lr"], metrics["epoch_time_s"],
                             metrics["imgs_per_s"])
                    logger.log(metrics, step=epoch + 1)
    finally:
        logger.finish()
    if is_main and best_acc1 >= 0:
        last = f", last {metrics['val_acc1']:.2f} %" if metrics else ""
        at = f" (epoch {best_epoch})" if best_epoch else ""
        log.info("done: best top-1 %.2f %%%s%s; run folder %s, best checkpoint %s", best_acc1, at, last,
                 output_dir, output_dir / ckpt.BEST)
    return metrics


def _drop_metrics_after(path: Path, epochs_done: int) -> None:
    """Keep metrics.jsonl's lines of the first epochs_done epochs (counted from 1), those of the resumed
    checkpoint: a line of a later epoch comes from a run killed after logging it and before its checkpoint
    was written, and is trained again."""
    if not path.exists():
        return

    def logged_epoch(line: str) -> float:
        try:
            return json.loads(line)["epoch"]
        except (ValueError, KeyError, TypeError):  # a line cut short by the kill
            return float("inf")

    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if logged_epoch(line) <= epochs_done]
    if len(kept) < len(lines):
        _write_atomic(path, "".join(kept))


def _resume_state(cfg: DictConfig, output_dir: Path, is_main: bool) -> Optional[Dict[str, Any]]:
    """resume=auto: newest readable checkpoint in output_dir (none, in a folder without checkpoints: a fresh
    start); resume=<path>: that file. A fresh start in a folder holding a run is refused."""
    found = rundir.run_files(output_dir)
    if cfg.resume in (None, "", False):
        if found:
            raise UserError(f"{output_dir} already holds a run ({', '.join(found)}); pass resume=auto to continue "
                            f"it or choose a new output_dir")
        return None
    if cfg.resume == "auto":
        state = ckpt.newest_readable(output_dir)
        if state is None and any(name.startswith("checkpoint-") for name in found):
            # never train from scratch over a run: its best checkpoint and metrics would be overwritten
            raise UserError(f"resume=auto found no readable {ckpt.LAST} or {ckpt.PREVIOUS} in {output_dir}, which "
                            f"holds a run ({', '.join(found)}); pass resume=<path> to a good checkpoint, or choose "
                            f"a new output_dir")
        if state is None and is_main:
            _drop_metrics_after(output_dir / METRICS, 0)  # a first epoch killed before its checkpoint
        return state
    return ckpt.load_checkpoint(Path(cfg.resume))
