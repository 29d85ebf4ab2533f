"""The benchmark scripts run end to end on tiny models and write the tables the README quotes."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from lion_vit.benchmark import measure, measure_inference

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def read_rows(path: Path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_steady_memory_leaves_out_first_call_costs():
    """The first forward pages in library code and allocator pools (megabytes at any size); the
    steady measurement, a second forward in the same fresh process, sees only the activations."""
    config = dict(model_name="deit_tiny_patch16_224", form=None, chunk_size=None, img_size=64, batch_size=1,
                  device="cpu", dtype="float32", repeats=0)
    first = measure(dict(config, memory="first"), timeout_s=300)
    steady = measure(dict(config, memory="steady"), timeout_s=300)
    assert first["status"] == steady["status"] == "ok"
    assert 0 <= steady["peak_mem_mb"] < 3 < first["peak_mem_mb"] - steady["peak_mem_mb"]


def test_unknown_memory_mode_raises():
    with pytest.raises(ValueError, match="unknown memory mode 'warm'"):
        measure_inference("deit_tiny_patch16_224", None, None, 32, 1, "cpu", "float32", 0, memory="warm")


def test_resolution_and_chunk_scripts(tmp_path):
    out = run_script("benchmark_resolution.py", "--runs", "deit_tiny_patch16_224", "lion_d_tiny:chunk:4",
                     "--resolutions", "64", "--repeats", "1", "--out", str(tmp_path))
    rows = read_rows(tmp_path / "resolution.csv")
    assert [(r["model"], r["form"], r["chunk_size"], r["status"]) for r in rows] == [
        ("deit_tiny_patch16_224", "", "", "ok"), ("lion_d_tiny", "chunk", "4", "ok")]
    assert all(r["memory"] == "steady" and float(r["time_s"]) > 0 and float(r["peak_mem_mb"]) >= 0 for r in rows)
    assert float(rows[1]["time_x_baseline"]) == pytest.approx(float(rows[1]["time_s"]) / float(rows[0]["time_s"]))
    assert (tmp_path / "resolution.png").stat().st_size > 0 and "| 64 | lion_d_tiny (chunk C=4) | ok |" in out

    run_script("benchmark_chunk.py", "--models", "lion_d_tiny", "--chunk-sizes", "4", "16", "--resolution", "64",
               "--baseline", "", "--reference-forms", "--repeats", "0", "--out", str(tmp_path))
    rows = read_rows(tmp_path / "chunk.csv")
    assert [(r["chunk_size"], r["status"]) for r in rows] == [("4", "ok"), ("16", "ok")]
    assert (tmp_path / "chunk.png").stat().st_size > 0


def test_train_script_ratios_and_profile(tmp_path):
    out = run_script("benchmark_train.py", "--models", "deit_tiny_patch16_224", "lion_d_tiny", "--batch-size", "2",
                     "--img-size", "32", "--steps", "1", "--profile", "--out", str(tmp_path))
    rows = read_rows(tmp_path / "train.csv")
    assert [r["model"] for r in rows] == ["deit_tiny_patch16_224", "lion_d_tiny"]
    assert float(rows[0]["x_baseline"]) == 1.0
    assert float(rows[1]["x_baseline"]) == pytest.approx(float(rows[1]["step_s"]) / float(rows[0]["step_s"]))
    assert (tmp_path / "train.png").stat().st_size > 0
    # the profile names each model and its most expensive ops
    assert "lion_d_tiny:" in out and "aten::" in out
