#!/usr/bin/env python
"""The GPU targets (docs/benchmarks.md, "GPU check") against what `make gpu-check` measured: one line per
target with the measured ratio and whether it is met, read from the CSVs in the gpu-check folder
(scripts/gpu_check.sh runs this last), then the least inference ratio any attention could reach, then the
dispatch settings (and the triton backend's inference groups) the timings pick. A target or a setting
whose measurement is missing or failed says so.

    python scripts/gpu_targets.py docs/benchmarks/gpu
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

# training step against DeiT-S (SDPA) in the same run, bf16: eager at 224 px batch 256 and 448 px batch 64; both
# sides compiled at 224 px batch 256; peak memory within PEAK_MEMORY of DeiT-S's in each of those runs
EAGER_TRAINING = {"lion_lit_small": 1.0, "lion_d_small": 1.05, "lion_s_small": 1.1, "lion_d_natural_small": 1.1,
                  "lion_s_natural_small": 1.2}
COMPILED_TRAINING = dict(EAGER_TRAINING, lion_lit_small=0.95)
PEAK_MEMORY = 1.1
TRAINING_896 = {"lion_d_small": 0.9, "lion_d_natural_small": 0.9}  # 896 px batch 32, the form plan() picks
INFERENCE_224 = {"lion_d_small": 1.05}  # inference time against DeiT-S at 224 px, batch 16 and 256
# inference at high resolution, batch 16, the chunk form: the attention's share, LION's time less DeiT-S's
# non-attention floor (b L of the fit in floor_lines) against DeiT-S's attention time (a L^2)
ATTENTION_SHARE = {1248: 0.25, 1792: 0.15}
INFERENCE_MODELS = ("lion_d_small", "lion_d_natural_small")
RNN_OVER_CHUNK = 3.0  # the rnn form's time against the chunk form's
BASELINE = "deit_small_patch16_224"
# end to end (train.py's last epoch on the input part's JPEGs) against the model-only step, at least: (model,
# compiled) -> share, with the JPEGs decoded in the workers (input) and on the GPU (input_gpu)
END_TO_END = {(BASELINE, True): 0.85, ("lion_d_small", False): 0.9, ("lion_d_small", True): 0.9}
INPUT_RUNS = (("input", "cpu"), ("input_gpu", "gpu"))
FIT_FROM = 896  # px: the smallest size fitted (below it a batch of 16 may wait on the host, as batch 1 does)


def read(path: Path) -> List[Dict[str, str]]:
    if not path.is_file():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def number(row: Optional[Dict[str, str]], column: str) -> Optional[float]:
    value = (row or {}).get(column) or ""
    return float(value) if value and (row or {}).get("status", "ok") == "ok" else None


def line(target: str, measured: Optional[float], limit: float, at_least: bool = False) -> str:
    bound = f"{'>=' if at_least else '<='} {limit:g}"
    if measured is None:
        return f"| {target} | {bound} | not measured | - |"
    met = measured >= limit if at_least else measured <= limit
    return f"| {target} | {bound} | {measured:.3g} | {'yes' if met else 'NO'} |"


def input_rows(folder: Path, run: str) -> Dict[tuple, Dict[str, str]]:
    """benchmark_input.py --train's rows of a run by (model, compiled)."""
    return {(r["model"], r["compile"] == "True"): r for r in read(folder / run / "input_train.csv")}


