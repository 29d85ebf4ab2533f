"""Reading weight files: a torch checkpoint (weights_only) or a .safetensors state dict, and the state
dict inside a checkpoint. Used by init_from_vit, the converter, distillation teachers and resume."""
from __future__ import annotations

import contextlib
import pickle
import re
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import numpy as np
import torch


def read_weights(path: Path) -> Dict[str, Any]:
    """Any file of weights as a dict: a torch checkpoint (loaded weights_only, as load_checkpoint does) or a
    .safetensors state dict. ValueError, saying which, for anything else."""
    try:
        if Path(path).suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(str(path))
        state = _safe_load(path)
    except Exception as error:  # torch raises many types for foreign files
        raise ValueError(f"{path} is corrupt or not a torch checkpoint ({type(error).__name__})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds no dict of weights")
    return state


def state_dict_of(state: Dict[str, Any]) -> Dict[str, Any]:
    """The weights of a checkpoint dict: its "model" entry (this project's, DeiT's), its "state_dict"
    entry, or the dict itself (a bare state dict)."""
    for key in ("model", "state_dict"):
        if isinstance(state.get(key), dict):
            return state[key]
    return state


def _safe_load(path: Path) -> Any:
    """torch.load(weights_only=True), also accepting numpy arrays (checkpoints of earlier lion-vit
    versions stored numpy's RNG state)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if not (_refused_global(error) or "").startswith("numpy."):
            raise
    with _numpy_arrays_allowed():
        return torch.load(path, map_location="cpu", weights_only=True)


def _refused_global(error: pickle.UnpicklingError) -> Optional[str]:
    """The name of the class or function a weights_only load refused, or None for another error."""
    found = re.search(r"GLOBAL (\S+)", str(error))
    return found.group(1) if found else None


@contextlib.contextmanager
def _numpy_arrays_allowed() -> Iterator[None]:
    """Allow numpy uint32 arrays (an RNG state's) in a weights_only load (torch >= 2.5; older torch
    refuses them)."""
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    if safe_globals is None:
        yield
        return
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray  # numpy 2 / 1
    with safe_globals([multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]):
        yield
