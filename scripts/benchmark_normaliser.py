#!/usr/bin/env python
"""The normaliser scan's launch settings on a GPU (lion_vit/ops/triton/normaliser.py; the knob
Tuning.normaliser_launch: tokens per chunk, chunk sums per carry tile, warps): its forward, and its forward and
backward, at one LION-d layer's shapes, for every combination given, as ratios to the code's settings (the
first row).

    python scripts/benchmark_normaliser.py                      # 1248 px, batch 1 and 16
    python scripts/benchmark_normaliser.py --tokens 32 64 128 --warps 2 4 8 --carry 8 16 32

The kernels see 2 x batch sequences (each one and its mirror), (img_size / 16)^2 + 1 tokens, 6 heads
of 64 (ViT-S), bfloat16 q and k, a gate per head. Every combination's normalisers and gradients are
compared with the code's settings' (the diff column: the largest relative difference). Times from
triton.testing.do_bench, in microseconds. Under TRITON_INTERPRET=1 it runs on a CPU, the comparison
without the times (use a small --img-size).
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared helpers (benchmarking.py)

from benchmarking import HelpFormatter, kernel_time_us, kernel_timing, markdown_table, positive_int
from lion_vit.ops.features import query_scale
from lion_vit.ops.tuning import Tuning, tuned


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"{text}: use a power of two")
    return value


def chunk_tokens(text: str) -> int:
    if power_of_two(text) < 16:
        raise argparse.ArgumentTypeError(f"{text} tokens per chunk: use a power of two, at least 16")
    return int(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[1, 16])
    parser.add_argument("--img-size", type=positive_int, default=1248, help="a multiple of 16")
    parser.add_argument("--tokens", nargs="+", type=chunk_tokens, default=[32, 64, 128], help="tokens per chunk")
    parser.add_argument("--warps", nargs="+", type=power_of_two, default=[1, 2, 4, 8], help="warps")
    parser.add_argument("--carry", nargs="+", type=power_of_two, default=[16], help="chunk sums per carry tile")
    args = parser.parse_args(argv)
    timing = kernel_timing(parser, args.img_size)
    if timing is None:
        return 2
    device, dtype, interpreted = timing
    from lion_vit.ops.triton import normaliser

    length, heads, width = (args.img_size // 16) ** 2 + 1, 6, 64
    tokens, carry, warps = Tuning().normaliser_launch
    code = (tokens, warps, carry)  # (the table's order)
    combinations = [code] + [c for c in itertools.product(args.tokens, args.warps, args.carry) if c != code]
    rows = []
    for batch in args.batch_sizes:
        generator = torch.Generator(device).manual_seed(0)
        q, k = (torch.rand(2 * batch, length, heads, width, device=device, generator=generator).to(dtype)
                for _ in range(2))
        k = torch.nn.functional.normalize(k.float(), dim=-1).to(dtype)
        gates = torch.log(torch.linspace(0.9, 0.999, heads, device=device)).expand(2 * batch, length, heads)
        gates = gates.contiguous()
        grad = torch.randn(2 * batch, length, heads, device=device, generator=generator)
        leaves = [t.clone().requires_grad_() for t in (q, k, gates)]

        def forward():
            return normaliser.Normaliser.apply(*leaves, query_scale(length))

        def train(out=None):
            return torch.autograd.grad(forward() if out is None else out, leaves, grad)

        expected, first = None, len(rows)
        for combination in combinations:
            tokens, warps, carry = combination
            with tuned(normaliser_launch=(tokens, carry, warps)):
                out = forward()
                results = [out.detach(), *train(out)]
                if expected is None:
                    expected = results
                diff = max(float((got.float() - want.float()).norm() / want.float().norm())
                           for got, want in zip(results, expected))
                forward_us, train_us = (None, None) if interpreted else (kernel_time_us(forward), kernel_time_us(train))
            rows.append(dict(batch=batch, tokens=combination[0], warps=combination[1], carry=combination[2],
                             forward_us=forward_us, train_us=train_us, diff=f"{diff:.1e}"))
        if not interpreted:  # ratios to this batch's first row, the code's settings
            for row in rows[first:]:
                row["forward_x"] = row["forward_us"] / rows[first]["forward_us"]
                row["train_x"] = row["train_us"] / rows[first]["train_us"]
    print(f"{args.img_size} px ({length} tokens), {heads} heads of {width}, {dtype}, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU, interpreted: no times'}\n")
    print(markdown_table(rows, ["batch", "tokens", "warps", "carry", "forward_us", "forward_x", "train_us", "train_x",
                                "diff"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
