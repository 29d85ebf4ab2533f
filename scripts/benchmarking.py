"""Measuring helpers shared by the scripts (benchmark_*.py, check_equivalence.py): inference time and
peak memory of one configuration, each CPU measurement in a fresh subprocess, and tables / plots of
the results. Not part of the library: `pip install lion-vit` needs none of it (plots: the [bench] extra).

Peak memory: on CUDA `torch.cuda.max_memory_allocated` minus what was allocated before the
forward (the weights); on CPU the growth of the process's peak RSS (VmHWM, reset through
/proc/self/clear_refs just before the forward) over its RSS at that moment. CPU subprocesses run
with a fixed glibc mmap threshold (MALLOC_MMAP_THRESHOLD_) so that every tensor of 64 KiB or
more is returned to the OS when freed: RSS then tracks live tensors, not heap fragmentation.

By default ("steady") the measured forward is the second one: the first also pays one-time costs
that do not grow with resolution (library code paged in, allocator pools, BLAS workspaces; about
18 MB of RSS on CPU, a little more for models that call more kernels). "first" measures the first
call instead, one-time costs included.

With compile, the model goes through torch.compile and its first call, which compiles it, is timed
on its own (compile_s) before anything is measured; "first" then means the first compiled call.
Each CPU subprocess gets an empty Inductor cache, so compile_s is what a first run pays; CUDA
configurations share one process and its warm compiler caches, so there it is a lower bound.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import errno
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

STATUS_OK, STATUS_OOM, STATUS_TIMEOUT, STATUS_ERROR = "ok", "OOM", "timeout", "error"


def _small_lion_names() -> str:
    import timm
    import lion_vit  # noqa: F401  (registers the LION models)
    return ", ".join(n for n in timm.list_models("lion_*") if n.endswith("_small"))


def model_name(text: str) -> str:
    """argparse type: a model timm knows (the LION models registered), else a one-line usage error."""
    import timm
    if not timm.is_model(text):
        raise argparse.ArgumentTypeError(
            f"unknown model {text!r}; use a LION name such as lion_d_small ({_small_lion_names()}) or a timm "
            f"model such as deit_small_patch16_224")
    return text


def lion_model_name(text: str) -> str:
    """argparse type: a LION model (any variant or Table 1 family, size, distilled or not), else one line."""
    from lion_vit.models import is_lion_model
    if not is_lion_model(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a LION model; use one such as lion_d_small ({_small_lion_names()}), at _tiny, "
            f"_small or _base, or its _distilled twin")
    return text


def _int_at_least(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what} integer, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1, "a positive")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0, "a non-negative")


def launch_setting(text: str) -> Tuple[int, int, int]:
    """argparse type: a bidirectional kernel's launch setting, own,loop,warps (lion_vit.ops.Tuning)."""
    from lion_vit.ops.tuning import check_launch_setting
    try:
        parts = tuple(int(part) for part in text.split(","))
    except ValueError:
        parts = text  # (not integers: refused below as a setting, with its expected form)
    try:
        return check_launch_setting(parts, repr(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _unwritable(folder: Path) -> Optional[str]:
    """Why results could not be written into `folder` (made, with its parents, when they are), or None. Nothing is
    made now: a run refused later (a bad argument, no GPU) leaves no empty folder behind."""
    existing = folder
    while not existing.exists() and existing != existing.parent:  # (the nearest folder there is)
        existing = existing.parent
    if not existing.is_dir():
        code = errno.EEXIST if existing == folder else errno.ENOTDIR
        return f"cannot create {str(folder)!r} ({os.strerror(code)})"
    return None if os.access(existing, os.W_OK | os.X_OK) else f"cannot write to {str(existing)!r}"


def output_folder(text: str) -> Path:
    """argparse type: a folder for the results, checked now, so that a path that cannot be written
    fails before the measurements, not after them."""
    reason = _unwritable(Path(text))
    if reason:
        raise argparse.ArgumentTypeError(f"{reason}; choose another folder")
    return Path(text)


def output_file(text: str) -> Path:
    """argparse type: a results file whose folder is checked now (and made as the file is written)."""
    reason = _unwritable(Path(text).parent)
    if reason:
        raise argparse.ArgumentTypeError(f"{text!r}: its folder: {reason}; choose another path")
    return Path(text)


DEVICES = ("cpu", "cuda")


def device_name(text: str) -> str:
    """argparse type: "cpu", or "cuda" where a CUDA device is available (else a one-line usage error
    up front, instead of a traceback or every configuration failing)."""
    if text not in DEVICES:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; choose one of {', '.join(DEVICES)}")
    if text == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("cuda: no CUDA device is available here (torch.cuda.is_available() is "
                                         "False); use --device cpu")
    return text


def check_patch_multiples(parser: argparse.ArgumentParser, option: str, sizes: List[int]) -> None:
    """The parser's error for an image size the patch (16 px, every model these scripts time) does not
    divide: else every run at that size would be a row of errors."""
    for size in sizes:
        if size % 16:
            parser.error(f"{option} {size} is not a multiple of the patch size (16)")


def kernel_timing(parser: argparse.ArgumentParser, img_size: int) -> Optional[Tuple[torch.device, torch.dtype, bool]]:
    """For the scripts that time Triton kernels (benchmark_normaliser.py, benchmark_fused.py): the device, the
    16-bit dtype they time (float16 under the interpreter, whose numpy has no bfloat16) and whether Triton's
    interpreter runs the kernels (TRITON_INTERPRET=1: a check on a CPU, no times; adapted here). None, after a
    line on stderr, where there is neither a GPU nor the interpreter; an img_size the patch does not divide is
    the parser's error."""
    from lion_vit.ops.triton import interpreting
    interpreted = interpreting()
    if not torch.cuda.is_available() and not interpreted:
        print(f"{parser.prog}: it times Triton kernels on a GPU (torch.cuda.is_available() is False); "
              "TRITON_INTERPRET=1 runs it on a CPU as a check, not a timing", file=sys.stderr)
        return None
    check_patch_multiples(parser, "--img-size", [img_size])
    if interpreted:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import interpret  # the interpreter's adaptations (tests/interpret.py)
        interpret.adapt_interpreter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device, torch.bfloat16 if device.type == "cuda" else torch.float16, interpreted


def kernel_time_us(fn: Callable[[], Any]) -> float:
    """Microseconds per call of fn on the GPU (triton.testing.do_bench)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100) * 1e3


def add_inference_arguments(parser: argparse.ArgumentParser) -> None:
    """The measurement options of the inference benchmarks (benchmark_resolution.py, benchmark_chunk.py)."""
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--device", default="cpu", type=device_name, help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=non_negative_int, default=2,
                        help="timed runs after one warm-up (median; an even count averages the middle two); "
                             "0: time the memory measurement's one forward")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="measure every configuration this many times, round-robin, keeping the best time "
                             "(machine drift then hits all configurations alike)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per CPU configuration")
    parser.add_argument("--memory", default="steady", choices=MEMORY_MODES,
                        help="peak memory of a second forward (steady) or of the first call, one-time costs "
                             "such as library code paged in included (first)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        choices=COMPILE_BACKENDS,
                        help="torch.compile every model (backend inductor, or aot_eager: Dynamo and AOTAutograd "
                             "without Inductor's code); its first, compiling call is timed on its own (compile_s)")
    add_backend_argument(parser)
    parser.add_argument("--group-share", type=positive_float, default=None, metavar="SHARE",
                        help="the triton backend's inference groups of images: a group's kernel buffers at most this "
                             "share of the batch's q, k, v (default: the code's, lion_vit.ops.Tuning.group_share); "
                             "a large value runs the batch in one call")
    parser.add_argument("--out", type=output_folder, default="bench_out", help="folder for the CSV, JSON and PNG")


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    """--attn-backend for the LION models (lion_vit.ops.dispatch: auto is triton on CUDA when installed)."""
    from lion_vit.ops import BACKENDS
    parser.add_argument("--attn-backend", default="auto", choices=BACKENDS,
                        help="LION kernels: auto (triton on CUDA with flash-linear-attention, else torch), "
                             "torch, triton")


def inference_settings(args: argparse.Namespace) -> Dict[str, Any]:
    """The row fields that add_inference_arguments' options set (measure_rows reads them)."""
    return dict(batch_size=args.batch_size, device=args.device, dtype=args.dtype, memory=args.memory,
                compile=args.compile, attn_backend=args.attn_backend,
                **({"group_share": args.group_share} if args.group_share is not None else {}))


def describe_settings(args: argparse.Namespace) -> str:
    """Those settings for a plot title, e.g. "batch 1, cpu float32, compiled"."""
    return f"batch {args.batch_size}, {args.device} {args.dtype}" + \
        (f", compiled ({args.compile})" if args.compile else "")


def result_columns(args: argparse.Namespace) -> List[str]:
    """The measured columns of an inference table (compile_s when compiled); chunks: the chunk form's
    chunks per sequence (1: one product over the whole sequence, which cost less)."""
    return ["chunks", "status", "time_s", "peak_mem_mb", "time_x_baseline", "mem_x_baseline"] + \
        (["compile_s"] if args.compile else [])


def run_spec(text: str) -> Tuple[str, Optional[str], Optional[int]]:
    """argparse type for model[:form[:chunk_size]] -> (model, form, chunk_size); forms apply to LION models."""
    from lion_vit.ops import FORM_CHOICES
    name, *rest = text.split(":")
    model_name(name)
    if not name.startswith("lion_"):
        if rest:
            raise argparse.ArgumentTypeError(f"{text!r}: only LION models take a form; write {name!r} alone")
        return name, None, None
    form = rest[0] if rest else "attention"
    if form not in FORM_CHOICES or len(rest) > 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {name}:FORM[:CHUNK_SIZE] with FORM one of "
                                         f"{sorted(FORM_CHOICES)}")
    chunk = positive_int(rest[1]) if len(rest) == 2 else None
    if chunk is not None and form != "chunk":
        raise argparse.ArgumentTypeError(f"{text!r}: a chunk size goes with the chunk form ({name}:chunk:{chunk})")
    return name, form, chunk


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
        return True
    except OSError:
        return False


def build(model_name: str, form: Optional[str], chunk_size: Optional[int], img_size: int,
          device: torch.device, dtype: torch.dtype, attn_backend: str = "auto") -> torch.nn.Module:
    from lion_vit.models import create_model_at_size  # (importing lion_vit registers the LION models)
    kwargs: Dict[str, Any] = {}
    if model_name.startswith("lion_"):
        kwargs.update(attn_form=form or "attention", chunk_size=chunk_size, attn_backend=attn_backend)
    model = create_model_at_size(model_name, img_size, **kwargs).eval().to(device)
    return model.to(dtype) if dtype == torch.float64 else model


def _group_share(share: Optional[float]) -> contextlib.AbstractContextManager:
    """lion_vit.ops.Tuning.group_share set inside the block (None: the code's)."""
    from lion_vit.ops import tuned
    return contextlib.nullcontext() if share is None else tuned(group_share=share)


MEMORY_MODES = ("steady", "first")
COMPILE_BACKENDS = ("inductor", "aot_eager")


def measure_inference(model_name: str, form: Optional[str], chunk_size: Optional[int], img_size: int,
                      batch_size: int, device: str, dtype: str, repeats: int,
                      memory: str = "steady", compile: Optional[str] = None,
                      attn_backend: str = "auto", group_share: Optional[float] = None) -> Dict[str, Any]:
    """Time (median of `repeats` after one warm-up) and peak memory of one forward, in this process
    (and, for a LION model's chunk form, its chunks per sequence).

    memory: "steady" measures the peak of a second forward, "first" that of the first call.
    compile: None, or the torch.compile backend for the model ("inductor", "aot_eager"); its compiling
    first call is timed as compile_s.
    attn_backend: the LION models' (lion_vit.ops.dispatch). group_share: the triton backend's
    lion_vit.ops.Tuning.group_share for this measurement (None: the code's).
    """
    if memory not in MEMORY_MODES:
        raise ValueError(f"unknown memory mode {memory!r}; choose one of {MEMORY_MODES}")
    dev = torch.device(device)
    torch_dtype = getattr(torch, dtype)
    model = build(model_name, form, chunk_size, img_size, dev, torch_dtype, attn_backend)
    # a LION model's chunk form: chunks per sequence (1 where one product over the whole sequence costs less)
    chunks = model.chunks_per_sequence((img_size, img_size)) if hasattr(model, "chunks_per_sequence") else None
    if compile:
        # as in a fresh process: no graphs of earlier configurations (CUDA sweeps run in one process,
        # where they would count towards Dynamo's recompile limit, beyond which it runs eagerly)
        torch._dynamo.reset()
        model = torch.compile(model, backend=compile)
    x = torch.randn(batch_size, 3, img_size, img_size, device=dev,
                    dtype=torch.float64 if torch_dtype == torch.float64 else torch.float32)
    autocast = torch.autocast(dev.type, dtype=torch_dtype) if torch_dtype in (torch.bfloat16, torch.float16) \
        else torch.autocast(dev.type, enabled=False)

    def forward() -> None:
        with torch.no_grad(), autocast, _group_share(group_share):
            model(x)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    compiled: Dict[str, Any] = {}
    if compile:
        start = time.perf_counter()
        forward()
        compiled["compile_s"] = time.perf_counter() - start
    elif memory == "steady":
        forward()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        base = _status_kb("VmRSS") * 1024 if _reset_peak_rss() else None
    start = time.perf_counter()
    forward()
    first = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(dev) - base) if dev.type == "cuda" else \
        (_status_kb("VmHWM") * 1024 - base if base is not None else None)
    times: List[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward()
        times.append(time.perf_counter() - start)
    return {"time_s": statistics.median(times) if times else first,
            "peak_mem_mb": None if peak is None else peak / 2**20, **compiled,
            **({"chunks": chunks} if chunks else {})}


def measure_train_memory(model_name: str, form: Optional[str], chunk_size: Optional[int], img_size: int,
                         batch_size: int, attn_backend: str = "auto", grad_checkpointing: bool = False
                         ) -> Dict[str, Any]:
    """CPU, in this process: the growth of peak RSS during a training step (forward, cross-entropy, backward,
    AdamW) over the RSS before it, the second step (the first also makes the optimizer's state)."""
    model = build(model_name, form, chunk_size, img_size, torch.device("cpu"), torch.float32, attn_backend).train()
    model.set_grad_checkpointing(grad_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch_size, 3, img_size, img_size), torch.randint(0, 1000, (batch_size,))

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    base = _status_kb("VmRSS") * 1024 if _reset_peak_rss() else None
    step()
    return {"peak_mem_mb": None if base is None else (_status_kb("VmHWM") * 1024 - base) / 2**20}


def train_memory_in_subprocess(config: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
    """measure_train_memory(**config) in a fresh interpreter with a fixed mmap threshold (as inference's memory)."""
    return _subprocess(config, timeout_s, {"MALLOC_MMAP_THRESHOLD_": "65536"}, "measure_train_memory")


def measure_in_subprocess(config: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
    """CPU: peak memory from one forward in a fresh interpreter with a fixed mmap threshold, time
    from another with the default allocator (the fixed threshold slows large allocations)."""
    memory = _subprocess(dict(config, repeats=0), timeout_s, {"MALLOC_MMAP_THRESHOLD_": "65536"})
    if memory["status"] != STATUS_OK or not config["repeats"]:
        return memory
    timing = _subprocess(dict(config, memory="first"), timeout_s, {})  # its memory is not used: no extra forward
    return dict(timing, peak_mem_mb=memory["peak_mem_mb"]) if timing["status"] == STATUS_OK else timing


def _subprocess(config: Dict[str, Any], timeout_s: float, extra_env: Dict[str, str],
                function: str = "measure_inference") -> Dict[str, Any]:
    """Run one of this module's measurements in a fresh interpreter; OOM / timeout become statuses."""
    code = (f"import json, sys; from benchmarking import {function}; "
            f"print('RESULT', json.dumps({function}(**json.loads(sys.argv[1]))))")
    here = Path(__file__).resolve().parent  # scripts/, and the clone above it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent)]), **extra_env)
    # compiling: an Inductor cache of its own, so nothing compiled by an earlier configuration or run is reused
    cache_dir = tempfile.TemporaryDirectory(prefix="lion_vit_inductor_", ignore_cleanup_errors=True) \
        if config.get("compile") else contextlib.nullcontext()
    with cache_dir as cache:
        if cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            proc = subprocess.run([sys.executable, "-c", code, json.dumps(config)], capture_output=True, text=True,
                                  timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            return {"status": STATUS_TIMEOUT, "time_s": None, "peak_mem_mb": None}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {"status": STATUS_OK, **json.loads(line[len("RESULT "):])}
    oom = proc.returncode in (-9, 137) or "out of memory" in proc.stderr.lower() or "MemoryError" in proc.stderr
    return {"status": STATUS_OOM if oom else STATUS_ERROR, "time_s": None, "peak_mem_mb": None,
            "detail": failure_line(proc)}


def failure_line(proc: subprocess.CompletedProcess) -> str:
    """Why a subprocess failed, in one line: its stderr's last (an exception's own line), else its exit code."""
    return (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]


def measure(config: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
    """CPU: a fresh subprocess per configuration; CUDA: in process, catching OOM."""
    if config["device"] == "cpu":
        return measure_in_subprocess(config, timeout_s)
    try:
        return {"status": STATUS_OK, **measure_inference(**config)}
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"status": STATUS_OOM, "time_s": None, "peak_mem_mb": None}
    except Exception as error:  # a size the patch does not divide, a kernel this GPU's compiler refuses (Triton's
        # errors are no RuntimeError): recorded, the sweep goes on
        return {"status": STATUS_ERROR, "time_s": None, "peak_mem_mb": None, "detail": error_detail(error)}


def error_detail(error: BaseException) -> str:
    """"Type: first line" of the error that stopped a measurement."""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def measure_round_robin(configs: Sequence[Dict[str, Any]], rounds: int, timeout_s: float,
                        report: Callable[[int, Dict[str, Any]], None]) -> List[Dict[str, Any]]:
    """Measure every configuration `rounds` times, one round over all of them after another, so that
    a machine whose speed drifts over minutes slows every configuration alike. Each configuration
    keeps its first successful result (else its first) with the best time of all rounds (noise only
    ever adds time);
    report(index, result) is called after every measurement."""
    results: List[Optional[Dict[str, Any]]] = [None] * len(configs)
    for _ in range(rounds):
        for index, config in enumerate(configs):
            result = measure(config, timeout_s)
            report(index, result)
            best = results[index]
            if best is None or (best["status"] != STATUS_OK and result["status"] == STATUS_OK):
                results[index] = result
            elif best["status"] == result["status"] == STATUS_OK:
                best["time_s"] = min(best["time_s"], result["time_s"])
    return results  # type: ignore[return-value]


def measure_rows(rows: Sequence[Dict[str, Any]], repeats: int, rounds: int, timeout_s: float,
                 progress_prefix: Callable[[Dict[str, Any]], str] = lambda row: "") -> None:
    """Measure the inference configuration each row describes (model, form, chunk_size, resolution,
    batch_size, device, dtype, memory, compile), round-robin over `rounds`, printing a line per
    measurement, and add the result (status, time_s, peak_mem_mb; compile_s when compiled) to the row."""
    configs = [dict(model_name=r["model"], form=r["form"], chunk_size=r["chunk_size"], img_size=r["resolution"],
                    batch_size=r["batch_size"], device=r["device"], dtype=r["dtype"], repeats=repeats,
                    memory=r["memory"], compile=r.get("compile"), attn_backend=r.get("attn_backend", "auto"),
                    group_share=r.get("group_share")) for r in rows]
    results = measure_round_robin(configs, rounds, timeout_s, lambda i, result: print(
        progress_prefix(rows[i]) + status_line(dict(rows[i], **result)), flush=True))
    for row, result in zip(rows, results):
        row.update(result)


def add_baseline_ratios(row: Dict[str, Any], baseline: Dict[str, Any]) -> None:
    """time_x_baseline and mem_x_baseline of a measured row, when both it and its baseline succeeded."""
    if row is not baseline and baseline["status"] == row["status"] == STATUS_OK:
        row["time_x_baseline"] = row["time_s"] / baseline["time_s"]
        row["mem_x_baseline"] = row["peak_mem_mb"] / max(baseline["peak_mem_mb"], 1e-9)


def paired_ratio(times: Sequence[float], baseline_times: Sequence[float]) -> float:
    """Median over rounds of time / baseline time within the same round of a round-robin.

    Steps of one round run next to each other, so a machine whose speed drifts between rounds
    (this one's does, by tens of percent within minutes) slows both sides of each pair alike;
    the best-of ratio instead compares each side's single luckiest step, which may come from
    different moments.
    """
    if len(times) != len(baseline_times) or not times:
        raise ValueError("paired_ratio needs one time per round for both, and at least one round")
    return statistics.median(t / b for t, b in zip(times, baseline_times))


def label(row: Dict[str, Any]) -> str:
    if not str(row["model"]).startswith("lion_"):
        return row["model"]
    form = row["form"] + (f" C={row['chunk_size']}" if row.get("chunk_size") else "")
    return f"{row['model']} ({form})"


def chunks_text(chunks: Optional[int]) -> str:
    """'1 chunk', '13 chunks'; '' for None (not the chunk form)."""
    return f"{chunks} chunk{'s' if chunks > 1 else ''}" if chunks else ""


def status_line(row: Dict[str, Any]) -> str:
    """One progress line for a measured row; a failed configuration says why (its error's last line)."""
    if row["status"] != STATUS_OK:
        return f"{label(row):40s} {row['status']:7s} {row.get('detail') or ''}".rstrip()
    peak = "n/a" if row["peak_mem_mb"] is None else f"+{row['peak_mem_mb']:9.1f} MB"
    compiled = f"  compile {row['compile_s']:.1f}s" if row.get("compile_s") is not None else ""
    chunks = f"  {chunks_text(row['chunks'])}" if row.get("chunks") else ""
    return f"{label(row):40s} {row['status']:7s} time {row['time_s']:8.3f}s  peak {peak}{compiled}{chunks}"


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The scripts' --help: their docstring as written, and every option's default (once: an option whose help
    says its default in words keeps those)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "(default" in text else super()._get_help_string(action)


def write_table(rows: List[Dict[str, Any]], out_dir: Path, stem: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(out_dir / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / f"{stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out_dir / f'{stem}.csv'} and {out_dir / f'{stem}.json'}", flush=True)


def markdown_table(rows: Sequence[Dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(value: Any) -> str:  # (three significant digits, but 1,003 images/s as 1003, not 1e+03)
        if isinstance(value, float):
            return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"
        return "" if value is None else str(value)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def pyplot(path: Path):
    """matplotlib's pyplot (Agg), or None with one line saying that the plot at path is not written: matplotlib
    comes with the [bench] extra, and the CSV, JSON and table written before the plot do not need it."""
    try:
        import matplotlib
    except ImportError:
        print(f"{path} not written: matplotlib is not installed (pip install -e \".[bench]\")", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_lines(rows: List[Dict[str, Any]], x_key: str, x_label: str, path: Path, title: str,
               log_x: bool = False) -> None:
    """Two panels (peak memory, time) against x_key, one line per model/form; OOM points dropped.
    Nothing is written when no configuration succeeded."""
    if not any(r["status"] == STATUS_OK for r in rows):
        print(f"no configuration succeeded: {path} not written")
        return
    plt = pyplot(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(label(r) for r in rows):
        series = sorted((r for r in rows if label(r) == name and r["status"] == STATUS_OK), key=lambda r: r[x_key])
        xs = [r[x_key] for r in series]
        axes[0].plot(xs, [r["peak_mem_mb"] for r in series], marker="o", label=name)
        axes[1].plot(xs, [r["time_s"] for r in series], marker="o", label=name)
    for ax, ylabel in zip(axes, ("peak memory growth (MB)", "time per forward (s)")):
        ax.set_xlabel(x_label)
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        if log_x:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)
    plt.close(fig)
