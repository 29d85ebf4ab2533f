"""The training entry point behind train.py: `train(cfg)` runs a whole DeiT-style job.

`_fit` reads like DeiT's main: data -> model (optionally from a softmax ViT) -> EMA (before DDP) ->
optimizer (lr scaled by the global batch / lr_base_batch) and per-update schedule -> mixup, loss and
distillation teacher -> resume -> epochs of train_one_epoch / evaluate / checkpoint. Only rank 0 writes.
"""
from __future__ import annotations

import errno
import json
import logging
import multiprocessing.process
import os
import re
import signal
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import timm
import torch
from omegaconf import DictConfig, OmegaConf
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.layers import to_2tuple
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, NativeScaler, random_seed
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..data import (build_dataset, build_loader, build_transform, decodes_on_device, num_classes_of, on_device,
                    resolve_num_workers)
from ..errors import UserError, first_line
from ..from_vit import init_from_vit
from ..hub import HubUnreachable
from ..ops import Plan, tuned, tuning
from . import checkpoint as ckpt
from . import interrupts, rundir
from .allocator import keep_freed_memory
from .build import (RESUME_SAME_OPTIMIZER, build_model, changed_architecture, check_resumable, check_same_classes,
                    load_weights, model_from_checkpoint, trained_model_settings, trained_size)
from .config import Size, check_settings, image_size, size_text, tuning_changes
from .distill import build_distillation
from .distributed import DistInfo, broadcast_object, cleanup, init_distributed
from .logs import WandbLogger, setup_logging
from .loop import NonFiniteLoss, Precision, Training, classification_loss, evaluate, train_one_epoch, \
    updates_per_epoch, waiting_advice

log = logging.getLogger("lion_vit")
METRICS = "metrics.jsonl"
EVAL = "eval.json"


def train(cfg: DictConfig, warnings: Sequence[str] = ()) -> Dict[str, Any]:
    """Run training (or evaluation with eval_only=true) as configured, with the ops' tuning knobs that
    cfg.tuning sets; returns the final metrics. warnings: what the caller found in how the config was composed,
    logged (by the main process) after the line that describes a training run."""
    check_settings(cfg)
    with tuned(**tuning_changes(cfg.tuning)):
        return _run(cfg, warnings)


def _run(cfg: DictConfig, warnings: Sequence[str] = ()) -> Dict[str, Any]:
    device = resolve_device(cfg.device)
    if device.type == "cpu" and cfg.cpu_keep_freed_memory:
        keep_freed_memory()
    if device.type == "cuda":
        configure_cuda(cfg.tf32)
    dist_info, device = init_distributed(device)
    output_dir, created = None, None
    try:
        if cfg.compile and not cfg.eval_only:
            _check_compiler(device)
        output_dir = Path(broadcast_object(str(cfg.output_dir)))  # rank 0's timestamp for everyone
        if dist_info.is_main:
            created = rundir.claim(output_dir)
        setup_logging(output_dir, dist_info.is_main)
        if dist_info.is_main and not rundir.holds(output_dir):
            log.warning("output_dir %s is on a filesystem without file locks: nothing stops another run from "
                        "writing to it while this one runs", output_dir)
        random_seed(epoch_seed(cfg.seed, 0, dist_info.rank))
        if cfg.eval_only:
            return run_eval_only(cfg, dist_info, device, output_dir)
        return _fit(cfg, dist_info, device, output_dir, warnings)
    except (UserError, RuntimeError, OSError) as error:  # torch.cuda.OutOfMemoryError is a RuntimeError
        short = error if isinstance(error, UserError) else _out_of_resources(error, cfg)
        if short is None:
            raise
        if created is not None:  # a run that failed before its first epoch's files leaves no folder behind
            setup_logging(None, dist_info.is_main)  # closes train.log
            rundir.release_all()
            rundir.remove_if_unused(output_dir, up_to=created)
        if short is error:
            raise
        raise short from None
    finally:
        rundir.release_all()
        cleanup()


