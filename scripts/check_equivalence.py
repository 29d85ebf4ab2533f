#!/usr/bin/env python
"""Measure how far the rnn and chunk forms are from the attention form, per model.

    python scripts/check_equivalence.py                       # all 15 models, 224 and 320x480, fp32
    python scripts/check_equivalence.py --models lion_gla_small lion_gla_natural_small   # Table 1 families
    python scripts/check_equivalence.py --models lion_d_small --sizes 448x448 --dtype float64
    python scripts/check_equivalence.py --dtype bfloat16      # each form under autocast, the attention form too

Decays are set "trained-like" (spread far from their initial values) so the masks are far from
all-ones. Prints one line per model/size/form: max |logits - reference| / max |reference|, and for
the chunk form how many chunks a sequence is cut into: 1 where it runs one product over the whole
sequence because chunks would cost more (LION-lit always, the two-scan models at 224 px), which
then matches the attention form exactly (or, for one chunk of one scan, to float rounding).
With --dtype bfloat16 or float16 the weights and the reference stay float32 (the attention form, no autocast) and
every form runs under autocast to that dtype, as training and mixed-precision inference do, the attention form
first: its error is the 16-bit rounding the others are measured against (x_attention, their error over its).
On CUDA the GPU kernels' float32 dots run in full precision (TRITON_F32_DEFAULT=ieee) rather than
Triton's default TF32, whose rounding would hide the forms' own disagreement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # (read when a kernel compiles: before any does)

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts\' shared helpers (benchmarking.py)

import lion_vit
from benchmarking import HelpFormatter, chunks_text, device_name, lion_model_name, output_file, positive_int
from lion_vit.testing import randomize_decays


def parse_size(text: str) -> tuple:
    """argparse type: "HxW" (or "S" for a square) -> (H, W)."""
    h, _, w = text.partition("x")
    try:
        return positive_int(h), positive_int(w or h)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected HxW with positive integers, such as 224x224, got {text!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--models", nargs="+", type=lion_model_name, default=list(lion_vit.LION_MODEL_NAMES),
                        metavar="MODEL", help="LION models, the paper's Table 1 families (lion_gla_small, ...; "
                                              "docs/models.md), _distilled ones too (default: the 15 LION models)")
    # 320x480 (600 tokens): long enough that every model with decays, two-scan ones included, runs chunks
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[(224, 224), (320, 480)],
                        help="HxW, multiples of the patch size 16 (default: 224x224 320x480)")
    parser.add_argument("--chunks", nargs="+", type=positive_int, default=[64, 37])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"],
                        help="the weights' dtype, or a 16-bit one: float32 weights, each form under autocast to it")
    parser.add_argument("--batch-size", type=positive_int, default=2)
    parser.add_argument("--device", default="cpu", type=device_name, help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, decays and inputs (default 0)")
    parser.add_argument("--json", type=output_file, help="also write the results to this file")
    args = parser.parse_args()
    autocast = args.dtype in ("bfloat16", "float16")
    dtype = torch.float32 if autocast else getattr(torch, args.dtype)  # (the weights')
    autocast_dtype = getattr(torch, args.dtype) if autocast else None
    forms = [("attention", None)] * autocast + [("rnn", None)] + [("chunk", c) for c in args.chunks]
    rows = []
    for name in args.models:
        torch.manual_seed(args.seed)  # the same weights in every run: the printed figures are reproducible
        model = timm.create_model(name, num_classes=10).to(dtype).eval()
        randomize_decays(model, seed=args.seed)
        model.to(args.device)
        for size in args.sizes:
            generator = torch.Generator().manual_seed(args.seed + 1)
            x = torch.randn(args.batch_size, 3, *size, dtype=dtype, generator=generator)
            x = x.to(args.device)
            with torch.no_grad():
                try:
                    reference = model.set_attn_form("attention")(x)
                except ValueError as error:  # a size the patch does not divide
                    parser.error(f"argument --sizes: {error}")
                for form, chunk in forms:
                    with torch.autocast(x.device.type, dtype=autocast_dtype, enabled=autocast):
                        out = model.set_attn_form(form, chunk)(x).float()
                    err = ((out - reference).abs().max() / reference.abs().max()).item()
                    chunks = model.chunks_per_sequence(size)
                    row = dict(model=name, size=f"{size[0]}x{size[1]}", form=form, chunk_size=chunk, chunks=chunks,
                               dtype=args.dtype, device=args.device, rel_err=err)
                    if autocast:  # (the attention form comes first: its error the yardstick)
                        yardstick = err if form == "attention" else yardstick
                        row["x_attention"] = err / max(yardstick, 1e-30)
                    rows.append(row)
                    ratio = f"  x_attention={row['x_attention']:.2f}" if autocast and form != "attention" else ""
                    print(f"{name:24s} {size[0]}x{size[1]:<4d} {form:9s} C={str(chunk):4s} {chunks_text(chunks):10s} "
                          f"rel_err={err:.2e}{ratio}", flush=True)
    worst = max(rows, key=lambda r: r["rel_err"])
    print(f"worst: {worst['rel_err']:.2e} ({worst['model']}, {worst['size']}, {worst['form']} C={worst['chunk_size']})")
    if autocast:
        worst = max((r for r in rows if r["form"] != "attention"), key=lambda r: r["x_attention"])
        print(f"worst against the attention form under autocast: x{worst['x_attention']:.2f} ({worst['model']}, "
              f"{worst['size']}, {worst['form']} C={worst['chunk_size']})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
