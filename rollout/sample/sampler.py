"""Logits -> tokens + logprobs: Gumbel-max over the filtered log-probabilities with counter
noise (rollout/sample/noise.py); the logprob returned is log_softmax(logits / T) at the chosen
token, and on request its log-probability under the truncated distribution it was drawn from
and that distribution's support (support.py).

`sample` and `pick` below are the torch reference. A `Sampler` binds the engine backend's
implementations (rollout/ops): the fused Triton sampler on CUDA (kernels/triton/
sample.py), the C Gumbel-max on the CPU (kernels/cpu/gumbel.c). The C kernel gives the
reference's tokens bit for bit; the fused sampler too, but within rounding of a top-p or min-p
boundary, and its logprobs an ulp apart: what is reported of its rows is read from the
reference's (`Sampler._draw_fused`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout_kernels.cpu import gumbel as native_gumbel

from ..ops.host_lists import host_tensor
from ..ops.op import Op, always, on_cuda
from .filters import filter_by_sort, filter_by_threshold
from .log_softmax import log_softmax
from .noise import TOKEN_STREAM, gumbel_noise, row_keys
from .support import sampled_at

# Elements of [B, V] computed at once on the CPU (the noise of the torch path, the rows a
# Sampler draws together): 4 MB per int32/fp32 temporary, so the temporaries of one block of
# rows stay in a shared L3 cache.
_BLOCK_ELEMENTS = 1 << 20


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
    # Every row's temperature is 0 (divided by 1) or 1: dividing the logits is the identity.
    unit_temperature: bool = False
    # Per row, on the host: drawn by argmax; drawn from a distribution a filter truncates.
    greedy: tuple[bool, ...] = ()
    truncated: tuple[bool, ...] = ()

    @classmethod
    def build(cls, temperature: list[float], top_k: list[int], top_p: list[float],
              min_p: list[float], seed: list[int], position: list[int],
              device: torch.device | str) -> "SamplingBatch":
        # The flags from each list's distinct values (a set is one pass in C; a step's rows
        # mostly share a few SamplingParams); the per-row tuples built only where some row is
        # greedy (greedy) or filtered (truncated), else all False.
        temperatures = set(temperature)
        any_greedy = 0 in temperatures
        filtered = (any(k > 0 for k in set(top_k)) or any(p < 1 for p in set(top_p))
                    or any(m > 0 for m in set(min_p)))
        rows = len(temperature)
        return cls(
            temperature=host_tensor(temperature, torch.float32, device),
            top_k=host_tensor(top_k, torch.int32, device),
            top_p=host_tensor(top_p, torch.float32, device),
            min_p=host_tensor(min_p, torch.float32, device),
            seed=host_tensor(seed, torch.int32, device),
            position=host_tensor(position, torch.int32, device),
            all_greedy=temperatures <= {0},
            any_greedy=any_greedy,
            needs_filter=filtered,
            unit_temperature=temperatures <= {0, 1},
            greedy=tuple(t == 0 for t in temperature) if any_greedy else (False,) * rows,
            truncated=tuple(t != 0 and (k > 0 or p < 1 or m > 0)
                            for t, k, p, m in zip(temperature, top_k, top_p, min_p))
            if filtered else (False,) * rows,
        )

    def rows(self, r: slice) -> "SamplingBatch":
        """The batch of rows `r` (built again from their values: the same flags as `build`
        gives them)."""
        return SamplingBatch.build(*(t[r].tolist() for t in (
            self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.position)),
            device=self.temperature.device)

    @classmethod
    def for_sequences(cls, rows: list, device: torch.device | str) -> "SamplingBatch":
        """One row per (sequence, offset): the sequence's parameters and seed, sampling the
        token at position num_tokens + offset (offsets > 0 are verified draft positions)."""
        params = [seq.params for seq, _ in rows]
        return cls.build(temperature=[p.temperature for p in params],
                         top_k=[p.top_k for p in params], top_p=[p.top_p for p in params],
                         min_p=[p.min_p for p in params], seed=[seq.seed for seq, _ in rows],
                         position=[seq.num_tokens + j for seq, j in rows], device=device)


def policy_logprobs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """log_softmax(logits / T) with T = 1 on greedy rows: what the caller reports."""
    logits = logits.float()
    if batch.unit_temperature:  # x / 1 == x exactly: skip a pass over [B, V]
        return log_softmax(logits)
    temperature = torch.where(batch.temperature == 0, 1.0, batch.temperature)
    return log_softmax(logits / temperature[:, None])


def filtered(logp: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The candidates: `logp` with top-k/p/min-p exclusions at -inf (what is sampled). On the
    CPU greedy rows are not filtered (their candidates row is logp): `pick` and the acceptance
    rules use the argmax of the logits there, never the candidates."""
    if not batch.needs_filter:
        return logp
    if logp.device.type != "cpu":  # the sort is cheap there; every row, as it always was
        return filter_by_sort(logp, batch.top_k, batch.top_p, batch.min_p)
    if batch.all_greedy:
        return logp
    top_k, top_p, min_p = batch.top_k, batch.top_p, batch.min_p
    if batch.any_greedy:
        sampled = batch.temperature != 0
        top_k = torch.where(sampled, top_k, 0)
        top_p = torch.where(sampled, top_p, 1.0)
        min_p = torch.where(sampled, min_p, 0.0)
    return filter_by_threshold(logp, top_k, top_p, min_p, normalized=True, copy=False)


