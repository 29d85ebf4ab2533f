"""A run folder belongs to one run: the lock, never training from scratch over a run, full disks,
SIGTERM, and images that cannot be read."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lion_vit.engine import checkpoint as ckpt
from lion_vit.engine import interrupts, rundir
from lion_vit.errors import UserError
from runs import (ENV, ROOT, SMALL_LION, assert_clean_error, assert_ok, read_metrics, run_python, run_train,
                  two_gloo_ranks)


def _args(folder, output_dir):
    return [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "batch_size=4", "aug=none",
            f"output_dir={output_dir}"]


@pytest.fixture(scope="session")  # (the slow tests run first: a module fixture would be made twice)
def run(folder, tmp_path_factory):
    """A finished 2-epoch run (last, prev and best checkpoints, two metrics lines)."""
    out = tmp_path_factory.mktemp("run")
    assert_ok(run_train(*_args(folder, out), "epochs=2"))
    return out


def _files(folder: Path):
    return sorted(p.name for p in folder.iterdir())


def _snapshot(folder: Path):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _run_patched(patch: str, *overrides: str):
    """train.py in a subprocess after `patch` (Python source) ran: a fault injected into it."""
    script = f"import runpy, sys\n{patch}\nsys.argv = ['train.py', *sys.argv[1:]]\nrunpy.run_path('train.py', run_name='__main__')\n"
    return run_python("-c", script, *overrides)


def test_a_locked_folder_is_refused_naming_the_run_that_holds_it(tmp_path):
    rundir.lock(tmp_path)
    try:
        proc = run_train(*SMALL_LION, "epochs=1", f"output_dir={tmp_path}")
        assert_clean_error(proc, "is in use by another run", f"PID {os.getpid()} on ")
        assert proc.returncode == 2
    finally:
        rundir.release_all()
    assert _files(tmp_path) == []  # the lock file goes with the run


def test_a_lock_dies_with_its_process(tmp_path):
    """kill -9 leaves the lock file behind but never a held lock: the folder can be resumed at once, even while
    a child the run forked lives on (a DataLoader worker outlives a killed run by up to its 5 s watchdog)."""
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; from lion_vit.engine import rundir; "
                               "from pathlib import Path; rundir.lock(Path(sys.argv[1])); worker = os.fork(); "
                               "worker or (os.write(1, b'worker\\n'), time.sleep(60), os._exit(0)); "
                               "os.write(1, f'locked {worker}\\n'.encode()); time.sleep(60)",
                               str(tmp_path)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    # both lines, in either order (each one write, so that they never interleave): the worker's says that its fork
    # handlers have run (until then it holds a copy of the lock, which a loaded host can leave it holding past the
    # kill below)
    lines = sorted(holder.stdout.readline().split() for _ in range(2))
    assert [words[0] for words in lines] == ["locked", "worker"]
    worker = lines[0][1]
    try:
        with pytest.raises(UserError, match="in use by another run"):
            rundir.lock(tmp_path)
        holder.kill()
        holder.wait()
        rundir.lock(tmp_path)  # (the worker still runs)
        rundir.release_all()
    finally:
        os.kill(int(worker), signal.SIGKILL)


@pytest.mark.parametrize("error", ["ENOSYS", "ENOLCK"])
def test_a_filesystem_without_locks_trains_unguarded_with_a_warning(tmp_path, error):
    """flock fails with ENOSYS on Lustre mounted noflock and with ENOLCK on NFS without its lock daemon: the run
    trains all the same and says once that nothing guards its folder; no lock file is left, nor a folder by a
    run that fails before its first epoch."""
    patch = (f"import errno, fcntl\ndef flock(fd, operation): raise OSError(errno.{error}, 'no locks here')\n"
             "fcntl.flock = flock")
    proc = _run_patched(patch, *SMALL_LION, "epochs=1", f"output_dir={tmp_path / 'run'}")
    assert_ok(proc)
    assert proc.stdout.count(f"output_dir {tmp_path / 'run'} is on a filesystem without file locks: nothing stops "
                             "another run from writing to it while this one runs") == 1
    assert (tmp_path / "run" / "checkpoint-last.pt").exists() and not (tmp_path / "run" / rundir.LOCK).exists()
    proc = _run_patched(patch, *SMALL_LION, "data=imagefolder", f"data.root={tmp_path / 'no_data'}",
                        f"output_dir={tmp_path / 'failed'}")
    assert_clean_error(proc, "no_data")
    assert not (tmp_path / "failed").exists()


# PIL.Image.open made to kill a DataLoader worker (a process with a parent) with SIGBUS, as a full /dev/shm does
_SIGBUS_IN_WORKERS = """import multiprocessing, os, signal, PIL.Image
real_open = PIL.Image.open
def open_in_worker(*args, **kwargs):
    if multiprocessing.parent_process() is not None:
        os.kill(os.getpid(), signal.SIGBUS)
    return real_open(*args, **kwargs)
