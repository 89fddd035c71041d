"""Counter-based sampling noise in Triton, bit-identical to `rollout.sampler`.

The noise of token t in a row is mix32(row_key ^ mix32(t)) with row_key = mix32(seed ^
mix32(position)) (rollout/sample/noise.py's token_bits says why t is mixed first):
a pure function of (seed, position, t). The hash runs on int32 holding uint32 bit patterns, the
same way as the torch version: right shifts are masked to make them logical, multiplications
wrap modulo 2**32 (Triton's integer multiply wraps; the constants are the torch ones, the second
one written as its signed int32 value).

The uniform built from the top 23 bits is exact. The Gumbel transform -log(-log(u)) uses
libdevice's logf on the GPU, the same routine torch's CUDA `log` calls, so it matches torch on
CUDA bit for bit; under the CPU interpreter `tl.log` is numpy's log, which can differ from torch's
CPU log by one ulp.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def mix32(x):
    """lowbias32 on int32 bit patterns (constants 0x7FEB352D, 0x846CA68B)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * -2073254261  # 0x846CA68B as a signed int32
    return x ^ ((x >> 16) & 0xFFFF)


@triton.jit
def row_key(seed, position):
    """`rollout.counter_noise.row_keys` for stream 0 (token noise), on int32 scalars."""
    return mix32(seed.to(tl.int32) ^ mix32(position.to(tl.int32)))


@triton.jit
def token_bits(key, tok):
    return mix32(key ^ mix32(tok.to(tl.int32)))


@triton.jit
def bits_to_uniform(h):
    """Top 23 bits -> float32 in (0, 1); every step is exact (see rollout.sampler)."""
    return (((h >> 9) & 0x7FFFFF).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23


@triton.jit
def precise_log(x, USE_LIBDEVICE: tl.constexpr):
    # tl.log may lower to an approximate instruction; libdevice's logf is what torch uses.
    if USE_LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def precise_exp(x, USE_LIBDEVICE: tl.constexpr):
    if USE_LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def gumbel(u, USE_LIBDEVICE: tl.constexpr):
    return -precise_log(-precise_log(u, USE_LIBDEVICE), USE_LIBDEVICE)


def use_libdevice(device: torch.device) -> bool:
    """libdevice exists only in compiled CUDA code, not under the interpreter."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"


@triton.jit
def _noise_kernel(seed, position, out_bits, out_uniform, out_gumbel, vocab_size,
                  BLOCK_V: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key = row_key(tl.load(seed + row), tl.load(position + row))
    h = token_bits(key, col)
    u = bits_to_uniform(h)
    ok = col < vocab_size
    offs = row.to(tl.int64) * vocab_size + col
    tl.store(out_bits + offs, h, mask=ok)
    tl.store(out_uniform + offs, u, mask=ok)
    tl.store(out_gumbel + offs, gumbel(u, USE_LIBDEVICE), mask=ok)


def gumbel_noise_triton(seed: torch.Tensor, position: torch.Tensor, vocab_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Debug entry point: (hash bits int32, uniform f32, gumbel f32), each [B, vocab_size],
    computed by the same Triton helpers the sampler uses."""
    batch = seed.shape[0]
    shape = (batch, vocab_size)
    bits = torch.empty(shape, dtype=torch.int32, device=seed.device)
    uniform = torch.empty(shape, dtype=torch.float32, device=seed.device)
    noise = torch.empty(shape, dtype=torch.float32, device=seed.device)
    if batch and vocab_size:
        block_v = 1024
        _noise_kernel[(batch, triton.cdiv(vocab_size, block_v))](
            seed.to(torch.int32), position.to(torch.int32), bits, uniform, noise, vocab_size,
            BLOCK_V=block_v, USE_LIBDEVICE=use_libdevice(seed.device), enable_fp_fusion=False)
    return bits, uniform, noise
