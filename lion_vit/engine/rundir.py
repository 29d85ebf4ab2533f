"""A run folder belongs to one run: an exclusive lock for the run's life, and what counts as a run's files."""
from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import List, Optional, Tuple

from ..errors import UserError

LOCK = ".lock"
# files a run leaves behind: a folder holding any of them holds a run
RUN_FILES = ("metrics.jsonl", "checkpoint-last.pt", "checkpoint-prev.pt", "checkpoint-best.pt")
_held: List[Tuple[Path, int]] = []  # the locks this process holds: (path, descriptor)


def lock(output_dir: Path) -> None:
    """Take output_dir's lock for the rest of this process's run, or raise UserError naming the run that
    holds it. An fcntl lock dies with its process (kill -9 too), so a stale lock never blocks a resume."""
    path = output_dir / LOCK
    while True:
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


def writable(output_dir: Path) -> Optional[str]:
    """None if a file can be created and removed in output_dir, else the reason."""
    probe = output_dir / f".write-test-{os.getpid()}"
    try:
        probe.touch()
        probe.unlink()
    except OSError as error:
        return error.strerror or str(error)
    return None


def remove_if_unused(output_dir: Path) -> None:
    """Remove a folder this run created when it holds no run file and no eval.json: only its config.yaml
    and train.log go, and the folder if nothing else is left in it (a wandb folder, say, keeps it)."""
    if run_files(output_dir) or (output_dir / "eval.json").exists():
        return
    for name in ("config.yaml", "train.log"):
        (output_dir / name).unlink(missing_ok=True)
    try:
        output_dir.rmdir()
    except OSError:  # not empty
        pass

