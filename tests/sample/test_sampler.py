"""The sampler: counter-based noise, the exact sampled distribution under each filter, the
logprobs it reports, and per-sample reproducibility through the whole engine.

Distribution tests draw one token from each of many rows that share logits and differ in
(seed, position); the seeds are fixed, so a test either always passes or always fails.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from filter_reference import reference
from floors import assert_as_exact_as
from models import tiny_model
from scipy import stats

from rollout import Engine, EngineConfig, SamplingParams
from rollout.sample.filters import (
    _row_maxima,
    _sorted_values,
    _top_values,
    filter_by_sort,
    filter_by_threshold,
)
from rollout.sample.log_softmax import log_softmax
from rollout.sample.noise import (
    bits_to_uniform,
    gumbel_noise,
    mix32,
    mix32_int,
    row_keys,
    sample_seed,
    to_int32,
    uniform_noise,
)
from rollout.sample.sampler import SamplingBatch, pick, sample, target_logprobs
from rollout.spec.verify import verify

P_MIN = 1e-3


def lowbias32(x: int) -> int:
    """Chris Wellons' lowbias32, written out independently of the module under test."""
    x &= 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def random_int32(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    edges = [0, 1, -1, 2**31 - 1, -2**31, 0x7FEB352D, -2073254261]
    return edges + rng.integers(-2**31, 2**31, n).tolist()


def batch(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0,
          seeds=None, positions=None) -> SamplingBatch:
    rng = np.random.default_rng(seed)
    if seeds is None:
        seeds = rng.integers(-2**31, 2**31, rows).tolist()
    if positions is None:
        positions = rng.integers(0, 1 << 20, rows).tolist()

    def per_row(v):
        return list(v) if isinstance(v, (list, tuple)) else [v] * rows

    return SamplingBatch.build(per_row(temperature), per_row(top_k), per_row(top_p),
                               per_row(min_p), seeds, positions, "cpu")


# --- noise --------------------------------------------------------------------------------
def test_mix32_equals_mix32_int_on_every_bit_pattern_kind():
    values = random_int32(5000, seed=1)
    got = mix32(torch.tensor(values, dtype=torch.int32)).tolist()
    for v, g in zip(values, got):
        assert g & 0xFFFFFFFF == mix32_int(v) == lowbias32(v), v
        assert -2**31 <= g < 2**31


def test_row_keys_and_token_bits_follow_the_documented_hash():
    """Pinned: changing the hash silently changes every seeded rollout (and the Triton sampler
    must reproduce it bit for bit)."""
    seeds, positions = random_int32(200, seed=2), random_int32(200, seed=3)
    positions = [p & 0x7FFFFFFF for p in positions]
    keys = row_keys(torch.tensor(seeds, dtype=torch.int32),
                    torch.tensor(positions, dtype=torch.int32)).tolist()
    for s, p, k in zip(seeds, positions, keys):
        assert k & 0xFFFFFFFF == lowbias32((s & 0xFFFFFFFF) ^ lowbias32(p))
    u = uniform_noise(torch.tensor(seeds[:20], dtype=torch.int32),
                      torch.tensor(positions[:20], dtype=torch.int32), 7)
    for row, k in enumerate(keys[:20]):
        for t in range(7):
            bits = to_int32(lowbias32((k & 0xFFFFFFFF) ^ lowbias32(t)))
            assert u[row, t].item() == bits_to_uniform(torch.tensor([bits])).item()


def unmix32(x: int) -> int:
    """lowbias32's inverse: each xor-shift undone, each multiply by its inverse mod 2^32."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * pow(0x846CA68B, -1, 1 << 32)) & 0xFFFFFFFF
    x ^= (x >> 15) ^ (x >> 30)
    x = (x * pow(0x7FEB352D, -1, 1 << 32)) & 0xFFFFFFFF
    return x ^ (x >> 16)


@pytest.mark.parametrize("d", [1, 5, 255, 4095])
def test_rows_whose_keys_differ_in_low_bits_draw_unrelated_noise(d):
    """Two rows whose keys differ by d < V (about V / 2^32 of all row pairs: among n = 64
    samples of one prompt over a 49K vocabulary, some 3 % of the groups had such a pair) once
    drew the same noise permuted, row b's at token t being row a's at t ^ d, and so coupled
    tokens. Seeds are solved for keys that differ by d; the noise must share no more values
    than independent draws of 2^23 levels would."""
    assert all(unmix32(lowbias32(x)) == x & 0xFFFFFFFF for x in random_int32(50, seed=9))
    vocab, position = 4096, 77
    seed_a = 123456789
    key_a = lowbias32(seed_a ^ lowbias32(position))
    seed_b = to_int32(unmix32(key_a ^ d) ^ lowbias32(position))
    seeds = torch.tensor([to_int32(seed_a), seed_b], dtype=torch.int32)
    keys = row_keys(seeds, torch.tensor([position] * 2, dtype=torch.int32)).tolist()
    assert (keys[0] ^ keys[1]) & 0xFFFFFFFF == d
    u = uniform_noise(seeds, torch.tensor([position] * 2, dtype=torch.int32), vocab)
    permuted = u[0, torch.arange(vocab) ^ d]
    # independent: each token's pair equal with probability 2^-23 (0.0005 expected here)
    assert int((u[1] == permuted).sum()) <= 1
    assert int((u[1] == u[0]).sum()) <= 1


def test_uniform_noise_is_in_the_open_unit_interval_and_uniform():
    b = batch(4000, seed=4)
    u = uniform_noise(b.seed, b.position, 64)
    assert bool(((u > 0) & (u < 1)).all())
    assert stats.kstest(u.flatten().double().numpy(), "uniform").pvalue > P_MIN
    # Neighbouring tokens of a row and neighbouring rows must not be correlated.
    assert abs(np.corrcoef(u[:, :-1].flatten(), u[:, 1:].flatten())[0, 1]) < 0.01
    assert abs(np.corrcoef(u[:-1].flatten(), u[1:].flatten())[0, 1]) < 0.01


def test_bits_to_uniform_stays_below_one_for_every_24_bit_pattern():
    """Every hash must give a finite Gumbel: u == 1 makes the noise +inf, and that token wins
    whatever its logit (even a filtered one: -inf + inf is nan, and argmax takes nan)."""
    top24 = torch.arange(1 << 24, dtype=torch.int64).to(torch.int32) << 8
    u = bits_to_uniform(top24 | 0xAB)
    assert float(u.min()) > 0
    bad = (u >= 1).nonzero().flatten()
    assert bad.numel() == 0, \
        f"bits_to_uniform gives {u.max().item()} for top-24-bit pattern(s) {bad[:4].tolist()}"
    gumbel = -torch.log(-torch.log(u))
    assert bool(torch.isfinite(gumbel).all())


def test_saturated_noise_does_not_override_filters_or_logits():
    """(seed, position) = (-2123720700, 0) hashes token 1 to the top 24-bit pattern. Top-k=1
    must still give the argmax, and a token e^-50 less likely than another must not win."""
    seed, position = -2123720700, 0
    g = gumbel_noise(torch.tensor([seed], dtype=torch.int32),
                     torch.tensor([position], dtype=torch.int32), 3)
    assert bool(torch.isfinite(g).all()), f"Gumbel noise {g.tolist()} is not finite"
    logits = torch.tensor([[5.0, 0.0, 1.0]])
    tokens, _ = sample(logits, batch(1, top_k=1, seeds=[seed], positions=[position]))
    assert tokens.tolist() == [0], "top_k=1 did not return the argmax"
    tokens, _ = sample(torch.tensor([[50.0, 0.0, 1.0]]),
                       batch(1, seeds=[seed], positions=[position]))
    assert tokens.tolist() == [0]


def test_noise_row_depends_only_on_its_seed_and_position():
    b = batch(64, seed=5)
    full = uniform_noise(b.seed, b.position, 40)
    for i in (0, 17, 63):
        alone = uniform_noise(b.seed[i:i + 1], b.position[i:i + 1], 40)
        assert torch.equal(alone[0], full[i])
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(uniform_noise(b.seed[perm], b.position[perm], 40), full[perm])
    # A bigger vocabulary only appends columns.
    assert torch.equal(uniform_noise(b.seed, b.position, 100)[:, :40], full)


def test_noise_differs_across_seeds_and_positions():
    seed = torch.full((100,), 7, dtype=torch.int32)
    pos = torch.arange(100, dtype=torch.int32)
    by_position = uniform_noise(seed, pos, 32)
    by_seed = uniform_noise(torch.arange(100, dtype=torch.int32), torch.zeros_like(pos), 32)
    for u in (by_position, by_seed):
        # Distinct rows share no more than a chance number of equal values (24-bit grid).
        same = (u[:, None, :] == u[None, :, :]).sum(-1)
        same.fill_diagonal_(0)
        assert int(same.max()) <= 1
    assert not torch.equal(uniform_noise(seed[:1], pos[:1], 32),
                           uniform_noise(seed[:1] ^ (1 << 31), pos[:1], 32))


def test_sample_seeds_are_distinct_per_sample_and_use_all_64_bits():
    seeds = [sample_seed(123, j) for j in range(2000)]
    assert len(set(seeds)) == len(seeds)
    assert all(-2**31 <= s < 2**31 for s in seeds)
    assert sample_seed(5, 0) != sample_seed(5 + (1 << 32), 0)
    assert sample_seed(5, 0) == sample_seed(5, 0)


# --- the sampled distribution -------------------------------------------------------------
def boundary_margin(logits, temperature, top_k, top_p, min_p) -> float:
    """How far the top-p and min-p decisions are from a tie; the test needs them clear."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    margins = [abs(p / p.max() - min_p).min()] if min_p > 0 else [1.0]
    if top_p < 1:
        s = np.sort(p)[::-1][:top_k if top_k > 0 else len(p)]
        s /= s.sum()
        margins.append(abs(np.cumsum(s) - s - top_p).min())
    return float(min(margins))


def chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value, with categories of expected count < 5 merged into one."""
    expected = expected_probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(exp) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
LOGITS = np.array([2.1, 1.7, 1.5, 0.9, 0.6, 0.2, -0.1, -0.5, -0.9, -1.4, -2.0, -3.1])
ROWS = 20000
CASES = {
    "T0.7": {"temperature": 0.7},
    "T1.5": {"temperature": 1.5},
    "top_k": {"temperature": 1.0, "top_k": 4},
    "top_p": {"temperature": 1.0, "top_p": 0.8},
    "min_p": {"temperature": 1.0, "min_p": 0.13},
    # Top-p over the renormalised top-5 keeps 3 tokens; over the full distribution it
    # would keep 4.
    "k_then_p": {"temperature": 1.0, "top_k": 5, "top_p": 0.75},
    "all": {"temperature": 0.8, "top_k": 9, "top_p": 0.9, "min_p": 0.06},
    "tight_p_hot": {"temperature": 2.0, "top_k": 10, "top_p": 0.35, "min_p": 0.0},
}


@pytest.mark.parametrize("name", list(CASES))
def test_sample_matches_the_exact_filtered_distribution(name):
    params = OFF | CASES[name]
    want = reference(LOGITS, **params)[1]
    assert boundary_margin(LOGITS, params["temperature"], params["top_k"], params["top_p"],
                           params["min_p"]) > 1e-3
    if name not in ("T0.7", "T1.5"):
        assert 1 < (want > 0).sum() < len(LOGITS), "the filter should cut, but not everything"
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(ROWS, -1)
    tokens, _ = sample(logits, batch(ROWS, seed=list(CASES).index(name), **params))
    counts = np.bincount(tokens.numpy(), minlength=len(LOGITS))
    outside = counts[want == 0].sum()
    assert outside == 0, f"{outside} samples of filtered-out tokens {np.flatnonzero(want == 0)}"
    p = chi_square(counts[want > 0], want[want > 0])
    assert p > P_MIN, (name, counts.tolist(), (want * ROWS).round(1).tolist(), p)


def test_each_row_uses_its_own_parameters():
    """Three parameter sets interleaved in one batch; each row set has its own distribution."""
    sets = [CASES["top_k"], CASES["T1.5"], CASES["all"]]
    rows = 3 * 8000
    cols = {key: [(OFF | sets[i % 3])[key] for i in range(rows)]
            for key in ("temperature", "top_k", "top_p", "min_p")}
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(rows, -1)
    tokens, _ = sample(logits, batch(rows, seed=11, **cols))
    for j, params in enumerate(sets):
        want = reference(LOGITS, **(OFF | params))[1]
        counts = np.bincount(tokens[j::3].numpy(), minlength=len(LOGITS))
        assert counts[want == 0].sum() == 0
        assert chi_square(counts[want > 0], want[want > 0]) > P_MIN, (params, counts.tolist())


def test_a_row_without_filters_is_unchanged_when_another_row_filters():
    """top_p = 1 means off. Applying the cumsum test anyway drops tail tokens whose rounded
    mass-before reaches 1.0, so such a row would sample differently depending on whether a
    filtering request shares its batch."""
    logits = torch.tensor([[0.0] + [-17.5] * 15, [0.0] + [-17.5] * 15])
    logp = logits.log_softmax(-1)
    out = filter_by_threshold(logp, torch.tensor([0, 3], dtype=torch.int32),
                          torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    assert torch.equal(out[0], logp[0]), \
        f"filters off, yet tokens {torch.isinf(out[0]).nonzero().flatten().tolist()} were masked"


# --- tokens and logprobs ------------------------------------------------------------------
def test_all_greedy_rows_give_argmax_and_its_log_softmax():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    tokens, logprobs = sample(logits, batch(64, temperature=0.0))
    assert torch.equal(tokens, logits.argmax(-1))
    want = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    exact = logits.double().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    assert_as_exact_as(logprobs, exact, want, "logprob")


def test_mixed_batch_logprobs_are_unfiltered_log_softmax_at_the_token():
    rows = 200
    logits = torch.randn(rows, 50, generator=torch.Generator().manual_seed(1)) * 3
    temperature = [0.0 if i % 4 == 0 else (0.6, 1.3, 2.0)[i % 3] for i in range(rows)]
    top_k = [0 if i % 2 else 3 for i in range(rows)]
    top_p = [0.7 if i % 5 == 1 else 1.0 for i in range(rows)]
    tokens, logprobs = sample(logits, batch(rows, temperature=temperature, top_k=top_k,
                                            top_p=top_p, seed=2))
    t = torch.tensor([1.0 if x == 0 else x for x in temperature])
    greedy = torch.tensor([x == 0 for x in temperature])
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    want = (logits / t[:, None]).log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    exact = (logits.double() / t[:, None]).log_softmax(-1).gather(-1, tokens[:, None])
    assert_as_exact_as(logprobs, exact.squeeze(-1), want, "logprob")
    # Top-3 rows only ever sample their top 3.
    ranks = (logits > logits.gather(-1, tokens[:, None])).sum(-1)
    k3 = torch.tensor([k == 3 for k in top_k])
    assert int(ranks[k3].max()) < 3



def test_noise_drawn_in_blocks_of_rows_picks_the_tokens_of_the_whole_batch(monkeypatch):
    """On the CPU the torch `pick` (the reference; the C sampler is the cpu backend's) draws
    the noise a block of rows at a time (sampler.py): the tokens are those of the definition,
    argmax(candidates + noise of the whole batch), across block edges, with greedy rows and
    -inf candidates."""
    rows, vocab = 23, 50
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 3
    temperature = [0.0 if i % 6 == 2 else 1.0 for i in range(rows)]
    b = batch(rows, temperature=temperature, top_k=[5 if i % 2 else 0 for i in range(rows)],
              seed=4)
    _, candidates = target_logprobs(logits, b)
    noise = gumbel_noise(b.seed, b.position, vocab, stream=2)
    want = torch.where(b.temperature == 0, logits.argmax(-1), (candidates + noise).argmax(-1))
    for block_rows in (1, 4, rows, 2 * rows):
        monkeypatch.setattr("rollout.sample.sampler._BLOCK_ELEMENTS", block_rows * vocab)
        assert torch.equal(pick(logits, candidates, b, stream=2), want), block_rows


def test_unit_temperatures_skip_the_division_bit_for_bit():
    """Rows at temperature 0 or 1 skip dividing the logits by 1: the same log-probabilities,
    non-finite logits included."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(5)) * 3
    logits[0, 3], logits[1, 4], logits[2] = float("inf"), float("nan"), float("-inf")
    b = batch(6, temperature=[1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    assert b.unit_temperature and not batch(6, temperature=0.7).unit_temperature
    logp, _ = target_logprobs(logits, b)
    want = log_softmax(logits / torch.ones(6)[:, None])
    assert torch.equal(logp.nan_to_num(), want.nan_to_num())
    assert torch.equal(logp.isnan(), want.isnan())

# --- the filter against the full sort it replaced -----------------------------------------
# filter_by_sort, the path off the CPU, is the definition: a sort of every row with indices. The
# CPU filter must reproduce it bit for bit; the statistical tests above hold the CPU path to
# the exact distribution.
def full_sort_target_logprobs(logits, batch):
    """target_logprobs as it was: every row (greedy ones too) through the full sort."""
    logits = logits.float()
    temperature = torch.where(batch.temperature == 0, 1.0, batch.temperature)
    logp = log_softmax(logits / temperature[:, None])
    if batch.needs_filter:
        return logp, filter_by_sort(logp, batch.top_k, batch.top_p, batch.min_p)
    return logp, logp


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def mixed_logits(rows: int, vocab: int, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    if kind == "normal":  # ~4% of the vocabulary covers top_p = 0.9
        return x * 3
    if kind == "flat":  # a random-weight head: top_p keeps most of the vocabulary
        return x * 0.3
    if kind == "peaked":  # three leading tokens, top-1 probability from ~0.05 to ~1
        lead = torch.rand(rows, 3, generator=g) * torch.tensor([10.0, -3.0, -3.0])
        lead[:, 0] += np.log(vocab) + 1.5  # the bulk sums to ~ vocab * e^4.5
        hot = torch.stack([torch.randperm(vocab, generator=g)[:3] for _ in range(rows)])
        return (x * 3).scatter_add_(1, hot, lead.cumsum(dim=1))
    if kind == "bf16":  # bf16 logits: ties everywhere
        return (x * 4).to(torch.bfloat16).float()
    if kind == "integers":  # a handful of distinct values: ties at every boundary
        return torch.randint(0, 6, (rows, vocab), generator=g).float()
    if kind == "masked":  # -inf logits (half of them, and rows with a single finite one)
        x = (x * 4).masked_fill(torch.rand(rows, vocab, generator=g) < 0.5, float("-inf"))
        x[::7] = float("-inf")
        x[::7, 3] = 1.0
        return x
    raise ValueError(kind)


KINDS = ("normal", "flat", "peaked", "bf16", "integers", "masked")


def mixed_params(rows: int, vocab: int, seed: int, with_greedy: bool = True) -> dict:
    rng = np.random.default_rng(seed)
    temperature = rng.choice([0.0, 0.6, 1.0, 1.7] if with_greedy else [0.6, 1.0, 1.7], rows)
    return {"temperature": temperature.tolist(),
            "top_k": rng.choice([0, 1, 5, 50, vocab, vocab - 1, 3000], rows).tolist(),
            "top_p": rng.choice([1.0, 0.999, 0.9, 0.5, 1e-3], rows).tolist(),
            "min_p": rng.choice([0.0, 0.05, 0.5], rows).tolist()}


def check_filter(logp, top_k, top_p, min_p, stats=None, normalized=True):
    """normalized: logp is a log_softmax (as in target_logprobs), which lets top-p rows be
    settled from candidates."""
    want = filter_by_sort(logp, top_k, top_p, min_p)
    got = filter_by_threshold(logp, top_k, top_p, min_p, normalized, stats=stats)
    bad = [i for i in range(len(logp)) if not same_bits(got[i], want[i])]
    assert not bad, (f"rows {bad[:8]} differ: top_k {top_k[bad[:8]].tolist()} top_p "
                     f"{top_p[bad[:8]].tolist()} min_p {min_p[bad[:8]].tolist()}, kept "
                     f"{[int(torch.isfinite(got[i]).sum()) for i in bad[:8]]} instead of "
                     f"{[int(torch.isfinite(want[i]).sum()) for i in bad[:8]]}")
    assert same_bits(filter_by_threshold(logp, top_k, top_p, min_p), want)


@pytest.mark.parametrize("vocab", [12, 1001, 8195])
def test_filter_equals_the_full_sort_on_mixed_rows(vocab):
    """Every filter combination over every logits kind: the same kept tokens and values, and
    through `sample`, the same tokens and logprobs bit for bit."""
    stats: dict[str, int] = {}
    rows = 84
    for j, kind in enumerate(KINDS):
        logits = mixed_logits(rows, vocab, kind, seed=vocab + j)
        params = mixed_params(rows, vocab, seed=vocab + j)
        b = batch(rows, seed=j, **params)
        t = torch.where(b.temperature == 0, 1.0, b.temperature)
        logp = (logits / t[:, None]).log_softmax(dim=-1)
        check_filter(logp, b.top_k, b.top_p, b.min_p, stats)
        want_logp, want_cand = full_sort_target_logprobs(logits, b)
        got_logp, got_cand = target_logprobs(logits, b)
        sampled = b.temperature != 0
        assert same_bits(got_logp, want_logp)
        assert same_bits(got_cand[sampled], want_cand[sampled])
        assert same_bits(got_cand[~sampled], got_logp[~sampled])  # greedy rows: unfiltered
        want_tokens = pick(logits, want_cand, b)
        tokens, logprobs = sample(logits, b)
        assert torch.equal(tokens, want_tokens), kind
        assert same_bits(logprobs, want_logp.gather(-1, want_tokens[:, None]).squeeze(-1))
    if vocab > 1000:  # every way of settling a row was taken
        for path in ("top_k", "top_k_softmax", "candidates", "sorted"):
            assert stats.get(path, 0) > 0, (path, stats)
        assert stats.get("reference") == 0, stats  # ties are settled by thresholds too


def test_filter_equals_the_full_sort_at_the_vocabulary_of_smollm2():
    """49,152 tokens, the bench's shapes: top-p decided from candidates (peaked rows), by the
    sorted values (normal, flat), top-k alone, with top-p, and min-p."""
    vocab, stats = 49152, {}
    for j, kind in enumerate(("peaked", "normal", "flat")):
        logp = mixed_logits(16, vocab, kind, seed=j).log_softmax(dim=-1)
        top_p = torch.tensor([0.9, 0.999, 0.5, 1.0] * 4)
        top_k = torch.tensor([0] * 8 + [50, 0, 2000, 5] + [0] * 4, dtype=torch.int32)
        min_p = torch.tensor([0.0] * 12 + [0.05, 0.0, 0.05, 0.5])
        check_filter(logp, top_k, top_p, min_p, stats)
    for path in ("top_k", "candidates", "sorted"):
        assert stats.get(path, 0) > 0, (path, stats)


def test_filter_at_top_p_equal_to_a_reference_mass():
    """top_p set to the exact float32 mass-before the reference computes at some position, and
    one ulp either side: the decision flips on the last bit, which the candidate bounds must
    leave to the exact path."""
    vocab, rows = 3000, 8
    stats: dict[str, int] = {}
    for kind in ("peaked", "normal", "flat"):
        logp = mixed_logits(rows, vocab, kind, seed=7).log_softmax(dim=-1)
        sorted_logp = logp.sort(dim=-1, descending=True).values
        for top_k in (0, 40):
            masked = sorted_logp.clone()
            if top_k:
                masked[:, top_k:] = float("-inf")
            probs = masked.softmax(dim=-1)
            mass = probs.cumsum(dim=-1) - probs
            for position in (1, 2, 5, 17, 33):
                at = mass[:, position]
                for p in (at, torch.nextafter(at, torch.ones(())),
                          torch.nextafter(at, torch.zeros(()))):
                    p = p.clamp(min=1e-6, max=0.9999)
                    check_filter(logp, torch.full((rows,), top_k, dtype=torch.int32), p,
                                 torch.zeros(rows), stats)
    # The bounds on the candidates / top-k values cannot settle a tie with top_p: exact paths.
    assert stats.get("top_k_softmax", 0) > 0 and stats.get("sorted", 0) > 0, stats


def test_filter_keeps_every_token_tied_at_the_boundary():
    """Tied values straddling the top-k / top-p boundary are all kept (or all dropped): the
    kept set the token-by-token definition gives, on both paths, without the full sort."""
    logp = torch.tensor([[0.0, -1.0, -1.0, -1.0, -2.0, -3.0] * 50] * 7).log_softmax(dim=-1)
    top_k = torch.tensor([2, 60, 0, 0, 150, 0, 51], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.05, 0.3, 0.9, 0.999, 0.5])
    min_p = torch.tensor([0.0] * 6 + [0.3])
    stats: dict[str, int] = {}
    check_filter(logp, top_k, top_p, min_p, stats)
    got = filter_by_threshold(logp, top_k, top_p, min_p)
    kept = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in got]
    for i in range(7):
        want, _ = reference(logp[i], 1.0, int(top_k[i]), float(top_p[i]), float(min_p[i]))
        assert kept[i] == want
    assert [len(s) // 50 for s in kept] == [1, 4, 1, 1, 4, 6, 4]  # groups of 50 ties
    assert stats.get("reference") == 0, stats


def test_top_p_renormalises_over_every_tied_top_k_survivor():
    """One token far ahead, then 2,000 tied ones across the k-th rank (k small, read from the
    top values; and k > TOPK_MAX, from the sorted row): top-p's mass renormalises over all the
    tied survivors (the lead holds 0.069 of them, 0.119 of the first k = 1,100), so top_p =
    0.1 keeps the tied tokens, 0.06 does not."""
    row = torch.full((5000,), -20.0)
    row[0], row[1:2001] = 5.0, 0.0
    logp = row.repeat(6, 1).log_softmax(dim=-1)
    top_k = torch.tensor([60, 1100, 1999, 60, 1100, 1999], dtype=torch.int32)
    top_p = torch.tensor([0.1] * 3 + [0.06] * 3)
    stats: dict[str, int] = {}
    check_filter(logp, top_k, top_p, torch.zeros(6), stats)
    got = filter_by_threshold(logp, top_k, top_p, torch.zeros(6))
    assert torch.isfinite(got).sum(dim=-1).tolist() == [2001] * 3 + [1] * 3
    for i in range(6):
        kept = set(torch.isfinite(got[i]).nonzero().flatten().tolist())
        assert kept == reference(logp[i], 1.0, int(top_k[i]), float(top_p[i]), 0.0)[0]
    assert stats["top_k"] == 2 and stats["sorted"] == 4 and stats["reference"] == 0, stats


@pytest.mark.parametrize("kind", ["bf16", "integers", "normal"])
def test_filter_follows_the_tokens_whatever_their_order(kind):
    """The kept set is a function of the values: permuting a row's tokens permutes its
    filtered row, bit for bit, on the CPU filter and the definition (a kept set picked by the
    sort among tied tokens would follow their order); on the integer grid, where every
    decision is far from rounding, it is the token-by-token one."""
    vocab, rows = 3001, 40
    logp = mixed_logits(rows, vocab, kind, seed=5).log_softmax(dim=-1)
    params = mixed_params(rows, vocab, seed=6, with_greedy=False)
    top_k = torch.tensor(params["top_k"], dtype=torch.int32)
    top_p, min_p = torch.tensor(params["top_p"]), torch.tensor(params["min_p"])
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(7))
    for fn in (filter_by_threshold, filter_by_sort):
        assert same_bits(fn(logp[:, perm], top_k, top_p, min_p),
                         fn(logp, top_k, top_p, min_p)[:, perm]), fn.__name__
    if kind == "integers":  # six values: every decision far from rounding
        got = filter_by_threshold(logp, top_k, top_p, min_p)
        for i in range(rows):
            want, _ = reference(logp[i], 1.0, int(top_k[i]), float(top_p[i]), float(min_p[i]))
            assert set(torch.isfinite(got[i]).nonzero().flatten().tolist()) == want, i


def test_filter_input_that_is_not_log_probabilities():
    """filter_by_threshold accepts any float32 rows (positive values, NaN)."""
    logits = torch.randn(12, 500, generator=torch.Generator().manual_seed(3)) * 4 + 2
    logits[5, 7] = float("nan")
    top_k = torch.tensor([0, 3, 0, 600] * 3, dtype=torch.int32)
    top_p = torch.tensor([0.9, 1.0, 0.5] * 4)
    min_p = torch.tensor([0.0, 0.1] * 6)
    check_filter(logits, top_k, top_p, min_p, normalized=False)


TOP_PS = (0.01, 0.5, 0.9, 0.999, 1.0)


@pytest.mark.parametrize("rows", [1, 2, 5, 64, 127, 128, 130])
def test_top_p_equals_the_full_sort_at_any_batch_size(rows):
    """Rows of every kind (flat, normal, peaked, bf16 and integer ties, -inf masked) at each
    top_p of TOP_PS, some with top-k or min-p as well, at batch sizes 1 to 130: the kept tokens
    and values of the definition bit for bit, and the same sampled tokens. Which rows try the
    candidates, the blocks their values come from and the split of the sort over threads all
    depend on the batch."""
    vocab = 4099  # not a multiple of the block width: columns past the last block
    kinds = [mixed_logits(22, vocab, kind, seed=rows + j) for j, kind in enumerate(KINDS)]
    pick_rows = torch.randperm(22 * len(KINDS), generator=torch.Generator().manual_seed(rows))
    logits = torch.cat(kinds)[pick_rows[:rows]]
    b = batch(rows, seed=rows, top_p=[TOP_PS[i % len(TOP_PS)] for i in range(rows)],
              top_k=[50 if i % 7 == 3 else 0 for i in range(rows)],
              min_p=[0.05 if i % 11 == 4 else 0.0 for i in range(rows)])
    check_filter(logits.log_softmax(dim=-1), b.top_k, b.top_p, b.min_p)
    _, want_cand = full_sort_target_logprobs(logits, b)
    assert torch.equal(sample(logits, b)[0], pick(logits, want_cand, b))


def test_top_values_from_blocks_are_topk():
    """`_top_values` reads the k largest values from the k blocks with the largest maxima (and
    the columns past the last block): torch.topk's values bit for bit, with ties and -inf, on
    any subset of rows; `_row_maxima`'s maximum is amax's, NaN included."""
    for vocab in (12, 1001, 4099, 49152):
        logp = torch.cat([mixed_logits(4, vocab, kind, seed=vocab) for kind in KINDS])
        logp = logp.log_softmax(dim=-1)
        with_nan = logp.clone()
        with_nan[2, vocab - 1] = float("nan")  # the last column: past the last block at 4099
        m, _ = _row_maxima(with_nan)
        want = with_nan.amax(dim=-1)
        assert torch.equal(m.isnan(), want.isnan()) and same_bits(m[~m.isnan()],
                                                                  want[~want.isnan()])
        _, maxima = _row_maxima(logp)
        for rows in (torch.arange(len(logp)), torch.arange(1, len(logp), 3)):
            for k in (1, 2, 3, 50, 64, 128, 300):
                if k <= vocab:
                    assert same_bits(_top_values(logp, rows, maxima, k),
                                     logp[rows].topk(k, dim=-1).values), (vocab, k)


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_sorted_values_split_over_threads(threads, monkeypatch):
    """The values sort is split over torch's number of threads: the rows logp.sort gives
    whatever the split, with fewer rows than threads, on log-probabilities and on any floats."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    logits = mixed_logits(5, 3001, "bf16", seed=threads)
    for x, nonpositive in ((logits.log_softmax(dim=-1), True), (logits, False)):
        for rows in (torch.arange(5), torch.tensor([0, 3]), torch.tensor([4])):
            assert same_bits(_sorted_values(x, rows, nonpositive),
                             x[rows].sort(dim=-1, descending=True).values)


def test_sorted_values_in_a_forked_child(monkeypatch):
    """The sort's thread pool does not survive a fork: a child makes its own rather than
    waiting on the parent's threads."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    logp = mixed_logits(4, 3001, "normal", seed=3).log_softmax(dim=-1)
    rows = torch.arange(4)
    want = logp.sort(dim=-1, descending=True).values
    assert same_bits(_sorted_values(logp, rows, True), want)  # the parent's pool is running
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the sort returns, and right
        signal.alarm(20)
        os._exit(0 if same_bits(_sorted_values(logp, rows, True), want) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_filter_rows_do_not_depend_on_their_batch():
    logp = torch.cat([mixed_logits(6, 2000, kind, seed=4) for kind in KINDS]).log_softmax(-1)
    rows = len(logp)
    params = mixed_params(rows, 2000, seed=9)
    top_k = torch.tensor(params["top_k"], dtype=torch.int32)
    top_p, min_p = torch.tensor(params["top_p"]), torch.tensor(params["min_p"])
    whole = filter_by_threshold(logp, top_k, top_p, min_p)
    for part in (torch.arange(0, rows, 3), torch.arange(rows - 1, -1, -5), torch.tensor([17])):
        assert same_bits(filter_by_threshold(logp[part], top_k[part], top_p[part], min_p[part]),
                         whole[part])


def test_rows_without_a_sampled_filter_are_not_filtered():
    """Greedy rows and rows with every filter off: no candidate selection, logp itself."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(5))
    b = batch(6, temperature=[0.0, 0.0, 1.0, 0.7, 0.0, 1.0], top_k=[5, 0, 0, 0, 3, 0],
              top_p=[0.9, 0.5, 1.0, 1.0, 1.0, 1.0], min_p=[0.0, 0.2, 0.0, 0.0, 0.0, 0.0])
    logp, candidates = target_logprobs(logits, b)
    assert candidates is logp
    tokens, logprobs = sample(logits, b)
    want_logp, want_cand = full_sort_target_logprobs(logits, b)
    assert torch.equal(tokens, pick(logits, want_cand, b))
    assert same_bits(logprobs, want_logp.gather(-1, tokens[:, None]).squeeze(-1))


@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_verification_is_unchanged(rule, monkeypatch):
    """Speculative verification through the new filter and through the full sort: the same
    accepted drafts, corrections and logprobs."""
    vocab, rng = 700, np.random.default_rng(8)
    drafts = [rng.integers(0, vocab, int(rng.integers(0, 5))).tolist() for _ in range(24)]
    rows = sum(len(d) + 1 for d in drafts)
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(rows, vocab, generator=g) * 3
    per_request = mixed_params(len(drafts), vocab, seed=8)
    expand = {key: [v for v, d in zip(vals, drafts) for _ in range(len(d) + 1)]
              for key, vals in per_request.items()}
    b = batch(rows, seed=8, **expand)
    # Make the drafts plausible: half of them are the target's own top token.
    for i, d in enumerate(drafts):
        start = sum(len(x) + 1 for x in drafts[:i])
        for j in range(0, len(d), 2):
            d[j] = int(logits[start + j].argmax())
    probs = [None if rng.random() < 0.5 or not d else
             torch.softmax(torch.randn(len(d), vocab, generator=g) * 2, dim=-1) for d in drafts]
    got = verify(logits, b, drafts, probs, rule)
    import rollout.spec.verify as verify_module
    monkeypatch.setattr(verify_module, "target_logprobs", full_sort_target_logprobs)
    want = verify(logits, b, drafts, probs, rule)
    assert [(v.tokens, v.logprobs) for v in got] == [(v.tokens, v.logprobs) for v in want]


# --- through the engine -------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


SEEDED_PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
SEEDED = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=12)


def other_requests(seed: int, count: int):
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for _ in range(count):
        prompts.append(rng.integers(0, 128, int(rng.integers(2, 40))).tolist())
        params.append(SamplingParams(
            n=int(rng.integers(1, 4)), temperature=float(rng.uniform(0.5, 1.5)),
            top_k=int(rng.choice([0, 5, 40])), top_p=float(rng.choice([1.0, 0.9])),
            max_tokens=int(rng.integers(4, 24))))
    # Same prompt, another seed: shares the seeded request's cached prefix.
    prompts.append(list(SEEDED_PROMPT))
    params.append(SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=9))
    return prompts, params


def seeded_samples(engine, before=(), after=()):
    prompts = [p for p, _ in before] + [SEEDED_PROMPT] + [p for p, _ in after]
    params = [q for _, q in before] + [SEEDED] + [q for _, q in after]
    outs = engine.generate(prompts, params)
    out = outs[len(before)]
    assert out.prompt_token_ids == SEEDED_PROMPT
    return [s.token_ids for s in sorted(out.samples, key=lambda s: s.index)]


def test_seeded_samples_do_not_depend_on_batch_or_schedule(model):
    def engine(kv=2048, **kw):
        return Engine(model, EngineConfig(kv_cache_tokens=kv, max_model_len=128, **kw))

    alone = seeded_samples(engine())
    assert len(alone) == 4 and all(len(s) == 12 for s in alone)
    assert len({tuple(s) for s in alone}) == 4, "the n samples of one request must differ"
    others = list(zip(*other_requests(0, 6)))
    big = engine()
    assert seeded_samples(big, before=others[:4], after=others[4:]) == alone
    assert seeded_samples(big) == alone, "a warm prefix cache changed the samples"
    # Chunked prefill and a few sequences at a time: other batch compositions and positions.
    small = engine(max_num_seqs=2, max_num_batched_tokens=16)
    assert seeded_samples(small, before=others[4:], after=others[:4]) == alone
    assert seeded_samples(engine(max_num_seqs=3, max_num_batched_tokens=5), before=others) == alone
    # A pool of one max_model_len forces preemption and recomputation.
    tight = engine(kv=128, max_num_seqs=8, max_num_batched_tokens=64)
    assert seeded_samples(tight, before=others[:3], after=others[3:]) == alone
    assert tight.stats.preemptions > 0, "the tight pool was meant to preempt"


def test_seeded_samples_do_not_depend_on_engine_seed_or_prefix_caching(model):
    base = Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=128, seed=1))
    other = Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=128, seed=2,
                                       enable_prefix_caching=False))
    assert seeded_samples(base) == seeded_samples(other)


def test_engine_first_token_distribution_matches_the_model(model):
    """First tokens of many seeded samples of one prompt follow softmax of the HF logits.
    40 requests of n=50 rather than one of n=2000: the scheduler admits the siblings of one
    request one per step (see the test below), which would take 2000 steps."""
    prompt = [5, 17, 42, 8]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    want = logits.softmax(-1).numpy()
    engine = Engine(model, EngineConfig(kv_cache_tokens=4096, max_model_len=128,
                                        max_num_seqs=2048))
    outs = engine.generate([prompt] * 40, [SamplingParams(n=50, temperature=1.0, max_tokens=1,
                                                          seed=1000 + i) for i in range(40)])
    first = np.array([s.token_ids[0] for out in outs for s in out.samples])
    assert len(first) == 2000
    counts = np.bincount(first, minlength=len(want))
    assert (want * len(first) >= 5).sum() >= 20, "the test needs a spread-out distribution"
    p = chi_square(counts, want)
    assert p > P_MIN, p


def test_siblings_of_a_cached_prompt_are_admitted_together(model):
    """Once the first sample has prefilled the prompt, every sibling only computes the last
    prompt token (its own logits): none of them can gain by waiting for another."""
    engine = Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=128))
    (out,) = engine.generate([[5, 17, 42, 8, 9]], SamplingParams(n=16, max_tokens=1, seed=0))
    assert len(out.samples) == 16
    assert engine.stats.prompt_tokens_computed == 5 + 15
    assert engine.stats.steps <= 3, f"{engine.stats.steps} steps to admit 16 siblings"
