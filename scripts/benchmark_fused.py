#!/usr/bin/env python
"""The fused attention form's kernel op by op on a GPU: the bidirectional kernel of ours in its code's launch
settings and in each other one given (lion_vit.ops.Tuning: bidirectional_forward, bidirectional_backward; and
the backward's key kernel in its other orientation, bidirectional_keys_first; every mask entry its own
exponential, bidirectional_factored_masks off: "entrywise"; the feature map applied to every tile of the kernels'
loops as they read it, with no pass mapping q and k first, bidirectional_map_pass off: "maps in loops"; the
forward's registers as ptxas allots them, bidirectional_forward_blocks 0: "uncapped"),
forward, and forward and backward, at one layer's shapes, as ratios to SDPA (DeiT-S's attention, the same q, k, v)
in the same run, and the portable attention form (backend torch) beside them. Row "softmax kernel" is softmax
attention as a Triton kernel in the code's launch settings (benchmark_issue.py's stand-in for SDPA, whose
instructions that script counts without a GPU): its ratio to SDPA is that count's calibration.

    python scripts/benchmark_fused.py                              # 224 px, batch 256
    python scripts/benchmark_fused.py --img-size 448 --batch-size 64 --backward 64,32,8 32,32,4

One LION layer's call as a ViT-S/16 makes it: 6 heads of 64, bfloat16 raw q, k (feature map silu_norm, which
the kernels apply) and v as views of one projection, for LION-d (a decay per head), LION-s (per token) and
LION-s-natural (two snake scans, class token first), decays in (0.5, 1), and LION-lit, whose code runs
Q (K^T V) in its linear kernels ("linear kernels"; Q (K^T V) in torch matmuls, "linear", and the bidirectional
kernel forced, every decay 1, beside them). Settings as
own,loop,warps: tokens of a program's own tile, tokens per tile of its loop (powers of two, at least 16),
warps. Each row's outputs and gradients are compared with those of the kernel in the code's settings (diff: the
largest relative difference). Times from triton.testing.do_bench, in microseconds. Under TRITON_INTERPRET=1 it
runs on a CPU, the comparison without the times (use a small --img-size and --batch-size). A kernel that fails
(its compiler's or the driver's error) is a row of status "error", its reason printed; the rows after it still
run, and the exit code is 1.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from functools import partial
from pathlib import Path
from typing import Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared helpers (benchmarking.py)

from benchmarking import (STATUS_ERROR, HelpFormatter, error_detail, kernel_time_us, kernel_timing, launch_setting,
                          markdown_table, output_folder, positive_int, write_table)
from lion_vit.ops.tuning import Tuning, tuned, tuning

Setting = Tuple[int, int, int]
CASES = ("lion_lit", "lion_d", "lion_s", "lion_s_natural")


def launch_settings(forward: Optional[Setting] = None, backward: Optional[Setting] = None,
                    keys_first: Optional[bool] = None, factored: Optional[bool] = None,
                    map_pass: Optional[bool] = None, blocks: Optional[int] = None) -> contextlib.AbstractContextManager:
    """The bidirectional kernel's settings inside the block (None: the code's)."""
    given = dict(bidirectional_forward=forward, bidirectional_backward=backward, bidirectional_keys_first=keys_first,
                 bidirectional_factored_masks=factored, bidirectional_map_pass=map_pass,
                 bidirectional_forward_blocks=blocks)
    return tuned(**{name: value for name, value in given.items() if value is not None})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--img-size", type=positive_int, default=224, help="a multiple of 16")
    parser.add_argument("--batch-size", type=positive_int, default=256)
    parser.add_argument("--forward", nargs="+", type=launch_setting, default=[(128, 64, 8), (64, 32, 4)],
                        metavar="O,L,W", help="the bidirectional forward kernel's settings to try besides the code's")
    parser.add_argument("--backward", nargs="+", type=launch_setting, default=[(64, 32, 8), (32, 32, 4), (64, 64, 8)],
                        metavar="O,L,W", help="the bidirectional backward kernels' settings to try besides the "
                                              "code's")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--out", type=output_folder, default=None,
                        help="a folder for the table as fused.csv and fused.json (default: printed only)")
    args = parser.parse_args(argv)
    timing = kernel_timing(parser, args.img_size)
    if timing is None:
        return 2
    device, dtype, interpreted = timing
    import torch.nn.functional as F

    from benchmark_issue import softmax_attention
    from lion_vit.ops import Plan, lion_attention, snake_orders

    side, heads, width, batch = args.img_size // 16, 6, 64, args.batch_size
    length = side * side + 1
    knobs = tuning()
    code = (knobs.bidirectional_forward, knobs.bidirectional_backward, knobs.bidirectional_keys_first,
            knobs.bidirectional_factored_masks, knobs.bidirectional_map_pass, knobs.bidirectional_forward_blocks)
    kernels = [("bidirectional", *code)]
    kernels += [("bidirectional", forward, *code[1:]) for forward in args.forward if forward != code[0]]
    kernels += [("bidirectional", code[0], backward, *code[2:]) for backward in args.backward if backward != code[1]]
    kernels += [("bidirectional", *code[:2], not code[2], *code[3:])]  # the key kernel's other orientation
    kernels += [("bidirectional", *code[:3], not code[3], *code[4:])]  # the masks factored or not
    kernels += [("bidirectional", *code[:4], not code[4], code[5])]  # the map: a pass first, or in the loops
    other_cap = 0 if code[5] else Tuning().bidirectional_forward_blocks  # (the default cap where the code has none)
    kernels += [("bidirectional", *code[:5], other_cap)]  # the forward's registers capped or not
    rows = []
    for case in args.cases:
        generator = torch.Generator(device).manual_seed(0)
        projection = torch.randn(batch, length, 3, heads, width, device=device, generator=generator).to(dtype)
        scans = 2 if case == "lion_s_natural" else 1
        per_token = case in ("lion_s", "lion_s_natural")
        decays = torch.rand(scans, batch if per_token else 1, heads, length if per_token else 1, device=device,
                            generator=generator) * 0.5 + 0.5
        orders = snake_orders(side, side, num_prefix_tokens=1).to(device) if scans == 2 else None
        leaves = [projection.requires_grad_()] + ([] if case == "lion_lit" else [torch.log(decays).requires_grad_()])
        upstream = torch.randn(batch, heads, length, width, device=device, generator=generator).to(dtype)

        def attention(backend: str = "triton", kernel: Optional[str] = None):
            """The layer's call; kernel: the bidirectional kernel forced (LION-lit's plan runs its linear
            kernels)."""
            q, k, v = leaves[0].permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, L, D] views of the projection
            plan = Plan("attention", "triton", whole=True) if kernel and case == "lion_lit" else None
            return lion_attention(q, k, v, leaves[1] if len(leaves) > 1 else None, orders, form="attention",
                                  backend=backend, feature_map="silu_norm", plan=plan)

        def sdpa():
            q, k, v = leaves[0].permute(2, 0, 3, 1, 4).unbind(0)
            return F.scaled_dot_product_attention(q, k, v)

        def softmax_kernel():
            q, k, v = leaves[0].permute(2, 0, 3, 1, 4).unbind(0)
            return softmax_attention(q, k, v, forward=code[0], backward=code[1])

        expected, softmax_expected, first = None, None, len(rows)
        unset = (None,) * 6
        runs = [("sdpa", *unset, sdpa), ("softmax kernel", *code[:2], *unset[2:], softmax_kernel)]
        runs += [(*kernel, partial(attention, kernel=kernel[0])) for kernel in kernels]
        # the portable form, which for LION-lit is Q (K^T V) in torch matmuls, after LION-lit's code: its linear kernels
        runs += [("linear kernels", *unset, attention)] if case == "lion_lit" else []
        runs += [("linear" if case == "lion_lit" else "torch", *unset, partial(attention, "torch"))]
        for name, forward, backward, keys_first, factored, map_pass, blocks, call in runs:
            settings = dict(forward=_text(forward, factored=factored, map_pass=map_pass, blocks=blocks),
                            backward=_text(backward, keys_first, factored, map_pass))
            with launch_settings(forward, backward, keys_first, factored, map_pass, blocks):
                try:
                    out = call()
                    softmax = name in ("sdpa", "softmax kernel")
                    results = [out.detach(), *torch.autograd.grad(out, leaves[:1] if softmax else leaves, upstream)]
                except Exception as error:  # out of memory, or a kernel this GPU's compiler or driver refuses: a row
                    oom = isinstance(error, torch.cuda.OutOfMemoryError)
                    rows.append(dict(case=case, kernel=name, **settings,
                                     status="out of memory" if oom else STATUS_ERROR))
                    what = " ".join(filter(None, (case, name, *settings.values())))
                    print(f"{what}: {error_detail(error)}", flush=True)
                    torch.cuda.empty_cache()  # (nothing to free where CUDA never started: the interpreter's)
                    continue
                diff = None
                # (the code's settings: what the others are compared with; where it failed, no diffs)
                if name == "bidirectional" and (forward, backward, keys_first, factored, map_pass, blocks) == code:
                    expected = results
                elif name == "sdpa":
                    softmax_expected = results
                elif name == "softmax kernel" and softmax_expected is not None:  # (against SDPA's)
                    diff = f"{max(_relative(got, want) for got, want in zip(results, softmax_expected)):.1e}"
                elif expected is not None:
                    diff = f"{max(_relative(got, want) for got, want in zip(results, expected)):.1e}"
                times = (None, None) if interpreted else (
                    kernel_time_us(call), kernel_time_us(lambda: torch.autograd.grad(call(), leaves, upstream,
                                                                                       allow_unused=True)))
            rows.append(dict(case=case, kernel=name, **settings, status="ok", forward_us=times[0], train_us=times[1],
                             diff=diff))
        if not interpreted:  # ratios to this case's SDPA row
            baseline = rows[first]
            for row in rows[first:]:
                if row["status"] == "ok" and baseline["status"] == "ok":
                    row["forward_x"] = row["forward_us"] / baseline["forward_us"]
                    row["train_x"] = row["train_us"] / baseline["train_us"]
    print(f"{args.img_size} px ({length} tokens), batch {batch}, {heads} heads of {width}, {dtype}, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU, interpreted: no times'}\n")
    print(markdown_table(rows, ["case", "kernel", "forward", "backward", "status", "forward_us", "forward_x",
                                "train_us", "train_x", "diff"]))
    if args.out is not None:
        write_table(rows, args.out, "fused")
    return 1 if any(row["status"] == STATUS_ERROR for row in rows) else 0


def _text(value: Optional[Setting], keys_first: Optional[bool] = None, factored: Optional[bool] = None,
          map_pass: Optional[bool] = None, blocks: Optional[int] = None) -> str:
    """A setting as own,loop,warps; a backward one with " keys first" where its key kernel's tiles are [keys,
    queries]; either with " entrywise" where no mask tile is factored, and " maps in loops" where no pass maps q
    and k first; a forward one with " uncapped" where its registers are not capped (blocks 0)."""
    return "" if value is None else ",".join(map(str, value)) + (" keys first" if keys_first else "") + \
        (" entrywise" if factored is False else "") + (" maps in loops" if map_pass is False else "") + \
        (" uncapped" if blocks == 0 else "")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


if __name__ == "__main__":
    sys.exit(main())
