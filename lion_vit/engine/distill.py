"""DeiT's knowledge distillation: a frozen teacher and DeiT's DistillationLoss semantics.

    loss = (1 - alpha) * classification loss + alpha * distillation loss
    soft: KL(student / tau || teacher / tau) * tau^2, summed and divided by the logits' count (DeiT's)
    hard: cross-entropy with the teacher's argmax

A student with a distillation token (`*_distilled`, distilled=True) is trained with its class head on
the labels and its distillation head on the teacher; any other student distils through its one head.
The teacher sees the (mixed) batch at its own input size and normalisation. Kept beside timm's newer
timm.task distillation because that one divides the soft loss by the batch (DeiT: by the logits' count)
and does not resize the teacher's input.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Sequence, Tuple

import timm
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from timm.layers import to_2tuple
from torch import Tensor, nn

from ..errors import UserError, first_line
from ..hub import hub_or_cache
from ..weights import load_into, read_weights, state_dict_of
from .build import model_from_checkpoint, trained_architecture
from .config import Size, image_size, size_text

log = logging.getLogger("lion_vit")


class DistillationLoss(nn.Module):
    """criterion(images, outputs, targets) of DeiT's training loop; `parts` holds the last batch's
    classification and distillation losses (logged as train_loss_cls / train_loss_dist)."""

    def __init__(self, base_criterion: Callable, teacher: nn.Module, teacher_input: Callable[[Tensor], Tensor],
                 kind: str, alpha: float, tau: float) -> None:
        super().__init__()
        if kind not in ("soft", "hard"):
            raise ValueError(f"distillation type must be soft or hard, got {kind!r}")
        self.base_criterion, self.teacher, self.teacher_input = base_criterion, teacher, teacher_input
        self.kind, self.alpha, self.tau = kind, alpha, tau
        self.parts: Dict[str, Tensor] = {}

    def forward(self, images: Tensor, outputs: Any, targets: Tensor) -> Tensor:
        outputs_kd = None
        if not isinstance(outputs, Tensor):  # (class head, distillation head)
            outputs, outputs_kd = outputs
        base_loss = self.base_criterion(outputs, targets)
        if outputs_kd is None:
            outputs_kd = outputs
        with torch.no_grad():
            teacher_outputs = self.teacher(self.teacher_input(images)).float()
        outputs_kd = outputs_kd.float()
        if self.kind == "soft":
            t = self.tau
            distillation_loss = F.kl_div(F.log_softmax(outputs_kd / t, dim=1),
                                         F.log_softmax(teacher_outputs / t, dim=1),
                                         reduction="sum", log_target=True) * (t * t) / outputs_kd.numel()
        else:
            distillation_loss = F.cross_entropy(outputs_kd, teacher_outputs.argmax(dim=1))
        self.parts = {"loss_cls": base_loss.detach(), "loss_dist": distillation_loss.detach()}
        return base_loss * (1 - self.alpha) + distillation_loss * self.alpha

    def train(self, mode: bool = True) -> "DistillationLoss":
        super().train(mode)
        self.teacher.eval()  # the teacher stays in eval mode (batch norm statistics, dropout)
        return self


class TeacherInput(nn.Module):
    """The student's batch (normalised with its mean / std at its size) as the teacher expects it."""

    def __init__(self, student: Tuple[Size, Sequence[float], Sequence[float]],
                 teacher: Tuple[Size, Sequence[float], Sequence[float]], interpolation: str = "bicubic") -> None:
        super().__init__()
        (student_size, s_mean, s_std), (teacher_size, t_mean, t_std) = student, teacher
        self.student_size, self.teacher_size = to_2tuple(student_size), to_2tuple(teacher_size)
        self.same = self.student_size == self.teacher_size and list(s_mean) == list(t_mean) and \
            list(s_std) == list(t_std)
        self.interpolation = interpolation if interpolation in ("bilinear", "bicubic") else "bilinear"
        for name, values in (("s_mean", s_mean), ("s_std", s_std), ("t_mean", t_mean), ("t_std", t_std)):
            self.register_buffer(name, torch.tensor(list(values), dtype=torch.float32).view(1, -1, 1, 1),
                                 persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.same:
            return x
        x = x.float() * self.s_std + self.s_mean
        if self.teacher_size != self.student_size:
            x = F.interpolate(x, size=self.teacher_size, mode=self.interpolation, align_corners=False,
                              antialias=any(t < s for t, s in zip(self.teacher_size, self.student_size)))
        return (x - self.t_mean) / self.t_std


def build_distillation(cfg: DictConfig, base_criterion: Callable, num_classes: int, classes: Sequence[str],
                       device: torch.device) -> DistillationLoss:
    """The teacher of cfg.distill, frozen on device, and the loss that mixes it in."""
    teacher, (size, mean, std) = build_teacher(cfg.distill, num_classes, classes)
    teacher = teacher.to(device).eval().requires_grad_(False)
    to_teacher = TeacherInput((image_size(cfg.img_size), cfg.data.mean, cfg.data.std), (size, mean, std),
                              cfg.data.interpolation).to(device)
    log.info("distillation: %s from %s at %s px, alpha %s, tau %s", cfg.distill.type,
             cfg.distill.teacher_checkpoint or cfg.distill.teacher, size_text(size), cfg.distill.alpha, cfg.distill.tau)
    return DistillationLoss(base_criterion, teacher, to_teacher, cfg.distill.type, cfg.distill.alpha, cfg.distill.tau)


def build_teacher(distill: DictConfig, num_classes: int, classes: Sequence[str]
                  ) -> Tuple[nn.Module, Tuple[Size, Sequence[float], Sequence[float]]]:
    """The teacher and its input (size, mean, std): from a train.py checkpoint (its config gives all three), or
    a timm model with its pretrained_cfg (weights from distill.teacher_checkpoint's state dict, or the hub)."""
    path = distill.teacher_checkpoint
    if path:
        try:
            state = read_weights(path)  # (a path or a URL)
        except ValueError as error:
            raise UserError(f"distill.teacher_checkpoint {error}; pass the path to the teacher's weights") from None
        if isinstance(state.get("config"), dict):
            return _trained_teacher(state, path, distill, classes)
    name = distill.teacher
    if not name:
        raise UserError("distill.teacher_checkpoint holds no train.py config; also set distill.teacher=<timm model "
                        "name> for its architecture")
    if not timm.is_model(name):
        raise UserError(f"unknown teacher {name!r}; set distill.teacher to a timm model name such as regnety_160 "
                        f"(timm.list_models())")
    try:
        if path:
            teacher = timm.create_model(name, num_classes=num_classes)
            load_into(teacher, state_dict_of(state), "the file")
        else:
            with hub_or_cache():  # offline: the local cache or one error at once
                teacher = timm.create_model(name, pretrained=True)
    except (RuntimeError, OSError, ValueError) as error:
        source = path or "timm's pretrained weights (the hub)"
        hint = "" if path else " (without the hub, pass the teacher's weights: distill.teacher_checkpoint=<path>)"
        raise UserError(f"cannot load teacher {name} from {source}: {first_line(error)}{hint}") from None
    if teacher.num_classes != num_classes:
        raise UserError(f"teacher {name} predicts {teacher.num_classes} classes, the data has {num_classes}; use a "
                        f"teacher trained on these classes (distill.teacher_checkpoint=<its weights>)")
    config = teacher.pretrained_cfg
    return teacher, (image_size(config["input_size"][-2:]), config["mean"], config["std"])


def _trained_teacher(state: Dict[str, Any], path: str, distill: DictConfig, classes: Sequence[str]):
    config, name = state["config"], trained_architecture(state).get("name")
    if distill.teacher and distill.teacher != name:
        raise UserError(f"distill.teacher={distill.teacher}, but {path} holds a {name}; drop distill.teacher (the "
                        f"checkpoint names its model)")
    size = image_size(config["img_size"])
    teacher = model_from_checkpoint(state, {**config["model"], "drop_path_rate": 0.0}, size,
                                    list(classes), "the training data", f"distil with a teacher trained on these "
                                    f"classes ({path} was trained on others)", state["model"])
    return teacher, (size, config["data"]["mean"], config["data"]["std"])
