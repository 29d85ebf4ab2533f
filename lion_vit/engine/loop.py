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
from .interrupts import raise_if_requested


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


def updates_per_epoch(num_batches: int, grad_accum_steps: int) -> int:
    """Optimizer steps in an epoch of num_batches batches: one per grad_accum_steps batches (the last
    step of an epoch may take fewer)."""
    return -(-num_batches // grad_accum_steps)


def train_one_epoch(model: nn.Module, loader, optimizer: torch.optim.Optimizer, criterion: Callable,
                    scheduler, epoch: int, device: torch.device, precision: Precision,
                    scaler: Optional[torch.amp.GradScaler] = None, mixup_fn: Optional[Callable] = None,
                    ema=None, clip_grad: Optional[float] = None, show_progress: bool = True,
                    grad_accum_steps: int = 1) -> Dict[str, float]:
    """Returns the epoch's mean loss (over all ranks), last lr, images seen (all ranks) and time.

    With grad_accum_steps > 1 the gradients of that many batches are averaged before each optimizer
    step (as one batch that many times larger; DDP synchronises only the last of them).
    """
    model.train()
    num_batches = len(loader)
    updates = updates_per_epoch(num_batches, grad_accum_steps)
    total_loss, seen = 0.0, 0
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    bar = tqdm(loader, desc=f"train {epoch}", disable=not show_progress, leave=False, dynamic_ncols=True)
    for step, (images, targets) in enumerate(bar):
        raise_if_requested(agree_on=device)  # every rank takes every step: they stop before the same one
        update, micro_step = divmod(step, grad_accum_steps)
        group = min(grad_accum_steps, num_batches - update * grad_accum_steps)  # batches in this update
        steps_now = micro_step == group - 1
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if mixup_fn is not None:
            images, targets = mixup_fn(images, targets)
        no_sync = getattr(model, "no_sync", None)  # DDP: all-reduce only with the update's last batch
        with contextlib.nullcontext() if steps_now or no_sync is None else no_sync():
            with precision.autocast():
                loss = criterion(model(images), targets)
            loss_value = loss.item()
            if not math.isfinite(loss_value):
                raise NonFiniteLoss(f"loss is {loss_value} at epoch {epoch}, step {step}")
            if group > 1:
                loss = loss / group
            (loss if scaler is None else scaler.scale(loss)).backward()
        total_loss += loss_value * images.shape[0]
        seen += images.shape[0]
        if not steps_now:
            continue
        if clip_grad:
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update(model, step=epoch * updates + update)
        scheduler.step_update(num_updates=epoch * updates + update + 1)
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
        raise_if_requested()
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