def _check_compiler(device: torch.device) -> None:
    """compile=true: torch.compile builds one small kernel first (C++ on a CPU, Triton on CUDA), so that a machine
    that cannot is one line before any folder is made, not a traceback at the first step."""
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(2, device=device))
    except Exception as error:  # inductor's InductorError, dynamo's BackendCompilerFailed, a compiler's own error
        inner = getattr(error, "inner_exception", None)  # what the backend raised, under dynamo's wrapper
        reason = f"{type(inner).__name__}: {first_line(inner)}" if inner is not None else first_line(error)
        raise UserError(f"compile=true, but torch.compile cannot build kernels on this machine ({reason}); install "
                        f"what it names (a C++ compiler; on CUDA also Python's headers), or set compile=false") from None


def _worker_death(error: BaseException) -> str:
    """Why the DataLoader says a worker died, where it was out of shared or main memory ("" for anything else)."""
    signals = _worker_signals(error)
    if signal.SIGBUS in signals:
        shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
        size = f" ({shm.f_blocks * shm.f_frsize / 2**20:.0f} MB here)" if shm else ""
        return (f"a DataLoader worker ran out of shared memory: batches pass through /dev/shm{size}; give it more "
                f"(docker run --shm-size=16g or --ipc=host)")
    if signal.SIGKILL in signals:
        return "a DataLoader worker was killed, most likely by the kernel's out-of-memory killer"
    return ""


def _worker_signals(error: BaseException) -> set:
    """The signals that killed the DataLoader workers whose death `error` reports ("exited unexpectedly"). Forked
    workers: torch's SIGCHLD handler names it, in the error or its cause. Workers started from a fork server or by
    spawn (Python 3.14's default on Linux) are not this process's children: torch reads only that they died, from
    the multiprocessing Processes that its check holds in the frame that raised; their exit codes are -signal."""
    text = f"{error} {error.__cause__ or ''}"
    if "exited unexpectedly" not in text:
        return set()
    named = {number for name, number in (("Bus error", signal.SIGBUS), ("Killed", signal.SIGKILL))
             if f"killed by signal: {name}" in text}
    pids = set(re.findall(r"\d+", str(error)))  # ("DataLoader worker (pid(s) 123, 456) exited unexpectedly")
    frame = error.__traceback__
    while frame is not None:
        for value in frame.tb_frame.f_locals.values():
            for process in value if isinstance(value, list) else [value]:
                if isinstance(process, multiprocessing.process.BaseProcess) and str(process.pid) in pids and \
                        (process.exitcode or 0) < 0:
                    named.add(-process.exitcode)
        frame = frame.tb_next
    return named


