#!/usr/bin/env python
"""Chunk-size sweep at a fixed high resolution (the paper's Figure 4): time and peak memory.

    python scripts/benchmark_chunk.py                                        # lion_d_small, 1248 px, CPU
    python scripts/benchmark_chunk.py --device cuda --models lion_d_small lion_s_small --resolution 1792

Also measures the baseline (--baseline, default DeiT-S) and the attention and rnn forms at the same
resolution for reference. Writes <out>/chunk.{csv,json,png}.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts\' shared helpers (benchmarking.py)

from benchmarking import (HelpFormatter, add_baseline_ratios, add_inference_arguments, check_patch_multiples,
                          describe_settings, inference_settings, label, lion_model_name, markdown_table, measure_rows,
                          model_name, plot_lines, positive_int, result_columns, write_table)
from lion_vit.ops import FORM_NAMES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--models", nargs="+", type=lion_model_name, default=["lion_d_small"], help="LION models")
    parser.add_argument("--chunk-sizes", nargs="+", type=positive_int, default=[16, 64, 256, 1024])
    parser.add_argument("--resolution", type=positive_int, default=1248, help="a multiple of the patch size (16)")
    parser.add_argument("--baseline", default="deit_small_patch16_224", type=lambda text: text and model_name(text),
                        help="'' to skip")
    parser.add_argument("--reference-forms", nargs="*", choices=sorted(set(FORM_NAMES) - {"chunk"}), default=["rnn"],
                        help="other forms to measure too")
    add_inference_arguments(parser)
    args = parser.parse_args()
    check_patch_multiples(parser, "--resolution", [args.resolution])

    configs = [(args.baseline, None, None)] if args.baseline else []
    for model in args.models:
        configs += [(model, "chunk", c) for c in args.chunk_sizes] + [(model, f, None) for f in args.reference_forms]
    rows = [dict(model=model, form=form, chunk_size=chunk, resolution=args.resolution, **inference_settings(args))
            for model, form, chunk in configs]
    measure_rows(rows, args.repeats, args.rounds, args.timeout)
    if args.baseline:
        for row in rows:
            add_baseline_ratios(row, rows[0])
    write_table(rows, args.out, "chunk")
    chunk_rows = [r for r in rows if r["form"] == "chunk"]
    plot_lines(chunk_rows, "chunk_size", "chunk size (tokens)", args.out / "chunk.png",
               f"chunk form at {args.resolution}px, {describe_settings(args)}", log_x=True)
    for row in rows:
        row["run"] = label(row)
    print(markdown_table(rows, ["run", *result_columns(args)]))


if __name__ == "__main__":
    main()
