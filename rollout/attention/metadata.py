"""The flat step metadata every attention backend reads (docs/architecture.md, "The step's flat batch"), and the
helpers that build it on the device from host lengths."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from ..ops.host_lists import host_tensor


@dataclass
class AttentionMetadata:
    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int64 [sum kv_len]
    out_slots: torch.Tensor  # int64 [T]: where the new tokens' K/V go
    q_lens: list[int]
    kv_lens: list[int]
    # Per request, on the host: its sample group (a request's samples going on from parked
    # K/V are a group of their own: (group, tag)), and how many leading context slots it holds
    # in common with every other request of that group (the cached prompt; 0 = none known).
    # Backends that read a group's shared K/V once use these; empty lists mean no grouping.
    groups: list[Hashable] = field(default_factory=list)
    shared_lens: list[int] = field(default_factory=list)
    plan: Any = field(default=None)  # the backend's per-step precomputation, shared by layers

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens)


def indptr(lens: list[int], device) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as int32 on `device`."""
    return host_tensor([0, *accumulate(lens)], torch.int32, device)


def ranges(starts: list[int], lens: list[int], device) -> torch.Tensor:
    """arange(s, s + n) for each (s, n), concatenated; built on `device` from O(B) host data
    (output_size keeps repeat_interleave from reading the total back)."""
    total = sum(lens)
    lens_t = host_tensor(lens, torch.int64, device)
    offsets = lens_t.cumsum(0) - lens_t  # where each range begins in the output
    shift = host_tensor(starts, torch.int64, device) - offsets
    return torch.arange(total, device=device) + torch.repeat_interleave(shift, lens_t,
                                                                        output_size=total)
