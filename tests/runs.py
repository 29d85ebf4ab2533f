"""Helpers for tests that run train.py end to end on CPU with tiny generated data."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import List

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
# No test reaches the network: the Hugging Face hub's address is a closed port here, its cache an empty folder.
# The runs' temporary folder (TMPDIR), removed at exit: what a run killed with -9 leaves there (wandb's and
# multiprocessing's folders), and torchrun's logs, go with it. A URL's weights download into torch.hub's cache
# under TORCH_HOME, in it too.
RUNS_TMP = tempfile.mkdtemp(prefix="lion-vit-tests-")
atexit.register(shutil.rmtree, RUNS_TMP, True)
ENV = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
           HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_CACHE=str(Path(tempfile.gettempdir()) / "lion-vit-tests-no-hub"),
           TORCH_HOME=os.path.join(RUNS_TMP, "torch-home"), TMPDIR=RUNS_TMP)
SMALL_LION = ["model=lion", "model.name=lion_s_tiny", "model.patch_size=8", "img_size=32",
              "+model.kwargs.depth=2", "optim=adamw", "progress=false", "num_workers=0"]


def run_train(*overrides: str, timeout: int = 300, launcher=None):
    """`python train.py OVERRIDES` (or `launcher OVERRIDES`), its output captured, as subprocess.run."""
    if launcher is not None:
        return subprocess.run([*launcher, *overrides], cwd=ROOT, env=ENV, capture_output=True, text=True,
                              timeout=timeout)
    return run_python(str(ROOT / "train.py"), *overrides, timeout=timeout)


def run_python(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python ARGV` in ROOT with ENV, as subprocess.run with captured output: a child forked by the fork
    server below, a fresh process all the same."""
    return _FORK_SERVER.run(list(argv), timeout)


# The fork server: a Python process that has imported what train.py imports (torch, timm, Hydra, the
# engine, scikit-learn for the digits: most of the time a start takes) and has run nothing, so a child
# forked from it is what a fresh `python train.py` is once its imports are done. It forks one child per
# request, which runs the script as __main__ with the request's argv, its stdout and stderr in files, and
# exits as the interpreter would (atexit handlers, tracebacks, exit codes). Requests and replies are JSON
# lines: {"argv", "stdout", "stderr"} in; {"pid"}, then {"returncode"} out.
_SERVER = r"""
import gc, json, os, runpy, sys
import hydra, timm, torch  # noqa: F401
import lion_vit.engine.trainer  # noqa: F401
import sklearn.datasets, sklearn.model_selection  # noqa: F401,E401  (imported when the digits load)
gc.collect()
gc.freeze()  # (the imports' objects out of every collection: at exit a child's collections touched them all)
replies = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush(); replies.flush()
    pid = os.fork()
    if pid == 0:
        replies.close()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdin = open(0, closefd=False)
        os.dup2(os.open(request["stdout"], os.O_WRONLY), 1)
        os.dup2(os.open(request["stderr"], os.O_WRONLY), 2)
        if request["argv"][0] == "-c":  # python -c CODE ARGS
            sys.argv = ["-c", *request["argv"][2:]]
            exec(compile(request["argv"][1], "<string>", "exec"), {"__name__": "__main__"})
        else:  # python SCRIPT ARGS
            sys.argv = request["argv"]
            sys.path[0] = os.path.dirname(sys.argv[0])
            runpy.run_path(sys.argv[0], run_name="__main__")
        sys.exit(0)
    print(json.dumps({"pid": pid}), file=replies, flush=True)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), file=replies, flush=True)
os._exit(0)  # (nothing left to do: no finalization, whose leak reports would follow the suite's summary)
"""

# gc.freeze keeps the imports' reference cycles alive through a child's finalization, where a fresh process
# collects them: Triton 3.9's bindings (nanobind) then report them as leaks on stderr, the harness's doing.
_LEAK_REPORT = re.compile(r"^nanobind: leaked .*?^See https://nanobind\.readthedocs\.io/\S*refleaks\.html\n?",
                          re.MULTILINE | re.DOTALL)


class _ForkServer:
    """One server per run at a time: runs started side by side (threads) get a server each."""

    def __init__(self):
        self.idle: List[subprocess.Popen] = []
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def started(self, argv, stdout: str = os.devnull, stderr: str = os.devnull):
        """A child running `python ARGV` (`.pid`), its output written to the files named; on leaving, waits
        for it to end (kill it first to end it early) and sets `.returncode`."""
        with self.lock:
            server = self.idle.pop() if self.idle else None
        if server is None or server.poll() is not None:
            server = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=ROOT, env=ENV, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            atexit.register(server.stdin.close)
        server.stdin.write(json.dumps({"argv": list(argv), "stdout": stdout, "stderr": stderr}) + "\n")
        server.stdin.flush()
        child = SimpleNamespace(pid=json.loads(server.stdout.readline())["pid"], returncode=None)
        try:
            yield child
        finally:
            child.returncode = json.loads(server.stdout.readline())["returncode"]
            with self.lock:
                self.idle.append(server)

    def run(self, argv, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="lion_vit_run_") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            out.touch(), err.touch()
            timed_out = threading.Event()
            with self.started(argv, str(out), str(err)) as child:
                def kill():
                    timed_out.set()
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.pid, signal.SIGKILL)

                timer = threading.Timer(timeout, kill)
                timer.start()
            timer.cancel()
            if timed_out.is_set():
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(argv, child.returncode, out.read_text(),
                                               _LEAK_REPORT.sub("", err.read_text()))


_FORK_SERVER = _ForkServer()


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


def free_port() -> int:
    """A TCP port free on this host now, for a process group's MASTER_PORT."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def two_gloo_ranks(target, *args) -> None:
    """target(rank, *args) in each of two spawned processes that form a gloo process group (torch.distributed)."""
    import torch.multiprocessing as mp
    mp.spawn(_in_gloo_group, args=(free_port(), target, args), nprocs=2)


def _in_gloo_group(rank: int, port: int, target, args) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        target(rank, *args)
    finally:
        dist.destroy_process_group()


def read_metrics(output_dir: Path):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def kill_after_first_epoch(*overrides: str, output_dir: Path, epochs: int) -> int:
    """Start train.py, kill -9 it once its first epoch is logged, and return the epochs it had logged
    (at least one, fewer than `epochs`)."""
    metrics = output_dir / "metrics.jsonl"
    with _FORK_SERVER.started([str(ROOT / "train.py"), *overrides, f"epochs={epochs}", f"output_dir={output_dir}"]) \
            as child:
        deadline = time.time() + 240
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
    done = metrics.read_text().count("\n")
    assert 1 <= done < epochs, "the run must be killed part-way"
    return done