def _fit(cfg: DictConfig, dist_info: DistInfo, device: torch.device, output_dir: Path,
         warnings: Sequence[str] = ()) -> Dict[str, Any]:
    is_main = dist_info.is_main
    resume_state = _resume_state(cfg, output_dir, is_main)
    if is_main:
        rundir.write_atomic(output_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))

    train_set, train_loader = _data(cfg, "train", dist_info, device)
    val_set, val_loader = _data(cfg, "val", dist_info, device)
    num_classes = num_classes_of(train_set)
    check_same_classes(train_set.classes, val_set.classes, "the validation split",
                       "give train and val the same class folders")
    if len(train_loader) == 0:
        raise UserError(f"{len(train_set)} training images are fewer than one batch of {cfg.batch_size} per "
                        f"process; lower batch_size")

    model = build_model(cfg.model, num_classes, image_size(cfg.img_size), initial_weights=resume_state is None)
    if cfg.model.init_from and resume_state is None:
        _init_from_vit(model, cfg.model.init_from)
    model.to(device)
    ema = ModelEmaV3(model, decay=cfg.ema.decay) if cfg.ema.enabled else None
    if cfg.grad_checkpointing:  # (after the EMA's copy, which is only evaluated)
        _grad_checkpointing(model, cfg.model.name)

    updates = updates_per_epoch(len(train_loader), cfg.grad_accum_steps)
    global_batch = cfg.batch_size * dist_info.world_size * cfg.grad_accum_steps
    lr = cfg.optim.lr * global_batch / cfg.optim.lr_base_batch if cfg.optim.lr_base_batch else cfg.optim.lr
    optimizer = build_optimizer(cfg, model, lr)
    scheduler = build_scheduler(cfg, optimizer, updates)
    precision = _precision(cfg, device)
    loss_scaler = NativeScaler(device.type) if precision.dtype == torch.float16 else None
    mixup_fn, loss_fn = _mixup_and_loss(cfg, num_classes)
    criterion = classification_loss(loss_fn)
    if cfg.distill.type != "none":  # DeiT: the teacher's loss mixed in, the student's distillation head trained
        criterion = build_distillation(cfg, loss_fn, num_classes, train_set.classes, device)
        if getattr(model, "dist_token", None) is not None:
            model.set_distilled_training(True)

    workers = resolve_num_workers(cfg.num_workers)  # (the loader's, as _data resolves it)
    start_epoch, best = 0, (-1.0, None)  # the best validation top-1 so far and its epoch (from 1)
    if resume_state is not None:
        start_epoch, best = _resume(cfg, resume_state, model, ema, optimizer, scheduler, loss_scaler, updates,
                                    output_dir, is_main, workers)

    train_model: nn.Module = torch.compile(model) if cfg.compile else model
    if dist_info.enabled:
        train_model = DistributedDataParallel(train_model, device_ids=[device.index] if device.type == "cuda" else None)
    training = Training(train_model, optimizer, criterion, scheduler, precision, loss_scaler, mixup_fn, ema,
                        cfg.optim.clip_grad, cfg.grad_accum_steps)
    _describe_run(cfg, model, train_set, val_set, num_classes, lr, global_batch, dist_info, device, is_main)
    if is_main:
        for warning in warnings:
            log.warning("%s", warning)
        _warn_of_schedule_slips(cfg, scheduler, updates, lr)

    logger = WandbLogger(cfg, output_dir, is_main, run_id=(resume_state or {}).get("wandb_run_id"))
    metrics: Dict[str, Any] = {}
    show = cfg.progress and is_main
    try:
        # the first Ctrl-C stops the run before its next step: see interrupts.py
        with interrupts.stop_between_steps(announce=is_main):
            for epoch in range(start_epoch, cfg.epochs):
                random_seed(epoch_seed(cfg.seed, epoch, dist_info.rank))  # a resumed run sees the same randomness
                train_loader.sampler.set_epoch(epoch)
                try:
                    stats = train_one_epoch(training, train_loader, epoch, show, cfg.log_interval)
                except NonFiniteLoss as error:
                    kept = (f"The last good checkpoint is kept in {output_dir}" if (output_dir / ckpt.LAST).exists()
                            else "No epoch finished, so there is no checkpoint")
                    raise UserError(f"{error}; stopped. {kept} (lower optim.lr or set optim.clip_grad)") from None
                # a Ctrl-C from here on stops the run after this epoch's checkpoint: its training is not lost
                val = evaluate(model, val_loader, device, precision, show, cfg.log_interval, interruptible=False)
                metrics = {"epoch": epoch + 1, **{f"val_{k}": val[k] for k in ("loss", "acc1", "acc5")},
                           **{k: v for k, v in stats.items() if k not in ("images", "steady_wait_share")}}
                if ema is not None:
                    metrics["val_acc1_ema"] = evaluate(ema.module, val_loader, device, precision, show,
                                                       cfg.log_interval, interruptible=False)["acc1"]
                is_best = val["acc1"] > best[0]
                best = (val["acc1"], epoch + 1) if is_best else best
                if is_main:
                    state = {"model": model.state_dict(), "model_ema": ema.module.state_dict() if ema else None,
                             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                             "scaler": loss_scaler.state_dict() if loss_scaler else None, "epoch": epoch + 1,
                             "format": ckpt.FORMAT,
                             "best_acc1": best[0], "best_epoch": best[1], "num_classes": num_classes,
                             "classes": list(train_set.classes), "loader_workers": workers,
                             "config": OmegaConf.to_container(cfg, resolve=True), "wandb_run_id": logger.run_id}
                    _save_epoch(output_dir, metrics, state, is_best)
                    _log_epoch(metrics, cfg.epochs)
                    if epoch == start_epoch:  # (the first epoch this process trains says it once)
                        advice = waiting_advice(stats["steady_wait_share"], workers)
                        if advice:
                            log.warning("epoch %d %s", epoch + 1, advice)
                    logger.log(metrics, step=epoch + 1)
    finally:
        logger.finish()
    if is_main and best[0] >= 0:
        last = f", last {metrics['val_acc1']:.2f} %" if metrics else ""
        elsewhere = _resumed_elsewhere(cfg, output_dir)  # (its best, where the run resumed from it trained nothing)
        best_file = next((path for path in (output_dir / ckpt.BEST, elsewhere and elsewhere.parent / ckpt.BEST)
                          if path and path.is_file()), None)
        log.info("done: best top-1 %.2f %% (epoch %s)%s; run folder %s%s", best[0], best[1], last, output_dir,
                 f", best checkpoint {best_file}" if best_file else "")
    return metrics


