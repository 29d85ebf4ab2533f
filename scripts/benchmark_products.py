#!/usr/bin/env python
"""The attention form's six L x L products of a training step, with the keys and the values' width as
they are and padded: whether padding would pay on a GPU, and what the normaliser's column of ones cost
(docs/benchmarks.md, "Training on the portable forms").

    python scripts/benchmark_products.py --device cuda          # 224 px (197 tokens), batch 256, bf16
    python scripts/benchmark_products.py --device cuda --tokens 197 577 --batch-size 64

Per head, a training step of the attention form (lion_vit/ops/attention.py) multiplies the scores Q K^T,
the weights by V, and in the backward the weights' gradient, V's, Q's and K's: six batched matmuls whose
rows are L or Dv wide. At L = 197 no bf16 row of an L x L tensor is a multiple of 16 bytes, which may keep
cuBLAS off its fastest kernels; padding the keys with zero rows changes no result. The values are Dv
wide (the code: the normaliser is the weights' row sums), Dv + 1 ([V, 1]: the normaliser as a column of
ones) or Dv + 1 padded with zero columns. Each row of the table times the six products
(torch.utils.benchmark, median) as a ratio to the first, the code's.
On a CPU it runs as a check (--device cpu --dtype float32): its times say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared helpers (benchmarking.py)

from benchmarking import HelpFormatter, markdown_table, positive_int

def padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def six_products(rows: int, length: int, keys: int, key_dim: int, width: int, device: torch.device,
                 dtype: torch.dtype) -> Callable[[], None]:
    """The six products for `rows` (batch x heads) sequences of `length` queries and `keys` keys: scores
    [L, keys], the weights times the values (`width` columns), and their four gradients."""
    generator = torch.Generator(device).manual_seed(0)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=generator).to(dtype)

    q, k, values = tensor(rows, length, key_dim), tensor(rows, keys, key_dim), tensor(rows, keys, width)
    weights, grad_out, grad_scores = tensor(rows, length, keys), tensor(rows, length, width), tensor(rows, length, keys)

    def step() -> None:
        q @ k.mT  # scores
        weights @ values  # numerator (and with a column of ones, normaliser)
        grad_out @ values.mT  # the weights' gradient
        weights.mT @ grad_out  # the values'
        grad_scores @ k  # Q's
        grad_scores.mT @ q  # K's
    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--tokens", nargs="+", type=positive_int, default=[197], help="L (224 px: 197)")
    parser.add_argument("--batch-size", type=positive_int, default=256)
    parser.add_argument("--heads", type=positive_int, default=6)
    parser.add_argument("--head-dim", type=positive_int, default=64)
    parser.add_argument("--multiple", type=positive_int, default=8, help="pad widths to a multiple of this")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds of timing per row")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmark_products.py: --device cuda, but torch.cuda.is_available() is False; --device cpu "
              "--dtype float32 runs it as a check", file=sys.stderr)
        return 2
    from torch.utils.benchmark import Timer

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows_of_table = []
    for length in args.tokens:
        first = None
        widths = (args.head_dim, args.head_dim + 1, padded(args.head_dim + 1, args.multiple))  # V, [V, 1], padded
        for keys, width in itertools.product((length, padded(length, args.multiple)), widths):
            step = six_products(args.batch_size * args.heads, length, keys, args.head_dim, width, device, dtype)
            step()  # (cuBLAS picks its kernels on the first call)
            us = Timer("step()", globals={"step": step}).blocked_autorange(min_run_time=args.min_time).median * 1e6
            first = first or us
            rows_of_table.append(dict(tokens=length, keys=keys, width=width, us=us, x=us / first))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (a check: no GPU timing)"
    print(f"{args.batch_size} x {args.heads} heads of {args.head_dim}, {args.dtype}, {name}\n")
    print(markdown_table(rows_of_table, ["tokens", "keys", "width", "us", "x"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
