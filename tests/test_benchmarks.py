"""The benchmark scripts run end to end on tiny models and write the tables the README quotes."""
from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import re
import runpy
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # the scripts' shared helpers (scripts/benchmarking.py)

from benchmarking import device_name, measure, measure_inference, model_name, positive_int, run_spec, status_line  # noqa: E402
from runs import run_python  # noqa: E402
from lion_vit.data.gpu import JPEG_DECODERS  # noqa: E402


def run_script(name: str, *args: str) -> str:
    proc = run_python(str(ROOT / "scripts" / name), *args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def read_rows(path: Path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_steady_memory_leaves_out_first_call_costs():
    """The first forward pages in library code and allocator pools (megabytes at any size); the
    steady measurement, a second forward in the same fresh process, sees only the activations."""
    config = dict(model_name="deit_tiny_patch16_224", form=None, chunk_size=None, img_size=64, batch_size=1,
                  device="cpu", dtype="float32", repeats=0)
    with ThreadPoolExecutor(max_workers=2) as pool:  # two fresh processes, side by side
        first, steady = pool.map(lambda memory: measure(dict(config, memory=memory), timeout_s=300),
                                 ("first", "steady"))
    assert first["status"] == steady["status"] == "ok"
    assert 0 <= steady["peak_mem_mb"] < 3 < first["peak_mem_mb"] - steady["peak_mem_mb"]


def test_group_share_holds_for_the_measured_forwards_only(monkeypatch, tmp_path):
    """--group-share sets the triton backend's group_share (its inference groups of images) while each configuration
    runs, and the code's value is back afterwards; without it the code's value runs."""
    import benchmarking
    from benchmarking import add_inference_arguments, inference_settings
    from lion_vit.ops import tuning
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(tuning().group_share)
            return x

    monkeypatch.setattr(benchmarking, "build", lambda *args: Probe())
    parser = argparse.ArgumentParser()
    add_inference_arguments(parser)
    code = tuning().group_share
    for argv, share_seen in ((["--group-share", "1000"], 1000.0), ([], code)):
        settings = inference_settings(parser.parse_args([*argv, "--out", str(tmp_path)]))
        seen.clear()
        measure_inference("lion_d_tiny", "chunk", None, 32, repeats=2, **settings)
        assert seen == [share_seen] * 4  # warm-up, memory, two timed
        assert tuning().group_share == code
    assert "group_share" not in settings  # (nor in the CSV's columns)


def test_unknown_memory_mode_raises():
    with pytest.raises(ValueError, match="unknown memory mode 'warm'"):
        measure_inference("deit_tiny_patch16_224", None, None, 32, 1, "cpu", "float32", 0, memory="warm")


@pytest.mark.slow
def test_resolution_and_chunk_scripts(tmp_path):
    # the two scripts (each a fresh process per configuration, mostly start-up) run side by side
    with ThreadPoolExecutor(max_workers=2) as pool:
        resolution = pool.submit(run_script, "benchmark_resolution.py", "--runs", "deit_tiny_patch16_224",
                                 "lion_d_tiny:chunk:4", "--resolutions", "64", "--repeats", "0", "--out", str(tmp_path))
        chunk = pool.submit(run_script, "benchmark_chunk.py", "--models", "lion_d_tiny", "--chunk-sizes", "16",
                            "--resolution", "256", "--baseline", "", "--reference-forms", "--repeats", "0",
                            "--out", str(tmp_path))
        out = resolution.result()
        chunk.result()
    rows = read_rows(tmp_path / "resolution.csv")
    assert [(r["model"], r["form"], r["chunk_size"], r["status"]) for r in rows] == [
        ("deit_tiny_patch16_224", "", "", "ok"), ("lion_d_tiny", "chunk", "4", "ok")]
    assert all(r["memory"] == "steady" and float(r["time_s"]) > 0 and float(r["peak_mem_mb"]) >= 0 for r in rows)
    assert float(rows[1]["time_x_baseline"]) == pytest.approx(float(rows[1]["time_s"]) / float(rows[0]["time_s"]))
    # 16 tokens: one product over the whole sequence costs less than chunks of 4 (the chunks column says 1)
    assert [r["chunks"] for r in rows] == ["", "1"]
    assert (tmp_path / "resolution.png").stat().st_size > 0 and "| 64 | lion_d_tiny (chunk C=4) | 1 | ok |" in out

    rows = read_rows(tmp_path / "chunk.csv")  # 256 tokens: chunks pay
    assert [(r["chunk_size"], r["chunks"], r["status"]) for r in rows] == [("16", "16", "ok")]
    assert (tmp_path / "chunk.png").stat().st_size > 0 and "16 chunks" in chunk.result()


def test_a_timed_cpu_configuration_takes_memory_and_time_from_two_fresh_processes(monkeypatch):
    """With timing repeats, peak memory comes from a process with the fixed mmap threshold and the time
    from another with the default allocator (the scripts' runs above use --repeats 0: one process each)."""
    import benchmarking as benchmark
    calls = []

    def fake(config, timeout_s, extra_env):
        calls.append((config, extra_env))
        return {"status": "ok", "time_s": 2.0 if extra_env else 1.0, "peak_mem_mb": 5.0 if extra_env else 9.0}

    monkeypatch.setattr(benchmark, "_subprocess", fake)
    config = dict(model_name="lion_d_tiny", form="chunk", chunk_size=4, img_size=32, batch_size=1, device="cpu",
                  dtype="float32", repeats=2, memory="steady")
    assert benchmark.measure(config, timeout_s=60) == {"status": "ok", "time_s": 1.0, "peak_mem_mb": 5.0}
    (memory, memory_env), (timing, timing_env) = calls
    assert memory["repeats"] == 0 and memory["memory"] == "steady" and memory_env == {"MALLOC_MMAP_THRESHOLD_": "65536"}
    assert timing["repeats"] == 2 and timing["memory"] == "first" and timing_env == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the triton backend runs on this machine's GPU")
def test_train_script_names_a_backend_that_cannot_run_here(tmp_path, monkeypatch, capsys):
    """--attn-backend triton on a CPU (Triton's interpreter off, as for a user): the parser's one line."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(sys, "argv", ["benchmark_train.py", "--attn-backend", "triton", "--models",
                                      "deit_tiny_patch16_224", "lion_d_tiny", "--img-size", "32", "--batch-size", "2",
                                      "--steps", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(ROOT / "scripts" / "benchmark_train.py"), run_name="__main__")
    assert stopped.value.code == 2
    assert "benchmark_train.py: error: lion_d_tiny at --img-size 32: the triton backend runs Triton kernels, which " \
           "need a CUDA GPU" in capsys.readouterr().err


@pytest.mark.slow
def test_train_script_ratios_and_profile(tmp_path):
    out = run_script("benchmark_train.py", "--models", "deit_tiny_patch16_224", "lion_d_tiny", "--batch-size", "2",
                     "--img-size", "32", "--steps", "1", "--profile", "--memory", "--out", str(tmp_path))
    rows = read_rows(tmp_path / "train.csv")
    assert [r["model"] for r in rows] == ["deit_tiny_patch16_224", "lion_d_tiny"]
    # --memory: each model's step in a fresh process, its peak RSS growth and the ratio to the baseline's
    assert all(float(r["peak_mem_mb"]) > 0 for r in rows) and float(rows[0]["mem_x_baseline"]) == 1.0
    peaks = [float(r["peak_mem_mb"]) for r in rows]
    assert float(rows[1]["mem_x_baseline"]) == pytest.approx(peaks[1] / peaks[0])
    assert float(rows[0]["x_baseline"]) == 1.0
    assert float(rows[1]["x_baseline"]) == pytest.approx(float(rows[1]["step_s"]) / float(rows[0]["step_s"]))
    # one round: the paired ratio is that round's ratio, the same steps as the best-of ratio
    assert float(rows[0]["x_baseline_paired"]) == 1.0
    assert float(rows[1]["x_baseline_paired"]) == pytest.approx(float(rows[1]["x_baseline"]))
    assert (tmp_path / "train.png").stat().st_size > 0
    # each warm-up is printed as it ends (a run cut short says how far it got); the profile names each
    # model and its most expensive ops, and their total against the profiled step's wall time
    assert "lion_d_tiny: warm-up step" in out and "aten::" in out
    assert re.search(r"^lion_d_tiny: [\d.]+ s profiled \(CPU self time, .*\) in a step of [\d.]+ s wall, \d+%$", out,
                     re.MULTILINE), out


def test_train_script_leaves_out_a_model_that_runs_out_of_memory(tmp_path, monkeypatch):
    """A form that does not fit on the GPU (the attention form at high resolution) is recorded as out of
    memory and the others are still timed against the baseline; a baseline that does not fit is one line.
    A model whose kernel fails there (a compiler's or driver's error) is a row of status error, the others timed,
    and the script exits 1 once the table is written. Simulated on the CPU by models whose forward raises."""
    import lion_vit.models
    build = lion_vit.models.create_model_at_size

    def create(name, img_size, **kwargs):
        model = build(name, img_size, **kwargs)
        if kwargs.get("attn_form") == "attention" or name == "deit_tiny_patch16_224":
            def forward(x):
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
            model.forward = forward
        if name == "lion_lit_tiny":
            def forward(x):
                raise RuntimeError("Triton Error [CUDA]: invalid argument")
            model.forward = forward
        return model

    def run(*models):
        monkeypatch.setattr(sys, "argv", ["benchmark_train.py", "--models", *models, "--batch-size", "2",
                                          "--img-size", "32", "--steps", "1", "--malloc", "default", "--out",
                                          str(tmp_path)])
        runpy.run_path(str(ROOT / "scripts" / "benchmark_train.py"), run_name="__main__")

    monkeypatch.setattr(lion_vit.models, "create_model_at_size", create)
    run("lion_gla_tiny:chunk:2", "lion_d_tiny:attention", "lion_s_tiny")
    rows = read_rows(tmp_path / "train.csv")
    # (lion_s_tiny takes --attn-form auto, which is the attention form on a CPU: the form and chunk_size columns
    # say what ran)
    assert [(r["model"], r["form"], r["chunk_size"], r["status"]) for r in rows] == [
        ("lion_gla_tiny", "chunk", "2", "ok"), ("lion_d_tiny", "attention", "", "out of memory"),
        ("lion_s_tiny", "attention", "", "ok")]
    assert rows[1]["step_s"] == "" and float(rows[0]["x_baseline"]) == 1.0 and float(rows[2]["x_baseline"]) > 0
    with pytest.raises(SystemExit, match="the baseline deit_tiny_patch16_224 runs out of memory at --batch-size 2"):
        run("deit_tiny_patch16_224", "lion_d_tiny:chunk")
    with pytest.raises(SystemExit, match=r"^benchmark_train.py: lion_lit_tiny failed \(above\); the table holds"):
        run("lion_d_tiny:chunk:4", "lion_lit_tiny", "lion_s_tiny")
    assert [(r["model"], r["status"], bool(r["step_s"])) for r in read_rows(tmp_path / "train.csv")] == [
        ("lion_d_tiny", "ok", True), ("lion_lit_tiny", "error", False), ("lion_s_tiny", "ok", True)]


def test_train_script_with_grad_checkpointing_in_every_model_and_its_memory_step(tmp_path, monkeypatch):
    """--grad-checkpointing: every model timed with timm's gradient checkpointing, and so measured by --memory's
    fresh processes (their runner recorded here), the CSV saying so."""
    import benchmarking
    import lion_vit.models
    build, built, measured = lion_vit.models.create_model_at_size, [], []
    monkeypatch.setattr(lion_vit.models, "create_model_at_size",
                        lambda *args, **kwargs: built.append(build(*args, **kwargs)) or built[-1])
    monkeypatch.setattr(benchmarking, "train_memory_in_subprocess",
                        lambda config, timeout_s: measured.append(config) or {"status": "ok", "peak_mem_mb": 1.0})
    for flag in (["--grad-checkpointing"], []):
        built.clear()
        measured.clear()
        monkeypatch.setattr(sys, "argv", ["benchmark_train.py", "--models", "deit_tiny_patch16_224", "lion_d_tiny",
                                          "--batch-size", "2", "--img-size", "32", "--steps", "1", "--memory", *flag,
                                          "--out", str(tmp_path)])
        runpy.run_path(str(ROOT / "scripts" / "benchmark_train.py"), run_name="__main__")
        assert [model.grad_checkpointing for model in built] == [bool(flag)] * 2
        assert [config["grad_checkpointing"] for config in measured] == [bool(flag)] * 2
        assert [r["grad_checkpointing"] for r in read_rows(tmp_path / "train.csv")] == [str(bool(flag))] * 2


@pytest.mark.slow
def test_resolution_script_compiles_and_times_the_compile_apart(tmp_path):
    """--compile: the compiling first call is reported as compile_s, the measured forward after it
    runs the compiled model (one configuration, no timing repeats: one compile; through aot_eager,
    which takes seconds where Inductor's code generation takes tens of them)."""
    from benchmarking import add_inference_arguments
    parser = argparse.ArgumentParser()
    add_inference_arguments(parser)
    assert parser.parse_args(["--compile", "--out", str(tmp_path)]).compile == "inductor"
    assert parser.parse_args(["--out", str(tmp_path)]).compile is None
    out = run_script("benchmark_resolution.py", "--runs", "lion_d_tiny:chunk:4", "--resolutions", "32",
                     "--repeats", "0", "--compile", "aot_eager", "--out", str(tmp_path))
    row, = read_rows(tmp_path / "resolution.csv")
    assert row["status"] == "ok" and row["compile"] == "aot_eager"
    assert float(row["compile_s"]) > 10 * float(row["time_s"]) > 0
    assert "| compile_s |" in out and re.search(r"compile +\d+\.\ds", out)


def test_each_compiled_configuration_starts_from_an_empty_inductor_cache(monkeypatch):
    """A compile time read from a cache filled by an earlier configuration (or run) would be a fraction
    of what a first run pays: each compiling subprocess gets its own, deleted afterwards."""
    import benchmarking as benchmark
    caches = []

    def fake_run(args, env, **kwargs):
        caches.append(env.get("TORCHINDUCTOR_CACHE_DIR"))
        assert caches[-1] is None or Path(caches[-1]).is_dir()
        result = {"time_s": 0.5, "peak_mem_mb": 1.0, "compile_s": 9.0}
        return subprocess.CompletedProcess(args, 0, stdout="RESULT " + json.dumps(result), stderr="")

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    config = dict(model_name="lion_d_tiny", form="chunk", chunk_size=4, img_size=32, batch_size=1, device="cpu",
                  dtype="float32", repeats=1, memory="steady")
    assert measure(dict(config, compile=True), timeout_s=60) == {"status": "ok", "time_s": 0.5, "peak_mem_mb": 1.0,
                                                                 "compile_s": 9.0}
    memory_cache, timing_cache = caches
    assert memory_cache != timing_cache and not Path(memory_cache).exists() and not Path(timing_cache).exists()
    measure(dict(config, compile=False), timeout_s=60)
    assert caches[2:] == [None, None]


def test_baselines_without_an_input_size_argument_are_built_too():
    """A CNN baseline (resnet18) takes any input size and no img_size argument; ViTs get theirs."""
    from lion_vit.models import create_model_at_size
    cnn = create_model_at_size("resnet18", 48, num_classes=3)
    vit = create_model_at_size("lion_d_tiny", 48, 8, depth=1, num_classes=3)
    assert vit.patch_embed.img_size == (48, 48) and vit.patch_embed.patch_size == (8, 8)
    assert cnn(torch.randn(1, 3, 48, 48)).shape == vit(torch.randn(1, 3, 48, 48)).shape == (1, 3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'not_an_argument'"):
        create_model_at_size("resnet18", 48, not_an_argument=1)


def test_softmax_baseline_refuses_a_size_its_patch_does_not_divide():
    """timm's DeiT built for 40 px with patch 16 silently drops the last 8 pixels of every image (a
    2x2 grid); like the LION models, the baselines built here refuse that size instead."""
    from lion_vit.models import create_model_at_size
    with pytest.raises(ValueError, match="img_size 40x40 is not divisible by the patch size 16x16"):
        create_model_at_size("deit_tiny_patch16_224", 40, depth=1, num_classes=3)
    deit = create_model_at_size("deit_tiny_patch16_224", 40, 8, depth=1, num_classes=3)  # patch 8 divides it
    assert deit.patch_embed.grid_size == (5, 5) and deit(torch.randn(1, 3, 40, 40)).shape == (1, 3)


def test_paired_ratio_follows_a_drifting_machine():
    from benchmarking import paired_ratio
    # the machine is fast only during the baseline's first step; every same-round pair says x1.1
    baseline, model = [1.0, 1.5, 1.5], [1.65, 1.65, 1.65]
    assert min(model) / min(baseline) == pytest.approx(1.65)
    assert paired_ratio(model, baseline) == pytest.approx(1.1)
    assert paired_ratio([3.0, 1.0, 2.0], [1.0, 1.0, 1.0]) == 2.0  # the median, not the mean or the best
    with pytest.raises(ValueError, match="one time per round"):
        paired_ratio([1.0], [1.0, 2.0])


@pytest.mark.parametrize("text, expected", [
    ("deit_small_patch16_224", ("deit_small_patch16_224", None, None)),
    ("lion_d_small", ("lion_d_small", "attention", None)),
    ("lion_s_natural_small:rnn", ("lion_s_natural_small", "rnn", None)),
    ("lion_d_small:chunk:64", ("lion_d_small", "chunk", 64)),
])
def test_run_spec_parses(text, expected):
    assert run_spec(text) == expected


@pytest.mark.parametrize("text, message", [
    ("lion_x_small", "unknown model 'lion_x_small'"),
    ("lion_d_small:flash", "FORM one of ['attention', 'auto', 'chunk', 'rnn']"),
    ("lion_d_small:chunk:0", "expected a positive integer, got '0'"),
    ("lion_d_small:chunk:abc", "expected a positive integer, got 'abc'"),
    ("lion_d_small:rnn:16", "a chunk size goes with the chunk form"),
    ("lion_d_small:chunk:16:4", "expected lion_d_small:FORM[:CHUNK_SIZE]"),
    ("deit_small_patch16_224:chunk:64", "only LION models take a form"),
])
def test_run_spec_rejects(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        run_spec(text)


def test_tables_show_a_rate_past_a_thousand_without_an_exponent():
    """Three significant digits, but 1,002.8 images/s is 1003, not "1e+03"."""
    from benchmarking import markdown_table
    table = markdown_table([{"rate": 1002.8, "ratio": 1.33021, "small": 0.0123456, "none": None, "count": 7}],
                           ["rate", "ratio", "small", "none", "count"])
    assert table.splitlines()[-1] == "| 1003 | 1.33 | 0.0123 |  | 7 |"


def test_argument_types():
    assert positive_int("3") == 3 and model_name("lion_lit_tiny") == "lion_lit_tiny"
    for bad in ("0", "-2", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)


def test_device_argument_says_when_cuda_is_missing(monkeypatch):
    """--device cuda on a machine without CUDA is a usage error up front, naming the fix."""
    assert device_name("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(argparse.ArgumentTypeError, match="no CUDA device is available.*use --device cpu"):
        device_name("cuda")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown device 'gpu'"):
        device_name("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_name("cuda") == "cuda"


@pytest.mark.parametrize("script, args, message", [
    ("benchmark_train.py", ["--models", "deit_tiny_patch16_224", "lion_q_tiny"], "unknown model 'lion_q_tiny'"),
    ("benchmark_train.py", ["--models", "lion_d_tiny", "--img-size", "40"], "not divisible by the patch size"),
    # timm's DeiT itself would crop 40 px to 32 and be timed on that
    ("benchmark_train.py", ["--models", "deit_tiny_patch16_224", "--img-size", "40"], "not divisible by the patch size"),
    ("benchmark_resolution.py", ["--runs", "lion_d_tiny:fast"], "FORM one of"),
    ("benchmark_resolution.py", ["--group-share", "0"], "expected a positive number, got '0'"),
    ("benchmark_resolution.py", ["--resolutions", "224", "100"], "--resolutions 100 is not a multiple of the patch"),
    ("benchmark_chunk.py", ["--models", "deit_tiny_patch16_224"], "'deit_tiny_patch16_224' is not a LION model"),
    ("benchmark_chunk.py", ["--resolution", "1250"], "--resolution 1250 is not a multiple of the patch size (16)"),
    ("benchmark_cuda_graph.py", ["--runs", "lion_d_tiny:fast"], "FORM one of"),
    ("check_equivalence.py", ["--models", "lion_d_tiny", "--sizes", "40x48"], "not divisible by the patch size"),
    ("check_equivalence.py", ["--models", "lion_d_tiny_distiled"], "use one such as lion_d_small (lion_d_natural_"),
    # an output path that cannot be written fails before minutes of measurements, not after
    ("benchmark_resolution.py", ["--out", "README.md"], "cannot create 'README.md' (File exists)"),
    ("benchmark_train.py", ["--out", "README.md/results"], "(Not a directory); choose another folder"),
    ("check_equivalence.py", ["--json", "README.md/eq.json"], "its folder: cannot create 'README.md'"),
])
def test_scripts_reject_bad_arguments_in_one_line(script, args, message, monkeypatch, capsys):
    """A typo gets argparse's usage error naming the problem, not a traceback or a silent run. The
    script runs in this process (a Python start per case cost most of this test's time): any exception
    but argparse's exit fails the test, as a traceback would."""
    import lion_vit.engine.allocator as allocator
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: None)  # leave this process's malloc settings
    monkeypatch.setattr(sys, "argv", [script, *args])
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "scripts" / script), run_name="__main__")
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_refused_run_leaves_no_output_folder_behind(tmp_path, monkeypatch):
    """An output path is checked as the arguments are read and made only as results are written: a run refused
    after that (a bad argument, a GPU script on a CPU) leaves no empty folder behind."""
    import lion_vit.engine.allocator as allocator
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: None)  # leave this process's malloc settings
    new = tmp_path / "new"
    for script, args in (("benchmark_train.py", ["--out", str(new / "train"), "--models", "lion_q_tiny"]),
                         ("benchmark_cuda_graph.py", ["--out", str(new / "graphs")]),
                         ("check_equivalence.py", ["--json", str(new / "eq.json"), "--sizes", "40x48"])):
        monkeypatch.setattr(sys, "argv", [script, *args])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(ROOT / "scripts" / script), run_name="__main__")
        assert exit_info.value.code == 2 and not new.exists(), script


def test_cuda_graph_script_without_a_gpu_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["benchmark_cuda_graph.py"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "scripts" / "benchmark_cuda_graph.py"), run_name="__main__")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == \
        "benchmark_cuda_graph.py: CUDA graphs need a GPU (torch.cuda.is_available() is False)"


def test_host_script_times_forwards_whose_triton_launches_do_nothing(tmp_path):
    """(In a process of its own: it replaces Triton's interpreted launches.) The LION model plans the triton
    backend, whose bidirectional kernel a block launches after the map pass over its keys
    (Tuning.bidirectional_map_pass), and each row is set against the first model's."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark_host.py"), "--models",
                           "deit_tiny_patch16_224", "lion_d_tiny", "--rounds", "2", "--forwards", "2", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "host.json").read_text())
    assert [row["model"] for row in rows] == ["deit_tiny_patch16_224", "lion_d_tiny"]
    assert rows[0]["x_baseline"] == 1 and rows[0]["triton_launches"] == 0 and rows[0]["launches"] > 12
    from lion_vit.ops import tuning
    assert rows[1]["triton_launches"] == 12 * (2 if tuning().bidirectional_map_pass else 1) and rows[1]["host_ms"] > 0
    assert "| lion_d_tiny |" in proc.stdout


def test_products_script_times_the_six_products_as_they_are_and_padded(monkeypatch, capsys):
    """scripts/benchmark_products.py (for a GPU) on a CPU as a check: six rows per length, the keys as they
    are or padded to the multiple, each with V's width, [V, 1]'s and [V, 1]'s padded, timed as ratios to
    the first (the code's); without a GPU, --device cuda is one line."""
    main = runpy.run_path(str(ROOT / "scripts" / "benchmark_products.py"))["main"]
    assert main(["--device", "cpu", "--dtype", "float32", "--tokens", "13", "--batch-size", "2", "--heads", "1",
                 "--head-dim", "8", "--multiple", "4", "--min-time", "0.01"]) == 0
    table = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| 13")]
    assert [(int(tokens), int(keys), int(width)) for tokens, keys, width, _, _ in table] == [
        (13, 13, 8), (13, 13, 9), (13, 13, 12), (13, 16, 8), (13, 16, 9), (13, 16, 12)]
    assert float(table[0][4]) == 1 and all(float(row[3]) > 0 for row in table)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([]) == 2
    assert capsys.readouterr().err.strip().startswith("benchmark_products.py: --device cuda, but")


# Runs each script's --help as from a clone where lion-vit was never installed, one after the other in
# one process: the editable install's import hooks and the repository root are taken off the import path
# first (exit 3 when lion_vit can still be imported), and before each script the path is reset and
# lion_vit and the scripts' helpers are forgotten, so each script must find them on its own.
_WITHOUT_INSTALLED_PACKAGE = """
import runpy, sys
root, scripts = sys.argv[1], sys.argv[2:]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in repr(h)]
sys.path[:] = [p for p in sys.path if "editable" not in p and p.rstrip("/") not in ("", ".", root)]
sys.path_importer_cache.clear()
try:
    import lion_vit
except ImportError:
    pass
else:
    sys.exit(3)
path = list(sys.path)
for script in scripts:
    sys.path[:] = path
    for name in [m for m in sys.modules if m.split(".")[0] in ("lion_vit", "benchmarking")]:
        del sys.modules[name]
    print("=== " + script.rsplit("/", 1)[-1], flush=True)
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        if exit.code:
            raise
    try:  # what the script imports later (in a function, or a child process it starts) is found too
        import lion_vit
        print("lion_vit found")
    except ImportError:
        print("lion_vit not found")
"""


def test_each_scripts_help_shows_its_example_commands_as_written():
    """An example command continued with a backslash keeps its two lines in `--help` (a raw docstring), so it
    can be pasted into a shell; in a plain docstring the backslash would join them."""
    for path in [ROOT / "train.py", *sorted((ROOT / "scripts").glob("*.py"))]:
        text = path.read_text()
        docstring = ast.parse(text).body[0].value
        continued = [line for line in ast.get_source_segment(text, docstring).splitlines() if line.endswith("\\")]
        assert set(continued) <= set(docstring.value.splitlines()), path.name


def test_scripts_run_from_a_clone_without_installing(tmp_path):
    """`python scripts/<name>.py` works from a fresh clone before `pip install -e .`, as train.py does: each
    script's --help, and a script that imports lion_vit (at once or where it is used) finds the clone's."""
    scripts = sorted(path.name for path in (ROOT / "scripts").glob("*.py") if path.name != "benchmarking.py")
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_INSTALLED_PACKAGE, str(ROOT),
                           *(str(ROOT / "scripts" / script) for script in scripts)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if proc.returncode == 3:
        pytest.skip("lion_vit is installed as a regular package here, so a clone without it cannot be simulated")
    assert proc.returncode == 0, proc.stderr[-2000:]
    outputs = dict(part.split("\n", 1) for part in proc.stdout.split("=== ")[1:])
    assert list(outputs) == scripts
    for script, out in outputs.items():
        assert out.startswith("usage: " + script), (script, out[:200])
        if re.search(r"^\s*(from|import) lion_vit\b", (ROOT / "scripts" / script).read_text(), re.M):
            assert out.rstrip().endswith("lion_vit found"), (script, out[-300:])
        # an option whose help says its default in words does not get argparse's after it
        assert not re.search(r"\(default[^)]*\)\s*\(default", " ".join(out.split())), (script, out)


def test_a_kernel_the_gpu_refuses_is_recorded_and_the_sweep_goes_on(monkeypatch):
    """On CUDA the measurements run in process: an error of Triton's (no RuntimeError) is the row's status, with
    its reason, as out of memory is."""
    import benchmarking

    class OutOfResources(Exception):  # (Triton's errors derive from Exception alone)
        pass

    def fails(**config):
        raise OutOfResources("out of resource: shared memory, Required: 262144, Hardware limit: 232448")

    monkeypatch.setattr(benchmarking, "measure_inference", fails)
    config = dict(model_name="lion_d_tiny", form="attention", chunk_size=None, img_size=32, batch_size=1,
                  device="cuda", dtype="bfloat16", repeats=1, memory="steady")
    assert benchmarking.measure(config, timeout_s=60) == {
        "status": "error", "time_s": None, "peak_mem_mb": None,
        "detail": "OutOfResources: out of resource: shared memory, Required: 262144, Hardware limit: 232448"}


def test_failed_configuration_is_recorded_with_its_reason(tmp_path):
    """A size the patch does not divide fails that configuration only, and says why."""
    config = dict(model_name="lion_d_tiny", form="chunk", chunk_size=4, img_size=40, batch_size=1, device="cpu",
                  dtype="float32", repeats=0, memory="steady")
    result = measure(config, timeout_s=300)
    assert result["status"] == "error" and "not divisible by the patch size" in result["detail"]
    row = dict(model="lion_d_tiny", form="chunk", chunk_size=4, **result)
    assert status_line(row).endswith(result["detail"]) and "\n" not in status_line(row)


def test_check_equivalence_script(tmp_path):
    """The README's form-agreement figures come from this script: it must report every form and size, and
    how many chunks the chunk form ran: at 2 x 3 patches one product over the whole sequence (chunks of 5
    would cost more), exactly the attention form's; at 17 x 17 patches (289 tokens) 58 chunks of 5."""
    out = run_script("check_equivalence.py", "--models", "lion_d_tiny", "lion_s_natural_tiny", "--sizes", "32x48",
                     "272x272", "--chunks", "5", "--json", str(tmp_path / "eq.json"))
    rows = json.loads((tmp_path / "eq.json").read_text())
    assert [(r["model"], r["size"], r["form"], r["chunk_size"]) for r in rows] == [
        (m, s, f, c) for m in ("lion_d_tiny", "lion_s_natural_tiny") for s in ("32x48", "272x272")
        for f, c in (("rnn", None), ("chunk", 5))]
    for r in rows:
        if r["form"] == "chunk" and r["size"] == "32x48":
            assert r["chunks"] == 1 and r["rel_err"] == 0, r
        else:
            assert r["chunks"] == (58 if r["form"] == "chunk" else None) and 0 < r["rel_err"] < 1e-5, r
    assert "1 chunk " in out and "58 chunks" in out and out.splitlines()[-1].startswith("worst: ")


def test_check_equivalence_under_autocast_measures_each_form_against_the_attention_forms_rounding(tmp_path):
    """--dtype bfloat16: float32 weights and reference, every form under autocast, the attention form's error
    the yardstick (x_attention). LION-lit at 600 tokens: its rnn form's states once summed in bfloat16 came to
    x3.05 of the attention form's error; now the forms agree as 16 bits allow."""
    out = run_script("check_equivalence.py", "--models", "lion_lit_tiny", "--sizes", "320x480", "--chunks", "5",
                     "--dtype", "bfloat16", "--json", str(tmp_path / "eq.json"))
    rows = json.loads((tmp_path / "eq.json").read_text())
    assert [(r["form"], r["dtype"]) for r in rows] == [(f, "bfloat16") for f in ("attention", "rnn", "chunk")]
    assert rows[0]["x_attention"] == 1 and 1e-4 < rows[0]["rel_err"] < 3e-2, rows[0]
    for r in rows[1:]:
        assert r["x_attention"] == pytest.approx(r["rel_err"] / rows[0]["rel_err"]) and r["x_attention"] < 2, r
    assert out.splitlines()[-1].startswith("worst against the attention form under autocast: x")


def test_check_equivalence_takes_the_table_1_families(tmp_path):
    """docs/models.md's families' agreement figures come from the same script, by the families' names."""
    run_script("check_equivalence.py", "--models", "lion_gla_natural_tiny", "--sizes", "32x48", "--chunks", "5",
               "--json", str(tmp_path / "eq.json"))
    rows = json.loads((tmp_path / "eq.json").read_text())
    assert [(r["model"], r["form"]) for r in rows] == [("lion_gla_natural_tiny", form) for form in ("rnn", "chunk")]
    assert all(r["rel_err"] < 1e-5 for r in rows), rows


def test_round_robin_keeps_each_configurations_best_time(monkeypatch):
    """Rounds go over all configurations in turn; each keeps its best time, and a configuration
    that failed once but succeeded in another round keeps the success."""
    import benchmarking as benchmark
    times = {"a": [3.0, 1.0, 2.0], "b": [None, 5.0, 4.0]}  # b fails in the first round
    calls = []

    def fake_measure(config, timeout_s):
        calls.append(config["name"])
        t = times[config["name"]][calls.count(config["name"]) - 1]
        if t is None:
            return {"status": "error", "time_s": None, "peak_mem_mb": None, "detail": "boom"}
        return {"status": "ok", "time_s": t, "peak_mem_mb": 10 * t}

    monkeypatch.setattr(benchmark, "measure", fake_measure)
    reported = []
    results = benchmark.measure_round_robin([{"name": "a"}, {"name": "b"}], 3, 1.0,
                                            lambda i, r: reported.append((i, r["status"])))
    assert calls == ["a", "b"] * 3 and len(reported) == 6
    assert results[0] == {"status": "ok", "time_s": 1.0, "peak_mem_mb": 30.0}  # memory of its first result
    assert results[1] == {"status": "ok", "time_s": 4.0, "peak_mem_mb": 50.0}


@pytest.mark.slow
def test_the_library_and_train_py_need_no_benchmark_dependency():
    """`pip install lion-vit` has no matplotlib (the [bench] extra): it is not a dependency, no module of
    the package plots, and every module imports without it (an import of it is refused here)."""
    tomllib = pytest.importorskip("tomllib")  # (Python >= 3.11)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("matplotlib") for d in project["dependencies"])
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["bench"])
    assert not [p for p in (ROOT / "lion_vit").rglob("*.py") if "matplotlib" in p.read_text()]
    code = ("import sys, pkgutil, importlib, lion_vit; sys.modules['matplotlib'] = None; "
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages(lion_vit.__path__, 'lion_vit.')]; "
            "import timm; timm.create_model('lion_s_small'); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_a_benchmark_without_matplotlib_writes_its_tables_and_says_the_plot_is_not_written(tmp_path):
    """Without the [bench] extra a script measures, writes its CSV and JSON and prints its table as usual; its
    plot is one line naming the extra (it was a traceback after the measurement)."""
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "
            f"sys.argv = ['benchmark_train.py', '--models', 'deit_tiny_patch16_224', '--batch-size', '1', "
            f"'--img-size', '32', '--steps', '1', '--out', {str(tmp_path)!r}]; "
            f"runpy.run_path({str(ROOT / 'scripts' / 'benchmark_train.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f'{tmp_path / "train.png"} not written: matplotlib is not installed (pip install -e ".[bench]")' in proc.stdout
    assert "| deit_tiny_patch16_224 |" in proc.stdout and [r["model"] for r in read_rows(tmp_path / "train.csv")] == [
        "deit_tiny_patch16_224"]
    assert not (tmp_path / "train.png").exists() and (tmp_path / "train.json").exists()


def test_input_script_times_both_paths_on_synthetic_jpegs(tmp_path):
    """benchmark_input.py makes an ImageFolder of JPEGs of ImageNet's sizes and times train.py's loader
    beside the path it replaced, and its DataLoader alone, by number of workers, with ratios to the old path."""
    data = tmp_path / "images"
    out = run_script("benchmark_input.py", "--images", "12", "--batch-size", "4", "--img-size", "32",
                     "--workers", "0", "1", "--repeats", "1", "--data", str(data), "--out", str(tmp_path))
    jpegs = sorted(data.glob("train/*/*.JPEG"))
    assert len(jpegs) == 12 and "12 JPEGs" in out
    from PIL import Image
    sizes = [Image.open(path).size for path in jpegs]
    assert all(350 <= width <= 520 and 300 <= height <= 500 for width, height in sizes)
    rows = read_rows(tmp_path / "input.csv")
    assert [(r["path"], r["workers"]) for r in rows] == [(path, workers) for workers in "01"
                                                        for path in ("workers", "device", "loader")]
    for old, *new in (rows[0:3], rows[3:6]):
        assert float(old["x_workers_path"]) == 1.0
        for row in new:
            assert float(row["imgs_per_s"]) > 0
            assert float(row["x_workers_path"]) == pytest.approx(float(row["imgs_per_s"]) / float(old["imgs_per_s"]))
    import PIL  # each row names the PIL that ran, which a drop-in fork (Pillow-SIMD) would change
    assert {row["pillow"] for row in rows} == {f"pillow {PIL.__version__}"} and f"by pillow {PIL.__version__}" in out
    # the device's work is this process's: its OpenMP threads wait passively, unless the environment says otherwise
    policy = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    assert {row["omp_wait_policy"] for row in rows} == {policy} and f"OpenMP threads here wait: {policy}" in out


def test_input_script_writes_only_into_a_folder_of_its_own(tmp_path):
    """--data is where the synthetic JPEGs are made: a folder of other files (a dataset, which would gain ten class
    folders) is refused before anything is written; one made for another count keeps exactly the new count."""
    data = tmp_path / "images"
    for count in (12, 8):
        run_script("benchmark_input.py", "--images", str(count), "--batch-size", "4", "--img-size", "32", "--workers",
                   "0", "--repeats", "1", "--data", str(data), "--out", str(tmp_path))
    assert len(list(data.glob("train/*/*.JPEG"))) == 8 and len(list(data.glob("val/*/*.JPEG"))) == 32
    assert sorted(p.name for p in (data / "train").iterdir()) == [f"class_{c}" for c in range(8)]
    assert runpy.run_path(str(ROOT / "scripts" / "benchmark_input.py"))["foreign_file"](data) is None
    dataset = tmp_path / "imagenet"
    (dataset / "train" / "n01440764").mkdir(parents=True)
    (dataset / "train" / "n01440764" / "n01440764_10026.JPEG").write_bytes(b"")
    proc = run_python(str(ROOT / "scripts" / "benchmark_input.py"), "--data", str(dataset), "--images", "4",
                      "--batch-size", "2")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        f"--data {dataset} holds train/n01440764/n01440764_10026.JPEG, which this script did not make: it writes its "
        "synthetic JPEGs there (a dataset would gain their class folders); choose a new or empty folder")
    assert [p.name for p in (dataset / "train").iterdir()] == ["n01440764"]


