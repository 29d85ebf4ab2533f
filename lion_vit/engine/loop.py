"""One training epoch and one evaluation pass, device- and precision-agnostic."""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional

import torch
from timm.utils import NativeScaler, dispatch_clip_grad
from torch import nn
from tqdm import tqdm

from ..data.datasets import split_unreadable
from ..errors import UserError
from .distributed import all_reduce_sum, gather_to_main
from .interrupts import agreement, raise_if_agreed, raise_if_requested

log = logging.getLogger("lion_vit")
file_log = logging.getLogger("lion_vit.file")  # train.log only (train.py); details the console need not show


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


class Progress:
    """Progress through a loader: tqdm's bar on a terminal; elsewhere (a SLURM log, a pipe), where a bar's
    redraws would pile up, a line every `log_interval` steps as timm's train.py logs (0: none)."""

    def __init__(self, loader, desc: str, show: bool, log_interval: int) -> None:
        self.total, self.desc, self.log_interval = len(loader), desc, log_interval
        self.bar = tqdm(loader, desc=desc, leave=False, dynamic_ncols=True) if show and sys.stderr.isatty() else None
        self.lines = show and self.bar is None and log_interval > 0
        self.loader, self.start = loader, time.perf_counter()

    def __iter__(self) -> Iterator:
        return iter(self.bar if self.bar is not None else self.loader)

    def report(self, step: int, **values: str) -> None:
        """After batch `step` (from 0): formatted values to the bar, or to every log_interval-th line with
        the time per step and the time left (the last step has the epoch's line)."""
        done = step + 1
        if self.bar is not None:
            self.bar.set_postfix(values, refresh=False)
        elif self.lines and done % self.log_interval == 0 and done < self.total:
            per_step = (time.perf_counter() - self.start) / done
            shown = "".join(f"  {name} {value}" for name, value in values.items())
            log.info("%s [%*d/%d]%s  %.3f s/step  %s left", self.desc, len(str(self.total)), done, self.total, shown,
                     per_step, tqdm.format_interval(per_step * (self.total - done)))


class WaitedFor:
    """An iterable's items, and the seconds spent waiting for them (`waited`; for the first, `first`): in an epoch,
    the time the step waits for the input pipeline (each step syncs with the device as it reads its loss, so the
    wait is the loader's, not the GPU's), as timm's train.py logs its data time. The first item's wait includes
    the loader's start: in a process's first epoch its workers' (seconds each where they start from a fork server
    or by spawn, Python 3.14's default on Linux, importing torch anew)."""

    def __init__(self, iterable) -> None:
        self.iterable, self.waited, self.first = iterable, 0.0, None

    def __iter__(self) -> Iterator:
        items = iter(self.iterable)
        while True:
            start = time.perf_counter()
            try:
                item = next(items)
            except StopIteration:
                return
            finally:
                wait = time.perf_counter() - start
                self.first = wait if self.first is None else self.first
                self.waited += wait
            yield item


def waiting_advice(data_wait_share: float, workers: int, share_to_advise: float = 0.5) -> Optional[str]:
    """Where an epoch mostly waited for its data (data_wait_share at least share_to_advise; train.py passes the
    epoch's steady_wait_share, its loader's start left out), what feeds it faster, as a phrase after "epoch N";
    else None."""
    if data_wait_share < share_to_advise:
        return None
    if workers == 0:
        fix = ("num_workers=0: the main process loads every batch between the steps; num_workers=auto gives the "
               "loader this node's cores")
    else:
        fix = (f"its {workers} DataLoader workers cannot keep up; more cores, Pillow-SIMD or data.decode=gpu feed "
               "it faster (docs/training.md, the input pipeline)")
    return f"waited for its data {100 * data_wait_share:.0f} % of its time: {fix}"


def scheduled_lr(optimizer: torch.optim.Optimizer) -> float:
    """The schedule's current lr: the largest group's (with optim.layer_decay the head's, of lr_scale 1)."""
    return max(group["lr"] for group in optimizer.param_groups)