def _data(cfg: DictConfig, split: str, dist_info: DistInfo, device: torch.device):
    """A split's dataset (with its train or eval transform) and this process's loader of it."""
    train = split == "train"
    transform = build_transform(cfg.data, cfg.aug, image_size(cfg.img_size), train=train)
    dataset = build_dataset(cfg.data, split, transform)
    loader = build_loader(dataset, train=train, batch_size=cfg.batch_size,
                          num_workers=resolve_num_workers(cfg.num_workers), rank=dist_info.rank,
                          world_size=dist_info.world_size, seed=cfg.seed,
                          repeated_aug=cfg.aug.repeated_aug if train else 0, pin_memory=device.type == "cuda",
                          prefetch_factor=cfg.prefetch_factor, encoded=decodes_on_device(cfg.data, train))
    return dataset, on_device(loader, cfg.data, cfg.aug if train else None, device)


def _mixup_and_loss(cfg: DictConfig, num_classes: int) -> Tuple[Optional[Mixup], nn.Module]:
    """timm's Mixup/CutMix (with its label smoothing) and the loss that fits its targets, as DeiT."""
    if cfg.aug.mixup > 0 or cfg.aug.cutmix > 0:
        mixup_fn = Mixup(mixup_alpha=cfg.aug.mixup, cutmix_alpha=cfg.aug.cutmix, prob=cfg.aug.mixup_prob,
                         switch_prob=cfg.aug.mixup_switch_prob, mode=cfg.aug.mixup_mode,
                         label_smoothing=cfg.aug.smoothing, num_classes=num_classes)
        return mixup_fn, SoftTargetCrossEntropy()
    if cfg.aug.smoothing > 0:
        return None, LabelSmoothingCrossEntropy(smoothing=cfg.aug.smoothing)
    return None, nn.CrossEntropyLoss()


def _init_from_vit(model: nn.Module, source: str) -> None:
    """model.init_from: a softmax ViT's weights (lion_vit.init_from_vit), its errors as one line."""
    try:
        init_from_vit(model, source)
    except (ValueError, RuntimeError, OSError) as error:
        from_hub = not Path(source).exists() and timm.is_model(source)  # the hub out of reach, say
        hint = " (without the hub, fetch the weights elsewhere and pass the file: model.init_from=<path>)" \
            if from_hub and isinstance(error, OSError) and not isinstance(error, HubUnreachable) else ""
        raise UserError(f"model.init_from={source}: {first_line(error)}{hint}") from None


def _resume(cfg: DictConfig, state: Dict[str, Any], model: nn.Module, ema: Optional[ModelEmaV3],
            optimizer: torch.optim.Optimizer, scheduler, loss_scaler: Optional[NativeScaler], updates: int,
            output_dir: Path, is_main: bool, workers: int) -> Tuple[int, Tuple[float, Optional[int]]]:
    """Load a checkpoint's training state (workers: this run's loader workers a process, to compare with the
    checkpoint's run); returns the epoch to start from and the best so far."""
    check_resumable(cfg, state)
    load_weights(model, state["model"], trained_size(state))
    try:
        optimizer.load_state_dict(ckpt.optimizer_state(state, optimizer, model))
    except (ValueError, KeyError) as error:  # other parameter groups: another weight_decay, say
        raise UserError(f"the checkpoint's optimizer state does not fit this run's optimizer "
                        f"({first_line(error)}); {RESUME_SAME_OPTIMIZER}") from None
    # the schedule is rebuilt from this run's settings, not loaded: the processes, batch_size or epochs may differ
    start_epoch = ckpt.epochs_done(state)
    scheduler.step_update(num_updates=start_epoch * updates)
    if loss_scaler is not None and state.get("scaler"):
        loss_scaler.load_state_dict(state["scaler"])
    if ema is not None:
        trained_ema = state.get("model_ema")
        if trained_ema is not None:
            load_weights(ema.module, trained_ema, trained_size(state))
        else:  # EMA turned on for a run that trained without it: start from its weights
            ema.set(model)
            log.info("ema: the checkpoint holds no EMA weights (its run had ema.enabled=false); the EMA starts "
                     "from the resumed weights")
    elsewhere = _resumed_elsewhere(cfg, output_dir)
    log.info("resumed after epoch %d of %s", start_epoch, output_dir if cfg.resume == "auto" else cfg.resume)
    if is_main:
        if elsewhere:  # continued in a new folder: it starts with the history of the checkpoint's run
            rundir.copy_metrics(elsewhere.parent / METRICS, output_dir / METRICS)
        rundir.drop_metrics_after(output_dir / METRICS, start_epoch)
    if start_epoch >= cfg.epochs:
        log.info("the checkpoint has finished all %d epochs of epochs=%d: nothing left to train (a larger epochs "
                 "goes on along that longer schedule)", start_epoch, cfg.epochs)
    trained_workers = state.get("loader_workers")
    if is_main and trained_workers is not None and trained_workers != workers and start_epoch < cfg.epochs:
        # (each worker draws from a seed of its own, as DataLoader's: num_workers=auto follows the node's cores)
        log.warning("this run loads its training data with %d worker(s) a process, the checkpoint's run with %d: its "
                    "augmentations are drawn otherwise from here on, and the weights will not be an uninterrupted "
                    "run's; num_workers=%d keeps its draws", workers, trained_workers, trained_workers)
    return start_epoch, (state.get("best_acc1", -1.0), state.get("best_epoch"))


