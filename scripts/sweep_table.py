#!/usr/bin/env python
"""The accuracy of a Hydra sweep of train.py (-m), by model: last and best top-1 over its jobs (seeds), as a
markdown table with mean and standard deviation. A job that has not finished its epochs is left out.

    python train.py -m model.name=lion_gla_tiny,lion_d_natural_tiny seed=0,1,2 output_dir=runs/sweep
    python scripts/sweep_table.py runs/sweep
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import yaml


def results(folder: Path) -> Dict[str, List[Tuple[float, float]]]:
    """model name -> (last, best) top-1 of each finished job, in the order the sweep named the models."""
    found: Dict[str, List[Tuple[float, float]]] = {}
    for job in sorted((p for p in folder.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        config, metrics = job / "config.yaml", job / "metrics.jsonl"
        if not (config.is_file() and metrics.is_file()):
            continue
        settings = yaml.safe_load(config.read_text())
        lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if len(lines) < settings["epochs"]:
            continue
        found.setdefault(settings["model"]["name"], []).append(
            (lines[-1]["val_acc1"], max(line["val_acc1"] for line in lines)))
    return found


def spread(values) -> str:
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}" if len(values) > 1 else f"{values[0]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the sweep's output_dir (its jobs 0, 1, ...)")
    args = parser.parse_args()
    found = results(args.folder) if args.folder.is_dir() else {}
    if not found:
        parser.error(f"{args.folder} holds no finished train.py job; give the output_dir of a sweep (-m) that ran")
    print("| model | jobs | last top-1 (%) | best top-1 (%) |\n|---|---|---|---|")
    for name, runs in found.items():
        last, best = zip(*runs)
        print(f"| {name} | {len(runs)} | {spread(last)} | {spread(best)} |")


if __name__ == "__main__":
    sys.exit(main())
