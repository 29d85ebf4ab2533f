"""CPU training: keep freed tensor memory in the process instead of handing it back to the OS.

glibc serves large allocations with mmap and gives them back with munmap (and trims the heap
top), so every training step of a ViT on a CPU page-faults its activations (tens of MB each)
in again, and on a CPU the page faults on a fresh 30 MB tensor cost more than the arithmetic
done on it (`scripts/benchmark_train.py --malloc default` measures the difference). The price is
that the process keeps its peak heap (RSS does not shrink after a step), which a training loop
reuses anyway. CUDA memory has its own caching allocator and is not affected.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("lion_vit")

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_HEAP_UP_TO = 1 << 30  # serve blocks up to 1 GiB from the heap, not from fresh mmaps
_NEVER = -1  # read by glibc as SIZE_MAX: never trim the heap top. With any finite threshold glibc gives
# the top back and faults it in again at every training step (docs/benchmarks.md, --malloc default).


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to reuse freed blocks instead of unmapping them; False where unsupported.

    Applies to allocations made after the call, process-wide (also to DataLoader workers forked later).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, _HEAP_UP_TO)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER))
    if not done:
        log.debug("mallopt refused the CPU allocator settings; using glibc's defaults")
    return done