PIL.Image.open = open_in_worker
"""


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_worker_out_of_shared_memory_is_one_line_and_leaves_no_run_files(folder, tmp_path, start):
    """A worker dies of SIGBUS where /dev/shm is too small for the batches in flight (Docker's 64 MB): one line
    naming it and the fix, exit 2, and a run that had not finished an epoch leaves no folder behind. Workers forked
    from train.py's process, or started from a fork server (Python 3.14's default on Linux), which preloads the
    fault."""
    (tmp_path / "sigbus_in_workers.py").write_text(_SIGBUS_IN_WORKERS)
    patch = (f"import multiprocessing, os, sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport sigbus_in_workers\n"
             f"os.environ['PYTHONPATH'] = {str(tmp_path)!r} + os.pathsep + os.environ['PYTHONPATH']\n"
             f"multiprocessing.set_start_method({start!r}, force=True)\n"
             f"multiprocessing.set_forkserver_preload(['sigbus_in_workers'])")
    proc = _run_patched(patch, *SMALL_LION, "data=imagefolder", f"data.root={folder}", "num_workers=1",
                        "batch_size=4", "epochs=1", f"output_dir={tmp_path / 'run'}")
    proc.stderr = proc.stderr.replace("\0", "")  # (the dying worker's own message ends in a NUL)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert_clean_error(proc, "a DataLoader worker ran out of shared memory: batches pass through /dev/shm",
                       "(num_workers=1, batch_size 4, img_size 32); lower num_workers or batch_size")
    assert not (tmp_path / "run").exists()  # (with wandb on, its offline run would keep the folder)


def test_default_output_dirs_differ_between_runs_started_in_the_same_second():
    """The default output_dir ends in the process id, which rank 0 broadcasts to every torchrun rank."""
    from omegaconf import OmegaConf
    import lion_vit.engine.config  # noqa: F401  (registers the ${pid:} resolver)
    template = OmegaConf.load(ROOT / "configs" / "config.yaml")._get_node("output_dir")._value()
    assert template == "outputs/${now:%Y-%m-%d_%H-%M-%S}-${pid:}"
    assert OmegaConf.create({"output_dir": template.replace("${now:%Y-%m-%d_%H-%M-%S}", "T")}).output_dir == \
        f"outputs/T-{os.getpid()}"


def test_resume_auto_without_a_readable_checkpoint_refuses_and_keeps_the_run(run, folder, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for name in (ckpt.LAST, ckpt.PREVIOUS):
        (copy / name).write_bytes(b"\x00truncated")
    before = _snapshot(copy)
    del before["train.log"]  # (the warnings and the error are logged there)
    proc = run_train(*_args(folder, copy), "epochs=3", "resume=auto")
    assert_clean_error(proc, f"resume=auto found no readable {ckpt.LAST} or {ckpt.PREVIOUS}", ckpt.BEST,
                       "resume=<path>")
    after = _snapshot(copy)
    del after["train.log"]
    assert proc.returncode == 2 and after == before
    assert proc.stdout.count("resume=auto skips") == 2 and "use another checkpoint" not in proc.stdout + proc.stderr


def test_a_fresh_start_over_any_trace_of_a_run_is_refused(folder, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1}\n')  # a first epoch that died before its checkpoint
    proc = run_train(*_args(folder, tmp_path), "epochs=1")
    assert_clean_error(proc, "already holds a run (metrics.jsonl)", "resume=auto")
    proc = run_train(*_args(folder, tmp_path), "epochs=1", "resume=auto")  # which starts it afresh, and says so
    assert_ok(proc)
    assert [m["epoch"] for m in read_metrics(tmp_path)] == [1]
    assert f"resume=auto: nothing to resume in {tmp_path}, a fresh start (to continue a run, pass output_dir=" \
        in proc.stdout
    proc = run_train(*_args(folder, tmp_path), "epochs=2", "resume=auto")
    assert_ok(proc)
    assert "resumed after epoch 1" in proc.stdout and "nothing to resume" not in proc.stdout


def test_resume_from_another_folder_never_writes_over_a_run_and_brings_its_history(run, folder, tmp_path):
    """resume=<another run's checkpoint> continues that run in output_dir: into a folder holding a run it is refused
    (it overwrote that run's checkpoints and mixed the two runs' metrics); into a new folder the run goes on there,
    its metrics.jsonl starting with the checkpoint's run's lines, as resume=auto's would."""
    other = tmp_path / "other"
    shutil.copytree(run, other)
    before = _snapshot(other)
    proc = run_train(*_args(folder, other), "epochs=3", f"resume={run / ckpt.LAST}")
    assert_clean_error(proc, f"{other} already holds a run (metrics.jsonl, {ckpt.LAST}, {ckpt.PREVIOUS}, {ckpt.BEST}), "
                       f"which resume={run / ckpt.LAST} would write over; pass resume=auto to continue the run in "
                       f"{other}, or a new output_dir")
    assert _snapshot(other) == before
    new = tmp_path / "new"
    proc = run_train(*_args(folder, new), "epochs=3", f"resume={run / ckpt.LAST}")
    assert_ok(proc)
    assert f"resumed after epoch 2 of {run / ckpt.LAST}" in proc.stdout
    assert read_metrics(new)[:2] == read_metrics(run) and [m["epoch"] for m in read_metrics(new)] == [1, 2, 3]
    assert f"best checkpoint {new / ckpt.BEST}" in proc.stdout or f"best checkpoint {run / ckpt.BEST}" in proc.stdout
    # nothing left to train: the folder gets the history, and the done line names the checkpoint there is
    proc = run_train(*_args(folder, tmp_path / "done"), "epochs=2", f"resume={run / ckpt.LAST}")
    assert_ok(proc)
    assert read_metrics(tmp_path / "done") == read_metrics(run) and f"best checkpoint {run / ckpt.BEST}" in proc.stdout


