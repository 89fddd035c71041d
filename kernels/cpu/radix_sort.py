"""Rows of 32-bit keys sorted in place (radix_sort.c) for the top-p filter's sort of
log-probabilities (rollout/sample/filters.py), where numpy's comparison sort was most of a
filtered sampling step: the same order, bit for bit (docs/benchmarks.md)."""

from __future__ import annotations

import torch

from . import has, library
from .ops import operator, returns_nothing


def supported() -> bool:
    return has("radix_sort_u32")


@operator("radix_sort_u32(Tensor(a!) keys) -> ()", returns_nothing)
def sort_rows(keys: torch.Tensor) -> None:
    """Sort each row of `keys` (int32 [rows, n] on the CPU, unit stride along n), in place,
    ascending as unsigned 32-bit integers, on the calling thread (the GIL released: callers
    split rows over their threads)."""
    if not (keys.dim() == 2 and keys.dtype == torch.int32 and keys.device.type == "cpu"
            and keys.stride(1) == 1):
        raise ValueError(f"radix_sort_u32: keys {keys.dtype} {tuple(keys.shape)} strides "
                         f"{keys.stride()} on {keys.device} must be int32 [rows, n] on the CPU "
                         f"(unit stride along n)")
    if library().radix_sort_u32(keys.data_ptr(), keys.shape[0], keys.shape[1],
                                keys.stride(0)) != 0:
        raise MemoryError("radix_sort_u32: no memory for a thread's scratch row")
