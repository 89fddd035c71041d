"""Counter-based sampling noise: the noise added to token t of a row is a pure function of
(sample seed, position, t), so a sample does not depend on which other requests share its
batch, on preemption, or on speculative decoding; `kernels/triton/counter_noise.py` and
`kernels/cpu/gumbel.c` reproduce it bit for bit.

The hash works on int32 tensors holding uint32 bit patterns: shifts are masked to make them
logical, and multiplications wrap modulo 2**32 on every backend (int64 arithmetic would be exact
too, but torch does not vectorise it on the CPU).
"""

from __future__ import annotations

import functools

import torch

_M1 = 0x7FEB352D
_M2 = 0x846CA68B - (1 << 32)  # 0x846CA68B as a signed int32
_UNIFORM_SCALE = 1.0 / (1 << 23)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mixer (lowbias32) on int32 tensors (`x` is not modified)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    # In place from here: this runs over batch x vocab elements every sampling step.
    x.mul_(_M1)
    x.bitwise_xor_((x >> 15).bitwise_and_(0x1FFFF))
    x.mul_(_M2)
    return x.bitwise_xor_((x >> 16).bitwise_and_(0xFFFF))


def mix32_int(x: int) -> int:
    """`mix32` on a Python int (uint32 semantics), used to derive per-sample seeds."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def to_int32(x: int) -> int:
    """A uint32 value as the signed int32 with the same bits."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= (1 << 31) else x


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a request seeded with `seed` (int32 bit pattern)."""
    lo, hi = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    return to_int32(mix32_int(lo ^ mix32_int(hi ^ mix32_int(sample_index + 0x9E3779B9))))


def row_keys(seed: torch.Tensor, position: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """One int32 key per (sample seed, position); `stream` separates independent draws
    (token noise, speculative acceptance) made at the same position."""
    pos = position.to(torch.int32)
    if stream:
        pos = pos ^ to_int32(mix32_int(stream))
    return mix32(seed.to(torch.int32) ^ mix32(pos))


def bits_to_uniform(h: torch.Tensor) -> torch.Tensor:
    """Top 23 bits of a hash -> float32 uniform in (0, 1). With 23 bits, m + 0.5 stays exact
    (24 significant bits), so u < 1 strictly and the Gumbel noise is always finite."""
    return (h >> 9).bitwise_and_(0x7FFFFF).to(torch.float32).add_(0.5).mul_(_UNIFORM_SCALE)


# Independent noise streams drawn at the same position.
TOKEN_STREAM = 0  # the token sampled from the target (also the bonus token when verifying)
ACCEPT_STREAM = 1  # the coin that accepts a draft token
RESIDUAL_STREAM = 2  # the token resampled from max(0, p - q) after a rejection
DRAFT_STREAM = 3  # the draft model's own proposals


def token_bits(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] int32 hashes mix32(keys[b] ^ mix32(t)). The token is mixed before it meets the
    key: with keys[b] ^ t, two rows whose keys differ in their low bits only (keys a ^ b = d
    < V: about V / 2^32 of all pairs, some 3 % of the 64-sample groups over a 49K vocabulary)
    drew the same noise permuted (row b's at t was row a's at t ^ d), and their tokens were
    coupled; mixed, two rows share a value only where two hashes collide."""
    return mix32(keys[:, None] ^ _token_hashes(vocab_size, keys.device)[None, :])


@functools.lru_cache(maxsize=4)
def _token_hashes(vocab_size: int, device: torch.device) -> torch.Tensor:
    """mix32 of every token id: the same for every row and step (the sampler draws in blocks of
    rows, several a step), so made once per vocabulary and device. Never written to."""
    with torch.inference_mode(False):  # a plain tensor, usable inside and outside the mode
        return mix32(torch.arange(vocab_size, dtype=torch.int32, device=device))


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, vocab_size: int,
                  stream: int = TOKEN_STREAM) -> torch.Tensor:
    """[B, V] uniforms, element (b, t) a function of (seed[b], position[b], t, stream) only."""
    return bits_to_uniform(token_bits(row_keys(seed, position, stream), vocab_size))


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, vocab_size: int,
                 stream: int = TOKEN_STREAM) -> torch.Tensor:
    u = uniform_noise(seed, position, vocab_size, stream)
    return u.log_().neg_().log_().neg_()


def uniform_scalar(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """[B] uniforms, one per (seed, position, stream)."""
    return bits_to_uniform(mix32(row_keys(seed, position, stream)))
