#!/usr/bin/env python
"""Small-batch GPU inference: each model's eager forward against the replay of one CUDA graph of it.

At batch 1 a forward is bound by the host's time to launch its kernels (Python, flash-linear-attention's
autotuner lookups, a few dozen launches per LION layer), not by the GPU; a CUDA graph replays the
launches without the host, so the two times side by side say how much of a forward is launch overhead.

    python scripts/benchmark_cuda_graph.py             # 1248 px, batch 1: DeiT-S, LION-d and LION-d-natural chunk
    python scripts/benchmark_cuda_graph.py --profile   # and the eager forward's top operators: host, GPU

Weights and input in bfloat16; times from triton.testing.do_bench (ms); the graph's output is checked
against an eager forward's. Prints a markdown table with each time as a ratio to the first model's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared helpers (benchmarking.py)

import lion_vit  # noqa: F401  (registers the LION models)
from benchmarking import HelpFormatter, build, markdown_table, positive_int, run_spec

DEFAULT_RUNS = ["deit_small_patch16_224", "lion_d_small:chunk:64", "lion_d_natural_small:chunk:64"]


def graphed_time(model: torch.nn.Module, x: torch.Tensor) -> Tuple[Optional[float], str]:
    """(ms per replay, how far the graph's output is from an eager forward's), or (None, why it failed)."""
    from triton.testing import do_bench
    try:
        side = torch.cuda.Stream()  # warm up (autotuning included) off the capturing stream, as CUDA graphs ask
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x)
        ref = model(x)
        graph.replay()
        torch.cuda.synchronize()
        diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        return do_bench(graph.replay, warmup=50, rep=300), f"{diff:.1e}"
    except Exception as error:  # a model whose forward cannot be captured is a row, not a crash
        return None, f"capture failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--runs", nargs="+", type=run_spec, default=[run_spec(r) for r in DEFAULT_RUNS],
                        help="model[:form[:chunk_size]]; the first is the baseline")
    parser.add_argument("--img-size", type=positive_int, default=1248)
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--profile", action="store_true",
                        help="also print each model's top operators by host time, then by GPU time, over three eager "
                             "forwards")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmark_cuda_graph.py: CUDA graphs need a GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    from triton.testing import do_bench
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device="cuda", dtype=torch.bfloat16)
    rows = []
    for name, form, chunk_size in args.runs:
        model = build(name, form, chunk_size, args.img_size, torch.device("cuda"), torch.float32)
        model = model.to(torch.bfloat16)
        with torch.no_grad():
            eager = do_bench(lambda: model(x), warmup=50, rep=300)
            graphed, check = graphed_time(model, x)
            if args.profile:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        model(x)
                    torch.cuda.synchronize()
                print(f"{name} {form or ''}: eager forwards x3")
                for key in ("self_cpu_time_total", "self_cuda_time_total"):  # host time, then the GPU's kernels
                    print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=50))
        rows.append({"model": name, "form": form or "", "eager_ms": eager, "graph_ms": graphed,
                     "graph_vs_eager": check})
        print(f"{name} {form or ''}: eager {eager:.2f} ms, CUDA graph "
              f"{'-' if graphed is None else f'{graphed:.2f} ms'} ({check})", flush=True)
    for row in rows:
        row["eager_x_baseline"] = row["eager_ms"] / rows[0]["eager_ms"]
        if row["graph_ms"] is not None and rows[0]["graph_ms"] is not None:
            row["graph_x_baseline"] = row["graph_ms"] / rows[0]["graph_ms"]
    print(f"\n{args.img_size} px, batch {args.batch_size}, bfloat16, {torch.cuda.get_device_name()}\n")
    print(markdown_table(rows, ["model", "form", "eager_ms", "graph_ms", "eager_x_baseline", "graph_x_baseline",
                                "graph_vs_eager"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
