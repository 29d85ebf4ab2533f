#!/usr/bin/env python
r"""The accuracy of a Hydra sweep of train.py (-m) as a markdown table; also of the runs in a folder such as
outputs/ (train.py's default output_dirs, in the order of their names: their start times), or of one run. A
training sweep: a row per model and combination of the other settings its jobs differ in (a column each; the seed,
output_dir and logging aside), last and best top-1 over its jobs (seeds), mean and standard deviation; a job that
has not finished its epochs (running, or stopped) is left out. An evaluation sweep (eval_only=true): a row per
job's eval.json, in the sweep's order, with the form and resolution that ran. What is left out is named on stderr.

    python train.py -m model.name=lion_gla_tiny,lion_d_natural_tiny seed=0,1,2 output_dir=runs/sweep
    python scripts/sweep_table.py runs/sweep
    python train.py -m eval_only=true checkpoint=runs/sweep/0/checkpoint-best.pt img_size=224,448 \
        model.attn_form=attention,chunk output_dir=runs/eval_sweep
    python scripts/sweep_table.py runs/eval_sweep
    python scripts/sweep_table.py outputs                    # the runs of plain `python train.py ...` commands
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import yaml


def jobs(folder: Path) -> List[Path]:
    """A sweep's job folders 0, 1, ... in order; else the runs in folder, by name; else folder, where it is a run."""
    numbered = sorted((p for p in folder.iterdir() if p.name.isdigit() and p.is_dir()), key=lambda p: int(p.name))
    if numbered:
        return numbered
    if is_run(folder):
        return [folder]
    return sorted(p for p in folder.iterdir() if p.is_dir() and is_run(p))


def is_run(folder: Path) -> bool:
    """Whether train.py wrote folder: a training run's settings or an evaluation's result."""
    return (folder / "config.yaml").is_file() or (folder / "eval.json").is_file()


# settings that name or feed a run without changing what it trains: never a reason for a row of its own
NOT_COMPARED = ("seed", "output_dir", "resume", "checkpoint", "progress", "log_interval", "num_workers",
                "prefetch_factor", "grad_checkpointing", "logger.", "tuning.")


def _flat(settings: Dict[str, Any], prefix: str = "") -> Dict[str, str]:
    """config.yaml's settings as dotted names -> their values as text (lists included)."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return flat


def results(folder: Path) -> Tuple[List[str], Dict[Tuple[str, ...], List[Tuple[float, float]]]]:
    """The settings the finished jobs differ in (model.name first, seeds and run names aside), and for each of their
    combinations, in the order the jobs ran, the (last, best) top-1 of its jobs."""
    finished = []
    for job in jobs(folder):
        config, metrics = job / "config.yaml", job / "metrics.jsonl"
        if not (config.is_file() and metrics.is_file()):
            continue
        settings = _read(config, yaml.safe_load, yaml.YAMLError, ("epochs",))
        lines = logged_epochs(metrics.read_text())
        if settings is None:
            continue
        if len(lines) < settings["epochs"]:  # (running, or stopped: resume=auto continues it)
            print(f"left out {job}: {len(lines)} of its {settings['epochs']} epochs", file=sys.stderr)
            continue
        finished.append((_flat(settings), (lines[-1]["val_acc1"], max(line["val_acc1"] for line in lines))))
    names = list(dict.fromkeys(name for flat, _ in finished for name in flat))
    differing = [name for name in names if not name.startswith(NOT_COMPARED) and name != "model.name"
                 and len({flat.get(name) for flat, _ in finished}) > 1]
    columns = ["model.name", *differing]
    found: Dict[Tuple[str, ...], List[Tuple[float, float]]] = {}
    for flat, accuracies in finished:
        found.setdefault(tuple(flat.get(name, "") for name in columns), []).append(accuracies)
    return differing, found


def logged_epochs(text: str) -> List[Dict[str, Any]]:
    """metrics.jsonl's epoch lines; a line cut short (a job killed while writing it, or one being written now) is
    left out, as train.py's resume drops it."""
    lines = []
    for line in text.splitlines():
        try:
            logged = json.loads(line)
        except ValueError:
            continue
        if isinstance(logged, dict) and "val_acc1" in logged:
            lines.append(logged)
    return lines


def evaluations(folder: Path) -> List[Dict[str, Any]]:
    """Each job's eval.json (an evaluation sweep), in job order."""
    found = [_read(job / "eval.json", json.loads, ValueError, EVALUATED) for job in jobs(folder)
             if (job / "eval.json").is_file()]
    return [e for e in found if e is not None]


def _read(path: Path, parse, errors, keys: Tuple[str, ...]):
    """path's contents parsed, or None for a file that is not the dict of `keys` train.py writes there (named on
    stderr: a file edited or written by something else)."""
    try:
        read = parse(path.read_text())
        why = "" if isinstance(read, dict) and set(keys) <= set(read) else f"not a mapping of {', '.join(keys)}"
    except (errors, OSError, UnicodeDecodeError) as error:
        why = str(error).strip().splitlines()[0]
    if why:
        print(f"left out {path}: not as train.py writes it ({why})", file=sys.stderr)
        return None
    return read


EVALUATED = ("model", "weights", "img_size", "attn_form", "chunk_size", "attn_plan", "acc1", "acc5", "loss",
             "num_images")  # (what an eval.json holds that the table reads)


def spread(values) -> str:
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}" if len(values) > 1 else f"{values[0]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a sweep's output_dir (its jobs 0, 1, ...), a folder of runs "
                                                  "(outputs/) or one run's folder")
    args = parser.parse_args()
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder; give the output_dir of a sweep (-m), a folder of runs "
                     "(outputs/) or one run's folder")
    (differing, found), evaluated = results(args.folder), evaluations(args.folder)
    if not found and not evaluated:
        parser.error(f"{args.folder} holds no finished train.py job; give the output_dir of a sweep (-m) that ran, a "
                     f"folder of runs (outputs/) or one run's folder")
    if found:
        print(_header(["model", *differing, "jobs", "last top-1 (%)", "best top-1 (%)"]))
    for values, runs in found.items():
        last, best = zip(*runs)
        print(f"| {' | '.join(values)} | {len(runs)} | {spread(last)} | {spread(best)} |")
    if evaluated:
        print(_header(["model", "weights", "img_size", "form", "chunk_size", "what ran", "top-1 (%)", "top-5 (%)",
                       "loss", "images", "batch_size", "images/s", "peak GPU memory (MB)"]))
    for e in evaluated:  # (chunk_size: where chunks ran; attn_form and attn_plan: null for a softmax model; the
        # speed and memory: empty in an eval.json from before they were recorded, the memory on a CPU)
        print(f"| {e['model']} | {e['weights']} | {e['img_size']} | {e['attn_form'] or ''} | {e['chunk_size'] or ''} "
              f"| {e['attn_plan'] or ''} | {e['acc1']:.2f} | {e['acc5']:.2f} | {e['loss']:.4f} | {e['num_images']} "
              f"| {e.get('batch_size') or ''} | {_figure(e.get('imgs_per_s'))} | {_figure(e.get('peak_gpu_mem_mb'))} |")


def _header(columns: List[str]) -> str:
    """A markdown table's header and separator lines."""
    return "| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|"


def _figure(value) -> str:
    return "" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.3g}"


if __name__ == "__main__":
    sys.exit(main())