def test_input_script_times_both_paths_from_the_dataloaders_first_batch(monkeypatch):
    """With each image costing one tick of a fake clock, both paths deliver one image a tick, though timm's
    PrefetchLoader (the device path) hands out a batch only once the next one is loaded."""
    from timm.data.loader import PrefetchLoader
    from torch.utils.data import DataLoader, Dataset, DistributedSampler
    script = runpy.run_path(str(ROOT / "scripts" / "benchmark_input.py"))
    ticks = [0]

    class Images(Dataset):
        def __len__(self):
            return 24

        def __getitem__(self, index: int):
            ticks[0] += 1
            return torch.zeros(3, 4, 4, dtype=torch.uint8), 0

    fake_time = argparse.Namespace(perf_counter=lambda: ticks[0])
    monkeypatch.setitem(script["images_per_second"].__globals__, "time", fake_time)
    for wrap in (lambda clock: clock, lambda clock: PrefetchLoader(clock, device=torch.device("cpu"))):
        sampler = DistributedSampler(Images(), num_replicas=1, rank=0, shuffle=False)
        clock = script["FirstBatchClock"](DataLoader(Images(), batch_size=4, sampler=sampler))
        assert script["images_per_second"](wrap(clock), clock, 0) == 1.0


@pytest.mark.slow
def test_input_script_end_to_end_sets_train_py_against_the_model_only_step(tmp_path):
    """--train: train.py's last epoch on the folder (plus its val/ split) against benchmark_train.py, with
    the JPEGs decoded in the workers and (--decode gpu, here on the CPU) on the device."""
    run_script("benchmark_input.py", "--images", "8", "--batch-size", "4", "--img-size", "32", "--train",
               "lion_d_tiny", "--epochs", "1", "--steps", "1", "--decode", "cpu", "gpu", "--data",
               str(tmp_path / "images"), "--out", str(tmp_path))
    assert len(list((tmp_path / "images").glob("val/*/*.JPEG"))) == 32  # 4 for each of the 8 classes
    rows = read_rows(tmp_path / "input_train.csv")
    assert [row["decode"] for row in rows] == ["cpu", "gpu"]
    assert rows[0]["jpeg_decoder"] == "" and rows[1]["jpeg_decoder"] in JPEG_DECODERS  # (the CSV's None: empty)
    assert rows[0]["model_only_imgs_per_s"] == rows[1]["model_only_imgs_per_s"]  # measured once for both
    for row in rows:
        assert row["model"] == "lion_d_tiny" and row["compile"] == "False" and int(row["workers"]) >= 1
        run = tmp_path / f"train_lion_d_tiny_decode_{row['decode']}"
        metrics = json.loads((run / "metrics.jsonl").read_text())
        assert not list(run.glob("*.pt"))  # its checkpoints are not kept
        assert float(row["imgs_per_s"]) == pytest.approx(metrics["imgs_per_s"])
        assert float(row["data_wait_share"]) == pytest.approx(metrics["data_wait_share"])
        assert float(row["x_model_only"]) == pytest.approx(float(row["imgs_per_s"]) / float(row["model_only_imgs_per_s"]))


