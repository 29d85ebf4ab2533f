"""The settings of train.py as Hydra structured configs: every setting's type and allowed values.

The values themselves live in configs/ (YAML, grouped by concern), and only there: these dataclasses
are their schema and hold no defaults (tests/test_settings.py checks every YAML file against them).
`check_settings(cfg)` merges the composed config into the schema (OmegaConf checks the types and
unknown keys), then checks each field's rule from its metadata and the few rules that
relate two settings, so that a bad value is one line naming the setting and what it must be,
before any data or model is built. (Registered as Hydra's schema instead, a bad value would end in
Hydra's multi-line report and exit code 1.)
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError
from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform
from timm.optim import list_optimizers

from ..data.build import KINDS
from ..errors import UserError
from ..ops import BACKENDS, FORM_CHOICES

# ${pid:} in the default output_dir: runs started in the same second get folders of their own
OmegaConf.register_new_resolver("pid", os.getpid, replace=True)

DEVICES = ("auto", "cpu", "cuda")
AMP_DTYPES = ("bfloat16", "float16")
WANDB_MODES = ("online", "offline", "disabled")
# timm's schedules that step per update (plateau needs a validation metric each epoch)
SCHEDULES = ("cosine", "tanh", "step", "multistep", "poly", "constant", "wsd", "rsqrt")
MIXUP_MODES = ("batch", "pair", "elem")
DISTILL_TYPES = ("none", "soft", "hard")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float (inf and nan are never a setting's value)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_pair(value: Any, test: Callable[[Any], bool]) -> bool:
    return isinstance(value, (list, tuple, ListConfig)) and len(value) == 2 and all(test(x) for x in value)


def positive_int(v: Any) -> bool:
    return _is_int(v) and v > 0


def non_negative_int(v: Any) -> bool:
    return _is_int(v) and v >= 0


def positive(v: Any) -> bool:
    return _is_number(v) and v > 0


def non_negative(v: Any) -> bool:
    return _is_number(v) and v >= 0


def fraction(v: Any) -> bool:
    return _is_number(v) and 0 <= v <= 1


def optional(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or test(v)


def switch(v: Any) -> bool:
    return isinstance(v, bool)  # OmegaConf would take yes/on/ture-like strings; `compile=ture` must not pass


def one_of(*choices: str) -> Callable[[Any], bool]:
    return lambda v: v in choices


def _is_timm_optimizer(value: Any) -> bool:
    """A name timm's create_optimizer_v2 takes: any case, optionally with its lookahead_ prefix."""
    return str(value).lower().removeprefix("lookahead_") in list_optimizers()


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


# how an error states the common rules (a field may say more)
_WORDING = {positive_int: "a positive integer", non_negative_int: "an integer >= 0", positive: "a positive number",
            non_negative: "a number >= 0", fraction: "a probability in [0, 1]", switch: "true or false"}


def setting(test: Optional[Callable[[Any], bool]] = None, expected: str = "", *, training: bool = False,
            choices: tuple = ()) -> Any:
    """A schema field, without a default (the YAML in configs/ holds every value). test / expected: the
    rule a value must meet and how the error line states it; choices: the allowed values (rule and
    wording both); training: checked for training runs only."""
    if choices:
        test, expected = one_of(*choices), " | ".join(choices)
    expected = expected or _WORDING.get(test, "")
    return field(default=MISSING, metadata={"test": test, "expected": expected, "training": training})


@dataclass
class ModelConfig:
    name: str = setting(lambda v: isinstance(v, str) and bool(v), "a timm model name such as lion_s_small")
    attn_form: str = setting(choices=tuple(FORM_CHOICES))
    attn_backend: str = setting(choices=tuple(BACKENDS))
    chunk_size: Optional[int] = setting(optional(positive_int), "null or a positive integer")
    patch_size: Optional[int] = setting(optional(positive_int),
                                        "a positive integer that divides img_size (null for timm models without "
                                        "patches)")
    drop_path_rate: float = setting(lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1) (stochastic depth)",
                                    training=True)
    kwargs: Dict[str, Any] = setting()  # more timm.create_model arguments
    init_from: Optional[str] = MISSING  # a softmax ViT's weights to start from (lion_vit.init_from_vit)


