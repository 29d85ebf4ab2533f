#!/usr/bin/env python
r"""Training-step throughput of LION models against DeiT in the same process (the paper's Table 2
"train time"): forward, backward and AdamW step at 224 px, timed round-robin over the models so
machine noise hits them all alike.

    python scripts/benchmark_train.py                                    # small scale, batch 32, CPU fp32
    python scripts/benchmark_train.py --device cuda --dtype bfloat16 --batch-size 256

    python scripts/benchmark_train.py --device cuda --dtype bfloat16 --img-size 512 \
        --models deit_small_patch16_224 lion_d_small:attention lion_d_small:chunk   # which form trains faster

Prints each model's step time as a ratio to the baseline (the first model): the ratio of best steps,
and the median of the per-round ratios (paired: robust to a machine whose speed drifts), and writes
<out>/train.{csv,json,png}. A model that runs out of GPU memory is recorded as such and left out.
Peak memory: on CUDA that of the warm-up step; on a CPU, with --memory, the peak RSS growth of a step in a
fresh process per model (slower: the models are built and stepped again).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts\' shared helpers (benchmarking.py)

import lion_vit  # noqa: F401  (registers the LION models)
from benchmarking import (STATUS_ERROR, STATUS_OK, HelpFormatter, add_backend_argument, device_name, error_detail,
                          markdown_table, model_name, output_folder, paired_ratio, positive_int, pyplot,
                          run_spec, train_memory_in_subprocess, write_table)
from lion_vit.engine.allocator import keep_freed_memory
from lion_vit.models import create_model_at_size
from lion_vit.ops import FORM_CHOICES
from lion_vit.ops.tuning import CHUNK_BACKWARD_FALLBACKS, tuned, tuning

DEFAULT_MODELS = ["deit_small_patch16_224", "lion_lit_small", "lion_d_small", "lion_s_small",
                  "lion_d_natural_small", "lion_s_natural_small"]


def train_spec(text: str):
    """argparse type: model[:form[:chunk_size]] as benchmark_resolution.py's --runs, where a LION model
    without a form takes --attn-form."""
    return run_spec(text) if ":" in text else (model_name(text), None, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--models", nargs="+", type=train_spec, default=[(m, None, None) for m in DEFAULT_MODELS],
                        metavar="MODEL[:FORM[:CHUNK]]",
                        help="the first is the baseline; a LION model may name its form")
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--img-size", type=positive_int, default=224, help="a multiple of the patch size (16)")
    parser.add_argument("--device", default="cpu", type=device_name, help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--steps", type=positive_int, default=3,
                        help="timed rounds (one step per model each) after one warm-up; the best step and the "
                             "median per-round ratio are reported")
    parser.add_argument("--compile", action="store_true", help="torch.compile every model")
    parser.add_argument("--grad-checkpointing", action="store_true",
                        help="timm's gradient checkpointing in every model (train.py's grad_checkpointing=true)")
    parser.add_argument("--attn-form", default="auto", choices=FORM_CHOICES,
                        help="the LION models' form (auto: attention, or for long sequences the chunk form on a CPU "
                             "and the chunk kernels on CUDA)")
    add_backend_argument(parser)
    parser.add_argument("--chunk-backward-fallback", choices=sorted(CHUNK_BACKWARD_FALLBACKS),
                        default=tuning().chunk_backward_fallback,
                        help="what trains in the chunk form where flash-linear-attention's chunk backward fails "
                             "(Hopper with Triton 3.4.0-3.7.0): lion_vit.ops.Tuning.chunk_backward_fallback")
    parser.add_argument("--malloc", default="keep", choices=["keep", "default"],
                        help="CPU: 'keep' freed memory for reuse as train.py does (cpu_keep_freed_memory), "
                             "or glibc's 'default' (large tensors page-faulted in again every step)")
    parser.add_argument("--memory", action="store_true",
                        help="CPU: also the peak RSS growth of a training step, each model in a fresh process "
                             "(benchmarking.measure_train_memory; CUDA measures peak memory always)")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile one more step per model and print its most expensive ops "
                             "(where the time goes: shared linear/MLP matmuls vs attention)")
    parser.add_argument("--out", type=output_folder, default="bench_out", help="folder for the CSV, JSON and PNG")
    args = parser.parse_args()
    with tuned(chunk_backward_fallback=args.chunk_backward_fallback):
        _measure(parser, args)


def _measure(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Build, time (and profile) the models that args name; write and print the table."""
    if args.device == "cpu" and args.malloc == "keep":
        keep_freed_memory()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=device)
    y = torch.randint(0, 1000, (args.batch_size,), device=device)
    labels = [":".join(str(part) for part in spec if part is not None) for spec in args.models]
    if len(set(labels)) < len(labels):
        parser.error(f"{max(labels, key=labels.count)} is named twice in --models; name each model (and form) once")
    setups, plans = {}, {}
    for label, (name, form, chunk_size) in zip(labels, args.models):
        try:
            lion = dict(attn_form=form or args.attn_form, chunk_size=chunk_size,
                        attn_backend=args.attn_backend) if name.startswith("lion_") else {}
            model = create_model_at_size(name, args.img_size, **lion).to(device).train()
            model.set_grad_checkpointing(args.grad_checkpointing)
            if lion:
                plans[label] = model.attn_plan((args.img_size, args.img_size), device)
        except (ValueError, AssertionError) as error:  # a size the patch does not divide, a backend not here
            parser.error(f"{name} at --img-size {args.img_size}: {error}")
        if lion:
            print(f"{label}: {plans[label]}", flush=True)
        step_model = torch.compile(model) if args.compile else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        setups[label] = (step_model, optimizer)

    def step(name: str) -> float:
        model, optimizer = setups[name]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    baseline = labels[0]
    peaks, failed = {}, {}
    for name in labels:  # warm-up, and peak memory of one step on CUDA
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            print(f"{name}: warm-up step {step(name):.1f} s{' (compile included)' if args.compile else ''}", flush=True)
        except torch.cuda.OutOfMemoryError:  # this model does not fit at this batch and size; the others may
            if name == baseline:
                sys.exit(f"benchmark_train.py: the baseline {name} runs out of memory at --batch-size "
                         f"{args.batch_size} and --img-size {args.img_size}; lower them")
            failed[name] = "out of memory"
            del setups[name]
            torch.cuda.empty_cache()
            print(f"{name}: out of memory at batch {args.batch_size}, {args.img_size} px: left out", flush=True)
            continue
        except Exception as error:  # a kernel this GPU's compiler or driver refuses: a row, the others still timed
            if name == baseline:
                raise
            failed[name] = STATUS_ERROR
            del setups[name]
            print(f"{name}: {error_detail(error)}: left out", flush=True)
            continue
        peaks[name] = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    times = {name: [] for name in setups}
    for _ in range(args.steps):
        for name in setups:
            times[name].append(step(name))
    if args.memory and device.type == "cpu":  # after the timing: a fresh process each, one at a time
        for label, (name, form, chunk_size) in zip(labels, args.models):
            if label in setups:
                result = train_memory_in_subprocess(dict(
                    model_name=name, form=form or args.attn_form, chunk_size=chunk_size, img_size=args.img_size,
                    batch_size=args.batch_size, attn_backend=args.attn_backend,
                    grad_checkpointing=args.grad_checkpointing), timeout_s=3600)
                peaks[label] = result["peak_mem_mb"] if result["status"] == STATUS_OK else None
                print(f"{label}: peak RSS growth of a step "
                      + (f"{peaks[label]:.0f} MB" if peaks[label] is not None else result["status"]), flush=True)

    # best of the timed steps: on a shared machine noise only ever adds time; and the median of the
    # per-round ratios, which a machine whose speed drifts between rounds moves less
    baseline_times = times[baseline]
    base = min(baseline_times)
    rows = []
    for label, (name, _, _) in zip(labels, args.models):
        row = dict(model=name, form=plans[label].form if label in plans else None,
                   chunk_size=plans[label].chunk_size if label in plans else None, batch_size=args.batch_size,
                   img_size=args.img_size, device=args.device, dtype=args.dtype,
                   grad_checkpointing=args.grad_checkpointing,
                   malloc=args.malloc if args.device == "cpu" else None, status=failed.get(label, "ok"))
        if label in times:
            best, paired = min(times[label]), paired_ratio(times[label], baseline_times)
            row.update(step_s=best, step_median_s=statistics.median(times[label]), imgs_per_s=args.batch_size / best,
                       x_baseline=best / base, x_baseline_paired=paired, peak_mem_mb=peaks[label],
                       mem_x_baseline=peaks[label] / peaks[baseline] if peaks[label] and peaks[baseline] else None)
            print(f"{label:26s} step {best:.3f}s  {args.batch_size / best:8.1f} img/s  x{best / base:.2f}  "
                  f"(paired x{paired:.2f})", flush=True)
        rows.append(row)
    write_table(rows, args.out, "train")
    _plot([(label, row["x_baseline"]) for label, row in zip(labels, rows) if label in times], baseline,
          args.out / "train.png", f"train step, {args.img_size}px, batch {args.batch_size}, {args.device} {args.dtype}")
    print(markdown_table(rows, ["model", "form", "chunk_size", "status", "step_s", "imgs_per_s", "x_baseline", "x_baseline_paired",
                                "peak_mem_mb", "mem_x_baseline"]))
    if args.profile:
        for name in setups:
            _print_profile(name, lambda: step(name), device)
    errors = [name for name, status in failed.items() if status == STATUS_ERROR]
    if errors:
        sys.exit(f"benchmark_train.py: {', '.join(errors)} failed (above); the table holds the others")