def test_input_script_end_to_end_goes_on_past_a_run_that_fails(tmp_path, monkeypatch, capsys):
    """A train.py run (or a model-only step) that fails on the GPU is a row of status error, its reason printed;
    the others are measured and the table is written after each run. Simulated with a stand-in for the
    subprocesses: LION-d's compiled runs fail, train.py's other runs write their metrics."""
    import subprocess
    given = dict(os.environ)
    script = runpy.run_path(str(ROOT / "scripts" / "benchmark_input.py"))

    environments = []

    def run(command, **kwargs):
        environments.append(kwargs.get("env"))
        if "compile=true" in command or "--compile" in command:
            if "model.name=lion_d_small" in command or "lion_d_small" in command:
                return subprocess.CompletedProcess(command, 1, "", "Traceback\nRuntimeError: Triton Error [CUDA]\n")
        if "--out" in command:  # benchmark_train.py's model-only step
            out = Path(command[command.index("--out") + 1])
            out.mkdir(parents=True)
            (out / "train.csv").write_text("model,imgs_per_s\nx,200.0\n")
        else:  # train.py's run
            out = Path(next(arg for arg in command if arg.startswith("output_dir="))[len("output_dir="):])
            out.mkdir(parents=True)
            (out / "metrics.jsonl").write_text(json.dumps({"imgs_per_s": 150.0, "data_wait_share": 0.25}) + "\n")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", run)
    args = argparse.Namespace(train=["deit_small_patch16_224", "lion_d_small"], compile="both", decode=["cpu"],
                              img_size=224, batch_size=256, epochs=2, steps=10, device="cuda", data=tmp_path / "images",
                              out=tmp_path / "out")
    rows = script["end_to_end_rows"](args)
    assert [(r["model"], r["compile"], r["status"], r.get("x_model_only")) for r in rows] == [
        ("deit_small_patch16_224", False, "ok", 0.75), ("deit_small_patch16_224", True, "ok", 0.75),
        ("lion_d_small", False, "ok", 0.75), ("lion_d_small", True, "error", None)]
    assert [r["status"] for r in read_rows(tmp_path / "out" / "input_train.csv")] == ["ok", "ok", "ok", "error"]
    printed = capsys.readouterr().out.splitlines()
    assert "lion_d_small compiled: benchmark_train.py failed: RuntimeError: Triton Error [CUDA]" in printed
    assert "lion_d_small compiled, decode cpu: train.py failed: RuntimeError: Triton Error [CUDA]" in printed
    # train.py and benchmark_train.py run with the environment the script was given, not its OpenMP setting
    assert len(environments) == 8 and all(env == given for env in environments)


