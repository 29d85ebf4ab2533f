"""Helpers for tests that run train.py end to end on CPU with tiny generated data."""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
SMALL_LION = ["model=lion", "model.name=lion_s_tiny", "model.patch_size=8", "img_size=32",
              "+model.kwargs.depth=2", "optim=adamw", "progress=false", "num_workers=0"]


def run_train(*overrides: str, timeout: int = 300, launcher=(sys.executable, "train.py")):
    return subprocess.run([*launcher, *overrides], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def assert_ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def assert_clean_error(proc, *needles: str):
    """Non-zero exit, one `error:` line on stderr naming the problem, no traceback."""
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]


def make_image_folder(root: Path, classes: int = 3, train_per_class: int = 8, val_per_class: int = 4,
                      size: int = 32) -> Path:
    """Class k is a noisy image of colour k, so a model can learn it in a few steps."""
    rng = np.random.default_rng(0)
    colours = [(220, 40, 40), (40, 220, 40), (40, 40, 220), (200, 200, 40)]
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for k in range(classes):
            folder = root / split / f"class_{k}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = np.clip(np.array(colours[k]) + rng.normal(0, 30, (size, size, 3)), 0, 255)
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"img_{i}.png")
    return root


def make_cifar10(root: Path, per_batch: int = 6) -> Path:
    """The python-pickle CIFAR-10 layout, with tiny random batches."""
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, per_batch).tolist()}
        with open(base / name, "wb") as f:
            pickle.dump(batch, f)
    with open(base / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, f)
    return root


def read_metrics(output_dir: Path):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def kill_after_first_epoch(*overrides: str, output_dir: Path, epochs: int) -> int:
    """Start train.py, kill -9 it once its first epoch is logged, and return the epochs it had logged
    (at least one, fewer than `epochs`)."""
    proc = subprocess.Popen([sys.executable, "train.py", *overrides, f"epochs={epochs}", f"output_dir={output_dir}"],
                            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    metrics = output_dir / "metrics.jsonl"
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = metrics.read_text().count("\n")
    assert 1 <= done < epochs, "the run must be killed part-way"
    return done
