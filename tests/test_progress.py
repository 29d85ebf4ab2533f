"""Progress lines and bars, and the CPU allocator setting that keeps freed memory."""
from __future__ import annotations

import io
import logging
import re
import subprocess
import sys

import pytest

from runs import assert_ok, run_train


@pytest.mark.slow
def test_progress_off_a_terminal_is_a_log_line_every_log_interval_steps(tmp_path):
    """Under SLURM or a pipe (stderr not a terminal) tqdm's redraws would pile up in the log file: progress is
    instead a line every log_interval steps, on stdout and in train.log, and the epoch's line ends the epoch."""
    proc = run_train("epochs=1", f"output_dir={tmp_path}", "log_interval=5")  # digits: 22 steps per epoch
    assert_ok(proc)
    steps = re.findall(r"INFO train 1 \[\s*(\d+)/22\]  loss \d\.\d{4}  lr \S+  \d+\.\d{3} s/step  \S+ left\n",
                       proc.stdout)
    assert steps == ["5", "10", "15", "20"], proc.stdout[-2000:]
    assert re.search(r"INFO eval \[5/6\]", proc.stdout) and "INFO epoch 1/1" in proc.stdout
    assert "\r" not in proc.stdout + proc.stderr and "it/s" not in proc.stderr
    assert (tmp_path / "train.log").read_text().count(" INFO train 1 [") == 4


def test_the_epoch_line_names_the_gpu_memory_where_the_epoch_measured_it(caplog):
    """On CUDA an epoch's metrics hold this process's peak GPU memory (as DeiT's log's "max mem"): its line says
    it; a CPU's epoch has none, and its line none either."""
    from lion_vit.engine.trainer import _log_epoch
    metrics = dict(epoch=3, train_loss=1.0, val_loss=2.0, val_acc1=50.0, val_acc5=90.0, lr=1e-3, epoch_time_s=10.0,
                   imgs_per_s=100.0, data_wait_share=0.25)
    with caplog.at_level(logging.INFO, logger="lion_vit"):
        _log_epoch(metrics, 5)
        _log_epoch({**metrics, "peak_gpu_mem_mb": 9420.8}, 5)
    assert [r.getMessage().split("  lr ")[1] for r in caplog.records] == [
        "1.00e-03  10.0s (100 img/s, 25 % waiting for data)",
        "1.00e-03  10.0s (100 img/s, 25 % waiting for data, 9.2 GB GPU memory)"]


def test_progress_on_a_terminal_is_a_tqdm_bar(monkeypatch, caplog):
    from lion_vit.engine.loop import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    with caplog.at_level(logging.INFO, logger="lion_vit"):
        progress = Progress(range(12), "train 3", show=True, log_interval=5)
        postfixes = []
        for step, _ in enumerate(progress):
            progress.report(step, loss="0.1234")
            postfixes.append(progress.bar.postfix)  # drawn at tqdm's next refresh
        assert "train 3:   0%|" in sys.stderr.getvalue() and postfixes[-1] == "loss=0.1234"
        assert not caplog.records, "a terminal gets the bar, not log lines"
        monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
        progress = Progress(range(12), "eval", show=True, log_interval=5)
        for step, _ in enumerate(progress):
            progress.report(step)
        for show, interval in ((False, 5), (True, 0)):  # progress=false; log_interval=0
            quiet = Progress(range(12), "eval", show=show, log_interval=interval)
            for step, _ in enumerate(quiet):
                quiet.report(step)
    assert [r.getMessage()[:11] for r in caplog.records] == ["eval [ 5/12", "eval [10/12"]
    assert sys.stderr.getvalue() == ""


_FAULTS_SCRIPT = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from lion_vit.engine.allocator import keep_freed_memory
    assert keep_freed_memory()
faults = []
for _ in range(12):  # a step's worth of large activations, allocated, written and freed again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16, 2**20)  # 64 MiB
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# after warm-up: the heap settles within the first few allocations, how many depends on what the imports
# left on it
print(sum(faults[9:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_keep_freed_memory_stops_page_faulting_large_tensors_again():
    """glibc default: every 64 MiB tensor is a fresh mmap (16k page faults); kept: the heap is reused."""
    def repeat_faults(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], capture_output=True, text=True, check=True)
        return int(run.stdout.split()[-1])
    assert repeat_faults("default") > 3 * 10_000
    assert repeat_faults("keep") < 1_000


def test_an_epoch_that_mostly_waited_for_data_names_what_feeds_it():
    """train.py logs this after a run's first epoch: num_workers=0 names num_workers=auto; workers that cannot
    keep up name the faster pipelines; an epoch that waited less gets no advice."""
    from lion_vit.engine.loop import waiting_advice
    assert waiting_advice(0.74, 0) == ("waited for its data 74 % of its time: num_workers=0: the main process loads "
                                       "every batch between the steps; num_workers=auto gives the loader this node's "
                                       "cores")
    assert "its 8 DataLoader workers cannot keep up" in waiting_advice(0.5, 8)
    assert "data.decode=gpu" in waiting_advice(0.5, 8)
    assert waiting_advice(0.49, 0) is None and waiting_advice(0.9, 0, share_to_advise=0.95) is None


@pytest.mark.slow
def test_workers_slow_to_start_are_not_advised_as_workers_that_cannot_keep_up(tmp_path):
    """The first batch of a process's first epoch waits for its DataLoader workers to start: seconds each where
    they start from a fork server (Python 3.14's default on Linux) and import torch anew. That wait is in the
    epoch's data_wait_share (most of a short epoch's), not in what the advice reads."""
    from runs import read_metrics, run_python
    script = ("import multiprocessing, runpy, sys\nmultiprocessing.set_start_method('forkserver', force=True)\n"
              "sys.argv = ['train.py', *sys.argv[1:]]\nrunpy.run_path('train.py', run_name='__main__')\n")
    proc = run_python("-c", script, "epochs=1", "num_workers=1", "optim.warmup_epochs=0", "progress=false",
                      f"output_dir={tmp_path}")
    assert_ok(proc)
    (line,) = read_metrics(tmp_path)
    assert line["data_wait_share"] > 0.5, line  # the workers' start: the digits train in a fraction of it
    assert "waited for its data" not in proc.stdout
