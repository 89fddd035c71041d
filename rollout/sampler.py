"""Logits -> tokens + logprobs.

Sampling is Gumbel-max with counter-based noise: the noise added to token t of a row is a pure
function of (sample seed, position, t). A sample therefore does not depend on which other
requests share its batch, on preemption, or on speculative decoding, and the Triton sampler in
`kernels/sample.py` reproduces it bit for bit.

The hash works on int32 tensors holding uint32 bit patterns: shifts are masked to make them
logical, and multiplications wrap modulo 2**32 on every backend (int64 arithmetic would be exact
too, but it runs ~30x slower on CPU because it does not vectorise).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, vocab_size: int,
                  stream: int = TOKEN_STREAM) -> torch.Tensor:
    """[B, V] uniforms, element (b, t) a function of (seed[b], position[b], t, stream) only."""
    keys = row_keys(seed, position, stream)
    tokens = torch.arange(vocab_size, dtype=torch.int32, device=seed.device)
    return bits_to_uniform(mix32(keys[:, None] ^ tokens[None, :]))


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, vocab_size: int,
                 stream: int = TOKEN_STREAM) -> torch.Tensor:
    u = uniform_noise(seed, position, vocab_size, stream)
    return u.log_().neg_().log_().neg_()


def uniform_scalar(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """[B] uniforms, one per (seed, position, stream)."""
    return bits_to_uniform(mix32(row_keys(seed, position, stream)))


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors on the logits' device."""

    temperature: torch.Tensor  # float32 [B]; 0 means greedy
    top_k: torch.Tensor  # int32 [B]; <= 0 means off
    top_p: torch.Tensor  # float32 [B]; 1 means off
    min_p: torch.Tensor  # float32 [B]; 0 means off
    seed: torch.Tensor  # int32 [B]
    position: torch.Tensor  # int32 [B]: position of the token being sampled
    all_greedy: bool
    any_greedy: bool
    needs_filter: bool

    @classmethod
    def build(cls, temperature: list[float], top_k: list[int], top_p: list[float],
              min_p: list[float], seed: list[int], position: list[int],
              device: torch.device | str) -> "SamplingBatch":
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int32, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            seed=torch.tensor(seed, dtype=torch.int32, device=device),
            position=torch.tensor(position, dtype=torch.int32, device=device),
            all_greedy=all(t == 0 for t in temperature),
            any_greedy=any(t == 0 for t in temperature),
            needs_filter=any(k > 0 for k in top_k) or any(p < 1 for p in top_p)
            or any(m > 0 for m in min_p),
        )

    @classmethod
    def for_sequences(cls, rows: list, device: torch.device | str) -> "SamplingBatch":
        """One row per (sequence, offset): the sequence's parameters and seed, sampling the
        token at position num_tokens + offset (offsets > 0 are verified draft positions)."""
        params = [seq.params for seq, _ in rows]
        return cls.build(temperature=[p.temperature for p in params],
                         top_k=[p.top_k for p in params], top_p=[p.top_p for p in params],
                         min_p=[p.min_p for p in params], seed=[seq.seed for seq, _ in rows],
                         position=[seq.num_tokens + j for seq, j in rows], device=device)


def filter_logprobs(logp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) the tokens that top-k, then top-p (on the top-k survivors, renormalised),
    then min-p (relative to the most likely token) exclude. `logp` is log_softmax(logits / T)."""
    vocab = logp.shape[-1]
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logp.device)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(torch.int64)
    drop_sorted = ranks[None, :] >= k[:, None]
    probs = sorted_logp.masked_fill(drop_sorted, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p == 1 means off: in fp32 the mass before the tail can round to exactly 1.0.
    drop_sorted |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop_sorted[:, 0] = False  # the most likely token always survives
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    drop |= logp < (sorted_logp[:, :1] + torch.log(min_p)[:, None])
    return logp.masked_fill(drop, float("-inf"))


def target_logprobs(logits: torch.Tensor,
                    batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, candidates): logp = log_softmax(logits / T) with T = 1 on greedy rows (what the
    caller reports), candidates = logp with top-k/p/min-p exclusions at -inf (what is sampled)."""
    logits = logits.float()
    temperature = torch.where(batch.temperature == 0, 1.0, batch.temperature)
    logp = (logits / temperature[:, None]).log_softmax(dim=-1)
    if batch.needs_filter:
        return logp, filter_logprobs(logp, batch.top_k, batch.top_p, batch.min_p)
    return logp, logp


def pick(logits: torch.Tensor, candidates: torch.Tensor, batch: SamplingBatch,
         stream: int = TOKEN_STREAM) -> torch.Tensor:
    """Gumbel-max over `candidates` with the counter noise of `stream`; the argmax of the raw
    logits on greedy rows (no noise is drawn when every row is greedy)."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    noise = gumbel_noise(batch.seed, batch.position, logits.shape[-1], stream)
    tokens = (candidates + noise).argmax(dim=-1)
    if batch.any_greedy:
        tokens = torch.where(batch.temperature == 0, logits.argmax(dim=-1), tokens)
    return tokens


def sample(logits: torch.Tensor, batch: SamplingBatch,
           stream: int = TOKEN_STREAM) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (tokens int64 [B], logprobs float32 [B]).

    The logprob is log_softmax(logits / T) at the chosen token, before any top-k/p/min-p
    filtering (T = 1 for greedy rows): the quantity a GRPO/PPO trainer recomputes.
    """
    logp, candidates = target_logprobs(logits, batch)
    tokens = pick(logits, candidates, batch, stream)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
