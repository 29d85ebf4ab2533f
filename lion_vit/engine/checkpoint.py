"""Checkpoints that survive crashes: atomic writes, the previous one kept, clear errors."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ..errors import UserError, first_line
from ..weights import UnsafeWeights, has_ema, is_url, official_lion_hint, read_weights, state_dict_of
from .interrupts import deferred

log = logging.getLogger(__name__)
LAST, PREVIOUS, BEST = "checkpoint-last.pt", "checkpoint-prev.pt", "checkpoint-best.pt"
# A training checkpoint's `epoch` is the number of epochs it has finished, as the console and metrics.jsonl
# count them (format 2); checkpoints without `format` held the finished epoch's 0-based index, as DeiT's do.
# Format 3: the layers' decay parameters are their decay kind's (`attn.decay.logit`; load_state_dict reads
# the old names), which moved LION-d's logits in the optimizer's order of parameters (optimizer_state).
FORMAT = 3


def epochs_done(state: Dict[str, Any]) -> int:
    """How many epochs a training checkpoint has finished (any format)."""
    return state["epoch"] + (0 if state.get("format", 1) >= 2 else 1)


def optimizer_state(state: Dict[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> Dict[str, Any]:
    """The checkpoint's optimizer state in the order of this optimizer's parameters. Before format 3 a layer's
    per-head decay logits (`attn.decay_logit`) were its own parameters, first among the layer's; now they are
    `attn.decay.logit`, after its projections and norms: in each parameter group they move back to where the
    checkpoint has their state."""
    saved = state["optimizer"]
    groups = [len(group["params"]) for group in optimizer.param_groups]
    if state.get("format", 1) >= 3 or groups != [len(group["params"]) for group in saved["param_groups"]]:
        return saved  # (another optimizer's state: load_state_dict says how it differs)
    names = {id(param): name for name, param in model.named_parameters()}
    position = {name: index for index, name in enumerate(names.values())}

    def old_position(param: torch.Tensor) -> float:  # a logit right before its layer's first parameter
        name = names.get(id(param), "")
        if not name.endswith(".attn.decay.logit"):
            return position.get(name, -1)
        layer = name[:-len("decay.logit")]
        return min(index for other, index in position.items() if other.startswith(layer)) - 0.5

    index = {id(param): i for i, param in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    remapped = {"state": {}, "param_groups": []}
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        old_order = sorted(group["params"], key=old_position)  # the checkpoint's order of this group's params
        for param, saved_index in zip(old_order, saved_group["params"]):
            if saved_index in saved["state"]:
                remapped["state"][index[id(param)]] = saved["state"][saved_index]
        remapped["param_groups"].append(dict(saved_group, params=[index[id(param)] for param in group["params"]]))
    return remapped


def save_atomic(state: Dict[str, Any], path: Path, keep_previous: Optional[Path] = None) -> None:
    """Write to a temp file, fsync, then rename over `path` (moving the old file to `keep_previous`),
    and fsync the directory so that the renames survive a power loss too."""
    save_together([(state, path, keep_previous)])


def save_together(writes: List[Tuple[Dict[str, Any], Path, Optional[Path]]]) -> None:
    """save_atomic writes that land together or not at all (an epoch's last and best checkpoints agree on
    best_acc1): all temp files are written first; a failed write (a full disk) removes them, changing nothing."""
    with deferred():  # a Ctrl-C or SIGTERM meanwhile waits until the files are in place
        written: List[Path] = []
        try:
            for state, path, _ in writes:
                written.append(_write_temp(state, path))
        except BaseException:
            for tmp in written:
                tmp.unlink(missing_ok=True)
            raise
        for (_, path, keep_previous), tmp in zip(writes, written):
            if keep_previous is not None and path.exists():
                os.replace(path, keep_previous)
            os.replace(tmp, path)
        for directory in {path.parent for _, path, _ in writes}:
            _fsync_directory(directory)


def _write_temp(state: Dict[str, Any], path: Path) -> Path:
    """state in path's temp file, fsynced; a failed write removes it and raises UserError."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as error:  # a full disk or quota: torch raises either
        tmp.unlink(missing_ok=True)
        kept = "; the checkpoint already there is kept" if path.exists() else ""
        raise UserError(f"could not write checkpoint {path} ({write_failure(error)}){kept}; free space there or "
                        f"set another output_dir, then continue with resume=auto") from None
    return tmp


def write_failure(error: BaseException) -> str:
    """Why a write failed, in words; a full disk also where torch's writer reports a failed internal check."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the device"
    text = str(error)
    if isinstance(error, RuntimeError) and ("unexpected pos" in text or "failed writing" in text
                                            or "file write failed" in text):
        return "no space left on the device (torch could not write the file)"
    return getattr(error, "strerror", None) or first_line(error)


def _fsync_directory(directory: Path) -> None:
    """Flush a directory's renames to disk; skipped where it cannot be opened (Windows) or fsynced."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(path: Union[str, Path], weights: bool = False, setting: str = "checkpoint") -> Dict[str, Any]:
    """A training checkpoint (a file's path or a URL, read weights_only: a file that would run code is refused),
    or a UserError.
    weights=True (evaluation): also a file of weights alone, a state dict (.pth, .safetensors) or timm's
    checkpoint, as {"model": its weights, "model_ema": its EMA weights where it has them}. setting: the
    setting that named path (checkpoint, resume), for the errors."""
    if Path(path).is_dir():
        resume = setting == "resume"
        fix = f"to continue its run there, pass resume=auto output_dir={path}; or " if resume else ""
        raise UserError(f"{setting}={path} is a folder; {fix}pass a checkpoint file in it, e.g. "
                        f"{Path(path) / (LAST if resume else BEST)}")
    try:
        state = read_weights(path)
    except UnsafeWeights as error:
        raise UserError(f"checkpoint {error}; use a checkpoint written by lion-vit's train.py") from None
    except ValueError as error:  # (a URL's error says what to do; a file there but unreadable: its run's previous)
        fix = "" if is_url(str(path)) else "; check the path" if not Path(path).is_file() else \
            f"; use another checkpoint (e.g. {PREVIOUS})"
        raise UserError(f"checkpoint {error}{fix}") from None
    chosen = state_dict_of(state)
    official = official_lion_hint(chosen, path)
    if official:
        raise UserError(f"{setting}={path} {official}, then {setting}=lion.pt")
    if "model" not in state and weights and state:  # (chosen as timm's loaders choose them)
        state = {"model": chosen, "model_ema": state_dict_of(state, use_ema=True) if has_ema(state) else None}
    if "model" not in state:
        raise UserError(f"checkpoint {path} holds no 'model' weights; expected a lion-vit training checkpoint")
    return state


def newest_readable(output_dir: Path) -> Optional[Dict[str, Any]]:
    """For resume=auto: the readable checkpoint in output_dir with the highest epoch, if any."""
    best = None
    for name in (LAST, PREVIOUS):
        path = output_dir / name
        if not path.exists():
            continue
        try:
            state = load_checkpoint(path)
        except UserError as error:  # (its advice to use another checkpoint is what resume=auto does)
            log.warning("resume=auto skips %s", str(error).split("; ")[0])
            continue
        if state.get("epoch") is not None and (best is None or epochs_done(state) > epochs_done(best)):
            best = state
    return best
