"""Transparent huge pages for a CPU KV pool.

A decode step reads every sample's own K/V from slots spread through the pool: a 4 KB page
holds five of SmolLM2-135M's 768-byte rows of a layer, and the pool spans hundreds of MB, so
small pages cost a TLB miss every few rows. Backed by 2 MB pages the pool costs a fraction of
the page walks, and building it faults once per 2 MB instead of once per 4 KB, which is what
a rebuild at wake_up pays (docs/benchmarks.md has both figures).

Linux hosts commonly ship transparent huge pages in `madvise` mode (only regions that ask get
them), so the pool asks, on a private anonymous mapping of its own: `madvise(MADV_HUGEPAGE)`
before the first write, the tensor starting on a 2 MB boundary. Its own mapping, not malloc's:
once the engine keeps freed heap blocks (rollout/colocation/host_heap.py) malloc may serve the
pool from heap memory already written on small pages, where the advice comes too late. Where
the kernel has no huge pages free, or there is no madvise, the pool is the same memory on small
pages; dropping the tensor unmaps it.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap

import torch

HUGE_PAGE = 2 << 20
PRIVATE_ANONYMOUS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def can_advise() -> bool:
    """Whether this platform's mmap takes the huge-page advice (Linux)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")


def empty_zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), on huge pages where a CPU host gives them (tensors of at least one
    whole huge page; smaller ones come from torch as before)."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < HUGE_PAGE or not can_advise():
        return torch.zeros(shape, dtype=dtype, device=device)
    # One huge page more than asked, never touched, so the tensor can start on a boundary.
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=PRIVATE_ANONYMOUS)
    except OSError as e:
        # A backstop to size_pool's check against available memory (memory taken between
        # that check and this build, a rebuild at wake_up): the field to lower, not a bare
        # OSError.
        if e.errno != errno.ENOMEM:
            raise
        raise ValueError(f"kv_cache_tokens: the KV pool's {nbytes / 2**20:.1f} MiB could not "
                         f"be mapped ({e}); lower kv_cache_tokens") from e
    view = ctypes.c_char.from_buffer(mapping)
    offset = -ctypes.addressof(view) % HUGE_PAGE
    del view  # the export would otherwise pin the mapping open
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # a kernel without transparent huge pages: small pages, the same memory
    # The tensor's storage holds the mapping; the mapping is unmapped with the storage.
    t = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset).view(shape)
    return t.zero_()  # the first write: fault the pool in now, at build, on the advised pages
