"""Ctrl-C (SIGINT) and SIGTERM (SLURM's preemption, `kill`'s default) end a training run cleanly: at a
step boundary, as KeyboardInterrupt (SIGTERM: its subclass Terminated), which train.py turns into exit
status 130 (143) and one line saying where the run stands.

Raised wherever the main thread is, the interrupt is often lost or turned into another error (in the
DataLoader's fork, inside torch.save); SIGTERM's default kills silently. So while training a first signal
is only noted and the loops stop before their next step (all ranks the same one; distributed training stops
at it, after its forward and before its backward: agreement); a second raises at once.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .distributed import queued_sum

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_requested: Optional[int] = None  # the signal that arrived in the last stop_between_steps block
_noting = False  # in such a block, with its handlers installed


class Terminated(KeyboardInterrupt):
    """A SIGTERM, raised as Ctrl-C's KeyboardInterrupt is (the same clean stop, exit status 143)."""


def raise_terminated(signum: int, frame) -> None:
    """The SIGTERM handler outside stop_between_steps blocks (train.py installs it): raise at once."""
    raise Terminated


def raise_interrupt(signum: int) -> None:
    """Raise what `signum` means here: Terminated for SIGTERM, else KeyboardInterrupt."""
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


_RAISING: Dict[int, Callable] = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: raise_terminated}


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _ours(signum: int) -> bool:
    """Whether the signal's handler stops the run (Python's, SIGTERM's default or raise_terminated); a
    process that ignores a signal, or handles it itself, keeps it."""
    handler = signal.getsignal(signum)
    return handler is _RAISING[signum] or (signum == signal.SIGTERM and handler == signal.SIG_DFL)


@contextlib.contextmanager
def stop_between_steps(announce: bool = True) -> Iterator[None]:
    """Within the block, the first Ctrl-C or SIGTERM is noted (and, with announce, said on stderr) for the
    loops to stop before their next step; the second raises at once. Main thread, _ours handlers only."""
    global _requested, _noting
    if _noting:  # nested: the outer block notes
        yield
        return
    _requested = None
    handled = [signum for signum in SIGNALS if _main_thread() and _ours(signum)]
    previous = {signum: signal.getsignal(signum) for signum in handled}

    def note(signum: int, frame) -> None:
        global _requested
        _requested = signum
        for other in handled:
            signal.signal(other, _RAISING[other])
        if announce:
            again = "send SIGTERM again" if signum == signal.SIGTERM else "press Ctrl-C again"
            what = "terminated" if signum == signal.SIGTERM else "interrupt"
            print(f"\n{what}: stopping before the next step ({again} to stop at once)", file=sys.stderr, flush=True)
    for signum in handled:
        signal.signal(signum, note)
    _noting = bool(handled)
    try:
        yield
    finally:
        _noting = False
        for signum in handled:
            signal.signal(signum, previous[signum])


def requested() -> Optional[int]:
    """The signal that arrived in the last `stop_between_steps` block, or None (train.py reports an error
    after one as the interrupt: a second signal raises wherever the run is)."""
    return _requested


def raise_if_requested() -> None:
    """Between steps: raise KeyboardInterrupt (Terminated) if a Ctrl-C (SIGTERM) was noted in the
    enclosing stop_between_steps block.

    Distributed ranks must stop before the same step, or one waits in a collective for a peer that has
    gone: a distributed run goes on here (eval_only's shards may differ by a batch) to the next step the ranks
    agree on (agreement, raise_if_agreed)."""
    if _noting and _requested and not (dist.is_available() and dist.is_initialized()):
        raise_interrupt(_requested)


def agreement(device: torch.device) -> Optional[Tensor]:
    """In a distributed run, each rank's noted signal summed over the ranks, [SIGTERMs, Ctrl-Cs] on `device` (the
    process group's), the all-reduce queued and not awaited (queued_sum); None where not distributed. The
    training loop reads it with its step's loss, after the forward, and hands it to raise_if_agreed: every rank
    then stops before the same backward, where a read of its own would make the host wait for the device before
    every step."""
    noted = _requested if _noting else None
    return queued_sum([float(noted == signal.SIGTERM), float(noted == signal.SIGINT)], device)


def raise_if_agreed(terms: float, ints: float) -> None:
    """Raise what agreement's sums, read, say: any rank's SIGTERM, else any rank's Ctrl-C, else nothing."""
    if terms or ints:
        raise_interrupt(signal.SIGTERM if terms else signal.SIGINT)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold a Ctrl-C or SIGTERM until the block ends (a checkpoint's writes), then hand it to the handler
    it was meant for; nested blocks pass it outwards. Main thread and Python handlers only."""
    if not _main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    held = [signum for signum, handler in previous.items()
            if callable(handler) or (signum == signal.SIGTERM and handler == signal.SIG_DFL)]
    received = []
    for signum in held:
        signal.signal(signum, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for signum in held:
            signal.signal(signum, previous[signum])
    for signum in received[:1]:
        handler = previous[signum]
        if callable(handler):
            handler(signum, None)
        else:  # SIGTERM's default: the same clean stop as Ctrl-C's
            raise_interrupt(signum)
