"""`make gpu-check` is ready before a GPU runs it: every command scripts/gpu_check.sh would run is one
the scripts accept (models, forms, sizes, folders), each part is there, and bad use is one line."""
from __future__ import annotations

import argparse
import os
import runpy
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["tests", "equivalence", "inference", "graphs", "fused", "fused_tests", "fallback", "normaliser", "forms",
         "compile", "compile_natural", "input", "input_gpu"]


def gpu_check(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


class Parsed(Exception):
    pass


def parsed_arguments(monkeypatch, argv) -> argparse.Namespace:
    """The arguments a script's parser makes of argv on a machine with CUDA (the script stops there)."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise Parsed(parse_args(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(Parsed) as stop:
        runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
    return stop.value.args[0]


def test_every_command_of_the_gpu_check_is_accepted(tmp_path, monkeypatch):
    out = tmp_path / "gpu"
    proc = gpu_check("--dry-run", "--out", str(out))
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    assert not out.exists()  # a dry run writes nothing
    commands = [shlex.split(line) for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert all(c[0] == "python3" or c[:2] == ["env", "TRITON_F32_DEFAULT=ieee"] for c in commands)
    commands = [c[2:] if c[0] == "env" else c for c in commands]

    tests = [c for c in commands if c[1:3] == ["-m", "pytest"]]
    assert len(tests) == 3 and {"tests/test_triton.py", "tests/test_dispatch.py"} <= set(tests[0])
    assert tests[2][-1] == "tests/test_gpu_decode.py"  # input_gpu's: the device decoding, natively
    assert all((ROOT / arg).is_file() for test in tests for arg in test if arg.startswith("tests/"))
    fused_tests = tests[1][tests[1].index("-k") + 1]  # the fused attention form's tests, natively
    assert fused_tests == "(attention or fused or bidirectional or linear) and not (chunk or vector)"
    assert "tests/test_triton.py" in tests[1]

    seen, fused_kernels, graphs = [], [], []
    for command in commands:
        if command in tests:
            continue
        args = parsed_arguments(monkeypatch, command[1:])
        if command[1] == "scripts/gpu_targets.py":  # reads what the others wrote
            assert args.folder == out and command is commands[-1]
            continue
        if command[1] == "scripts/benchmark_cuda_graph.py":  # eager against CUDA graphs
            graphs.append((args.img_size, args.batch_size, args.compile, [run[:2] for run in args.runs]))
            assert args.out.is_relative_to(out)
            continue
        if command[1] == "scripts/benchmark_normaliser.py":  # its table goes to the part's log in --out
            assert args.img_size == 1248 and args.batch_sizes == [1, 16] and args.tokens and args.warps
            continue
        if command[1] == "scripts/benchmark_fused.py":  # the fused kernels op by op (a GPU's only: no --device)
            fused_kernels.append((args.img_size, args.batch_size))
            assert args.out.is_relative_to(out)
            continue
        if command[1] == "scripts/benchmark_products.py":  # the same: 224 px, batch 256, bf16, on the GPU
            assert args.tokens == [197] and args.batch_size == 256
            assert args.device == "cuda" and args.dtype == "bfloat16"
            continue
        if command[1] == "scripts/benchmark_input.py":  # end to end: train.py (bf16 autocast) against model-only
            assert args.device == "cuda" and args.compile == "both" and args.out.is_relative_to(out)
            assert args.train == ["deit_small_patch16_224", "lion_d_small"] and args.batch_size == 256
            assert args.decode == (["gpu"] if args.out.name == "input_gpu" else ["cpu"])
            continue
        assert args.device == "cuda" and ("benchmark_" not in command[1] or args.dtype == "bfloat16"), command
        folder = getattr(args, "out", None) or getattr(args, "json", None)
        assert Path(folder).is_relative_to(out), command  # every result lands in --out
        seen.append((command[1], args))
    by_script = {script: [a for s, a in seen if s == script] for script, _ in seen}
    assert fused_kernels == [(224, 256), (448, 64)]  # the training targets' shapes
    deit = ("deit_small_patch16_224", None)
    assert graphs == [(1248, 1, True, [deit, ("lion_d_small", "chunk"), ("lion_d_natural_small", "chunk")]),
                      (224, 16, False, [deit, ("lion_d_small", "attention"), ("lion_d_natural_small", "attention")])]

    assert [a.dtype for a in by_script["scripts/check_equivalence.py"]] == ["float32", "bfloat16"]
    resolution = [a for a in by_script["scripts/benchmark_resolution.py"] if a.group_share is None
                  and a.out.name.startswith("resolution")]  # the inference targets: 1248 and 1792 px
    assert sorted(a.batch_size for a in resolution) == [1, 16]
    groups = {a.out.name: a for a in by_script["scripts/benchmark_resolution.py"] if a.out.name.startswith("groups")}
    assert groups["groups_code"].group_share is None and groups["groups_one"].group_share >= 1000  # one call
    assert all(a.runs == groups["groups_code"].runs and a.batch_size == 16 for a in groups.values())
    assert ("lion_d_small", "chunk", 64) in groups["groups_code"].runs
    for args in resolution:
        assert {1248, 1792} <= set(args.resolutions)
        assert args.runs[0] == ("deit_small_patch16_224", None, None)
        assert {("lion_d_small", "chunk"), ("lion_d_small", "rnn"), ("lion_d_natural_small", "chunk")} <= {
            run[:2] for run in args.runs}
    train = by_script["scripts/benchmark_train.py"]
    five = {"lion_lit_small", "lion_d_small", "lion_s_small", "lion_d_natural_small", "lion_s_natural_small"}
    at_224 = [a for a in train if a.img_size == 224]  # the training targets, eager and both sides compiled
    eager, compiled = [a for a in at_224 if not a.compile], [a for a in at_224 if a.compile]
    default = [a for a in eager if a.attn_backend == "auto"]  # the fused attention form on a GPU
    assert len(default) == 1 and {m for m, _, _ in default[0].models[1:]} == five
    assert default[0].profile  # (where the step's time goes, kernel by kernel)
    assert [a.attn_backend for a in eager if a not in default] == ["torch"]  # the portable form beside them
    assert [a.batch_size for a in train if a.img_size == 448 and {m for m, _, _ in a.models[1:]} == five] == [64]
    inference = [a for a in by_script["scripts/benchmark_resolution.py"] if a.resolutions == [224]]
    assert sorted(a.batch_size for a in inference) == [16, 256]
    assert {m for a in compiled for m, _, _ in a.models[1:]} == five  # in parts that fit a call each
    assert all(a.batch_size == 256 for a in at_224)
    assert any(a.img_size == 896 and a.batch_size == 32 and ("lion_d_small", None, None) in a.models for a in train)
    forms = [a for a in train if ("lion_d_small", "attention", None) in a.models]  # the crossover of the two forms
    assert len({a.img_size for a in forms}) >= 3
    for args in forms:
        assert ("lion_d_small", "chunk", None) in args.models
    fallback = {(a.attn_backend, *run[1:]): a.chunk_backward_fallback for a in train for run in a.models
                if a.img_size == 896 and a.attn_backend != "auto" and run[0] == "lion_d_small"}
    assert ("torch", "chunk", 64) in fallback  # the portable form needs its chunks
    assert ("triton", "rnn", None) in fallback
    assert fallback["triton", "chunk", None] == "forward"
    assert all(a.models[0] == ("deit_small_patch16_224", None, None) for a in train)


def test_parts_run_alone_in_the_order_given():
    """Each part alone (its estimate, its commands), then the targets' table (one line)."""
    whole = gpu_check("--dry-run").stdout.splitlines()
    assert sum(len(gpu_check("--dry-run", part).stdout.splitlines()) - 1 for part in PARTS) == len(whole) - 1
    compile_then_tests = gpu_check("--dry-run", "compile", "tests").stdout.splitlines()
    assert compile_then_tests[0] == "# part compile: about 4 min on a cold H100"
    assert "benchmark_products.py" in compile_then_tests[1] and "--compile" in compile_then_tests[2]
    assert "pytest" in compile_then_tests[4] and "gpu_targets.py" in compile_then_tests[5]


FAKE_PYTHON = """#!/usr/bin/env bash
# python3 for gpu_check.sh on a CPU: CUDA "is available", the environment prints, the fused kernels' benchmark
# runs until stopped (saying so once if it is interrupted, as pytest prints its summary then: timeout signals the
# command and then its process group, and a second SIGINT during the trap ran it again), every other measurement
# ends at once
case "$*" in
    -c*) ;;
    -) cat >/dev/null; echo "commit fake" ;;
    *benchmark_fused.py*) echo "timing"
        trap 'trap "" INT; echo "interrupted: the summary so far"; exit 130' INT
        sleep 60 >/dev/null 2>&1 & wait ;;
    *) echo "ran $*" ;;
esac
"""


def test_deadline_stops_the_measurement_running_and_skips_the_rest(tmp_path):
    """A call limited in time ends with what finished: the measurement running at --deadline is interrupted
    (SIGINT, on which pytest prints its failures and durations) and its log kept, the later ones are skipped,
    and the targets table and the bundle still come."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    out, bundle = tmp_path / "gpu", tmp_path / "gpu.tar.gz"
    run = out / "input" / "train_deit_small_patch16_224_decode_cpu"  # (a train.py run of an earlier call)
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "checkpoint-last.pt").write_bytes(b"weights")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--out", str(out), "--bundle",
                           str(bundle), "--deadline", "3", "tests", "fused_tests", "fused"], capture_output=True,
                          text=True, env=env, timeout=60)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "STOPPED at the deadline: fused_kernels (their logs are in %s)" % out in lines
    skipped = next(line for line in lines if line.startswith("SKIPPED, past the deadline: ")).split(": ")[1].split()
    assert skipped[:2] == ["train", "train_448"] and skipped[-1] == "graphs_224_b16"  # 224 px first
    assert not any(line.startswith("FAILED") for line in lines)
    assert (out / "fused_kernels.log").read_text() == "timing\ninterrupted: the summary so far\n"
    with tarfile.open(bundle) as packed:
        names = set(packed.getnames())
    assert {"gpu/tests.log", "gpu/fused_tests.log", "gpu/fused_kernels.log", "gpu/targets.log"} <= names
    assert "gpu/train.log" not in names
    assert f"gpu/input/{run.name}/metrics.jsonl" in names and not [name for name in names if name.endswith(".pt")]


def test_each_part_is_estimated_to_fit_a_ten_minute_call():
    estimates = [line for line in gpu_check("--dry-run").stdout.splitlines() if line.startswith("# part ")]
    assert [line.split()[2].rstrip(":") for line in estimates] == PARTS
    assert all(0 < int(line.split()[4]) < 10 for line in estimates), estimates


def test_settings_table_picks_from_the_timings(tmp_path):
    """The crossover sizes for auto_chunk_min_tokens and the faster fallback, from CSVs as the scripts write
    them; what was not measured says so."""
    def write(name, header, *rows):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("\n".join([header, *rows]) + "\n")

    for size, attention, chunk in ((384, 1.0, 1.4), (512, 1.0, 1.1), (640, 1.0, 0.9), (896, 2.0, 1.0)):
        write(f"forms_{size}/train.csv", "model,form,img_size,status,step_s",
              f"lion_d_small,attention,{size},ok,{attention}", f"lion_d_small,chunk,{size},ok,{chunk}")
    write("fallback_torch/train.csv", "model,form,status,x_baseline", "lion_d_small,chunk,ok,0.8")
    write("fallback_rnn/train.csv", "model,form,status,x_baseline", "lion_d_small,rnn,ok,1.3",
          "lion_d_natural_small,rnn,ok,2.0")
    write("fallback_forward/train.csv", "model,form,status,x_baseline", "lion_d_small,chunk,ok,0.7",
          "lion_d_natural_small,chunk,out of memory,")
    lines = runpy.run_path(str(ROOT / "scripts" / "gpu_targets.py"))["setting_lines"](tmp_path)
    row = {cells[1].strip(): [c.strip() for c in cells[2:4]] for cells in (line.split("|") for line in lines[2:])}
    assert row["auto_chunk_min_tokens[True, 1] (lion_d_small)"][1] == "1600"  # 640 px: 40 x 40 patches
    assert row["auto_chunk_min_tokens[False, 2] (lion_d_natural_small)"] == ["not measured", "-"]
    assert row["chunk_backward_fallback (lion_d_small, 896 px b32)"] == [
        "portable chunk form x0.80, recurrent kernels x1.30, chunk kernels (backward by forward) x0.70 of DeiT-S",
        '"forward"']
    assert row["chunk_backward_fallback (lion_d_natural_small, 896 px b32)"][1] == (
        '"rnn" (not measured: portable chunk form, chunk kernels (backward by forward))')
    # where the chunk backward fails, the training rows timed the fallback: the pick says so
    (tmp_path / "environment.txt").write_text("flash-linear-attention's chunk backward: FAILS here (...)\n")
    lines = runpy.run_path(str(ROOT / "scripts" / "gpu_targets.py"))["setting_lines"](tmp_path)
    row = {cells[1].strip(): [c.strip() for c in cells[2:4]] for cells in (line.split("|") for line in lines[2:])}
    measured, pick = row["auto_chunk_min_tokens[True, 1] (lion_d_small)"]
    assert "640 px: fallback x0.90" in measured and pick.startswith("1600 (not for the chunk kernels")
    assert row["group_share (lion_d_small, b16)"] == ["not measured", "-"]
    assert row["recurrent_group_programs (lion_d_small rnn, b16)"] == ["not measured", "-"]
    assert row["bidirectional_forward / _backward (224 px b256)"] == ["not measured", "-"]
    assert row["LION-lit's attention form (224 px b256)"] == ["not measured", "-"]
    assert row["benchmark_issue.py's softmax kernel (224 px b256)"] == ["not measured", "-"]
    # data.decode on CUDA: "gpu" only where it trained faster end to end in every run measured both ways
    assert row["data.decode on CUDA (images/s, gpu over cpu)"] == ["not measured", "-"]
    columns = "model,compile,decode,status,imgs_per_s"
    write("input/input_train.csv", columns, "deit_small_patch16_224,False,cpu,ok,1500",
          "deit_small_patch16_224,True,cpu,ok,1500", "lion_d_small,True,cpu,ok,1400")
    write("input_gpu/input_train.csv", columns, "deit_small_patch16_224,False,gpu,ok,3000",
          "deit_small_patch16_224,True,gpu,ok,4500", "lion_d_small,True,gpu,error,")
    decode = runpy.run_path(str(ROOT / "scripts" / "gpu_targets.py"))["decode_lines"]
    assert decode(tmp_path) == ['| data.decode on CUDA (images/s, gpu over cpu) | deit_small_patch16_224 x2.00, '
                                'deit_small_patch16_224 compiled x3.00 | "gpu" |']
    write("input_gpu/input_train.csv", columns, "deit_small_patch16_224,False,gpu,ok,1400")
    assert decode(tmp_path)[0].endswith('| deit_small_patch16_224 x0.93 | "cpu" (as now) |')
    # the inference groups: one call is the pick only where it is faster at every size within DeiT-S's memory
    columns = "model,form,resolution,status,time_x_baseline,mem_x_baseline"
    write("groups_code/resolution.csv", columns, "lion_d_small,chunk,896,ok,1.8,0.8",
          "lion_d_small,chunk,1248,ok,0.9,0.8", "lion_d_natural_small,chunk,1248,ok,1.2,0.8",
          "lion_d_small,rnn,1248,ok,5.6,0.9")
    write("groups_one/resolution.csv", columns, "lion_d_small,chunk,896,ok,1.2,0.95",
          "lion_d_small,chunk,1248,ok,0.8,0.97", "lion_d_natural_small,chunk,1248,ok,1.0,1.3",
          "lion_d_small,rnn,1248,ok,3.0,0.99")
    lines = runpy.run_path(str(ROOT / "scripts" / "gpu_targets.py"))["setting_lines"](tmp_path)
    row = {cells[1].strip(): [c.strip() for c in cells[2:4]] for cells in (line.split("|") for line in lines[2:])}
    measured, pick = row["group_share (lion_d_small, b16)"]
    assert measured.startswith("896 px: groups x1.80 (mem x0.80), one call x1.20 (mem x0.95), 1248 px")
    assert pick == "one call (a large group_share)"
    assert row["group_share (lion_d_natural_small, b16)"][1] == "keep"  # faster, but over DeiT-S's memory
    assert row["recurrent_group_programs (lion_d_small rnn, b16)"] == [
        "1248 px: groups x5.60 (mem x0.90), one call x3.00 (mem x0.99) of DeiT-S",
        "one call (a large recurrent_group_programs)"]


def test_launch_settings_and_lits_form_pick_the_least_time(tmp_path):
    """The bidirectional kernel's launch settings from benchmark_fused.py's CSV (as write_table writes it): each
    pair's time summed over the cases against the code's pair (the first), a pair that ran out of memory in any
    case left out, and the least the pick; LION-lit's form: its linear kernels
    ("linear kernels"), Q (K^T V) in torch matmuls ("linear") or the bidirectional kernel in the code's settings, the
    fastest (against the matmuls where a run, as those before the linear kernels, has no row of them)."""
    import csv
    (tmp_path / "fused_kernels").mkdir()
    with open(tmp_path / "fused_kernels" / "fused.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["case", "kernel", "forward", "backward", "status", "train_us"])
        for case, times in (("lion_lit", (100, 90, 95)), ("lion_d", (100, 80, 70)), ("lion_s", (100, 85, None))):
            writer.writerow([case, "sdpa", "", "", "ok", 90])
            for (forward, backward), time in zip((("64,64,4", "64,32,8"), ("128,64,8", "64,32,8"),
                                                  ("64,64,4", "32,32,4")), times):
                writer.writerow([case, "bidirectional", forward, backward, "ok" if time else "out of memory", time])
            writer.writerow([case, "linear" if case == "lion_lit" else "torch", "", "", "ok", 125])
    (tmp_path / "fused_kernels_448").mkdir()
    with open(tmp_path / "fused_kernels_448" / "fused.csv", "w", newline="") as f:  # (before the linear kernels)
        writer = csv.writer(f)
        writer.writerow(["case", "kernel", "forward", "backward", "status", "train_us"])
        writer.writerows([["lion_lit", "bidirectional", "64,64,4", "64,32,8", "ok", 150],
                          ["lion_lit", "linear", "", "", "ok", 125]])
    with open(tmp_path / "fused_kernels" / "fused.csv", "a", newline="") as f:
        csv.writer(f).writerow(["lion_lit", "linear kernels", "", "", "ok", 50])
    with open(tmp_path / "fused_kernels" / "fused.csv", "a", newline="") as f:  # the proxy's softmax kernel
        csv.writer(f).writerows([["lion_d", "softmax kernel", "64,64,4", "64,32,4", "ok", 99],
                                 ["lion_s", "softmax kernel", "64,64,4", "64,32,4", "error", ""]])
    targets = runpy.run_path(str(ROOT / "scripts" / "gpu_targets.py"))
    assert targets["softmax_lines"](tmp_path) == [
        "| benchmark_issue.py's softmax kernel (224 px b256) | lion_d: softmax kernel x1.10 of SDPA, bidirectional "
        "x1.01 of it | - |", "| benchmark_issue.py's softmax kernel (448 px b64) | not measured | - |"]
    assert targets["launch_lines"](tmp_path) == [
        "| bidirectional_forward / _backward (224 px b256) | 64,64,4 / 64,32,8 x1.00, 128,64,8 / 64,32,8 x0.85 of the "
        "code's | 128,64,8 / 64,32,8 |",
        "| bidirectional_forward / _backward (448 px b64) | 64,64,4 / 64,32,8 x1.00 of the code's | 64,64,4 / 64,32,8 |"]
    assert targets["lit_lines"](tmp_path) == [
        "| LION-lit's attention form (224 px b256) | Q (K^T V) in torch matmuls x2.50, the bidirectional kernel x2.00 "
        "of the linear kernels | the linear kernels |",
        "| LION-lit's attention form (448 px b64) | the bidirectional kernel x1.20 of Q (K^T V) in torch matmuls | "
        "Q (K^T V) in torch matmuls |"]


@pytest.mark.parametrize("eager, graph, verdict", [
    (2.0, 1.01, "launch-bound: CUDA graphs meet it"), (1.04, 0.99, "within it eager"),
    (2.0, 1.3, "the GPU's time misses it too")])
def test_batch_16_inference_says_whether_the_launches_bound_it(tmp_path, eager, graph, verdict):
    """benchmark_cuda_graph.py's table at 224 px, batch 16 (as write_table writes it): LION-d's eager forward and
    its CUDA graph's replay, each against DeiT-S's the same way, and whether the gap to the target is the host's."""
    (tmp_path / "graphs_224_b16").mkdir()
    (tmp_path / "graphs_224_b16" / "graphs.csv").write_text(
        "model,form,eager_ms,graph_ms,eager_x_baseline,graph_x_baseline\n"
        "deit_small_patch16_224,,6.4,1.0,1.0,1.0\n"
        f"lion_d_small,attention,{6.4 * eager},{graph},{eager},{graph}\n")
    lines = runpy.run_path(str(ROOT / "scripts" / "gpu_targets.py"))["graph_lines"](tmp_path)
    assert lines == [f"| inference 224 px b16, lion_d_small attention, eager and CUDA graph x DeiT-S | "
                     f"eager x{eager:.2f}, CUDA graph x{graph:.2f} | {verdict} |"]


def test_targets_table_reads_the_measurements(tmp_path):
    """Met, missed, failed (out of memory) and never measured targets, from CSVs as the scripts write them:
    step time and peak memory against DeiT-S's row of the same run, a model's first row where a run names it
    twice (as plan() runs it, then by form), and the attention's share of high-resolution inference."""
    def write(name, header, *rows):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("\n".join([header, *rows]) + "\n")

    write("train_compile/train.csv", "model,form,status,x_baseline,peak_mem_mb", "deit_small_patch16_224,,ok,1.0,100",
          "lion_d_small,attention,ok,1.0,120", "lion_s_small,attention,ok,1.5,105",
          "lion_s_natural_small,,out of memory,,")
    write("train_896/train.csv", "model,form,status,x_baseline,peak_mem_mb", "deit_small_patch16_224,,ok,1.0,100",
          "lion_d_small,chunk,ok,0.8,90", "lion_d_small,attention,ok,1.4,200")
    write("inference_224_b16/resolution.csv", "model,form,resolution,status,time_s,time_x_baseline",
          "deit_small_patch16_224,,224,ok,0.01,1.0", "lion_d_small,attention,224,ok,0.0104,1.04")
    a, b = 2e-10, 4e-6  # DeiT-S's batch-16 times exactly a L^2 + b L
    deit = [f"deit_small_patch16_224,,{size},{tokens},ok,{a * tokens ** 2 + b * tokens},,"
            for size, tokens in ((896, 3137), (1248, 6085), (1792, 12545))]
    # LION-d: its attention a fifth of DeiT-S's at 1248 px, a third at 1792 px
    write("resolution_b16/resolution.csv", "model,form,resolution,tokens,status,time_s,time_x_baseline,mem_x_baseline",
          *deit, f"lion_d_small,chunk,1248,6085,ok,{b * 6085 + a * 6085 ** 2 / 5},,0.9",
          f"lion_d_small,chunk,1792,12545,ok,{b * 12545 + a * 12545 ** 2 / 3},,0.9")
    write("resolution_b1/resolution.csv", "model,form,resolution,status,time_s,time_x_baseline,mem_x_baseline",
          "deit_small_patch16_224,,1248,ok,0.01,,", "lion_d_small,chunk,1248,ok,0.004,0.4,1.2",
          "lion_d_small,rnn,1248,ok,0.02,2.0,1.0")
    columns = "model,compile,decode,status,imgs_per_s,model_only_imgs_per_s,x_model_only"
    write("input/input_train.csv", columns, "deit_small_patch16_224,True,cpu,ok,6000,7000,0.857",
          "lion_d_small,False,cpu,ok,2400,2700,0.889", "lion_d_small,True,cpu,error,,,")
    lines = runpy.run_path(str(ROOT / "scripts" / "gpu_targets.py"))["target_lines"](tmp_path)
    row = {cells[1].strip(): [c.strip() for c in cells[2:5]] for cells in (line.split("|") for line in lines[2:])}
    # end to end against the model-only step: at least the share
    assert row["end to end, decode cpu, deit_small_patch16_224 compiled x model only"] == [">= 0.85", "0.857", "yes"]
    assert row["end to end, decode cpu, lion_d_small eager x model only"] == [">= 0.9", "0.889", "NO"]
    assert row["end to end, decode cpu, lion_d_small compiled x model only"][1:] == ["not measured", "-"]
    assert row["end to end, decode gpu, lion_d_small eager x model only"][1:] == ["not measured", "-"]
    assert row["train 224 px b256 compiled, lion_d_small x DeiT-S"] == ["<= 1.05", "1", "yes"]
    assert row["train 224 px b256 compiled, lion_d_small peak memory x DeiT-S"] == ["<= 1.1", "1.2", "NO"]
    assert row["train 224 px b256 compiled, lion_s_small x DeiT-S"] == ["<= 1.1", "1.5", "NO"]
    assert row["train 224 px b256 compiled, lion_s_small peak memory x DeiT-S"][1:] == ["1.05", "yes"]
    assert row["train 896 px b32, lion_d_small x DeiT-S"] == ["<= 0.9", "0.8", "yes"]
    assert row["inference 224 px b16, lion_d_small attention time x DeiT-S"] == ["<= 1.05", "1.04", "yes"]
    assert row["1248 px b16, lion_d_small chunk attention share x DeiT-S's attention"] == ["<= 0.25", "0.2", "yes"]
    assert row["1792 px b16, lion_d_small chunk attention share x DeiT-S's attention"] == ["<= 0.15", "0.333", "NO"]
    for missing in ("train 224 px b256 compiled, lion_s_natural_small x DeiT-S", "train 224 px b256 eager, "
                    "lion_d_small x DeiT-S", "inference 224 px b256, lion_d_small attention time x DeiT-S",
                    "1248 px b16, lion_d_natural_small chunk attention share x DeiT-S's attention"):
        assert row[missing][1] == "not measured", missing
    assert row["1248 px b1, lion_d_small chunk peak memory x DeiT-S"][1:] == ["1.2", "NO"]
    assert row["1248 px b1, lion_d_small rnn time x chunk"][1:] == ["5", "NO"]
    # every target has its line: training (time and memory, three runs of five: 224 and 448 px eager, 224 px
    # compiled; 896 px: two), inference at 224 px (two batches), end to end (two decodings, three runs), then per
    # batch (1, 16), size (1248, 1792) and model (two): the rnn's time, the chunk form's memory at 1248 px, and at
    # batch 16 the attention's share
    assert len(lines) == 2 + 3 * 5 * 2 + 2 + 2 + 2 * 3 + 2 * 2 * 2 + 2 * 2 + 2 * 2


def test_floor_table_splits_the_baselines_time_into_attention_and_the_rest(tmp_path):
    """DeiT-S's times made exactly a L^2 + b L: each size's least ratio is b L / time; a LION row is not
    read; with one size measured there is no fit."""
    a, b = 2e-10, 4e-6
    csv = tmp_path / "resolution_b16" / "resolution.csv"
    csv.parent.mkdir()
    rows = [f"deit_small_patch16_224,,{size},{(size // 16) ** 2},ok,{a * (size // 16) ** 4 + b * (size // 16) ** 2}"
            for size in (896, 1248, 1792)]
    header = "model,form,resolution,tokens,status,time_s"
    csv.write_text("\n".join([header, *rows, "lion_d_small,chunk,1248,6084,ok,1.0"]))
    floor_lines = runpy.run_path(str(ROOT / "scripts" / "gpu_targets.py"))["floor_lines"]
    row = {cells[1].strip(): [c.strip() for c in cells[2:5]]
           for cells in (line.split("|") for line in floor_lines(tmp_path)[2:])}
    for size in (1248, 1792):
        tokens = (size // 16) ** 2
        assert float(row[f"{size} px"][2].lstrip("x")) == pytest.approx(b / (a * tokens + b), rel=2e-3)
    assert row["(the fit)"][:2] == ["3 sizes", "worst relative residual 0.0%"]
    csv.write_text("\n".join([header, rows[1]]))
    assert all("not measured" in line for line in floor_lines(tmp_path)[2:])


@pytest.mark.parametrize("args, message", [
    (["bench"], "unknown part 'bench' (parts: tests equivalence inference graphs fused fused_tests fallback normaliser "
              "forms compile compile_natural input input_gpu)"),
    (["--out"], "--out needs a value"),
    (["--fast"], "unknown option --fast"),
    (["--deadline", "9m"], "--deadline takes whole seconds, not '9m'"),
    ([], "no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine"),
])
def test_bad_use_is_one_line_and_leaves_nothing(args, message, tmp_path):
    if not args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = gpu_check("--out", "gpu", *args, cwd=tmp_path) if args != ["--out"] else gpu_check(*args, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert not list(tmp_path.iterdir())