def target_logprobs(logits: torch.Tensor,
                    batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, candidates): `policy_logprobs` and their `filtered` candidates."""
    logp = policy_logprobs(logits, batch)
    return logp, filtered(logp, batch)


def gumbel_argmax_torch(candidates: torch.Tensor, batch: SamplingBatch,
                        stream: int) -> torch.Tensor:
    """argmax(candidates + gumbel_noise) per row, in torch ops."""
    vocab = candidates.shape[-1]
    if candidates.device.type != "cpu":
        noise = gumbel_noise(batch.seed, batch.position, vocab, stream)
        return (candidates + noise).argmax(dim=-1)
    # The noise takes some twenty elementwise passes over [B, V]: drawn for all rows at once,
    # each pass streams tens of MB through memory at batch 128; in blocks of rows whose
    # temporaries fit in the cache it runs about 2x faster. Each row's noise and argmax depend
    # on that row alone: the same tokens.
    tokens = torch.empty(candidates.shape[0], dtype=torch.long)
    block = max(1, _BLOCK_ELEMENTS // vocab)
    for i in range(0, candidates.shape[0], block):
        rows = slice(i, i + block)
        noise = gumbel_noise(batch.seed[rows], batch.position[rows], vocab, stream)
        torch.argmax(noise.add_(candidates[rows]), dim=-1, out=tokens[rows])
    return tokens


def gumbel_argmax_cpu(candidates: torch.Tensor, batch: SamplingBatch,
                      stream: int) -> torch.Tensor:
    """The C kernel's tokens are the torch path's bit for bit (kernels/cpu/gumbel.py)."""
    if candidates.stride(-1) != 1:
        return gumbel_argmax_torch(candidates, batch, stream)
    keys = row_keys(batch.seed, batch.position, stream)
    return native_gumbel.gumbel_argmax(candidates, keys)


GUMBEL_ARGMAX = Op("gumbel_argmax", torch=(gumbel_argmax_torch, always),
                   cpu=(gumbel_argmax_cpu, native_gumbel.supported))


def pick(logits: torch.Tensor, candidates: torch.Tensor, batch: SamplingBatch,
         stream: int = TOKEN_STREAM, gumbel_argmax=gumbel_argmax_torch) -> torch.Tensor:
    """Gumbel-max over `candidates` with the counter noise of `stream`; the argmax of the raw
    logits on greedy rows (no noise is drawn when every row is greedy)."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    tokens = gumbel_argmax(candidates, batch, stream)
    if batch.any_greedy:
        tokens = torch.where(batch.temperature == 0, logits.argmax(dim=-1), tokens)
    return tokens


def draw(logits: torch.Tensor, batch: SamplingBatch, gumbel_argmax=gumbel_argmax_torch
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens int64 [B], logprobs float32 [B], candidates [B, V]): the tokens, their
    log_softmax(logits / T) before any top-k/p/min-p filtering (T = 1 for greedy rows: the
    quantity a GRPO/PPO trainer recomputes), and the filtered log-probabilities they were
    drawn from."""
    logp, candidates = target_logprobs(logits, batch)
    tokens = pick(logits, candidates, batch, TOKEN_STREAM, gumbel_argmax)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), candidates


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: (tokens, logprobs) of `draw`."""
    return draw(logits, batch)[:2]


def draw_cpu(logits: torch.Tensor, batch: SamplingBatch):
    return draw(logits, batch, gumbel_argmax_cpu)


def draw_triton(logits: torch.Tensor, batch: SamplingBatch):
    """The fused Triton sampler: the same tokens as `draw` but within rounding of a top-p or
    min-p boundary (its kept set comes from float32 sums of its own); it keeps no candidates."""
    from rollout_kernels.triton import sample as kernel_sample

    tokens, logprobs = kernel_sample(logits, batch.temperature, batch.top_k, batch.top_p,
                                     batch.min_p, batch.seed, batch.position)
    return tokens, logprobs, None


DRAW = Op("draw", torch=(draw, always), cpu=(draw_cpu, native_gumbel.supported),
          triton=(draw_triton, on_cuda))


@dataclass(slots=True)
class Emitted:
    """What one sampled item emits in a step (one token; with speculation the accepted drafts
    and one more), on the host. Read only once built: the sampler fills it with tuples, which
    the garbage collector stops tracking (a step builds one per sequence; lists would stay
    tracked, and every one alive at a collection brings the next full one nearer)."""

    tokens: Sequence[int]
    logprobs: Sequence[float]  # log_softmax(logits / T) at each token: the untruncated policy
    sampling_logprobs: Sequence[float]  # under the truncated distribution it was drawn from
    supports: Sequence  # kept ids (int32 tensors), None: the whole vocabulary (or not asked for)
    # SamplingParams.top_logprobs: per token, (ids, logprobs) of the k most likely under the
    # untruncated policy (rollout/sample/top.py)
    tops: Sequence = ()


