"""Transparent huge pages for a CPU KV pool.

A decode step reads every sample's own K/V from slots spread through the pool: a 4 KB page
holds five of SmolLM2-135M's 768-byte rows of a layer, and the pool spans hundreds of MB, so
small pages cost a TLB miss every few rows. Backed by 2 MB pages the pool costs a fraction of
the page walks, and building it faults once per 2 MB instead of once per 4 KB, which is what
a rebuild at wake_up pays (docs/benchmarks.md has both figures).

Linux hosts commonly ship transparent huge pages in `madvise` mode (only regions that ask get
them), so the pool asks: `madvise(MADV_HUGEPAGE)` on the 2 MB-aligned part of its buffer, before
the buffer is first touched. Where the kernel has no such pages, or the call fails, the pool is
the same memory on small pages.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from ..colocation import host_heap

MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


@cache
def _madvise():
    lib = host_heap.libc()
    fn = None if lib is None else getattr(lib, "madvise", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages under the whole 2 MB pages of CPU tensor `t`'s storage (call before
    writing it: pages already faulted in stay small). True when the kernel took the advice."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu":
        return False
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    return hi > lo and madvise(lo, hi - lo, MADV_HUGEPAGE) == 0


def empty_zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), on huge pages where a CPU host gives them."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype)
    advise(t)
    return t.zero_()
