#!/usr/bin/env python
"""Inference time and peak memory against resolution (the paper's Figure 3, with time added).

    python scripts/benchmark_resolution.py                                   # CPU defaults, a few minutes
    python scripts/benchmark_resolution.py --device cuda --dtype bfloat16 --resolutions 224 448 896 1248 1792

Writes <out>/resolution.{csv,json,png} and prints a markdown table with each configuration's
time and memory as a ratio to the first model (the baseline) at the same resolution.
"""
from __future__ import annotations

import argparse

from lion_vit.benchmark import (MEMORY_MODES, add_baseline_ratios, device_name, label, markdown_table, measure_rows,
                                non_negative_int, output_folder, plot_lines, positive_int, run_spec, write_table)

DEFAULT_RUNS = ["deit_small_patch16_224", "lion_d_small:attention", "lion_d_small:chunk:64", "lion_d_small:rnn"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", type=run_spec, default=[run_spec(r) for r in DEFAULT_RUNS],
                        help="model[:form[:chunk_size]], form one of attention/rnn/chunk for LION models; "
                             f"the first is the baseline (default: {' '.join(DEFAULT_RUNS)})")
    parser.add_argument("--resolutions", nargs="+", type=positive_int, default=[224, 448, 672, 896, 1248],
                        help="square image sizes in px, multiples of the patch size (16)")
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--device", default="cpu", type=device_name, help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=non_negative_int, default=2, help="timed runs after one warm-up (median)")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="measure every configuration this many times, round-robin, keeping the best time "
                             "(machine drift then hits all configurations alike)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per CPU configuration")
    parser.add_argument("--memory", default="steady", choices=MEMORY_MODES,
                        help="peak memory of a second forward (steady) or of the first call, one-time costs "
                             "such as library code paged in included (first)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile every model; its first, compiling call is timed on its own (compile_s)")
    parser.add_argument("--out", type=output_folder, default="bench_out", help="folder for the CSV, JSON and PNG")
    args = parser.parse_args()

    rows = [dict(model=model, form=form, chunk_size=chunk, resolution=resolution, tokens=(resolution // 16) ** 2,
                 batch_size=args.batch_size, device=args.device, dtype=args.dtype, memory=args.memory,
                 compile=args.compile)
            for resolution in args.resolutions for model, form, chunk in args.runs]
    measure_rows(rows, args.repeats, args.rounds, args.timeout, lambda row: f"{row['resolution']:5d}px ")
    for row in rows:
        add_baseline_ratios(row, next(r for r in rows if r["resolution"] == row["resolution"]))
    write_table(rows, args.out, "resolution")
    plot_lines(rows, "resolution", "resolution (px, square)", args.out / "resolution.png",
               f"inference, batch {args.batch_size}, {args.device} {args.dtype}{', compiled' if args.compile else ''}")
    for row in rows:
        row["run"] = label(row)
    print(markdown_table(rows, ["resolution", "run", "status", "time_s", "peak_mem_mb", "time_x_baseline",
                                "mem_x_baseline", *(["compile_s"] if args.compile else [])]))


if __name__ == "__main__":
    main()
