"""The settings of train.py as Hydra structured configs: every setting's type and allowed values.

The values live in configs/ (YAML, grouped by concern) and only there: these dataclasses hold no defaults.
`check_settings(cfg)` turns a bad value into one line naming the setting and what it must be, before any
data or model is built (Hydra's own schema check ends in a multi-line report); `composition_error` does the
same for Hydra's errors while it composes the config from the command line.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import omegaconf
import torch
import yaml
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, InterpolationResolutionError, ValidationError
from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform
from timm.optim import get_optimizer_info, list_optimizers
from timm.scheduler import create_scheduler_v2

from ..data.build import DECODES, KINDS
from ..errors import UserError, first_line
from ..ops import BACKENDS, FORM_CHOICES, Tuning
from ..ops.tuning import THRESHOLD_KNOBS
from ..weights import is_url

# ${pid:} in the default output_dir: runs started in the same second get folders of their own (omegaconf 2.4
# deprecates register_new_resolver for register_resolver, in 2.3 the name of its legacy API)
_OMEGACONF_2_4 = tuple(map(int, re.match(r"(\d+)\.(\d+)", omegaconf.__version__).groups())) >= (2, 4)
(OmegaConf.register_resolver if _OMEGACONF_2_4 else OmegaConf.register_new_resolver)("pid", os.getpid, replace=True)

DEVICES = ("auto", "cpu", "cuda")
AMP_DTYPES = ("bfloat16", "float16")
WANDB_MODES = ("online", "offline", "disabled")


def _timm_schedules(names: Tuple[str, ...]) -> Tuple[str, ...]:
    """Those of `names` that the installed timm builds: timm < 1.0.31 has no constant, wsd or rsqrt, and
    returned no scheduler for them instead of an error."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    built = []
    for name in names:
        try:
            if create_scheduler_v2(optimizer, sched=name, num_epochs=10, warmup_epochs=1)[0] is not None:
                built.append(name)
        except ValueError:  # (timm 1.0.31 names an unknown schedule)
            pass
    return tuple(built)


