#!/usr/bin/env python
"""Inference time and peak memory against resolution (the paper's Figure 3, with time added).

    python scripts/benchmark_resolution.py                   # CPU defaults: 12-15 min on 2 cores (benchmarks.md)
    python scripts/benchmark_resolution.py --device cuda --dtype bfloat16 --resolutions 224 448 896 1248 1792

Writes <out>/resolution.{csv,json,png} and prints a markdown table with each configuration's
time and memory as a ratio to the first model (the baseline) at the same resolution.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts\' shared helpers (benchmarking.py)

from benchmarking import (HelpFormatter, add_baseline_ratios, add_inference_arguments, check_patch_multiples,
                          describe_settings, inference_settings, label, markdown_table, measure_rows, plot_lines,
                          positive_int, result_columns, run_spec, write_table)

DEFAULT_RUNS = ["deit_small_patch16_224", "lion_d_small:attention", "lion_d_small:chunk:64", "lion_d_small:rnn"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--runs", nargs="+", type=run_spec, default=[run_spec(r) for r in DEFAULT_RUNS],
                        help="model[:form[:chunk_size]], form one of attention/rnn/chunk for LION models; "
                             f"the first is the baseline (default: {' '.join(DEFAULT_RUNS)})")
    parser.add_argument("--resolutions", nargs="+", type=positive_int, default=[224, 448, 672, 896, 1248],
                        help="square image sizes in px, multiples of the patch size (16)")
    add_inference_arguments(parser)
    args = parser.parse_args()
    check_patch_multiples(parser, "--resolutions", args.resolutions)

    rows = [dict(model=model, form=form, chunk_size=chunk, resolution=resolution, tokens=(resolution // 16) ** 2,
                 **inference_settings(args))
            for resolution in args.resolutions for model, form, chunk in args.runs]
    measure_rows(rows, args.repeats, args.rounds, args.timeout, lambda row: f"{row['resolution']:5d}px ")
    for row in rows:
        add_baseline_ratios(row, next(r for r in rows if r["resolution"] == row["resolution"]))
    write_table(rows, args.out, "resolution")
    plot_lines(rows, "resolution", "resolution (px, square)", args.out / "resolution.png",
               f"inference, {describe_settings(args)}")
    for row in rows:
        row["run"] = label(row)
    print(markdown_table(rows, ["resolution", "run", *result_columns(args)]))


if __name__ == "__main__":
    main()