class Sampler:
    """`draw` and `pick` with the backend's implementations bound (rollout/ops/backend.py).
    Logits are sampled in float32 whatever the model's dtype."""

    def __init__(self, backend) -> None:
        self._draw = backend.bind(DRAW)
        self._fused = backend.choose(DRAW.implementations, torch.float32) == "triton"
        self._gumbel_argmax = backend.bind(GUMBEL_ARGMAX)
        # On the CPU a batch without filters is drawn a block of rows at a time
        # (_BLOCK_ELEMENTS): over the whole batch each pass of log_softmax streams [B, V]
        # through memory, into new tensors that page-fault on first touch; a block's
        # temporaries stay in the cache, and the heap hands the same blocks back each time.
        # Filtered batches are not: the filters' fixed cost per call outweighed it
        # (bench/sampling.py --draw; docs/benchmarks.md). Every row is drawn from its own
        # logits alone: the same bits either way. (One fused kernel does it all on CUDA.)
        self._block_rows = backend.device.type == "cpu"

    def draw(self, logits: torch.Tensor, batch: SamplingBatch,
             want_support: tuple[bool, ...] | None = None,
             want_logprobs: tuple[bool, ...] | None = None) -> list[Emitted]:
        """One token per row with its logprob and sampling logprob (rows in `want_logprobs`,
        default all), and the support of the rows in `want_support` (support.py)."""
        rows, vocab = logits.shape
        in_blocks = self._block_rows and not batch.needs_filter
        block = max(2, _BLOCK_ELEMENTS // vocab) if in_blocks else rows
        if rows <= block:
            return self._draw_rows(logits, batch, want_support, want_logprobs)
        emitted = []
        for i in range(0, rows, block):
            r = slice(i, i + block)
            emitted += self._draw_rows(logits[r], batch.rows(r), want_support and want_support[r],
                                       want_logprobs and want_logprobs[r])
        return emitted

    def _draw_rows(self, logits: torch.Tensor, batch: SamplingBatch,
                   want_support: tuple[bool, ...] | None,
                   want_logprobs: tuple[bool, ...] | None) -> list[Emitted]:
        want_support = want_support or (False,) * len(batch.greedy)
        reported = [cut and (want_logprobs is None or want_logprobs[r] or want_support[r])
                    for r, cut in enumerate(batch.truncated)]
        if self._fused and (want_logprobs is None or any(want_logprobs) or any(reported)):
            tokens, logprobs, candidates = self._draw_fused(logits, batch, reported)
        else:
            tokens, logprobs, candidates = self._draw(logits, batch)
        token_list, lp_list = tokens.tolist(), logprobs.tolist()
        sampling, supports = sampled_at(candidates, list(range(len(token_list))), token_list,
                                        lp_list, batch.greedy, batch.truncated, want_support,
                                        want_logprobs)
        return [Emitted((t,), (lp,), (s,), (sup,))
                for t, lp, s, sup in zip(token_list, lp_list, sampling, supports)]

    def _draw_fused(self, logits: torch.Tensor, batch: SamplingBatch, reported: list[bool]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The fused kernel's draw where something is reported of it: the kernel keeps no
        candidates, decides its own kept set and sums its own log-sum, each in float32 in
        another order than the definitions the report is read from. So:
        - a row that reports its truncated distribution (`reported`: sampling logprob,
          support, read from `filter_by_sort`'s candidates) is drawn from those candidates
          (`pick`: the same noise, the kernel's token away from rounding): within rounding of
          a top-p or min-p boundary the kernel kept a token the definition drops, which came
          back outside its own support with a sampling logprob of -inf;
        - logprobs are log_softmax.py's at the token (`policy_logprobs`), as Engine.score and
          the top-k alternatives compute them: the kernel's were an ulp apart at some tokens,
          so a batch-invariant engine's score did not give back the rollout's bits.
        Other rows keep the kernel's token, so that none depends on what its neighbours ask."""
        logp = policy_logprobs(logits, batch)
        candidates = filtered(logp, batch) if any(reported) else None
        if candidates is not None and all(reported):
            tokens = pick(logits, candidates, batch, TOKEN_STREAM, self._gumbel_argmax)
        else:
            tokens = self._draw(logits, batch)[0]
            if candidates is not None:
                mine = torch.tensor(reported, device=tokens.device)
                picked = pick(logits, candidates, batch, TOKEN_STREAM, self._gumbel_argmax)
                tokens = torch.where(mine, picked, tokens)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), candidates

    def pick(self, logits: torch.Tensor, candidates: torch.Tensor, batch: SamplingBatch,
             stream: int = TOKEN_STREAM) -> torch.Tensor:
        return pick(logits, candidates, batch, stream, self._gumbel_argmax)