def _print_profile(name: str, run_step, device: torch.device) -> None:
    """One step under torch.profiler: the ops (on CUDA, the GPU's kernels) with the most self time, as a share of
    the step's; and their total against the step's wall time, which on a GPU says whether the kernels or the host
    bound the step (the kernels' time near the wall time: the GPU was busy throughout)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        wall = run_step()  # (synchronised on CUDA)

    def self_time(event) -> float:  # (microseconds; self_cuda_time_total before torch 2.4)
        if not cuda:
            return event.self_cpu_time_total
        attribute = "self_device_time_total" if hasattr(event, "self_device_time_total") else "self_cuda_time_total"
        return getattr(event, attribute)

    events = prof.key_averages()
    if cuda:  # the kernels themselves (an operator's row would count its kernels' time once more)
        events = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    events = sorted(events, key=self_time, reverse=True)
    total = sum(self_time(e) for e in events) or 1.0
    print(f"\n{name}: {total / 1e6:.3f} s profiled ({'GPU kernels' if cuda else 'CPU'} self time, profiler overhead "
          f"included) in a step of {wall:.3f} s wall, {total / 1e6 / wall:.0%}")
    for event in events[:15 if cuda else 10]:
        print(f"  {self_time(event) / total:6.1%}  {self_time(event) / 1e6:7.3f} s  x{event.count:<4d} {event.key}")


def _plot(ratios, baseline: str, path: Path, title: str) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh([label for label, _ in ratios][::-1], [ratio for _, ratio in ratios][::-1])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel(f"train step time / {baseline}")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)
    plt.close(fig)


if __name__ == "__main__":
    main()