def _save_epoch(output_dir: Path, metrics: Dict[str, Any], state: Dict[str, Any], is_best: bool) -> None:
    """The epoch's metrics line, then its checkpoints, with signals held (a run killed in between re-trains
    this epoch and drops its line on resume)."""
    with interrupts.deferred():
        rundir.append_line(output_dir / METRICS, json.dumps(metrics))
        ckpt.save_together([(state, output_dir / ckpt.LAST, output_dir / ckpt.PREVIOUS)]
                           + ([(state, output_dir / ckpt.BEST, None)] if is_best else []))


def _log_epoch(metrics: Dict[str, Any], epochs: int) -> None:
    parts = "".join(f"  {name.removeprefix('train_')} {value:.4f}" for name, value in metrics.items()
                    if name.startswith("train_loss_"))
    ema = f"  ema acc1 {metrics['val_acc1_ema']:.2f}" if "val_acc1_ema" in metrics else ""
    memory = f", {metrics['peak_gpu_mem_mb'] / 1024:.1f} GB GPU memory" if "peak_gpu_mem_mb" in metrics else ""
    log.info("epoch %d/%d  train_loss %.4f%s  val_loss %.4f  acc1 %.2f  acc5 %.2f%s  lr %.2e  %.1fs (%.0f img/s, "
             "%.0f %% waiting for data%s)", metrics["epoch"], epochs, metrics["train_loss"], parts,
             metrics["val_loss"], metrics["val_acc1"], metrics["val_acc5"], ema, metrics["lr"],
             metrics["epoch_time_s"], metrics["imgs_per_s"], 100 * metrics["data_wait_share"], memory)
    if metrics.get("pil_decoded"):  # summed over the ranks (the first file of each is named in its warning)
        log.info("data.decode=gpu: %d training images of epoch %d were decoded by PIL on the CPU",
                 metrics["pil_decoded"], metrics["epoch"])


def _grad_checkpointing(model: nn.Module, name: str) -> None:
    """timm's gradient checkpointing: each block's activations are recomputed in backward, not kept."""
    try:
        model.set_grad_checkpointing(True)
    except (AssertionError, NotImplementedError, AttributeError) as error:  # timm's models that have none assert
        raise UserError(f"grad_checkpointing=true: {name} has no gradient checkpointing in timm "
                        f"({first_line(error) or 'set_grad_checkpointing refused'}); set grad_checkpointing=false") \
            from None


