#!/usr/bin/env python
"""Small-batch GPU inference: each model's eager forward against the replay of one CUDA graph of it.

At batch 1 a forward is bound by the host's time to launch its kernels (Python, flash-linear-attention's
autotuner lookups, a few dozen launches per LION layer), not by the GPU; a CUDA graph replays the
launches without the host, so the two times side by side say how much of a forward is launch overhead.

    python scripts/benchmark_cuda_graph.py             # 1248 px, batch 1: DeiT-S, LION-d and LION-d-natural chunk
    python scripts/benchmark_cuda_graph.py --profile   # and the eager forward's top operators: host, GPU
    python scripts/benchmark_cuda_graph.py --compile   # and torch.compile(mode="reduce-overhead", fullgraph=True)

Weights and input in bfloat16; times from triton.testing.do_bench (ms); the graph's output is checked
against an eager forward's. Prints a markdown table with each time as a ratio to the first model's (--out:
also as graphs.csv and graphs.json there, which gpu_targets.py reads).
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
from benchmarking import (HelpFormatter, build, check_patch_multiples, markdown_table, output_folder, positive_int,
                          run_spec, write_table)

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
        return do_bench(graph.replay, warmup=50, rep=300), _distance(out, ref)
    except Exception as error:  # a model whose forward cannot be captured is a row, not a crash
        return None, f"capture failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"


def compiled_time(model: torch.nn.Module, x: torch.Tensor) -> Tuple[Optional[float], str]:
    """(ms per call of torch.compile(model, mode="reduce-overhead", fullgraph=True): Inductor's code replayed
    as CUDA graphs, the compile not timed; how far its output is from an eager forward's), or (None, why)."""
    from triton.testing import do_bench
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):  # compile, record, replay
            out = compiled(x).clone()  # (a later replay overwrites the graph's output)
        return do_bench(lambda: compiled(x), warmup=50, rep=300), _distance(out, model(x))
    except Exception as error:  # a graph break (fullgraph) or a failed compile is a row, not a crash
        return None, f"compile failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"


def _distance(out: torch.Tensor, ref: torch.Tensor) -> str:
    return f"{((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item():.1e}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--runs", nargs="+", type=run_spec, default=[run_spec(r) for r in DEFAULT_RUNS],
                        help="model[:form[:chunk_size]]; the first is the baseline")
    parser.add_argument("--img-size", type=positive_int, default=1248)
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--compile", action="store_true",
                        help='also time torch.compile(model, mode="reduce-overhead", fullgraph=True) (CUDA graphs '
                             "of Inductor's code; each compile takes tens of seconds, not timed)")
    parser.add_argument("--out", type=output_folder, default=None,
                        help="a folder for the table as graphs.csv and graphs.json (default: printed only)")
    parser.add_argument("--profile", action="store_true",
                        help="also print each model's top operators by host time, then by GPU time, over three eager "
                             "forwards")
    args = parser.parse_args(argv)
    check_patch_multiples(parser, "--img-size", [args.img_size])
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
            compiled, compiled_check = compiled_time(model, x) if args.compile else (None, "")
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
                     "graph_vs_eager": check, "compiled_ms": compiled, "compiled_vs_eager": compiled_check})
        print(f"{name} {form or ''}: eager {eager:.2f} ms, CUDA graph "
              f"{'-' if graphed is None else f'{graphed:.2f} ms'} ({check})"
              + (f", compiled {'-' if compiled is None else f'{compiled:.2f} ms'} ({compiled_check})"
                 if args.compile else ""), flush=True)
    for row in rows:
        for column in ("eager", "graph", "compiled"):
            if row[f"{column}_ms"] is not None and rows[0][f"{column}_ms"] is not None:
                row[f"{column}_x_baseline"] = row[f"{column}_ms"] / rows[0][f"{column}_ms"]
    print(f"\n{args.img_size} px, batch {args.batch_size}, bfloat16, {torch.cuda.get_device_name()}\n")
    print(markdown_table(rows, ["model", "form", "eager_ms", "graph_ms", "eager_x_baseline", "graph_x_baseline",
                                "graph_vs_eager"] + (["compiled_ms", "compiled_x_baseline", "compiled_vs_eager"]
                                                     if args.compile else [])))
    if args.out is not None:
        write_table(rows, args.out, "graphs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
