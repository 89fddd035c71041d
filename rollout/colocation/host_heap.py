"""The C heap of a CPU engine's process (glibc): freed blocks kept for the next step, and given
back to the system when the engine sleeps.

A decode step allocates and frees tensors of [batch, vocab] floats: the logits, and with
top-k/top-p/min-p the filter's log-probabilities, sorted values and candidates, 25 MB each at
batch 128 with a 49K vocabulary (an unfiltered draw goes a block of rows at a time and makes
none). glibc serves blocks that size with fresh mmaps, or from the heap top that it trims back
to the system once they are free, so every step touched its memory anew: thousands of page
faults a step (docs/benchmarks.md).
`keep_freed_blocks` raises glibc's mmap threshold to its maximum (32 MB) and its trim threshold
(KEEP_BYTES), so blocks below 32 MB come from the heap and stay there for reuse; larger ones
(the KV pool) are still mapped and unmapped on their own. `release_freed_blocks` (at sleep)
hands every free heap page back, so sleeping frees the memory it always freed.

Process-wide settings; elsewhere than glibc both do nothing, and so does `keep_freed_blocks`
where the user tuned glibc's malloc through its environment (USER_TUNING).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's cap on 64-bit systems
KEEP_BYTES = 256 << 20  # free memory at the heap top kept rather than trimmed
USER_TUNING = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@cache
def libc() -> ctypes.CDLL | None:
    """The process's C library (also rollout/kv/huge_pages.py's); None where it is not glibc's
    libc.so.6."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@cache
def _glibc() -> ctypes.CDLL | None:
    lib = libc()
    if lib is None or not hasattr(lib, "mallopt") or not hasattr(lib, "malloc_trim"):
        return None
    lib.mallopt.argtypes, lib.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    lib.malloc_trim.argtypes, lib.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lib


@cache
def keep_freed_blocks() -> bool:
    """Whether glibc now keeps freed blocks below 32 MB for reuse (once per process)."""
    libc = _glibc()
    tuned = (any(name in os.environ for name in USER_TUNING)
             or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""))
    if libc is None or tuned:
        return False
    # Trim first: a failure between the two leaves the heap kept, mapped as before.
    return (libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) == 1
            and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1)


def release_freed_blocks() -> None:
    """Give every free page of the heap back to the system (malloc_trim)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