def updates_per_epoch(num_batches: int, grad_accum_steps: int) -> int:
    """Optimizer steps in an epoch: one per grad_accum_steps batches (the last may take fewer)."""
    return -(-num_batches // grad_accum_steps)


@dataclass
class Training:
    """What the epoch loop carries: the model (DDP- or compile-wrapped), optimizer, schedule, loss, settings."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    criterion: Callable  # criterion(images, outputs, targets): images for a distillation teacher
    scheduler: Any
    precision: Precision
    loss_scaler: Optional[NativeScaler] = None  # float16 autocast only (timm's NativeScaler)
    mixup_fn: Optional[Callable] = None
    ema: Any = None
    clip_grad: Optional[float] = None
    grad_accum_steps: int = 1


def classification_loss(loss_fn: Callable) -> Callable:
    """A criterion(images, outputs, targets) of a loss of (outputs, targets)."""
    return lambda images, outputs, targets: loss_fn(outputs, targets)


def train_one_epoch(training: Training, loader, epoch: int, show_progress: bool = True,
                    log_interval: int = 50) -> Dict[str, float]:
    """The epoch's mean loss over all ranks (and of each of a criterion's `parts`, as a distillation loss
    has), last lr, images seen and time, on CUDA this process's peak GPU memory, and for a loader that decodes on
    the device the images PIL decoded instead, summed over the ranks. With grad_accum_steps > 1
    the gradients of that many batches are averaged before each optimizer step (DDP synchronises only the last
    of them)."""
    t = training
    model, optimizer, device = t.model, t.optimizer, t.precision.device
    model.train()
    num_batches, accum = len(loader), t.grad_accum_steps
    updates = updates_per_epoch(num_batches, accum)
    totals: Dict[str, float] = {}
    seen = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    progress = Progress(loader, f"train {epoch + 1}", show_progress, log_interval)  # "epoch 1/300" in the log
    batches = WaitedFor(progress)
    for step, (images, targets) in enumerate(batches):
        agreed = agreement(device)  # distributed: the ranks agree whether to stop, read with this step's loss
        if agreed is None:
            raise_if_requested()
        update, micro_step = divmod(step, accum)
        group = min(accum, num_batches - update * accum)  # batches in this update
        need_update = micro_step == group - 1
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if t.mixup_fn is not None:
            images, targets = t.mixup_fn(images, targets)
        no_sync = getattr(model, "no_sync", None)  # DDP: all-reduce only with the update's last batch
        with contextlib.nullcontext() if need_update or no_sync is None else no_sync():
            with t.precision.autocast():
                loss = t.criterion(images, model(images), targets)
            # one device-to-host copy a step: the loss, its parts and the ranks' agreement
            parts = getattr(t.criterion, "parts", {})
            read = torch.stack([loss.detach().float(), *(p.float() for p in parts.values())])
            read = (read if agreed is None else torch.cat([read, agreed])).tolist()
            if agreed is not None:  # every rank stops before the same backward: none waits in its all-reduce alone
                raise_if_agreed(*read[-2:])
            values = dict(zip(["train_loss", *(f"train_{name}" for name in parts)], read))
            if not math.isfinite(values["train_loss"]):  # counted from 1, as the log's
                raise NonFiniteLoss(f"loss is {values['train_loss']} at epoch {epoch + 1}, step {step + 1}")
            _backward(t, loss / group if group > 1 else loss, need_update)
        for name, value in values.items():
            totals[name] = totals.get(name, 0.0) + value * images.shape[0]
        seen += images.shape[0]
        if need_update:
            optimizer.zero_grad(set_to_none=True)
            if t.ema is not None:
                t.ema.update(model, step=epoch * updates + update)
            t.scheduler.step_update(num_updates=epoch * updates + update + 1)
        progress.report(step, loss=f"{values['train_loss']:.4f}", lr=f"{scheduled_lr(optimizer):.2e}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    pil_decoded = getattr(loader, "pil_decoded", None)  # data.decode=gpu: the images PIL decoded instead
    *sums, seen, pil_sum = all_reduce_sum([*totals.values(), seen, pil_decoded or 0], device)
    first = batches.first or 0.0  # (the wait that includes the loader's start)
    stats = {**{name: total / max(seen, 1) for name, total in zip(totals, sums)}, "lr": scheduled_lr(optimizer),
             "images": seen, "epoch_time_s": elapsed, "imgs_per_s": seen / elapsed,
             "data_wait_share": batches.waited / elapsed,
             "steady_wait_share": (batches.waited - first) / max(elapsed - first, 1e-9)}  # (the pipeline's rate alone)
    if pil_decoded is not None:
        stats["pil_decoded"] = int(pil_sum)
    if device.type == "cuda":  # this process's most GPU memory in the epoch, as DeiT's log's "max mem"
        stats["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return stats


def _backward(t: Training, loss: torch.Tensor, need_update: bool) -> None:
    """Backward, and on an update's last batch clip and step (timm's NativeScaler for float16)."""
    if t.loss_scaler is not None:
        t.loss_scaler(loss, t.optimizer, clip_grad=t.clip_grad, parameters=t.model.parameters(),
                      need_update=need_update)
        return
    loss.backward()
    if need_update:
        if t.clip_grad:
            dispatch_clip_grad(t.model.parameters(), t.clip_grad)
        t.optimizer.step()


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, precision: Precision,
             show_progress: bool = True, log_interval: int = 50, interruptible: bool = True) -> Dict[str, float]:
    """Top-1 / top-5 accuracy (%) and mean cross-entropy, summed exactly over all ranks; this process's time, and
    on CUDA its peak GPU memory. interruptible=False (an epoch's evaluation in training): a first Ctrl-C lets it
    finish, so the epoch gets its checkpoint. The sums stay on the device until the end: no batch waits for the
    one before to reach the host."""
    model.eval()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # cross-entropy, top-1 and top-5 hits
    count = 0
    progress = Progress(loader, "eval", show_progress, log_interval)
    unreadable = []
    for step, (images, targets) in enumerate(progress):
        if interruptible:
            raise_if_requested()
        images, targets, skipped = split_unreadable(images, targets)
        unreadable += skipped
        if not targets.numel():
            continue
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with precision.autocast():
            logits = model(images)
        logits = logits.float()
        # (hits counted, where timm's accuracy gives float32 percentages that would be turned back into counts)
        hits = logits.topk(min(5, logits.shape[-1]), dim=-1).indices == targets[:, None]
        sums += torch.stack([criterion(logits, targets).double(), hits[:, 0].sum().double(), hits.sum().double()])
        count += targets.shape[0]
        progress.report(step)
    sums = sums.tolist()  # (waits for the device: its work is in the time)
    elapsed = time.perf_counter() - start
    loss_sum, correct1, correct5, count, left_out = all_reduce_sum([*sums, count, len(unreadable)], device)
    evaluated = int(round(count))
    if left_out:  # (rank 0 names every rank's)
        everyone = gather_to_main(unreadable)
        if not evaluated:  # (a loss and accuracies of no image would read as 0)
            first = f" (the first: {loader.dataset.samples[min(everyone)][0]})" if everyone else ""
            raise UserError(f"none of the {int(left_out)} images of this evaluation could be read{first}; replace "
                            f"them with images PIL reads")
        if everyone is not None:
            _name_unreadable(everyone, loader.dataset)
    count = max(count, 1)
    stats = {"loss": loss_sum / count, "acc1": 100.0 * correct1 / count, "acc5": 100.0 * correct5 / count,
             "num_images": evaluated, "eval_time_s": elapsed}
    if device.type == "cuda":  # (as train_one_epoch's)
        stats["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return stats


_named_unreadable: set = set()  # files already named in this process


def _name_unreadable(indices, dataset) -> None:
    """The unreadable images an evaluation left out: each named once in train.log, a count on the console."""
    paths = [dataset.samples[i][0] for i in indices]
    new = sorted(set(paths) - _named_unreadable)
    _named_unreadable.update(new)
    for path in new:
        file_log.info("unreadable image left out of the evaluation: %s", path)
    log.warning("%d unreadable image(s) left out of this evaluation's %d; named in train.log", len(paths),
                len(dataset))
