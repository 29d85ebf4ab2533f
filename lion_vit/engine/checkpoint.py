"""Checkpoints that survive crashes: atomic writes, the previous one kept, clear errors."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from ..errors import UserError

log = logging.getLogger(__name__)
LAST, PREVIOUS, BEST = "checkpoint-last.pt", "checkpoint-prev.pt", "checkpoint-best.pt"


def save_atomic(state: Dict[str, Any], path: Path, keep_previous: Optional[Path] = None) -> None:
    """Write to a temp file, fsync, then rename over `path` (moving the old file to `keep_previous`)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if keep_previous is not None and path.exists():
        os.replace(path, keep_previous)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> Dict[str, Any]:
    """Load a training checkpoint or raise UserError saying what is wrong with it."""
    if not Path(path).is_file():
        raise UserError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # torch raises many types for truncated or foreign files
        raise UserError(f"checkpoint {path} is corrupt or not a torch checkpoint ({type(error).__name__}); "
                        f"use another checkpoint (e.g. {PREVIOUS})") from None
    if not isinstance(state, dict) or "model" not in state:
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
        except UserError as error:
            log.warning("resume=auto skips %s", error)
            continue
        if "epoch" in state and (best is None or state["epoch"] > best["epoch"]):
            best = state
    return best
