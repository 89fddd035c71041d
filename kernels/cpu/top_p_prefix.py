"""The top-p filter's scan of sorted rows in one pass (top_p_prefix.c): `_prefix_exact`'s result
(rollout/sample/filters.py), bit for bit, without its passes of torch ops over [rows, vocab]."""

from __future__ import annotations

import torch

from . import has, library
from .ops import operator


def supported() -> bool:
    return has("top_p_prefix_f32")


@operator("top_p_prefix(Tensor probs, Tensor k, Tensor top_p, int length) -> Tensor",
          lambda probs, k, top_p, length: probs.new_empty(probs.shape[0], dtype=torch.int64))
def prefix_lengths(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                   length: int) -> torch.Tensor:
    """int64 [rows]: each row's kept prefix length, or -1 (filters._prefix_exact's contract):
    `probs` float32 [rows, vocab] on the CPU with unit stride along vocab, `k` int64 [rows],
    `top_p` float32 [rows], positions < `length` examined. On the calling thread (the GIL
    released: callers split rows over their threads)."""
    assert probs.dim() == 2 and probs.dtype == torch.float32 and probs.stride(1) == 1
    k = k.to(torch.int64).contiguous()
    top_p = top_p.to(torch.float32).contiguous()
    out = torch.empty(probs.shape[0], dtype=torch.int64)
    library().top_p_prefix_f32(probs.data_ptr(), probs.shape[0], probs.stride(0),
                               probs.shape[1], length, k.data_ptr(), top_p.data_ptr(),
                               out.data_ptr())
    return out
