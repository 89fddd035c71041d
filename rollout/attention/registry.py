"""The attention backend of each engine backend (rollout/ops/backend.py)."""

from __future__ import annotations

import os

import torch

from ..ops.op import Op, always
from . import cpu
from .invariant import InvariantCpuAttention
from .sdpa import TorchAttention

# What the Triton kernels run and are tested in: their tile sizes and dot precision assume 2- or
# 4-byte floats (kernels/triton/paged_attention.py).
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Under TRITON_INTERPRET=1 the same kernels run on the CPU, but the interpreter's bf16 tl.dot is
# wrong (a bf16 engine's logprobs were 5.9 nats off transformers'; the kernel tests leave bf16
# out there, tests/support/kernels_env.py): bf16 takes the torch attention instead.
INTERPRETED_DTYPES = (torch.float16, torch.float32)


def _triton(pool, windows, invariant: bool = False):
    from .triton import TritonAttention  # imports triton: only when this backend is built

    return TritonAttention(pool, windows, invariant)


def _triton_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type == "cuda":
        return dtype in TRITON_DTYPES
    return os.environ.get("TRITON_INTERPRET") == "1" and dtype in INTERPRETED_DTYPES


ATTENTION = Op("attention", torch=(TorchAttention, always),
               cpu=(cpu.CpuAttention, cpu.supported), triton=(_triton, _triton_supported))


def attention_name(backend, dtype: torch.dtype) -> str:
    """The attention implementation a backend runs for a model of `dtype`."""
    if backend.batch_invariant:
        return f"{'triton' if backend.name == 'triton' else 'cpu'}-invariant"
    return backend.choose(ATTENTION.implementations, dtype)


def make_attention(backend, dtype: torch.dtype, pool, windows):
    """The attention backend of an engine's backend, for a model of `dtype`."""
    if not backend.batch_invariant:
        return backend.bind(ATTENTION, dtype)(pool, windows)
    if backend.name == "triton":
        if not _triton_supported(backend.device, dtype):
            raise ValueError(f"batch_invariant: the Triton attention does not run {dtype} on "
                             f"{backend.device}")
        return _triton(pool, windows, invariant=True)
    from rollout_kernels.cpu import paged_attention as kernel

    if not kernel.built():
        raise ValueError(f"batch_invariant: needs the C attention kernel, which is off here "
                         f"({kernel.why_not()})")
    return InvariantCpuAttention(pool, windows)