# timm's schedules that step per update (plateau needs a validation metric each epoch)
SCHEDULES = _timm_schedules(("cosine", "tanh", "step", "multistep", "poly", "constant", "wsd", "rsqrt"))
MIXUP_MODES = ("batch", "pair", "elem")
DISTILL_TYPES = ("none", "soft", "hard")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float (inf and nan are never a setting's value)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_numbers(value: Any, test: Callable[[Any], bool]) -> bool:
    return isinstance(value, (list, tuple, ListConfig)) and len(value) > 0 and all(test(x) for x in value)


def _is_pair(value: Any, test: Callable[[Any], bool]) -> bool:
    return isinstance(value, (list, tuple, ListConfig)) and len(value) == 2 and all(test(x) for x in value)


INTERPOLATIONS = ("bicubic", "bilinear", "nearest", "lanczos", "box", "hamming")  # timm's transforms' names

# A rule is a test of a value and how an error line states it: the wording lives with the test.
Rule = Tuple[Callable[[Any], bool], str]
POSITIVE_INT: Rule = (lambda v: _is_int(v) and v > 0, "a positive integer")
NON_NEGATIVE_INT: Rule = (lambda v: _is_int(v) and v >= 0, "an integer >= 0")
POSITIVE: Rule = (lambda v: _is_number(v) and v > 0, "a positive number")
NON_NEGATIVE: Rule = (lambda v: _is_number(v) and v >= 0, "a number >= 0")
FRACTION: Rule = (lambda v: _is_number(v) and 0 <= v <= 1, "a probability in [0, 1]")
# OmegaConf would take yes/on and ture-like strings for a bool; `compile=ture` must not pass
SWITCH: Rule = (lambda v: isinstance(v, bool), "true or false")


def optional(rule: Rule) -> Rule:
    return (lambda v: v is None or rule[0](v)), f"null or {rule[1]}"


def _is_non_blank(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _non_blank(what: str) -> Rule:
    """A string that is not blank: an unset shell variable (resume=$CKPT) leaves an empty one, which would mean
    something else (no resume, data.root itself as the split) without a word."""
    return _is_non_blank, f"{what} (not empty, as an unset shell variable leaves it)"


# a run continues from its files, not a download (checkpoint=, model.init_from=, distill.teacher_checkpoint= read URLs)
_RESUMABLE: Rule = (lambda v: _is_non_blank(v) and not is_url(v), "auto or a checkpoint file's path (not empty, as "
                    "an unset shell variable leaves it, nor a URL: download it first)")


def _timm_optimizer(value: Any) -> str:
    """The timm optimizer an optim.opt names: any case, optionally with its lookahead_ prefix."""
    return str(value).lower().removeprefix("lookahead_")


def _is_timm_optimizer(value: Any) -> bool:
    """A name timm's create_optimizer_v2 takes."""
    return _timm_optimizer(value) in list_optimizers()


_AUGMENT_OPTION = re.compile(r"[a-z]+\d[\d.]*")  # a letter key and its number: m9, mstd0.5, inc1


def _is_timm_auto_augment(value: Any) -> bool:
    """null / '' (off), or a policy timm builds with every option read: its parsers assert deep inside
    create_transform, and skip an option without a number (rand-mfoo: the default magnitude)."""
    if not isinstance(value, str) or not value:
        return value in (None, "")
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


def setting(rule: Optional[Rule] = None, expected: str = "", *, choices: tuple = (), training: bool = False) -> Any:
    """A schema field without a default (configs/ holds the values) and the rule its value must meet: a Rule,
    a test with `expected`, or `choices`; training=True: checked for training runs only."""
    test, wording = (rule, "") if callable(rule) else rule or (None, "")
    if choices:
        test, wording = (lambda v: v in choices), " | ".join(choices)
    return field(default=MISSING, metadata={"test": test, "expected": expected or wording, "training": training})


def group(schema: type, training: bool = False) -> Any:
    """A config group; training=True: all of its rules are checked for training runs only."""
    return field(default_factory=schema, metadata={"training": training})


@dataclass
class ModelConfig:
    name: str = setting(lambda v: isinstance(v, str) and bool(v), "a timm model name such as lion_s_small")
    attn_form: str = setting(choices=tuple(FORM_CHOICES))
    attn_backend: str = setting(choices=tuple(BACKENDS))
    chunk_size: Optional[int] = setting(optional(POSITIVE_INT))
    patch_size: Optional[int] = setting(optional(POSITIVE_INT), "a positive integer that divides img_size (null for "
                                        "timm models without patches)")
    drop_path_rate: float = setting(lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1) (stochastic depth)",
                                    training=True)
    kwargs: Dict[str, Any] = setting()  # more timm.create_model arguments
    init_from: Optional[str] = MISSING  # a softmax ViT's weights to start from (lion_vit.init_from_vit)


@dataclass
class DataConfig:
    name: str = setting(choices=KINDS)
    root: Optional[str] = MISSING
    train_split: Optional[str] = setting(optional(_non_blank("a folder's name under data.root")))
    val_split: Optional[str] = setting(optional(_non_blank("a folder's name under data.root")))
    download: bool = setting(SWITCH)
    # (one per channel of the RGB images: timm's loader would average a list of another length, with a warning)
    mean: List[float] = setting(lambda v: _is_numbers(v, _is_number) and len(v) == 3,
                                "a list of 3 numbers, one per channel (RGB)")
    std: List[float] = setting(lambda v: _is_numbers(v, lambda x: _is_number(x) and x > 0) and len(v) == 3,
                               "a list of 3 positive numbers, one per channel (RGB)")
    interpolation: str = setting(choices=INTERPOLATIONS)
    crop_pct: float = setting(lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]")
    decode: str = setting(choices=DECODES)


@dataclass
class OptimConfig:
    opt: str = setting(_is_timm_optimizer, "a timm optimizer name such as adamw, sgd or lamb "
                       "(timm.optim.list_optimizers())")
    lr: float = setting(POSITIVE, "a finite positive number")
    lr_base_batch: Optional[int] = setting(optional(POSITIVE_INT), "null (lr as is) or a positive integer")
    weight_decay: float = setting(NON_NEGATIVE)
    betas: Optional[List[float]] = setting(
        lambda v: v is None or (_is_numbers(v, lambda x: _is_number(x) and 0 <= x < 1) and len(v) in (2, 3)),
        "null (the optimizer's own) or two numbers in [0, 1), three for adan")
    eps: float = setting(POSITIVE)
    sched: str = setting(choices=SCHEDULES)
    decay_epochs: Optional[float] = setting(optional(POSITIVE), "null (timm's default) or a positive number")
    decay_milestones: List[float] = setting(
        lambda v: _is_numbers(v, lambda x: _is_number(x) and x > 0) and list(v) == sorted(v),
        "a list of positive epochs in increasing order, e.g. [30,60,90]")
    decay_rate: float = setting(POSITIVE)
    warmup_epochs: float = setting(NON_NEGATIVE)
    warmup_lr: float = setting(NON_NEGATIVE)
    min_lr: float = setting(NON_NEGATIVE)
    clip_grad: Optional[float] = setting(optional(POSITIVE), "null or a positive max norm")
    layer_decay: Optional[float] = setting(lambda v: v is None or (_is_number(v) and 0 < v <= 1),
                                           "null (off) or a number in (0, 1], e.g. 0.75 for fine-tuning")


@dataclass
class AugConfig:
    enabled: bool = setting(SWITCH)
    auto_augment: Optional[str] = setting(
        _is_timm_auto_augment, "null (off) or a timm policy whose options are each a key and a number: "
        "rand-m9-mstd0.5-inc1 (RandAugment, DeiT's), augmix-m5-w3-d2, original, v0 or 3a")
    color_jitter: float = setting(NON_NEGATIVE)
    scale: List[float] = setting(lambda v: _is_pair(v, lambda x: _is_number(x) and 0 < x <= 1) and v[0] <= v[1],
                                 "[low, high] with 0 < low <= high <= 1 (RandomResizedCrop's area range)")
    hflip: float = setting(FRACTION)
    reprob: float = setting(FRACTION)
    remode: str = setting(choices=("pixel", "rand", "const"))  # timm's RandomErasing: per-pixel, per-channel or 0
    recount: int = setting(POSITIVE_INT, "a positive integer (erasings per image, at most)")
    mixup: float = setting(NON_NEGATIVE, "a number >= 0 (0: off)")
    cutmix: float = setting(NON_NEGATIVE, "a number >= 0 (0: off)")
    mixup_prob: float = setting(FRACTION)
    mixup_switch_prob: float = setting(FRACTION)
    mixup_mode: str = setting(choices=MIXUP_MODES)
    smoothing: float = setting(lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)")
    repeated_aug: int = setting(NON_NEGATIVE_INT, "an integer >= 0 (0 or 1: off)")


@dataclass
class DistillConfig:
    type: str = setting(choices=DISTILL_TYPES)
    teacher: Optional[str] = MISSING  # a timm model name
    teacher_checkpoint: Optional[str] = MISSING  # a train.py checkpoint, or the teacher's state dict
    alpha: float = setting(FRACTION, "a number in [0, 1] (the distillation loss's share)")
    tau: float = setting(POSITIVE, "a positive number (the soft distillation's temperature)")


@dataclass
class EmaConfig:
    enabled: bool = setting(SWITCH)
    decay: float = setting(lambda v: _is_number(v) and 0 < v < 1, "a number between 0 and 1")
    eval_ema: bool = setting(SWITCH)


@dataclass
class WandbConfig:
    mode: str = setting(lambda v: v in WANDB_MODES, " | ".join(WANDB_MODES) + " (its default is the environment's "
                        "WANDB_MODE, else offline)")
    project: str = MISSING
    entity: Optional[str] = MISSING
    name: Optional[str] = MISSING
    group: Optional[str] = MISSING
    tags: List[str] = setting()


@dataclass
class LoggerConfig:
    wandb: WandbConfig = group(WandbConfig)


# The ops' tuning knobs (lion_vit.ops.Tuning): one setting each, null for the code's default. Tuning checks
# the values (check_settings names the setting); the thresholds of form auto (THRESHOLD_KNOBS) take
# {training: n, inference: n}, for one and two scans alike, where Tuning keys them by (training, scans).
TuningConfig = dataclasses.make_dataclass(
    "TuningConfig", [(f.name, Any, field(default=MISSING)) for f in dataclasses.fields(Tuning)])
CHUNK_MODES = {True: "training", False: "inference"}  # the settings' names of its (training, scans) keys' flag


def tuning_changes(tuning: Any) -> Dict[str, Any]:
    """The tuning settings (a mapping) that are not null, as lion_vit.ops.tuned takes them; ValueError for a
    threshold of form auto that is not {training: n, inference: n} (either or both)."""
    settings = OmegaConf.to_container(tuning) if isinstance(tuning, DictConfig) else dict(tuning)
    changes = {name: value for name, value in settings.items() if value is not None}
    for name in [name for name in THRESHOLD_KNOBS if name in changes]:
        modes = changes[name]
        if not isinstance(modes, dict) or not modes or not set(modes) <= set(CHUNK_MODES.values()) or \
                not all(POSITIVE_INT[0](tokens) for tokens in modes.values()):
            raise ValueError(f"{name} must map training and / or inference to a positive number of "
                             f"tokens, e.g. {{training: 2048}}; got {modes!r}")
        changes[name] = {(training, scans): modes.get(CHUNK_MODES[training], tokens)
                         for (training, scans), tokens in getattr(Tuning(), name).items()}
    return changes


def _check_tuning(tuning: DictConfig) -> None:
    """Each tuning setting as Tuning checks it: one line naming the first it refuses."""
    for name, value in OmegaConf.to_container(tuning).items():
        try:
            dataclasses.replace(Tuning(), **tuning_changes({name: value}))
        except ValueError as error:
            raise UserError(f"tuning.{name}={value} is not allowed: {first_line(error)}") from None


@dataclass
class RunConfig:
    """configs/config.yaml and its groups."""
    img_size: Any = setting(lambda v: POSITIVE_INT[0](v) or _is_pair(v, POSITIVE_INT[0]),
                            "a positive integer (a square's side) or [height,width] of positive integers")
    epochs: int = setting(POSITIVE_INT, training=True)
    batch_size: int = setting(POSITIVE_INT)
    grad_accum_steps: int = setting(POSITIVE_INT, "a positive integer (1: no accumulation)")
    seed: int = setting(NON_NEGATIVE_INT)
    device: str = setting(choices=DEVICES)
    num_workers: Any = setting(lambda v: v == "auto" or (_is_int(v) and v >= 0),
                               "auto (the cores this process may use) or an integer >= 0")
    prefetch_factor: int = setting(POSITIVE_INT)
    output_dir: str = setting(_is_non_blank,
                              "a folder (empty, as an unset shell variable leaves it, would write the run into the "
                              "current folder); leave it out for a new folder under outputs/")
    resume: Optional[str] = setting(optional(_RESUMABLE))
    eval_only: bool = setting(SWITCH)
    checkpoint: Optional[str] = setting(optional(_non_blank("a checkpoint's path or URL")))
    amp: bool = setting(SWITCH)
    amp_dtype: str = setting(choices=AMP_DTYPES)
    compile: bool = setting(SWITCH)
    grad_checkpointing: bool = setting(SWITCH, training=True)
    tf32: bool = setting(SWITCH)
    cpu_keep_freed_memory: bool = setting(SWITCH)
    progress: bool = setting(SWITCH)
    log_interval: int = setting(NON_NEGATIVE_INT, "an integer >= 0 (0: no progress lines)")
    ema: EmaConfig = group(EmaConfig)
    model: ModelConfig = group(ModelConfig)
    data: DataConfig = group(DataConfig)
    optim: OptimConfig = group(OptimConfig, training=True)
    aug: AugConfig = group(AugConfig, training=True)
    distill: DistillConfig = group(DistillConfig, training=True)
    logger: LoggerConfig = group(LoggerConfig)
    tuning: TuningConfig = group(TuningConfig)


Size = Union[int, Tuple[int, int]]


def image_size(value: Any) -> Size:
    """img_size as torch, timm and eval.json take it: an integer for a square, else (height, width)."""
    if _is_int(value):
        return value
    height, width = (int(x) for x in value)
    return height if height == width else (height, width)


def size_text(size: Size) -> str:
    """How a line names a size: "224", "320x480" (height x width)."""
    return str(size) if _is_int(size) else f"{size[0]}x{size[1]}"


def _not_allowed(name: str, value: Any, expected: str) -> UserError:
    return UserError(f"{name}={value} is not allowed; set {name} to {expected}")


def _fields(schema: type, prefix: str = "", training: bool = False):
    """(dotted name, rule, training only) for every leaf setting of a schema dataclass."""
    types = typing.get_type_hints(schema)  # (the annotations are strings: from __future__ import annotations)
    for f in dataclasses.fields(schema):
        only_training = training or f.metadata.get("training", False)
        if dataclasses.is_dataclass(types[f.name]):
            yield from _fields(types[f.name], f"{prefix}{f.name}.", only_training)
        else:
            yield f"{prefix}{f.name}", f, only_training


_ABSENT = object()


def check_settings(cfg: DictConfig) -> None:
    """One clear line for a setting that is unknown, of the wrong type or out of range (torch, timm and the
    DataLoader would fail deep inside, or take it silently). Training-only rules are skipped with eval_only."""
    rules = {name: (f, training_only) for name, f, training_only in _fields(RunConfig)}
    try:
        OmegaConf.to_container(cfg, resolve=True)  # every ${...} in the settings
    except InterpolationResolutionError as error:
        raise UserError(f"{error.full_key} cannot be resolved ({first_line(error)}); correct its ${{...}}") from None
    try:
        OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    except ValidationError as error:
        name = re.sub(r"\[\d+\]$", "", str(error.full_key))
        f = rules[name][0] if name in rules else None
        expected = f.metadata.get("expected") if f else ""
        raise _not_allowed(name, OmegaConf.select(cfg, name, default=None),
                           expected or _type_name(str(f.type) if f else "")) from None
    except ConfigKeyError as error:
        raise unknown_setting(str(error.full_key)) from None
    training = cfg.eval_only is not True
    for name, (f, training_only) in rules.items():
        value = OmegaConf.select(cfg, name, default=_ABSENT)
        if value is not _ABSENT and (training or not training_only):
            _check_rule(name, f, value)
    _check_tuning(cfg.tuning)
    if cfg.data.name == "digits" and cfg.data.root:  # (the digits ship with scikit-learn)
        raise UserError(f"data.root={cfg.data.root} is not read by data=digits, which scikit-learn ships; to read "
                        f"that folder add data=imagefolder (or data=imagenet, data=cifar10, data=cifar100)")
    if training:
        _check_related(cfg)


def check_setting(name: str, value: Any) -> None:
    """One setting's rule, for a value train.py reads before Hydra composes the config (with -m, Hydra makes
    output_dir the sweep's folder before any job runs check_settings)."""
    _check_rule(name, next(f for field_name, f, _ in _fields(RunConfig) if field_name == name), value)


def _check_rule(name: str, f: dataclasses.Field, value: Any) -> None:
    test = f.metadata.get("test")
    if test is not None and not test(value):
        raise _not_allowed(name, value, f.metadata["expected"])


def unknown_setting(name: str) -> UserError:
    """A setting train.py does not have, with the nearest names it has (a typo is the usual cause)."""
    if name.partition(".")[0] == "experiment":  # (an experiment file's keys, where it lacks its package line)
        return UserError(f"{name} is not a setting of train.py: an experiment file sets the run's settings only when "
                         f"its first line is '# @package _global_', as in configs/experiment/")
    near = difflib.get_close_matches(name, [known for known, _, _ in _fields(RunConfig)], n=3, cutoff=0.7)
    guess = f"; did you mean {' or '.join(near)}?" if near else ""
    return UserError(f"{name} is not a setting of train.py{guess} (see configs/ for the settings; model.kwargs "
                     f"takes any timm.create_model argument)")


def composition_error(error: Exception) -> str:
    """One line for Hydra's error while it composes the config from the command line, before train.py runs:
    a setting the config lacks, a config group option that configs/ lacks, an override it cannot parse, a config
    file that is not YAML, its own flags combined as they cannot be. (Hydra prints these over several lines, ending
    in advice on stack traces; for an unknown setting it suggests appending it with +, which the settings check
    then refuses.)"""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:  # a config file's syntax
        mark = error.problem_mark
        what = "; ".join(part for part in (error.context, error.problem) if part)
        return f"cannot read the config file {mark.name}: {what} (line {mark.line + 1}, column {mark.column + 1}); " \
               f"fix its YAML"
    if isinstance(error, ValueError) and str(error).startswith("Only one of --run, --multirun, --cfg"):
        return f"{error}: choose one of -m (a sweep), --cfg (a run's settings) and --info; --cfg job prints a " \
               f"sweep job's settings from the job's command (without -m, one value of each swept setting)"
    cause = error.__cause__
    name = str(getattr(cause, "full_key", None) or "")
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and name and not name.startswith("hydra."):
        if name.startswith("model.kwargs."):  # free keys: timm.create_model's arguments
            return f"{name} is not in the config yet; add it with +{name}=<value>"
        return str(unknown_setting(name))
    missing, options = getattr(error, "missing_cfg_file", None), getattr(error, "options", None)
    if missing and options:  # group=option, where configs/<group>/ has no <option>.yaml
        group, _, option = missing.rpartition("/")
        line = f"there is no config {group}={option}; the choices for {group} are {', '.join(options)}"
        for folder in re.findall(r"path=file://(\S+)", str(error)):  # (Hydra's search path: configs/, --config-dir)
            if os.path.isfile(os.path.join(folder, f"{option}.yaml")):  # (a group's options are in its own folder)
                return f"{line}; Hydra reads {group} configs from a folder named {group}: move " \
                       f"{os.path.join(folder, option)}.yaml to {os.path.join(folder, group, option)}.yaml"
        return line
    appended = re.match(r"Multiple values for (\S+)\. To override a value use 'override \1: (\S+)'", str(error))
    if appended:  # +group=option (Hydra's idiom for a group its defaults leave out) where the defaults have it
        group, option = appended.groups()
        return f"+{group}={option} appends a config group that the config already has; choose it without the +: " \
               f"{group}={option}"
    twice = re.match(r"(\S+) appears more than once in the final defaults list", str(error))
    if twice:  # group=a +group=b
        group = twice.group(1)
        return f"the config group {group} is chosen twice; choose it once, without a +: {group}=<option>"
    text = str(error).split("Config search path:")[0]  # (a missing config's report ends with where it looked)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if cause is not None:
        lines.append(first_line(cause))
    override = getattr(error, "override", None)  # an override Hydra's grammar cannot read
    if override:
        lines.insert(0, f"cannot read the override {override}")
        if "~" in str(override).partition("=")[2]:  # (Hydra's grammar has no ~; zsh leaves it unexpanded after =)
            lines.append("for a path in your home folder write $HOME/..., which the shell expands")
    return "; ".join(lines)


def _type_name(annotation: str) -> str:
    """How an error names a field's type: `Optional[int]` -> "null or an integer"."""
    optional = annotation.startswith("Optional[")
    kind = annotation.removeprefix("Optional[").removesuffix("]") if optional else annotation
    name = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}.get(kind, kind)
    return f"null or {name}" if optional else name or "a value of its type"


