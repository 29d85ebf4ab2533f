"""The one reader of weight files, for resume, checkpoint=, model.init_from, distill.teacher_checkpoint
and from_official: a torch checkpoint loaded weights_only or a .safetensors state dict, as timm's
load_state_dict / load_checkpoint read them; the state dict inside it, chosen and cleaned as timm
chooses it; and loading one into a model, where a mismatch is one line."""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import pickle
import re
import urllib.error
import urllib.parse
from pathlib import Path
from typing import Any, Dict, Union

import torch
from timm.models import clean_state_dict
from torch import nn


WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".tar")  # (.tar: timm's train.py writes .pth.tar)


class UnsafeWeights(ValueError):
    """A weights file that would run code when unpickled: torch's weights_only load refuses it."""


URL = re.compile(r"^(https?|file)://")


def is_url(source: Union[str, Path]) -> bool:
    return isinstance(source, str) and bool(URL.match(source))


def download(url: str) -> Path:
    """The file at url, downloaded once into torch.hub's cache (as DeiT's URLs load through
    torch.hub.load_state_dict_from_url), in a folder of its own per URL: two runs' checkpoint-best.pt stay apart
    where torch.hub's one folder would mix them up. An unreachable URL is a ValueError of one line."""
    name = Path(urllib.parse.urlparse(url).path).name or "weights"
    cached = Path(torch.hub.get_dir()) / "checkpoints" / hashlib.sha256(url.encode()).hexdigest()[:16] / name
    if not cached.is_file():
        try:  # (into a temporary file, renamed once whole: an interrupted download leaves nothing cached)
            cached.parent.mkdir(parents=True, exist_ok=True)
            torch.hub.download_url_to_file(url, str(cached), progress=False)
        except (OSError, ValueError) as error:  # (urllib's URLError and HTTPError are OSErrors)
            with contextlib.suppress(OSError):
                cached.parent.rmdir()
            if isinstance(error, PermissionError):
                raise ValueError(f"{url} cannot be downloaded into {cached.parent} ({error.strerror}); set "
                                 f"TORCH_HOME to a folder you can write, or pass a downloaded file's path") from None
            reason = f"HTTP {error.code} {error.reason}" if isinstance(error, urllib.error.HTTPError) else \
                getattr(error, "reason", None) or error
            raise ValueError(f"{url} cannot be downloaded ({reason}); download it where it is reachable and pass "
                             f"the file's path") from None
    return cached


# DeiT's main.py (and so the official LION code, a DeiT fork) and timm's train.py keep their argparse arguments in
# every checkpoint: a Namespace, whose values weights_only still checks like any others
ARGUMENTS = (argparse.Namespace,)


def read_weights(path: Union[str, Path]) -> Dict[str, Any]:
    """The dict in a weights file, or at a URL (https://, file://: downloaded once, see download). A missing,
    corrupt or foreign file is a ValueError of one line starting with the path; one that would run code when
    unpickled (weights_only refuses it, ARGUMENTS aside), an UnsafeWeights."""
    path = download(path) if is_url(path) else Path(path)
    if path.is_dir():  # a run's folder, say: name the files it holds
        held = sorted(p.name for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
        raise ValueError(f"{path} is a folder, not a file" + (f" (it holds {', '.join(held[:4])})" if held else ""))
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(str(path))
        with torch.serialization.safe_globals(list(ARGUMENTS)):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        refused = re.search(r"GLOBAL (\S+)", str(error))
        if refused:
            raise UnsafeWeights(f"{path} holds a Python object ({refused.group(1)}) that torch's safe load "
                                f"(weights_only) will not unpickle") from None
        raise ValueError(f"{path} is corrupt or not a torch checkpoint (UnpicklingError)") from None
    except Exception as error:  # torch raises many types for truncated or foreign files
        raise ValueError(f"{path} is corrupt or not a torch checkpoint ({type(error).__name__})") from None
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path} holds no dict of weights")
    return checkpoint


def official_lion_hint(weights: Dict[str, Any], path: Union[str, Path]) -> str:
    """For weights in the official LION code's layout (its decays attn.a_i, lion_vit.convert) read from path, what
    they are and how to use them here, to follow the path in a message; else ""."""
    if not any(".attn.a_i" in key for key in weights):
        return ""
    return (f"holds weights of the official LION code (its decays are attn.a_i); convert them first: "
            f"python scripts/convert_official.py {path} lion.pt (lion_vit.from_official in Python)")


EMA_KEYS = ("state_dict_ema", "model_ema")  # where timm's and this project's checkpoints keep EMA weights


def state_dict_of(checkpoint: Dict[str, Any], use_ema: bool = False) -> Dict[str, Any]:
    """The weights in a checkpoint dict, chosen as timm's load_state_dict chooses them (with use_ema, its
    state_dict_ema / model_ema entry; then state_dict; then model, DeiT's and this project's; else the
    dict itself), with DDP's and torch.compile's prefixes removed (timm's clean_state_dict)."""
    keys = (EMA_KEYS if use_ema else ()) + ("state_dict", "model")
    chosen = next((checkpoint[key] for key in keys if isinstance(checkpoint.get(key), dict)), checkpoint)
    return clean_state_dict(chosen)


def has_ema(checkpoint: Dict[str, Any]) -> bool:
    """Whether the checkpoint holds EMA weights, which state_dict_of(use_ema=True) then returns."""
    return any(isinstance(checkpoint.get(key), dict) for key in EMA_KEYS)


def load_into(model: nn.Module, state_dict: Dict[str, Any], what: str) -> None:
    """model.load_state_dict(state_dict) (strict). A mismatch is a ValueError "<what> does not fit <model>:
    <its first problem>" (torch's first line only says "Error(s) in loading state_dict for ...")."""
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as error:
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        first = lines[1] if len(lines) > 1 else lines[0]
        raise ValueError(f"{what} does not fit {what_model(model)}: "
                         f"{first if len(first) <= 200 else first[:200] + ' ...'}") from None


def what_model(model: nn.Module) -> str:
    """A model's timm name where it has one (pretrained_cfg's architecture), else its class name."""
    return (getattr(model, "pretrained_cfg", None) or {}).get("architecture") or type(model).__name__