@dataclass
class DataConfig:
    name: str = setting(choices=KINDS)
    root: Optional[str] = MISSING
    train_split: Optional[str] = MISSING
    val_split: Optional[str] = MISSING
    download: bool = setting(switch)
    mean: List[float] = MISSING
    std: List[float] = MISSING
    interpolation: str = MISSING
    crop_pct: float = setting(lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]")


@dataclass
class OptimConfig:
    opt: str = setting(_is_timm_optimizer, "a timm optimizer name such as adamw, sgd or lamb "
                       "(timm.optim.list_optimizers())", training=True)
    lr: float = setting(positive, "a finite positive number", training=True)
    lr_base_batch: Optional[int] = setting(optional(positive_int),
                                           "null (lr as is) or a positive integer", training=True)
    weight_decay: float = setting(non_negative, training=True)
    betas: List[float] = setting(lambda v: _is_pair(v, lambda x: _is_number(x) and 0 <= x < 1),
                                 "two numbers in [0, 1)", training=True)
    eps: float = setting(positive, training=True)
    sched: str = setting(choices=SCHEDULES, training=True)
    warmup_epochs: float = setting(non_negative, training=True)
    warmup_lr: float = setting(non_negative, training=True)
    min_lr: float = setting(non_negative, training=True)
    clip_grad: Optional[float] = setting(optional(positive),
                                         "null or a positive max norm", training=True)
    layer_decay: Optional[float] = setting(lambda v: v is None or (_is_number(v) and 0 < v <= 1),
                                           "null (off) or a number in (0, 1], e.g. 0.75 for fine-tuning",
                                           training=True)


@dataclass
class AugConfig:
    enabled: bool = setting(switch)
    auto_augment: Optional[str] = setting(
        _is_timm_auto_augment, "null (off) or a timm policy whose options are each a key and a number: "
        "rand-m9-mstd0.5-inc1 (RandAugment, DeiT's), augmix-m5-w3-d2, original, v0 or 3a", training=True)
    color_jitter: float = setting(non_negative, training=True)
    scale: List[float] = setting(lambda v: _is_pair(v, lambda x: _is_number(x) and 0 < x <= 1) and v[0] <= v[1],
                                 "[low, high] with 0 < low <= high <= 1 (RandomResizedCrop's area range)",
                                 training=True)
    hflip: float = setting(fraction, training=True)
    reprob: float = setting(fraction, training=True)
    remode: str = MISSING
    recount: int = MISSING
    mixup: float = setting(non_negative, "a number >= 0 (0: off)", training=True)
    cutmix: float = setting(non_negative, "a number >= 0 (0: off)", training=True)
    mixup_prob: float = setting(fraction, training=True)
    mixup_switch_prob: float = setting(fraction, training=True)
    mixup_mode: str = setting(choices=MIXUP_MODES, training=True)
    smoothing: float = setting(lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)", training=True)
    repeated_aug: int = setting(non_negative_int, "an integer >= 0 (0 or 1: off)", training=True)


@dataclass
class DistillConfig:
    type: str = setting(choices=DISTILL_TYPES)
    teacher: Optional[str] = MISSING  # a timm model name
    teacher_checkpoint: Optional[str] = MISSING  # a train.py checkpoint, or the teacher's state dict
    alpha: float = setting(fraction, "a number in [0, 1] (the distillation loss's share)", training=True)
    tau: float = setting(positive, "a positive number (the soft distillation's "
                         "temperature)", training=True)


@dataclass
class EmaConfig:
    enabled: bool = setting(switch)
    decay: float = setting(lambda v: _is_number(v) and 0 < v < 1, "a number between 0 and 1")
    eval_ema: bool = setting(switch)


