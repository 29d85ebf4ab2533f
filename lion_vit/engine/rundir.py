"""A run folder belongs to one run: an exclusive lock for the run's life, what counts as a run's files, and
writes that leave a file whole (its new content, or its old one on a full disk)."""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any, List, Optional, Tuple

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ..errors import UserError

LOCK = ".lock"
# flock's errors on a filesystem without file locks (Lustre mounted noflock, NFS without its lock daemon, FUSE)
NO_LOCKS = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK)
# files a run leaves behind: a folder holding any of them holds a run
RUN_FILES = ("metrics.jsonl", "checkpoint-last.pt", "checkpoint-prev.pt", "checkpoint-best.pt")
SWEEP_RECORD = "multirun.yaml"  # Hydra's, in a sweep's folder (output_dir with -m)
_held: List[Tuple[Path, int]] = []  # the locks this process holds: (path, descriptor)


def lock(output_dir: Path) -> None:
    """Take output_dir's lock for the rest of this process's run, or raise UserError naming the run that
    holds it. An fcntl lock dies with its process (kill -9 too; forked children close their copies:
    _closed_in_forked_child), so a stale lock never blocks a resume. Where the filesystem has no locks, none is
    taken and no lock file left (`holds` says so): the run goes on unguarded rather than not at all."""
    path = output_dir / LOCK
    while True:
        existed = path.exists()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise UserError(f"cannot write in output_dir {output_dir} ({error.strerror}); choose a writable "
                            f"output_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if error.errno in (errno.EAGAIN, errno.EACCES):
                raise UserError(f"output_dir {output_dir} is in use by another run ({holder}); wait for it to "
                                f"end, or choose another output_dir") from None
            if error.errno in NO_LOCKS:
                if not existed:
                    path.unlink(missing_ok=True)
                return
            raise
        try:  # the file locked must still be the one at the path: a run ending meanwhile removes it
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"PID {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _held.append((path, fd))


def holds(output_dir: Path) -> bool:
    """Whether this process holds output_dir's lock."""
    return any(path == output_dir / LOCK for path, _ in _held)


def _closed_in_forked_child() -> None:
    """A forked child (a DataLoader worker) closes its copies of this process's lock descriptors, and forgets
    them. An flock lock lasts while any process holds its file open, so a worker outliving a killed run (up to
    the DataLoader's 5 s watchdog) kept the folder locked against the run's resume; only the run holds it now."""
    while _held:
        os.close(_held.pop()[1])


os.register_at_fork(after_in_child=_closed_in_forked_child)


def release_all() -> None:
    """Remove and release this process's locks: the path first, while still locked, so that a run starting
    meanwhile either finds the lock held or creates a new file."""
    while _held:
        path, fd = _held.pop()
        try:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)


def run_files(output_dir: Path) -> List[str]:
    """The names of the run files (RUN_FILES) in output_dir that are there and not empty."""
    return [name for name in RUN_FILES if (output_dir / name).is_file() and (output_dir / name).stat().st_size > 0]


def claim(output_dir: Path) -> Optional[Path]:
    """Create output_dir, check that it is writable and lock it for this run (rank 0); returns the outermost
    folder it created (output_dir itself, or a parent such as outputs/ on a first run), or None."""
    created = outermost_missing(output_dir)
    if (output_dir / SWEEP_RECORD).is_file():  # a sweep's folder: its jobs are in <output_dir>/<job number>
        jobs = sorted((p.name for p in output_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=int)
        listed = ", ".join(jobs[:5]) + (", ..." if len(jobs) > 5 else "") if jobs else "none"
        raise UserError(f"{output_dir} is the folder of a sweep (-m: {SWEEP_RECORD}, jobs {listed}), not a run's; "
                        f"continue a job with output_dir={output_dir}/<job number> resume=auto, or the sweep with -m "
                        f"and its overrides, or choose a new output_dir")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file of that name, no permission, a read-only disk
        raise UserError(f"cannot create output_dir {output_dir} ({error.strerror}); choose another "
                        f"output_dir") from None
    lock(output_dir)  # (which says so where output_dir is not writable)
    return created


def remove_if_unused(output_dir: Path, up_to: Optional[Path] = None) -> None:
    """Remove a folder this run created when it holds no run file and no eval.json: only its config.yaml
    and train.log go, and the folder if nothing else is left in it (a wandb folder, say, keeps it), then
    each empty parent up to `up_to` (the outermost folder the run created, e.g. outputs/)."""
    if run_files(output_dir) or (output_dir / "eval.json").exists():
        return
    for name in ("config.yaml", "train.log"):
        (output_dir / name).unlink(missing_ok=True)
    _remove_empty(output_dir, up_to)


def outermost_missing(path: Path) -> Optional[Path]:
    """The outermost of path and its parents that does not exist (what creating path creates), or None."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing = folder
    return missing


def _remove_empty(path: Path, up_to: Optional[Path]) -> None:
    """Remove path's folder if empty, then each empty parent up to `up_to` (only path itself where up_to is None)."""
    for folder in (path, *path.parents):
        try:
            folder.rmdir()
        except OSError:  # not empty
            return
        if up_to is None or folder == up_to:
            return


class SweepFolder(Callback):
    """Hydra callback (configs/config.yaml): a sweep (-m) that ends before any job has left a file, at bad
    input in its first job or a swept config that does not exist, leaves no output_dir holding nothing but
    the multirun.yaml Hydra writes there before the first job."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not (sweep_dir / SWEEP_RECORD).exists():  # (an earlier sweep's record stays)
            # at exit, however the sweep ends: Hydra calls on_multirun_end only after every job has succeeded
            atexit.register(self._remove_if_no_job, sweep_dir, outermost_missing(sweep_dir))

    @staticmethod
    def _remove_if_no_job(sweep_dir: Path, created: Optional[Path]) -> None:
        if sweep_dir.is_dir() and [path.name for path in sweep_dir.iterdir()] == [SWEEP_RECORD]:
            (sweep_dir / SWEEP_RECORD).unlink()
            if created is not None:  # a folder that was there before stays
                _remove_empty(sweep_dir, up_to=created)


def write_atomic(path: Path, text: str) -> None:
    """path's new content, or (a full disk) the old one and no temp file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def append_line(path: Path, line: str) -> None:
    """Append one line to path, or (a full disk) leave the file as it was, without half a line."""
    with open(path, "a") as f:
        size = f.tell()
        try:
            f.write(line + "\n")
            f.flush()
        except OSError:
            f.truncate(size)
            raise


def copy_metrics(source: Path, path: Path) -> None:
    """Start metrics.jsonl (path, not yet there) as a copy of another run's (source), where it has one."""
    if source.is_file() and not path.exists():
        write_atomic(path, source.read_text())


def drop_metrics_after(path: Path, epochs_done: int) -> None:
    """Keep metrics.jsonl's lines of the first epochs_done epochs (counted from 1), those of the resumed
    checkpoint: a line of a later epoch comes from a run killed after logging it and before its checkpoint
    was written, and is trained again."""
    if not path.exists():
        return

    def logged_epoch(line: str) -> float:
        try:
            return json.loads(line)["epoch"]
        except (ValueError, KeyError, TypeError):  # a line cut short by the kill
            return float("inf")

    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if logged_epoch(line) <= epochs_done]
    if len(kept) < len(lines):
        write_atomic(path, "".join(kept))