@pytest.mark.parametrize("when", ["start", "resume"])
def test_a_full_disk_writing_a_small_file_is_one_line_and_keeps_every_file(run, folder, tmp_path, when):
    """config.yaml at the start, metrics.jsonl's rewrite on resume: each written to a temp file first."""
    out = tmp_path / "out"
    if when == "resume":
        shutil.copytree(run, out)
        shutil.copy(out / ckpt.PREVIOUS, out / ckpt.LAST)  # resume from epoch 0: metrics loses its last line
    before = _snapshot(out) if out.exists() else {}
    full = ("import errno, os, pathlib\n"
            "write = pathlib.Path.write_text\n"
            "def full(self, *args, **kwargs):\n"
            "    if self.name.endswith('.tmp'):\n"
            "        open(self, 'w').write('partial')\n"
            "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))\n"
            "    return write(self, *args, **kwargs)\n"
            "pathlib.Path.write_text = full\n")
    proc = _run_patched(full, *_args(folder, out), "epochs=3", *(["resume=auto"] if when == "resume" else []))
    assert_clean_error(proc, "no space left on the device writing", "resume=auto")
    assert proc.returncode == 2
    if when == "start":  # a run that fails before its first epoch leaves no folder behind
        assert not out.exists()
        return
    assert {k: v for k, v in _snapshot(out).items() if k != "train.log"} == \
        {k: v for k, v in before.items() if k != "train.log"}  # nothing new, nothing changed, no temp file


def test_a_full_disk_inside_torch_save_keeps_last_and_best_in_agreement(folder, tmp_path):
    """torch's writer reports a full disk as a failed check ("unexpected pos"): said as a full disk. The
    epoch's last and best checkpoints land together or not at all."""
    full_at_epoch_2 = (
        "import torch\n"
        "save = torch.save\n"
        "def full(state, f, *args, **kwargs):\n"
        "    if isinstance(state, dict) and state.get('epoch') == 2:\n"
        "        f.write(b'partial')\n"
        "        raise RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos 128 vs 0')\n"
        "    return save(state, f, *args, **kwargs)\n"
        "torch.save = full\n")
    proc = _run_patched(full_at_epoch_2, *_args(folder, tmp_path), "epochs=3", "optim.lr=2e-3",
                        "optim.warmup_epochs=0")
    assert_clean_error(proc, f"could not write checkpoint {tmp_path / ckpt.LAST}",
                       "no space left on the device (torch could not write the file)")
    assert not [name for name in _files(tmp_path) if name.endswith(".tmp")]
    last, best = (torch.load(tmp_path / name, weights_only=True) for name in (ckpt.LAST, ckpt.BEST))
    assert last["epoch"] == best["epoch"] == 1 and last["best_acc1"] == best["best_acc1"]