def build_optimizer(cfg: DictConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """timm's create_optimizer_v2 from the optim settings, at lr (optim.lr scaled to the global batch)."""
    betas = {} if cfg.optim.betas is None else {"betas": tuple(cfg.optim.betas)}  # (null: the optimizer's own)
    return create_optimizer_v2(model, opt=cfg.optim.opt, lr=lr, weight_decay=cfg.optim.weight_decay,
                               eps=cfg.optim.eps, layer_decay=cfg.optim.layer_decay, **betas)


def build_scheduler(cfg: DictConfig, optimizer: torch.optim.Optimizer, updates: int):
    """timm's schedule of cfg.optim for cfg.epochs, stepped per update (`updates` an epoch)."""
    optim = cfg.optim  # (decay_epochs null: timm's default, which timm < 1.0.31 takes only by omission)
    decay_epochs = {} if optim.decay_epochs is None else {"decay_epochs": optim.decay_epochs}
    scheduler, _ = create_scheduler_v2(optimizer, sched=optim.sched, num_epochs=cfg.epochs,
                                       warmup_epochs=optim.warmup_epochs, warmup_lr=optim.warmup_lr,
                                       min_lr=optim.min_lr, decay_milestones=list(optim.decay_milestones),
                                       decay_rate=optim.decay_rate, step_on_epochs=False, updates_per_epoch=updates,
                                       **decay_epochs)
    return scheduler


# timm's schedules that end at optim.min_lr (step, multistep and constant never read it)
MIN_LR_SCHEDULES = ("cosine", "tanh", "poly", "wsd", "rsqrt")


def _warn_of_schedule_slips(cfg: DictConfig, scheduler, updates: int, lr: float) -> None:
    """Settings timm's scheduler takes that leave the learning rate where it starts (a smoke test, or a mistake),
    or raise it where it should fall: a min_lr above the run's lr (DeiT's scaling by a small batch, or a lower
    lr for fine-tuning without a lower min_lr)."""
    if cfg.optim.warmup_epochs >= cfg.epochs:
        log.warning("optim.warmup_epochs=%s is not below epochs=%d: the learning rate never leaves warm-up "
                    "(it ends below %.2e and the %s schedule never starts); lower optim.warmup_epochs for a "
                    "full schedule", cfg.optim.warmup_epochs, cfg.epochs, lr, cfg.optim.sched)
    elif cfg.optim.min_lr > lr and cfg.optim.sched in MIN_LR_SCHEDULES:
        base = cfg.optim.lr_base_batch
        scaled = f" (optim.lr {cfg.optim.lr:.2e} per {base} images)" if base else ""
        log.warning("optim.min_lr=%s is above this run's lr %.2e%s: the %s schedule raises the learning rate to "
                    "it instead of lowering it; set optim.min_lr below the lr", cfg.optim.min_lr, lr, scaled,
                    cfg.optim.sched)
    elif cfg.optim.sched in ("step", "multistep"):
        first = min(scheduler.decay_t) if cfg.optim.sched == "multistep" else scheduler.decay_t
        if first >= cfg.epochs * updates:
            name = "decay_epochs" if cfg.optim.sched == "step" else "decay_milestones"
            log.warning("optim.sched=%s first decays the learning rate at epoch %g, not before epochs=%d: it stays "
                        "%.2e; set optim.%s for this run's length", cfg.optim.sched, first / updates, cfg.epochs,
                        lr, name)


def _describe_run(cfg: DictConfig, model: nn.Module, train_set, val_set, num_classes: int, lr: float,
                  global_batch: int, dist_info: DistInfo, device: torch.device, is_main: bool) -> None:
    base = cfg.optim.lr_base_batch  # DeiT's scaling: the lr given is for a global batch of this size
    scaled = f" (optim.lr {cfg.optim.lr:.2e} per {base} images)" if base and base != global_batch else ""
    size = image_size(cfg.img_size)
    log.info("%s, %d train / %d val images, %d classes, lr %.2e%s, global batch %d, %d process(es), %s",
             _model_line(cfg.model, model, size), len(train_set), len(val_set), num_classes, lr, scaled,
             global_batch, dist_info.world_size, device)
    _log_plan(model, size)
    split = cfg.data.train_split
    if is_main and split and split == cfg.data.val_split:  # (a quick check of fitting, or a slip)
        log.warning("data.val_split=%s is the training split: every epoch's validation accuracy is on the training "
                    "images", split)
    teacher = cfg.distill.teacher_checkpoint or cfg.distill.teacher
    if is_main and cfg.distill.type == "none" and teacher:  # (not an error: distill=none on a distilling experiment)
        log.warning("distillation is off (distill.type=none): the teacher %s is not used; distill=soft or "
                    "distill=hard distils from it", teacher)


def _model_line(model_cfg: DictConfig, model: nn.Module, img_size: Size) -> str:
    """"model <name> (<size> params) at <img_size> px", naming every setting by which the model is not the
    architecture its name builds (the digits group's small widths, say)."""
    n_params = sum(p.numel() for p in model.parameters())
    changes = changed_architecture(model_cfg, model)
    changed = f" changed by {', '.join(changes)}" if changes else ""
    return f"model {model_cfg.name}{changed} ({n_params / 1e6:.2f}M params) at {size_text(img_size)} px"


def _log_plan(model: nn.Module, img_size: Size, dtype: Optional[torch.dtype] = None) -> Optional[Plan]:
    """Log what every LION layer runs on images of img_size (lion_vit.ops.dispatch), in evaluation too where that
    differs, and the tuning knobs set away from their defaults; return the plan (None for a model without LION
    layers)."""
    if not hasattr(model, "attn_plan"):
        return None
    try:
        run = model.attn_plan(to_2tuple(img_size), dtype=dtype)
        evaluated = model.attn_plan(to_2tuple(img_size), dtype=dtype, training=False)
    except ValueError as error:  # a backend that cannot run here (triton without a GPU or the kernels)
        raise UserError(f"model.attn_backend: {error}") from None
    log.info("attention: %s%s", run, "" if evaluated == run else f"; in evaluation, {evaluated}")
    changed = tuning().changes()
    if changed:
        log.info("tuning: %s (the other knobs at their defaults)", ", ".join(f"{k}={v}" for k, v in changed.items()))
    return run


def _resume_state(cfg: DictConfig, output_dir: Path, is_main: bool) -> Optional[Dict[str, Any]]:
    """The state to resume (resume=auto: the newest readable one in output_dir, if any; resume=<path>), or None.
    A fresh start in a folder holding a run is refused."""
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
            rundir.drop_metrics_after(output_dir / METRICS, 0)  # a first epoch killed before its checkpoint
            # (the default output_dir is a new folder each run: resume=auto alone never continues the last one)
            log.info("resume=auto: nothing to resume in %s, a fresh start (to continue a run, pass output_dir=<its "
                     "folder>)", output_dir)
        return state
    path = Path(cfg.resume)
    state = ckpt.load_checkpoint(path, setting="resume")
    if found and _resumed_elsewhere(cfg, output_dir):
        raise UserError(f"{output_dir} already holds a run ({', '.join(found)}), which resume={path} would write "
                        f"over; pass resume=auto to continue the run in {output_dir}, or a new output_dir to "
                        f"continue {path}'s run there")
    return state


def _resumed_elsewhere(cfg: DictConfig, output_dir: Path) -> Optional[Path]:
    """resume=<path> of a checkpoint outside output_dir (a run continued in a new folder): that path, else None."""
    if cfg.resume in (None, "", False, "auto") or Path(cfg.resume).resolve().parent == output_dir.resolve():
        return None
    return Path(cfg.resume)


def run_eval_only(cfg: DictConfig, dist_info: DistInfo, device: torch.device, output_dir: Path) -> Dict[str, Any]:
    """Evaluate `checkpoint` in the requested attn_form / chunk_size / img_size; write eval.json."""
    if not cfg.checkpoint:
        raise UserError("eval_only=true needs checkpoint=<path to a checkpoint-*.pt>")
    if (output_dir / EVAL).exists():  # as a training run never overwrites a run
        raise UserError(f"{output_dir} already holds an evaluation ({EVAL}); choose a new output_dir")
    state = ckpt.load_checkpoint(cfg.checkpoint, weights=True)  # (a path or a URL)
    use_ema = cfg.ema.eval_ema
    if use_ema and state.get("model_ema") is None:
        raise UserError(f"ema.eval_ema=true, but {cfg.checkpoint} holds no EMA weights (its run had "
                        f"ema.enabled=false); drop ema.eval_ema to evaluate its model weights")
    val_set, loader = _data(cfg, "val", dist_info, device)
    # the architecture is the checkpoint's; the form and resolution are this command's
    model_settings = OmegaConf.to_container(cfg.model, resolve=True)
    size = image_size(cfg.img_size)
    model = model_from_checkpoint(state, model_settings, size,
                                  val_set.classes, f"the {cfg.data.name} validation split",
                                  "evaluate on data with the classes the checkpoint was trained on",
                                  state["model_ema"] if use_ema else state["model"])
    precision = _precision(cfg, device)
    model.to(device).eval()
    trained = OmegaConf.create(trained_model_settings(state, model_settings))  # what model_from_checkpoint built
    name = trained.name
    log.info("%s, %d val images, the %s weights of %s, %s", _model_line(trained, model, size),
             len(val_set), "EMA" if use_ema else "model", cfg.checkpoint, device)
    run = _log_plan(model, size, precision.dtype)
    with interrupts.stop_between_steps(announce=dist_info.is_main):
        stats = evaluate(model, loader, device, precision, show_progress=cfg.progress and dist_info.is_main,
                         log_interval=cfg.log_interval)
    # what ran, not what was asked: "auto" resolved, and a chunk size only where chunks ran
    ran = {"attn_form": None, "chunk_size": None, "attn_plan": None} if run is None else {
        "attn_form": run.form, "chunk_size": run.chunk_size if run.form == "chunk" and not run.whole else None,
        "attn_plan": str(run)}
    result = {"acc1": stats["acc1"], "acc5": stats["acc5"], "loss": stats["loss"], **ran, "img_size": size,
              "num_images": stats["num_images"], "model": name, "checkpoint": str(cfg.checkpoint),
              "weights": "ema" if use_ema else "model",
              # this process's wall time, data loading and a compile included (benchmark_resolution.py times the
              # model alone), all processes' images; the GPU memory this process's evaluation took at its peak
              "batch_size": cfg.batch_size, "eval_time_s": stats["eval_time_s"],
              "imgs_per_s": stats["num_images"] / stats["eval_time_s"], "peak_gpu_mem_mb": stats.get("peak_gpu_mem_mb")}
    if dist_info.is_main:
        rundir.write_atomic(output_dir / EVAL, json.dumps(result, indent=2) + "\n")
        log.info("eval: %s", json.dumps(result))
        log.info("wrote %s", output_dir / EVAL)
    return result


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible; use device=cpu or device=auto")
    return torch.device(name)


def configure_cuda(tf32: bool) -> None:
    """timm's GPU defaults: cuDNN autotuning for the fixed input size; TF32 for float32 matmuls if tf32."""
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """The seed of an epoch on a rank, for timm.utils.random_seed."""
    return (seed * 1_000_003 + epoch * 1_009 + rank) % 2**32


def _precision(cfg: DictConfig, device: torch.device) -> Precision:
    return Precision(device, getattr(torch, cfg.amp_dtype) if cfg.amp and device.type == "cuda" else None)


_REQUESTED = re.compile(r"[Tt]ried to allocate ([0-9.]+) ?([A-Za-z]+)")


def _out_of_resources(error: BaseException, cfg: DictConfig) -> Optional[UserError]:
    """One line for a full disk, an allocation failure (CUDA's OutOfMemoryError, the CPU allocator's
    RuntimeError) or a DataLoader worker killed for want of memory, saying what to do; None for any other error."""
    worker, img_size = _worker_death(error), size_text(image_size(cfg.img_size))
    if worker:
        return UserError(f"{worker} (num_workers={cfg.num_workers}, batch_size {cfg.batch_size}, img_size "
                         f"{img_size}); lower num_workers or batch_size (resume=auto continues from the last "
                         f"checkpoint)")
    if isinstance(error, OSError):
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            return None
        where = f" writing {error.filename}" if error.filename else ""
        return UserError(f"no space left on the device{where}; free space there, then continue with resume=auto "
                         f"(the files already written are kept)")
    if not isinstance(error, torch.cuda.OutOfMemoryError) and "can't allocate memory" not in str(error):
        return None
    found = _REQUESTED.search(str(error))
    amount, unit = found.groups() if found else ("", "")
    size = "" if not found else f" ({float(amount) / 1e9:.1f} GB requested)" if unit == "bytes" else \
        f" ({amount} {unit} requested)"
    training = "" if cfg.eval_only else " (grad_accum_steps=<k> keeps the global batch)"
    checkpointing = "" if cfg.eval_only or cfg.grad_checkpointing else \
        ", or set grad_checkpointing=true (each block's activations computed again in backward, not kept)"
    return UserError(f"out of memory at img_size {img_size}, batch_size {cfg.batch_size} per process{size}; "
                     f"lower batch_size{training} or img_size{checkpointing} (the attention form's memory grows "
                     f"with the square of the tokens per image; to evaluate at high resolution use "
                     f"model.attn_form=chunk)")