def test_sweep_table_reads_the_finished_jobs_of_a_sweep(tmp_path):
    """scripts/sweep_table.py: last and best top-1 by model (and any other setting the jobs differ in) over the jobs
    of a train.py sweep, mean and standard deviation; a job that stopped before its epochs is left out, and so is a
    line that a kill cut short. The same for the runs of a folder such as outputs/ (by name) and for one run; a
    folder without runs, or no folder, is one line."""
    jobs = [("lion_gla_tiny", [50.0, 70.0]), ("lion_gla_tiny", [60.0, 50.0]), ("deit_tiny", [40.0, 45.0]),
            ("deit_tiny", [90.0])]  # the last job stopped after one of its two epochs
    for index, (name, accuracies) in enumerate(jobs):
        for job in (tmp_path / "sweep" / str(index), tmp_path / "outputs" / f"2026-12-03_17-0{index}-00-{index}"):
            job.mkdir(parents=True)
            (job / "config.yaml").write_text(f"epochs: 2\nmodel:\n  name: {name}\n")
            (job / "metrics.jsonl").write_text("".join(json.dumps({"val_acc1": a}) + "\n" for a in accuracies))
            if index in (0, 3):  # a job killed while it wrote a line (job 3 in its second epoch)
                with open(job / "metrics.jsonl", "a") as metrics:
                    metrics.write('{"epoch": 3, "val_ac')
    (tmp_path / "outputs" / "notes").mkdir()  # not a run
    broken = tmp_path / "outputs" / "2026-12-03_17-09-00-9"  # a run whose config.yaml was edited into bad YAML
    broken.mkdir()
    (broken / "config.yaml").write_text("epochs: [2\n")
    (broken / "metrics.jsonl").write_text(json.dumps({"val_acc1": 99.0}) + "\n")
    table = ["| lion_gla_tiny | 2 | 60.0 ± 14.1 | 65.0 ± 7.1 |", "| deit_tiny | 1 | 45.0 | 45.0 |"]
    proc = run_python(str(ROOT / "scripts" / "sweep_table.py"), str(tmp_path / "sweep"))
    assert proc.returncode == 0 and proc.stdout.splitlines()[2:] == table
    assert proc.stderr.splitlines() == [f"left out {tmp_path / 'sweep' / '3'}: 1 of its 2 epochs"]
    proc = run_python(str(ROOT / "scripts" / "sweep_table.py"), str(tmp_path / "outputs"))
    assert proc.returncode == 0 and proc.stdout.splitlines()[2:] == table
    assert proc.stderr.splitlines()[-1].startswith(f"left out {broken / 'config.yaml'}: not as train.py writes it "
                                                   f"(while parsing a flow sequence)"), proc.stderr
    run = next((tmp_path / "outputs").glob("*-02-00-2"))
    assert run_script("sweep_table.py", str(run)).splitlines()[2:] == ["| deit_tiny | 1 | 45.0 | 45.0 |"]
    # a sweep over another setting too: a row per model and value, a column for it; the seed is what jobs average
    for index, (lr, seed, accuracy) in enumerate([(1e-3, 0, 50.0), (1e-4, 0, 30.0), (1e-3, 1, 70.0), (1e-4, 1, 40.0)]):
        job = tmp_path / "lr_sweep" / str(index)
        job.mkdir(parents=True)
        (job / "config.yaml").write_text(f"epochs: 1\nseed: {seed}\noutput_dir: {job}\nmodel:\n  name: deit_tiny\n"
                                         f"optim:\n  lr: {lr}\n  opt: adamw\n")
        (job / "metrics.jsonl").write_text(json.dumps({"val_acc1": accuracy}) + "\n")
    assert run_script("sweep_table.py", str(tmp_path / "lr_sweep")).splitlines() == [
        "| model | optim.lr | jobs | last top-1 (%) | best top-1 (%) |", "|---|---|---|---|---|",
        "| deit_tiny | 0.001 | 2 | 60.0 ± 14.1 | 60.0 ± 14.1 |", "| deit_tiny | 0.0001 | 2 | 35.0 ± 7.1 | 35.0 ± 7.1 |"]
    proc = run_python(str(ROOT / "scripts" / "sweep_table.py"), str(tmp_path / "outputs" / "notes"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "holds no finished train.py job; give the output_dir of a sweep (-m) that ran, a folder of runs (outputs/) or "
        "one run's folder")
    proc = run_python(str(ROOT / "scripts" / "sweep_table.py"), str(tmp_path / "sweeep"))  # a typo
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "sweeep is not a folder; give the output_dir of a sweep (-m), a folder of runs (outputs/) or one run's folder")


