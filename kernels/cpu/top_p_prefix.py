"""The top-p filter's scan of sorted rows in one pass (top_p_prefix.c): `_prefix_exact`'s result
(rollout/sample/filters.py), bit for bit, without its passes of torch ops over [rows, vocab]."""

from __future__ import annotations

import torch

from . import fp32_cpu, has, library
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
    if not (probs.dim() == 2 and fp32_cpu(probs) and probs.stride(1) == 1):
        raise ValueError(f"top_p_prefix: probs {probs.dtype} {tuple(probs.shape)} strides "
                         f"{probs.stride()} on {probs.device} must be float32 [rows, vocab] on "
                         f"the CPU (unit stride along vocab)")
    rows, vocab = probs.shape
    # The C reads each row's first `length` values (its first one whatever the length) and
    # one k and top_p a row.
    if not 1 <= length <= vocab:
        raise ValueError(f"top_p_prefix: length {length} must be within 1 and the "
                         f"vocabulary's {vocab}")
    for name, x in (("k", k), ("top_p", top_p)):
        if x.numel() != rows or x.device.type != "cpu":
            raise ValueError(f"top_p_prefix: {name} {tuple(x.shape)} on {x.device} must have "
                             f"the probs' {rows} rows, on the CPU")
    k = k.to(torch.int64).contiguous()
    top_p = top_p.to(torch.float32).contiguous()
    out = torch.empty(probs.shape[0], dtype=torch.int64)
    library().top_p_prefix_f32(probs.data_ptr(), probs.shape[0], probs.stride(0),
                               probs.shape[1], length, k.data_ptr(), top_p.data_ptr(),
                               out.data_ptr())
    return out