@dataclass
class WandbConfig:
    mode: str = setting(choices=WANDB_MODES)
    project: str = MISSING
    entity: Optional[str] = MISSING
    name: Optional[str] = MISSING
    group: Optional[str] = MISSING
    tags: List[str] = setting()


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class RunConfig:
    """configs/config.yaml and its groups."""
    img_size: int = setting(positive_int)
    epochs: int = setting(positive_int, training=True)
    batch_size: int = setting(positive_int)
    grad_accum_steps: int = setting(positive_int, "a positive integer (1: no accumulation)")
    seed: int = setting(non_negative_int)
    device: str = setting(choices=DEVICES)
    num_workers: int = setting(non_negative_int)
    output_dir: str = MISSING
    resume: Optional[str] = MISSING
    eval_only: bool = setting(switch)
    checkpoint: Optional[str] = MISSING
    amp: bool = setting(switch)
    amp_dtype: str = setting(choices=AMP_DTYPES)
    compile: bool = setting(switch)
    tf32: bool = setting(switch)
    cpu_keep_freed_memory: bool = setting(switch)
    progress: bool = setting(switch)
    log_interval: int = setting(non_negative_int, "an integer >= 0 (0: no progress lines)")
    ema: EmaConfig = field(default_factory=EmaConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    aug: AugConfig = field(default_factory=AugConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def _not_allowed(name: str, value: Any, expected: str) -> UserError:
    return UserError(f"{name}={value} is not allowed; set {name} to {expected}")


def _fields(schema: type, prefix: str = ""):
    """(dotted name, field) for every leaf setting of a schema dataclass."""
    types = typing.get_type_hints(schema)  # (the annotations are strings: from __future__ import annotations)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(types[f.name]):
            yield from _fields(types[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


_ABSENT = object()


def check_settings(cfg: DictConfig) -> None:
    """One clear line for a setting of the wrong type, out of range, unknown, or a switch that is not
    true/false, before any data or model is built (torch, timm and the DataLoader would otherwise fail
    deep inside with their own assertion, or take the value silently). Settings a config does not
    have are left to the code that reads them; training-only rules are skipped with eval_only=true."""
    rules = dict(_fields(RunConfig))
    try:
        OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    except ValidationError as error:
        name = re.sub(r"\[\d+\]$", "", str(error.full_key))
        value = OmegaConf.select(cfg, name, default=None)
        expected = rules[name].metadata.get("expected") if name in rules else ""
        raise _not_allowed(name, value, expected or _type_name(str(rules[name].type) if name in rules else "")) \
            from None
    except ConfigKeyError as error:
        raise UserError(f"{error.full_key} is not a setting of train.py; see configs/ for the settings "
                        f"(model.kwargs takes any timm.create_model argument)") from None
    training = cfg.eval_only is not True
    for name, f in rules.items():
        test = f.metadata.get("test")
        value = OmegaConf.select(cfg, name, default=_ABSENT)
        if test is None or value is _ABSENT or (f.metadata["training"] and not training):
            continue
        if not test(value):
            raise _not_allowed(name, value, f.metadata["expected"])
    if training:
        _check_related(cfg)


def _type_name(annotation: str) -> str:
    """How an error names a field's type: `Optional[int]` -> "null or an integer"."""
    optional = annotation.startswith("Optional[")
    kind = annotation.removeprefix("Optional[").removesuffix("]") if optional else annotation
    name = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}.get(kind, kind)
    return f"null or {name}" if optional else name or "a value of its type"


def _check_related(cfg: DictConfig) -> None:
    """The rules that relate two settings."""
    if cfg.aug.mixup > 0 or cfg.aug.cutmix > 0:  # timm's Mixup asserts on an odd batch, deep in the first step
        if cfg.batch_size % 2:
            raise _not_allowed("batch_size", cfg.batch_size,
                               "an even number while mixup or cutmix is on (timm's Mixup mixes each image with its "
                               "mirror in the batch), or turn them off with aug.mixup=0 aug.cutmix=0")
    distill = OmegaConf.select(cfg, "distill")
    if distill is not None and distill.type != "none" and not (distill.teacher or distill.teacher_checkpoint):
        raise UserError(f"distill.type={distill.type} needs a teacher: set distill.teacher=<timm model name> or "
                        f"distill.teacher_checkpoint=<path>")