def test_sweep_table_lists_an_evaluation_sweep_job_by_job(tmp_path):
    """An evaluation sweep (eval_only=true, one eval.json per job): a row per job in the sweep's order, with the
    form, chunk size and plan that ran (empty for a softmax model's nulls) and its speed and GPU memory (empty in an
    eval.json from before they were recorded); a job without its eval.json is left out, and one whose eval.json is not
    train.py's too, named on stderr."""
    evals = [dict(model="lion_d_small", weights="model", img_size=448, attn_form="chunk", chunk_size=64,
                  attn_plan="chunk form, cpu backend: 13 chunks in groups of rows", acc1=71.25, acc5=90.5, loss=1.23456,
                  num_images=50000, batch_size=64, eval_time_s=40.0, imgs_per_s=1250.0, peak_gpu_mem_mb=2345.6),
             None,  # a job that failed: no eval.json
             dict(model="deit_small_patch16_224", weights="model_ema", img_size=224, attn_form=None, chunk_size=None,
                  attn_plan=None, acc1=79.9, acc5=95.0, loss=0.9, num_images=50000)]
    for index, evaluation in enumerate(evals):
        job = tmp_path / str(index)
        job.mkdir()
        if evaluation is not None:
            (job / "eval.json").write_text(json.dumps(evaluation))
    for index, text in ((3, '{"model": "lion'), (4, "[1, 2]")):  # not an eval.json of train.py: named and left out
        (tmp_path / str(index)).mkdir()
        (tmp_path / str(index) / "eval.json").write_text(text)
    proc = run_python(str(ROOT / "scripts" / "sweep_table.py"), str(tmp_path))
    assert proc.returncode == 0 and [line.split(" (")[0] for line in proc.stderr.splitlines()] == [
        f"left out {tmp_path / str(index) / 'eval.json'}: not as train.py writes it" for index in (3, 4)], proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "| model | weights | img_size | form | chunk_size | what ran | top-1 (%) | top-5 (%) | loss | " \
                       "images | batch_size | images/s | peak GPU memory (MB) |"
    assert lines[1] == "|---" * 13 + "|"
    assert lines[2:] == [
        "| lion_d_small | model | 448 | chunk | 64 | chunk form, cpu backend: 13 chunks in groups of rows | 71.25 | "
        "90.50 | 1.2346 | 50000 | 64 | 1250 | 2346 |",
        "| deit_small_patch16_224 | model_ema | 224 |  |  |  | 79.90 | 95.00 | 0.9000 | 50000 |  |  |  |"]