def _check_related(cfg: DictConfig) -> None:
    """The rules that relate two settings (of a training run)."""
    if cfg.checkpoint:  # read by evaluation alone: a training run would start from fresh weights without a word
        raise UserError(f"checkpoint={cfg.checkpoint} is read only with eval_only=true; to train from its weights "
                        f"pass model.init_from=<path>, to continue its run resume=<path>")
    if (cfg.aug.mixup > 0 or cfg.aug.cutmix > 0) and cfg.batch_size % 2:  # timm's Mixup asserts, deep in a step
        raise _not_allowed("batch_size", cfg.batch_size, "an even number while mixup or cutmix is on (timm's Mixup "
                           "mixes each image with its mirror), or turn them off with aug.mixup=0 aug.cutmix=0")
    optim = cfg.optim
    info = get_optimizer_info(_timm_optimizer(optim.opt))
    if info.second_order:  # (timm's AdaHessian: its step fails on gradients that have no graph)
        raise UserError(f"optim.opt={optim.opt} is a second-order optimizer, which train.py does not run (its "
                        f"backward keeps no graph of the gradients); choose a first-order one, such as adamw")
    if optim.betas is not None:  # (timm passes them as they are, a wrong count to fail in the optimizer)
        betas = list(optim.betas)
        if not info.has_betas:  # (timm drops them without a word)
            raise UserError(f"optim.betas={betas} is not read by optim.opt={optim.opt}, which takes no betas; set "
                            f"optim.betas=null")
        if len(betas) != info.num_betas:
            raise _not_allowed("optim.betas", betas, f"{info.num_betas} numbers for optim.opt={optim.opt}, or null "
                               f"for its own")
    if optim.sched in ("wsd", "rsqrt"):  # timm raises ValueError as it builds the schedule, after the data
        length = cfg.epochs - optim.warmup_epochs  # (their warm-up is a prefix within epochs)
        if length <= 0:
            raise UserError(f"optim.sched={optim.sched} needs epochs above optim.warmup_epochs (here {cfg.epochs} "
                            f"and {optim.warmup_epochs}); lower optim.warmup_epochs")
        if optim.sched == "rsqrt" and not optim.warmup_epochs:  # (its time scale is the warm-up's length)
            raise UserError("optim.sched=rsqrt needs a warm-up, whose length is its time scale: set "
                            "optim.warmup_epochs=<a positive number>")
        if optim.decay_epochs is not None and length < optim.decay_epochs >= 1:  # (below 1: a fraction)
            raise UserError(f"optim.decay_epochs={optim.decay_epochs} is longer than the {optim.sched} schedule after "
                            f"warm-up ({length:g} epochs); set it to at most {length:g}, or to a fraction below 1")
    distill = OmegaConf.select(cfg, "distill")
    if distill is not None and distill.type != "none" and not (distill.teacher or distill.teacher_checkpoint):
        raise UserError(f"distill.type={distill.type} needs a teacher: set distill.teacher=<timm model name> or "
                        f"distill.teacher_checkpoint=<path>")