def target_lines(folder: Path) -> List[str]:
    lines = ["| target | limit | measured | met |", "|---|---|---|---|"]
    for csv_names, limits, what in (
            (("train/train.csv",), EAGER_TRAINING, "train 224 px b256 eager"),
            (("train_448/train.csv",), EAGER_TRAINING, "train 448 px b64 eager"),
            (("train_compile/train.csv", "train_compile_natural/train.csv"), COMPILED_TRAINING,
             "train 224 px b256 compiled"),
            (("train_896/train.csv",), TRAINING_896, "train 896 px b32")):
        runs = [read(folder / name) for name in csv_names]
        rows, peaks = {}, {}  # a model's first row: as plan() runs it (a later row of it names its form)
        for run in runs:
            for r in run:
                if r["model"] not in rows:
                    rows[r["model"]], peaks[r["model"]] = r, _peak_ratio(r, run)
        for model, limit in limits.items():
            lines.append(line(f"{what}, {model} x DeiT-S", number(rows.get(model), "x_baseline"), limit))
            if "896" not in what:
                lines.append(line(f"{what}, {model} peak memory x DeiT-S", peaks.get(model), PEAK_MEMORY))
    for batch in (16, 256):
        rows = {r["model"]: r for r in read(folder / f"inference_224_b{batch}" / "resolution.csv")}
        for model, limit in INFERENCE_224.items():
            lines.append(line(f"inference 224 px b{batch}, {model} attention time x DeiT-S",
                              number(rows.get(model), "time_x_baseline"), limit))
    for run, decode in INPUT_RUNS:
        rows = input_rows(folder, run)
        for (model, compiled), least in END_TO_END.items():
            lines.append(line(f"end to end, decode {decode}, {model} {'compiled' if compiled else 'eager'} x model "
                              "only", number(rows.get((model, compiled)), "x_model_only"), least, at_least=True))
    fit = deit_fit(folder)
    for batch in (1, 16):
        rows = read(folder / f"resolution_b{batch}" / "resolution.csv")
        for resolution in ATTENTION_SHARE:
            for model in INFERENCE_MODELS:
                found = {r["form"]: r for r in rows if r["model"] == model and int(r["resolution"]) == resolution}
                chunk, rnn = found.get("chunk"), found.get("rnn")
                where = f"{resolution} px b{batch}, {model}"
                if batch == 16:
                    lines.append(line(f"{where} chunk attention share x DeiT-S's attention",
                                      attention_share(fit, chunk), ATTENTION_SHARE[resolution]))
                if resolution == 1248:
                    lines.append(line(f"{where} chunk peak memory x DeiT-S", number(chunk, "mem_x_baseline"), 1.0))
                rnn_time, chunk_time = number(rnn, "time_s"), number(chunk, "time_s")
                lines.append(line(f"{where} rnn time x chunk", rnn_time / chunk_time if rnn_time and chunk_time
                                  else None, RNN_OVER_CHUNK))
    return lines


def _peak_ratio(row: Dict[str, str], run: List[Dict[str, str]]) -> Optional[float]:
    """A row's peak memory against the baseline's (the run's first row, DeiT-S)."""
    peak, base = number(row, "peak_mem_mb"), number(run[0], "peak_mem_mb") if run else None
    return peak / base if peak and base else None


def deit_fit(folder: Path):
    """DeiT-S's batch-16 inference times fitted as a L^2 + b L over the sizes measured from FIT_FROM px (its
    attention grows with the square of the tokens L, the rest of its blocks linearly), by least squares of the
    relative error: (a, b, {size: (tokens, time)}), or None where fewer than two sizes were measured."""
    rows = [r for r in read(folder / "resolution_b16" / "resolution.csv") if r["model"] == BASELINE]
    points = {int(r["resolution"]): (int(r["tokens"]), number(r, "time_s")) for r in rows}
    points = {size: point for size, point in points.items() if point[1] and size >= FIT_FROM}
    if len(points) < 2:
        return None
    lengths, times = np.array(list(points.values()), dtype=np.float64).T
    # (a L^2 + b L) / t = 1 in the least-squares sense: the relative error
    (a, b), *_ = np.linalg.lstsq(np.stack([lengths ** 2, lengths], 1) / times[:, None], np.ones_like(times),
                                 rcond=None)
    return a, b, points


def attention_share(fit, row: Optional[Dict[str, str]]) -> Optional[float]:
    """(LION's time - DeiT-S's non-attention floor b L) / DeiT-S's attention time a L^2, for a row of the
    batch-16 resolution run; None where the row or the fit is missing."""
    time = number(row, "time_s")
    if fit is None or time is None or fit[0] <= 0 or fit[1] <= 0:
        return None
    a, b, _ = fit
    length = int(row["tokens"])
    return (time - b * length) / (a * length ** 2)


def floor_lines(folder: Path) -> List[str]:
    """The least inference ratio against DeiT-S that any attention can reach: DeiT-S's batch-16 times fitted
    as a L^2 + b L over the sizes measured (its attention grows with the square of the tokens L, the rest of
    its blocks linearly), by least squares of the relative error. A LION model runs the same blocks around
    its attention, so b L / time is its ratio with an attention that takes no time at all."""
    lines = ["| DeiT-S b16 at | time | its rest (b L) | least ratio |", "|---|---|---|---|"]
    fit = deit_fit(folder)
    if fit is None:
        return lines + [f"| {size} px | not measured (needs DeiT-S at two sizes) | - | - |" for size in ATTENTION_SHARE]
    a, b, points = fit
    for size in ATTENTION_SHARE:
        if size not in points:
            found = "not measured | - | -"
        elif a <= 0 or b <= 0:
            found = f"the times do not fit a L^2 + b L (a {a:.3g}, b {b:.3g}) | - | -"
        else:
            tokens_, time = points[size]
            found = f"{time * 1e3:.1f} ms | {b * tokens_ * 1e3:.1f} ms | x{b * tokens_ / time:.3g}"
        lines.append(f"| {size} px | {found} |")
    lengths, times = np.array(list(points.values()), dtype=np.float64).T
    residual = np.abs((a * lengths ** 2 + b * lengths) / times - 1).max()
    return lines + [f"| (the fit) | {len(points)} sizes | worst relative residual {residual:.1%} | - |"]


