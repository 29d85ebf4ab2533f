"""Ctrl-C (SIGINT) that ends a training run cleanly: at a step boundary, as KeyboardInterrupt, which
train.py turns into exit status 130 and one line saying where the run stands.

Python's default handler raises KeyboardInterrupt wherever the main thread is, and during training
that is often a place that loses it or turns it into something else: an os.fork callback (the
DataLoader starting its workers, every epoch) prints it as "Exception ignored" and training goes
on; a DataLoader iterator being built is left half-made (its __del__ then fails); inside torch's
C++ code it comes out as another error (torch.save: RuntimeError "unexpected pos", and the
checkpoint is lost). So while training, a first Ctrl-C is only noted, and the loops stop before
their next step (`raise_if_requested`; all ranks of a distributed run before the same one); a second
one raises at once, for a step that hangs.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from .distributed import all_reduce_sum

_requested = False  # a Ctrl-C arrived in the last stop_between_steps block
_noting = False  # in such a block, with its handler installed


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def stop_between_steps(announce: bool = True) -> Iterator[None]:
    """Within the block, the first Ctrl-C is noted (and, with announce, said on stderr) for the loops
    to stop before their next step; the second raises KeyboardInterrupt at once. Only Python's
    default handler in the main thread is replaced (a process that ignores SIGINT keeps ignoring it)."""
    global _requested, _noting
    if _noting:  # nested: the outer block notes
        yield
        return
    _requested = False
    if not _main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def note(signum: int, frame) -> None:
        global _requested
        _requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if announce:
            print("\ninterrupt: stopping before the next step (press Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)
    signal.signal(signal.SIGINT, note)
    _noting = True
    try:
        yield
    finally:
        _noting = False
        signal.signal(signal.SIGINT, signal.default_int_handler)


def requested() -> bool:
    """Whether a Ctrl-C arrived in the last `stop_between_steps` block: an error after it is its doing
    (a second Ctrl-C raises at once, wherever the run is, and may come out as another error)."""
    return _requested


def raise_if_requested(agree_on: Optional[torch.device] = None) -> None:
    """Between steps: raise KeyboardInterrupt if a Ctrl-C was noted in the enclosing
    stop_between_steps block (outside one, Python's handler has raised it already).

    In a distributed run the ranks must stop before the same step, or one waits in a collective for a
    peer that has gone: with `agree_on` (the device of the process group's tensors), every rank calls
    this before every training step and they decide together (one tiny all-reduce); without it
    (eval_only's evaluation, whose shards may differ by a batch), a distributed run goes on to the next
    agreed step. (An epoch's evaluation in training does not call this: the epoch's checkpoint comes first.)
    """
    stop = _noting and _requested
    if dist.is_available() and dist.is_initialized():
        if agree_on is None:
            return
        stop = all_reduce_sum([float(stop)], agree_on)[0] > 0
    if stop:
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold a Ctrl-C until the block ends, then hand it to the handler it was meant for.

    For writes that must finish once begun: a checkpoint (inside torch.save a KeyboardInterrupt
    becomes a RuntimeError and loses the file), an epoch's metrics line together with its
    checkpoints. Nested blocks pass the held Ctrl-C outwards; a handler that is not Python's
    (SIG_IGN, SIG_DFL) or a thread other than the main one leaves the block as it is.
    """
    previous = signal.getsignal(signal.SIGINT)
    if not _main_thread() or not callable(previous):
        yield
        return
    received = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        previous(signal.SIGINT, None)