def test_save_together_changes_nothing_when_one_write_fails(tmp_path, monkeypatch):
    last, best = tmp_path / ckpt.LAST, tmp_path / ckpt.BEST
    ckpt.save_together([({"epoch": 0}, last, tmp_path / ckpt.PREVIOUS), ({"epoch": 0}, best, None)])
    before = _snapshot(tmp_path)
    real_save = torch.save

    def full_on_best(state, f):
        if Path(f.name).name.startswith(ckpt.BEST):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(state, f)
    monkeypatch.setattr(ckpt.torch, "save", full_on_best)
    with pytest.raises(UserError, match=r"checkpoint-best.pt \(no space left on the device\)"):
        ckpt.save_together([({"epoch": 1}, last, tmp_path / ckpt.PREVIOUS), ({"epoch": 1}, best, None)])
    assert _snapshot(tmp_path) == before


@pytest.mark.slow
def test_sigterm_to_the_job_stops_like_ctrl_c(folder, tmp_path):
    """SIGTERM to the whole process group (SLURM's preemption, with loader workers): the run stops before
    its next step, says how to continue, exits 143 and leaves no temp file; resume=auto continues it."""
    args = [*_args(folder, tmp_path), "num_workers=1"]
    proc = subprocess.Popen([sys.executable, "train.py", *args, "epochs=50"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 240
    while not (tmp_path / ckpt.LAST).exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err and "exited unexpectedly" not in err
    assert f"terminated: {tmp_path} holds the checkpoint of the last finished epoch; continue with resume=auto" in err
    assert not [name for name in _files(tmp_path) if name.endswith(".tmp") or name == rundir.LOCK]
    done = len(read_metrics(tmp_path))
    assert_ok(run_train(*args, f"epochs={done + 1}", "resume=auto"))
    assert [m["epoch"] for m in read_metrics(tmp_path)] == list(range(1, done + 2))


def test_sigterm_is_noted_between_steps_and_held_during_a_write():
    steps = []
    with interrupts.stop_between_steps(announce=False):
        with pytest.raises(interrupts.Terminated):
            for step in range(3):
                interrupts.raise_if_requested()
                steps.append(step)
                if step == 0:
                    with interrupts.deferred():
                        os.kill(os.getpid(), signal.SIGTERM)
                        steps.append("write finished")
    assert steps == [0, "write finished"] and interrupts.requested() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.parametrize("override, needle", [
    ("model.drop_path_rate=2", "model.drop_path_rate"), ("model.drop_path_rate=-0.5", "model.drop_path_rate"),
    ("model.patch_size=-2", "model.patch_size"), ("model.patch_size=abc", "model.patch_size"),
    ("model.patch_size=0", "model.patch_size"), ("optim.lr=inf", "optim.lr"), ("optim.lr=nan", "optim.lr"),
])
def test_bad_values_are_named_before_anything_is_built(override, needle):
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.config import check_settings
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[override])
    with pytest.raises(UserError, match=rf"^{needle}=.* is not allowed; set {needle} to "):
        check_settings(cfg)


def test_an_output_dir_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """(As root a read-only mode does not stop writes: a read-only filesystem is simulated.)"""
    from lion_vit.engine.rundir import claim
    real_open = os.open

    def read_only(path, flags, *args):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_open(path, flags, *args)
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(UserError, match=r"^cannot write in output_dir .* \(Read-only file system\); choose a writable"):
        claim(tmp_path / "out")


def test_unreadable_images_are_left_out_of_the_evaluation_and_named_once(run, folder, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(folder, data)
    bad = [data / "val" / f"class_{k}" / f"broken_{k}.png" for k in range(3)]
    for path in bad:
        path.write_bytes(b"\x89PNG not really")
    good = sum(1 for _ in (folder / "val").rglob("*.png"))
    results = {}
    for name, root in (("with", data), ("without", folder)):
        out = tmp_path / name
        assert_ok(proc := run_train(*SMALL_LION, "eval_only=true", f"checkpoint={run / ckpt.BEST}", "data=imagefolder",
                                    f"data.root={root}", "batch_size=4", f"output_dir={out}"))
        results[name] = json.loads((out / "eval.json").read_text())
        if name == "with":
            assert "3 unreadable image(s) left out of this evaluation's" in proc.stdout
            log = (out / "train.log").read_text()
            assert all(log.count(str(path)) == 1 for path in bad)
            assert str(bad[0]) not in proc.stdout + proc.stderr  # named in train.log, counted on the console
    assert results["with"]["num_images"] == results["without"]["num_images"] == good
    assert results["with"]["acc1"] == pytest.approx(results["without"]["acc1"], rel=1e-6)


class _ValSet:
    """What evaluate reads of a dataset for the images it left out: their paths, and the dataset's size."""
    samples = [(f"/data/val/c/{i}.JPEG", 0) for i in range(6)]

    def __len__(self):
        return len(self.samples)


class _Batches(list):
    dataset = _ValSet()


class _Pixels(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 2)

    def forward(self, images):
        return self.fc(images.float().flatten(1))


def _evaluate_a_share_with_unreadable_images(rank: int, out: Path) -> None:
    """One rank of two evaluating its half of _ValSet, samples 1, 3 and 5 unreadable (one on rank 0, two on 1)."""
    from lion_vit.data.datasets import collate_dropping_unreadable
    from lion_vit.engine.logs import setup_logging
    from lion_vit.engine.loop import Precision, evaluate
    folder = out / f"rank{rank}"
    folder.mkdir()
    setup_logging(folder, is_main=rank == 0)
    image = torch.zeros(3, 2, 2, dtype=torch.uint8)
    share = range(3 * rank, 3 * rank + 3)
    loader = _Batches([collate_dropping_unreadable([(None, -(i + 1)) if i % 2 else (image, 0) for i in share])])
    stats = evaluate(_Pixels(), loader, torch.device("cpu"), Precision(torch.device("cpu")), show_progress=False)
    (folder / "num_images").write_text(str(stats["num_images"]))


def test_rank_0_counts_and_names_the_unreadable_images_of_every_rank(tmp_path):
    """A distributed evaluation's images left out: rank 0's train.log counts and names all ranks' (others have
    no train.log), not its own share alone."""
    two_gloo_ranks(_evaluate_a_share_with_unreadable_images, tmp_path)
    log = (tmp_path / "rank0" / "train.log").read_text()
    assert "3 unreadable image(s) left out of this evaluation's 6; named in train.log" in log
    assert all(log.count(f"left out of the evaluation: /data/val/c/{i}.JPEG") == 1 for i in (1, 3, 5))
    assert not (tmp_path / "rank1" / "train.log").exists()
    assert [(tmp_path / f"rank{rank}" / "num_images").read_text() for rank in (0, 1)] == ["3", "3"]


def test_an_evaluation_of_no_readable_image_is_one_line_not_a_score_of_0():
    """A loss of 0 and accuracies of 0 % would be a score of no image (a val split of a format PIL cannot read)."""
    from lion_vit.data.datasets import collate_dropping_unreadable
    from lion_vit.engine.loop import Precision, evaluate
    cpu = torch.device("cpu")
    loader = _Batches([collate_dropping_unreadable([(None, -3), (None, -5)]),
                       collate_dropping_unreadable([(None, -6)])])
    with pytest.raises(UserError, match=r"^none of the 3 images of this evaluation could be read \(the first: "
                                        r"/data/val/c/2.JPEG\); replace them with images PIL reads$"):
        evaluate(_Pixels(), loader, cpu, Precision(cpu), show_progress=False)
    image = torch.zeros(3, 2, 2, dtype=torch.uint8)
    loader.append(collate_dropping_unreadable([(image, 1)]))  # one readable image: scored
    assert evaluate(_Pixels(), loader, cpu, Precision(cpu), show_progress=False)["num_images"] == 1


def test_a_checkpoint_that_is_a_folder_says_so(tmp_path):
    with pytest.raises(UserError, match=r"^checkpoint=.* is a folder; pass a checkpoint file in it, e.g. "
                                        r".*checkpoint-best.pt"):
        ckpt.load_checkpoint(tmp_path)
    with pytest.raises(UserError, match=f"^resume={tmp_path} is a folder; to continue its run there, pass "
                                        f"resume=auto output_dir={tmp_path}; or .*checkpoint-last.pt"):
        ckpt.load_checkpoint(tmp_path, setting="resume")


def test_a_run_that_fails_before_training_leaves_no_folder(tmp_path):
    """Nor a parent it created (outputs/ of a first run: the default output_dir is outputs/<time>-<pid>);
    a folder it did not create is kept, with whatever was in it."""
    (tmp_path / "kept").mkdir()
    for output_dir in (tmp_path / "outputs" / "run", tmp_path / "kept" / "a" / "b", tmp_path / "kept"):
        assert_clean_error(run_train(*SMALL_LION, "data=imagefolder", f"data.root={tmp_path / 'nowhere'}", "epochs=1",
                                     f"output_dir={output_dir}"), "does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and not (tmp_path / "kept" / "a").exists()
