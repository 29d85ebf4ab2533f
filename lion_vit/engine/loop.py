"""One training epoch and one evaluation pass, device- and precision-agnostic."""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
from timm.utils import accuracy
from torch import nn
from tqdm import tqdm

from .distributed import all_reduce_sum


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite."""


@dataclass
class Precision:
    """Autocast settings: bf16 (or fp16 with a grad scaler) on CUDA, full precision elsewhere."""
    device: torch.device
    dtype: Optional[torch.dtype] = None  # None = autocast off

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


def scheduled_lr(optimizer: torch.optim.Optimizer) -> float:
    """The schedule's current lr: the largest over parameter groups (with optim.layer_decay the head's,
    whose lr_scale is 1; the first group would be the patch embedding's, scaled down the most)."""
    return max(group["lr"] for group in optimizer.param_groups)


def train_one_epoch(model: nn.Module, loader, optimizer: torch.optim.Optimizer, criterion: Callable,
                    scheduler, epoch: int, device: torch.device, precision: Precision,
                    scaler: Optional[torch.amp.GradScaler] = None, mixup_fn: Optional[Callable] = None,
                    ema=None, clip_grad: Optional[float] = None, show_progress: bool = True) -> Dict[str, float]:
    """Returns the epoch's mean loss (over all ranks), last lr, images seen (all ranks) and time."""
    model.train()
    updates_per_epoch = len(loader)
    total_loss, seen = 0.0, 0
    start = time.perf_counter()
    bar = tqdm(loader, desc=f"train {epoch}", disable=not show_progress, leave=False, dynamic_ncols=True)
    for step, (images, targets) in enumerate(bar):
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if mixup_fn is not None:
            images, targets = mixup_fn(images, targets)
        with precision.autocast():
            loss = criterion(model(images), targets)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise NonFiniteLoss(f"loss is {loss_value} at epoch {epoch}, step {step}")
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            if clip_grad:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if clip_grad:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
            optimizer.step()
        if ema is not None:
            ema.update(model, step=epoch * updates_per_epoch + step)
        scheduler.step_update(num_updates=epoch * updates_per_epoch + step + 1)
        total_loss += loss_value * images.shape[0]
        seen += images.shape[0]
        bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{scheduled_lr(optimizer):.2e}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    total_loss, seen = all_reduce_sum([total_loss, seen], device)
    return {"train_loss": total_loss / max(seen, 1), "lr": scheduled_lr(optimizer),
            "images": seen, "epoch_time_s": elapsed, "imgs_per_s": seen / elapsed}


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, precision: Precision,
             show_progress: bool = True) -> Dict[str, float]:
    """Top-1 / top-5 accuracy (%) and mean cross-entropy, summed exactly over all ranks."""
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    loss_sum, correct1, correct5, count = 0.0, 0.0, 0.0, 0
    for images, targets in tqdm(loader, desc="eval", disable=not show_progress, leave=False, dynamic_ncols=True):
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with precision.autocast():
            logits = model(images)
        logits = logits.float()
        loss_sum += criterion(logits, targets).item()
        top1, top5 = accuracy(logits, targets, topk=(1, min(5, logits.shape[-1])))
        correct1 += top1.item() * targets.shape[0] / 100.0
        correct5 += top5.item() * targets.shape[0] / 100.0
        count += targets.shape[0]
    loss_sum, correct1, correct5, count = all_reduce_sum([loss_sum, correct1, correct5, count], device)
    count = max(count, 1)
    return {"loss": loss_sum / count, "acc1": 100.0 * correct1 / count, "acc5": 100.0 * correct5 / count,
            "num_images": int(round(count))}
