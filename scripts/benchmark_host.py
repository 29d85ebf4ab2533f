#!/usr/bin/env python
"""A CPU proxy for the host's share of small-batch GPU inference: each model's eager forward with every Triton
launch a no-op, against DeiT-S's (docs/benchmarks.md, "Host time per forward").

    python scripts/benchmark_host.py                                   # DeiT-S and the five small LION models
    python scripts/benchmark_host.py --models deit_small_patch16_224 lion_d_small --rounds 30

At batch 16 and 224 px a GPU forward of DeiT-S or LION-d can be bound by the host: the Python, PyTorch's
dispatcher and the launches that queue the kernels, not the kernels. This times that work without a GPU. The
LION models plan the triton backend's kernels (under Triton's interpreter, which this script turns on) and
every Triton launch returns at once, so the kernels' arithmetic is left out; the tokens and widths are tiny
(--img-size 32: 4 patches and a class token; --width 48), so the CPU's arithmetic in the other operators stays
small too, and each forward costs about what its host costs. Each model's best time over --rounds rounds,
round-robin, each of --forwards forwards, on one thread; the first model is the baseline. A GPU adds each
launch's own cost (a few microseconds), which this leaves out: the table counts a forward's launches (PyTorch's
operators that would run a kernel, and Triton's kernels, also apart). On a CPU the LION layers also check that
their decays are at most 1 (three operators and a wait a layer), which a GPU skips.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

os.environ["TRITON_INTERPRET"] = "1"  # before Triton's language module is imported: the kernels' host path here
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared helpers (benchmarking.py)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import lion_vit  # noqa: E402, F401  (registers the LION models)
from benchmarking import (HelpFormatter, markdown_table, model_name, output_folder, positive_int,  # noqa: E402
                          write_table)

DEFAULT_MODELS = ["deit_small_patch16_224", "lion_lit_small", "lion_d_small", "lion_s_small", "lion_d_natural_small",
                  "lion_s_natural_small"]
# operators that make views or read metadata: no kernel on a GPU
_NO_KERNEL = ("view", "_unsafe_view", "t", "transpose", "permute", "unsqueeze", "squeeze", "expand", "slice",
              "select", "unbind", "alias", "as_strided", "detach", "split", "split_with_sizes", "reshape",
              "promote_types", "empty", "new_empty", "empty_strided", "unflatten")


class _Operators(TorchDispatchMode):
    """Counts PyTorch's operators that would launch a kernel on a GPU (views, metadata and allocations left
    out)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in _NO_KERNEL:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Launches:
    """Makes every Triton launch (ours and flash-linear-attention's, under the interpreter) return at once, and
    counts them."""

    def __init__(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction
        self.count = 0
        InterpretedFunction.__getitem__ = lambda function, grid: self.launch
        InterpretedFunction.run = lambda function, *args, **kwargs: self.launch()

    def launch(self, *args, **kwargs) -> None:
        self.count += 1


def build(name: str, img_size: int, width: int) -> torch.nn.Module:
    import timm
    lion = {} if not name.startswith("lion_") else dict(attn_backend="triton", attn_form="attention")
    return timm.create_model(name, img_size=img_size, embed_dim=width, **lion).eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--models", nargs="+", type=model_name, default=DEFAULT_MODELS,
                        help="timm names; the first is the baseline")
    parser.add_argument("--img-size", type=positive_int, default=32)
    parser.add_argument("--width", type=positive_int, default=48, help="embed_dim (a multiple of the heads)")
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--rounds", type=positive_int, default=15)
    parser.add_argument("--forwards", type=positive_int, default=40, help="forwards timed together in a round")
    parser.add_argument("--out", type=output_folder, default=None,
                        help="a folder for the table as host.csv and host.json (default: printed only)")
    args = parser.parse_args(argv)
    launches = _Launches()
    torch.set_num_threads(1)
    models = {name: build(name, args.img_size, args.width) for name in args.models}
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size)
    best: Dict[str, float] = {name: float("inf") for name in models}
    operators: Dict[str, Tuple[int, int]] = {}
    with torch.no_grad():
        for name, model in models.items():
            for _ in range(5):  # (first calls: plans, kept indices, caches)
                model(x)
            before = launches.count
            with _Operators() as counted:
                model(x)
            operators[name] = (counted.count, launches.count - before)
        for _ in range(args.rounds):  # round-robin: the host's drift hits every model alike
            for name, model in models.items():
                start = time.perf_counter()
                for _ in range(args.forwards):
                    model(x)
                best[name] = min(best[name], (time.perf_counter() - start) / args.forwards)
    baseline = args.models[0]
    rows: List[dict] = []
    for name, model in models.items():
        blocks = len(getattr(model, "blocks", [])) or 1
        rows.append({"model": name, "host_ms": best[name] * 1e3, "x_baseline": best[name] / best[baseline],
                     "more_us_per_block": (best[name] - best[baseline]) * 1e6 / blocks,
                     "launches": sum(operators[name]), "triton_launches": operators[name][1],
                     "img_size": args.img_size, "width": args.width,
                     "batch_size": args.batch_size})
    print(f"\nhost time per eager forward, Triton launches doing nothing: {args.img_size} px, width {args.width}, "
          f"batch {args.batch_size}, one thread; baseline {baseline}\n")
    print(markdown_table(rows, ["model", "host_ms", "x_baseline", "more_us_per_block", "launches", "triton_launches"]))
    if args.out is not None:
        write_table(rows, args.out, "host")
    return 0


if __name__ == "__main__":
    sys.exit(main())
