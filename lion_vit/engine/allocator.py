"""CPU training: keep freed tensor memory in the process instead of handing it back to the OS.

glibc serves large allocations with mmap and returns them with munmap, so every CPU training step
page-faults its activations in again (`scripts/benchmark_train.py --malloc default` measures the cost).
The price: RSS keeps its peak, which a training loop reuses anyway. CUDA has its own caching allocator.
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
_NEVER = -1  # read by glibc as SIZE_MAX: never trim the heap top (any finite threshold returns it every step)


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to reuse freed blocks instead of unmapping them; False where unsupported.
    Process-wide, for allocations after the call (also in DataLoader workers forked later)."""
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
