"""glibc's heap held steady, so that a step costs the same whatever ran before it.

    from ddp.heap import steady_heap
    steady_heap()  # once, at the start of a process that times steps

glibc serves an allocation of at least its mmap threshold (128 KiB in a fresh process)
with a mapping of its own, and hands the top of its heap back to the kernel once more
than its trim threshold (128 KiB) lies free there. Each time it frees a mapped block
larger than the mmap threshold but of at most 32 MiB (on 64 bits), it raises both: the
mmap threshold to that block's size, the trim threshold to twice that. Memory handed
back is page-faulted in again, zeroed, when the next step allocates it. So the same
step costs more or less by what the process happened to free before, and pinning the
mmap threshold alone still leaves the trimming between steps. Pinning both where
glibc's own rule ends takes that history out (the measurements:
docs/appendix/notes.md, "A steady heap").

Elsewhere (macOS, musl) the C library has its own rules and this does nothing. Not
used by `profiling.studies.grad_view_memory`, whose figure is the peak memory that this would hold.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters, from glibc's malloc.h
MMAP_THRESHOLD_BYTES = 32 * 2**20  # the highest glibc raises it to by itself (64 bits)
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES  # what glibc sets along with it


def steady_heap() -> bool:
    """Pin glibc's mmap and trim thresholds at the values its own rule reaches last
    (`MMAP_THRESHOLD_BYTES`, `TRIM_THRESHOLD_BYTES`): blocks up to 32 MiB come from the
    heap, and up to 64 MiB of free memory stays in it between steps. True if glibc took
    both; False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Both: pinning one turns off glibc's raising of the other too.
    mmap_ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    trim_ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return mmap_ok and trim_ok