def size_of(row: Dict[str, str]) -> int:
    return int(row.get("img_size") or row.get("resolution") or 0)


def tokens(size: int) -> int:
    return (size // 16) ** 2  # patch 16; the models timed (lion_d_small, lion_d_natural_small) have no class token


def setting_lines(folder: Path) -> List[str]:
    """The tuning knobs (lion_vit.ops.Tuning) the timings pick: auto_chunk_min_tokens (the smallest size measured
    from which the chunk kernels are faster than the attention form, training and inference, one and two
    scans; where environment.txt says FLA's chunk backward fails, the training rows timed the fallback and
    say so) and chunk_backward_fallback (the fastest of the portable chunk form, the recurrent
    kernels and the chunk kernels with a backward of their forward pass, where FLA's chunk backward fails)."""
    lines = ["| setting | measured | pick |", "|---|---|---|"]
    environment = folder / "environment.txt"
    # where FLA's chunk backward fails, the forms part's "chunk" rows trained through the fallback
    fallback = environment.is_file() and "chunk backward: FAILS" in environment.read_text()
    training = [r for path in sorted(folder.glob("forms_*/train.csv")) for r in read(path)]
    inference = read(folder / "resolution_b16" / "resolution.csv")
    for (is_training, scans), model in (((True, 1), "lion_d_small"), ((True, 2), "lion_d_natural_small"),
                                         ((False, 1), "lion_d_small"), ((False, 2), "lion_d_natural_small")):
        rows, column = (training, "step_s") if is_training else (inference, "time_s")
        times = {}
        for row in rows:
            if row["model"] == model and row.get("form") in ("attention", "chunk"):
                times.setdefault(size_of(row), {})[row["form"]] = number(row, column)
        ratios = {size: t["chunk"] / t["attention"] for size, t in sorted(times.items())
                  if t.get("attention") and t.get("chunk")}  # chunk kernels' time / attention form's
        if not ratios:
            lines.append(f"| auto_chunk_min_tokens[{is_training}, {scans}] ({model}) | not measured | - |")
            continue
        faster = [size for size, ratio in ratios.items() if ratio < 1]
        timed = "fallback" if is_training and fallback else "chunk"
        measured = ", ".join(f"{size} px: {timed} x{ratio:.2f}" for size, ratio in ratios.items())
        pick = f"{tokens(faster[0])}" if faster else "above the sizes measured"
        if timed == "fallback":
            pick += " (not for the chunk kernels: their backward fails here, the fallback trained)"
        lines.append(f"| auto_chunk_min_tokens[{is_training}, {scans}] ({model}) | {measured} | {pick} |")
    names = {"torch": "portable chunk form", "rnn": "recurrent kernels",
             "forward": "chunk kernels (backward by forward)"}
    for model in ("lion_d_small", "lion_d_natural_small"):
        found = {}
        for fallback in names:
            rows = {r["model"]: r for r in read(folder / f"fallback_{fallback}" / "train.csv")}
            ratio = number(rows.get(model), "x_baseline")
            if ratio is not None:
                found[fallback] = ratio
        if not found:
            lines.append(f"| chunk_backward_fallback ({model}, 896 px b32) | not measured | - |")
            continue
        measured = ", ".join(f"{names[fallback]} x{ratio:.2f}" for fallback, ratio in found.items())
        pick = min(found, key=found.get)
        missing = [names[fallback] for fallback in names if fallback not in found]
        lines.append(f"| chunk_backward_fallback ({model}, 896 px b32) | {measured} of DeiT-S | \"{pick}\""
                     + (f" (not measured: {', '.join(missing)})" if missing else "") + " |")
    return lines + launch_lines(folder) + lit_lines(folder) + softmax_lines(folder) + graph_lines(folder) + \
        group_lines(folder) + decode_lines(folder)


# benchmark_fused.py's runs in the fused part (their folders) and their shapes
FUSED_KERNEL_RUNS = (("fused_kernels", "224 px b256"), ("fused_kernels_448", "448 px b64"))


def first_train_us(rows: List[Dict[str, str]], case: str, kernel: str) -> Optional[float]:
    """The forward-and-backward time of a case's first benchmark_fused.py row of that kernel (for the
    bidirectional kernel, its code's settings), None where it is missing or did not run."""
    return next((number(row, "train_us") for row in rows if row["case"] == case and row["kernel"] == kernel), None)


def lit_lines(folder: Path) -> List[str]:
    """LION-lit's attention form: Q (K^T V) in its linear kernels (the code's, Tuning.linear_kernels;
    benchmark_fused.py's "linear kernels" rows), in torch matmuls ("linear") or the bidirectional kernel with every
    decay 1 (its rows in the code's settings), forward and backward, by benchmark_fused.py's lion_lit rows, as
    multiples of the linear kernels' time (of the matmuls', where a run has no linear kernels' row); the pick, the
    fastest."""
    routes = {"the linear kernels": "linear kernels", "Q (K^T V) in torch matmuls": "linear",
              "the bidirectional kernel": "bidirectional"}
    lines = []
    for run, what in FUSED_KERNEL_RUNS:
        rows = read(folder / run / "fused.csv")
        times = {label: first_train_us(rows, "lion_lit", name) for label, name in routes.items()}
        times = {label: time for label, time in times.items() if time is not None}
        label = f"LION-lit's attention form ({what})"
        if len(times) < 2 or "Q (K^T V) in torch matmuls" not in times:
            lines.append(f"| {label} | not measured | - |")
            continue
        base = next(iter(times))
        ratios = ", ".join(f"{name} x{time / times[base]:.2f}" for name, time in times.items() if name != base)
        lines.append(f"| {label} | {ratios} of {base} | {min(times, key=times.get)} |")
    return lines


def softmax_lines(folder: Path) -> List[str]:
    """benchmark_issue.py's proxy on the GPU: benchmark_fused.py's softmax attention as a Triton kernel ("softmax
    kernel") against SDPA, and the bidirectional kernel in the code's settings against that softmax kernel, forward
    and backward, case by case (LION-lit's, every decay 1): the ratios that script counts in instructions per pair
    of tokens without a GPU."""
    lines = []
    for run, what in FUSED_KERNEL_RUNS:
        rows = read(folder / run / "fused.csv")
        cases = list(dict.fromkeys(row["case"] for row in rows))
        ratios = []
        for case in cases:
            sdpa, softmax, ours = (first_train_us(rows, case, kernel)
                                   for kernel in ("sdpa", "softmax kernel", "bidirectional"))
            if softmax and sdpa and ours:
                ratios.append(f"{case}: softmax kernel x{softmax / sdpa:.2f} of SDPA, bidirectional "
                              f"x{ours / softmax:.2f} of it")
        label = f"benchmark_issue.py's softmax kernel ({what})"
        lines.append(f"| {label} | {'; '.join(ratios) if ratios else 'not measured'} | - |")
    return lines


def graph_lines(folder: Path) -> List[str]:
    """Inference at 224 px, batch 16, eager and replayed as a CUDA graph (benchmark_cuda_graph.py, graphs_224_b16),
    each against DeiT-S's the same way: where the replay meets INFERENCE_224 and the eager forward does not, the
    gap is the host's launches, and CUDA graphs (or torch.compile's "reduce-overhead") close it."""
    rows = {row["model"]: row for row in read(folder / "graphs_224_b16" / "graphs.csv")}
    lines = []
    for model, limit in INFERENCE_224.items():
        eager, graph = (number(rows.get(model), f"{kind}_x_baseline") for kind in ("eager", "graph"))
        label = f"inference 224 px b16, {model} attention, eager and CUDA graph x DeiT-S"
        if eager is None or graph is None:
            lines.append(f"| {label} | not measured | - |")
            continue
        verdict = ("launch-bound: CUDA graphs meet it" if graph <= limit < eager else
                   "within it eager" if eager <= limit else "the GPU's time misses it too")
        lines.append(f"| {label} | eager x{eager:.2f}, CUDA graph x{graph:.2f} | {verdict} |")
    return lines


def launch_lines(folder: Path) -> List[str]:
    """The bidirectional kernel's launch settings (Tuning.bidirectional_forward, _backward; "keys first":
    _keys_first; "entrywise": _factored_masks off; "maps in loops": _map_pass off; "uncapped": _forward_blocks 0)
    from benchmark_fused.py's rows (the fused_kernels runs): each pair tried, its forward-and-backward time summed
    over the cases against the code's pair (the first), and the pick, the least."""
    lines = []
    for run, what in FUSED_KERNEL_RUNS:
        totals: Dict[str, float] = {}
        failed = set()
        for row in read(folder / run / "fused.csv"):
            if row["kernel"] != "bidirectional":
                continue
            pair = f"{row['forward']} / {row['backward']}"
            time = number(row, "train_us")
            if time is None:
                failed.add(pair)
            else:
                totals[pair] = totals.get(pair, 0.0) + time
        totals = {pair: total for pair, total in totals.items() if pair not in failed}
        label = f"bidirectional_forward / _backward ({what})"
        if not totals:
            lines.append(f"| {label} | not measured | - |")
            continue
        code = next(iter(totals.values()))
        measured = ", ".join(f"{pair} x{total / code:.2f}" for pair, total in totals.items())
        lines.append(f"| {label} | {measured} of the code's | {min(totals, key=totals.get)} |")
    return lines


# The inference groups' settings, and the kernels each is timed on (the normaliser part): the chunk kernels'
# group_share, the recurrent kernel's recurrent_group_programs (lion_vit.ops.Tuning)
GROUP_SETTINGS = (("group_share", "lion_d_small", "chunk"), ("group_share", "lion_d_natural_small", "chunk"),
                  ("recurrent_group_programs", "lion_d_small", "rnn"))


def group_lines(folder: Path) -> List[str]:
    """The triton backend's inference groups: each model and form at batch 16 in the code's groups of images
    (groups_code) and in one call (groups_one), time and peak memory against DeiT-S in the same run. One call
    is the pick where it is faster at every size and its peak memory stays within DeiT-S's."""
    lines = []
    runs = [read(folder / name / "resolution.csv") for name in ("groups_code", "groups_one")]
    for setting, model, form in GROUP_SETTINGS:
        label = f"{setting} ({model}{' ' + form if form != 'chunk' else ''}, b16)"
        # per run, size -> (time, peak memory) against DeiT-S, where both were measured
        code, one = ({size_of(row): (number(row, "time_x_baseline"), number(row, "mem_x_baseline")) for row in rows
                      if row["model"] == model and row.get("form") == form} for rows in runs)
        measured = [(size, code[size], one[size]) for size in sorted(code.keys() & one.keys())
                    if None not in code[size] + one[size]]
        if not measured:
            lines.append(f"| {label} | not measured | - |")
            continue
        text = ", ".join(f"{size} px: groups x{groups[0]:.2f} (mem x{groups[1]:.2f}), one call x{whole[0]:.2f} "
                         f"(mem x{whole[1]:.2f})" for size, groups, whole in measured)
        better = all(whole[0] < groups[0] and whole[1] <= 1 for _, groups, whole in measured)
        lines.append(f"| {label} | {text} of DeiT-S | {f'one call (a large {setting})' if better else 'keep'} |")
    return lines


def decode_lines(folder: Path) -> List[str]:
    """data.decode's default on CUDA: "gpu" only where decoding on the GPU (input_gpu) trained faster end to end
    than in the workers (input) in every run measured in both."""
    cpu, gpu = (input_rows(folder, run) for run, _ in INPUT_RUNS)
    ratios = []
    for model, compiled in sorted(cpu.keys() & gpu.keys()):
        before, after = (number(rows[model, compiled], "imgs_per_s") for rows in (cpu, gpu))
        if before and after:
            ratios.append((f"{model}{' compiled' if compiled else ''}", after / before))
    if not ratios:
        return ["| data.decode on CUDA (images/s, gpu over cpu) | not measured | - |"]
    pick = '"gpu"' if all(ratio > 1 for _, ratio in ratios) else '"cpu" (as now)'
    return [f"| data.decode on CUDA (images/s, gpu over cpu) | {', '.join(f'{what} x{r:.2f}' for what, r in ratios)} "
            f"| {pick} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the gpu-check folder (its --out)")
    args = parser.parse_args()
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder; give the folder gpu_check.sh wrote (its --out)")
    print("\n".join(target_lines(args.folder) + [""] + floor_lines(args.folder) + [""] + setting_lines(args.folder)))


if __name__ == "__main__":
    sys.exit(main())
