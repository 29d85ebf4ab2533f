#!/usr/bin/env python
"""Convert a checkpoint of the official LION image-classification code (LIONS-EPFL/LION) into one of this
project, which `train.py eval_only=true checkpoint=OUT.pth` evaluates in any form and resolution.

    python scripts/convert_official.py official.pth lion_checkpoint.pth
    python scripts/convert_official.py official.pth out.pth --mask-type Selective --order S --no-pos-emb

The official settings (mask_type, order, pos_emb, cls_tok) come from the checkpoint's `args` unless given;
`model_ema` is taken when present (--no-ema: the raw weights).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts\' shared helpers (benchmarking.py)

import torch  # noqa: E402

from benchmarking import HelpFormatter  # noqa: E402
from lion_vit.convert import ARGS, MissingSettings, convert_official  # noqa: E402
from lion_vit.engine.checkpoint import write_failure  # noqa: E402
from lion_vit.engine.rundir import outermost_missing  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("official",
                        help="the official checkpoint (.pth), or its URL (downloaded once, into torch.hub's cache)")
    parser.add_argument("out", type=Path, help="where to write this project's checkpoint")
    parser.add_argument("--mask-type", choices=["Lit", "Decay", "Selective"], help="override the checkpoint's")
    parser.add_argument("--order", choices=["Normal", "S"], help="override the checkpoint's")
    parser.add_argument("--pos-emb", action=argparse.BooleanOptionalAction, default=None,
                        help="override the checkpoint's")
    parser.add_argument("--cls-tok", action=argparse.BooleanOptionalAction, default=None,
                        help="override the checkpoint's")
    parser.add_argument("--no-ema", action="store_true", help="convert `model`, not `model_ema`")
    args = parser.parse_args()
    if args.out.exists():  # (as timm's clean_checkpoint.py: out the official file itself would lose it)
        parser.exit(2, f"error: {args.out} already exists; name a new file for the converted checkpoint\n")
    given = {name: getattr(args, name) for name in ARGS if getattr(args, name) is not None}
    try:
        name, kwargs, model = convert_official(args.official, given, use_ema=not args.no_ema)
    except MissingSettings as error:  # the options that give them
        options = {"mask_type": "--mask-type {Lit,Decay,Selective}", "order": "--order {Normal,S}",
                   "pos_emb": "--pos-emb or --no-pos-emb", "cls_tok": "--cls-tok or --no-cls-tok"}
        parser.exit(2, f"error: {args.official} does not say its {', '.join(error.missing)}; pass "
                       f"{', '.join(options[name] for name in error.missing)}\n")
    except (ValueError, OSError, RuntimeError) as error:  # unknown settings, another shape, not a checkpoint
        parser.exit(2, f"error: {str(error).strip().splitlines()[0]}\n")
    num_classes = kwargs.pop("num_classes")
    out = {"model": model.state_dict(), "num_classes": num_classes, "epoch": None,
           "config": {"model": {"name": name, "patch_size": 16, "kwargs": kwargs}}}
    error = write(out, args.out)
    if error:
        parser.exit(2, f"error: could not write {args.out} ({error}); name another file\n")
    print(f"wrote {args.out}: {name}, {num_classes} classes, model.kwargs={kwargs}")


def write(state: dict, path: Path) -> str:
    """state saved whole at path (a temp file renamed), or why not; a failed write leaves no file or folder."""
    created, tmp = outermost_missing(path.parent), path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, path)
        return ""
    except (OSError, RuntimeError) as error:  # a full disk, a file where a folder should be, no permission
        with contextlib.suppress(OSError):  # (never written, or too long a name)
            tmp.unlink()
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        where = getattr(error, "filename", None)  # (a parent that is a file, say)
        return write_failure(error) if where in (None, str(tmp)) else f"{where}: {write_failure(error)}"


if __name__ == "__main__":
    main()
