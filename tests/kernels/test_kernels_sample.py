"""The Triton sampler against `rollout.sampler.sample`: same tokens, same logprobs, same noise.

Filter tests use logits whose decisions lie far from float rounding: tie-free ones (distinct
values far apart), and ones on a coarse grid, where every boundary falls inside a group of tied
tokens (both samplers keep the whole group).
"""

import pytest
import torch
from floors import assert_as_exact_as
from kernels_env import DEVICE, ON_GPU

from rollout.sample.filters import filter_by_sort
from rollout.sample.noise import gumbel_noise, mix32, row_keys, uniform_noise
from rollout.sample.sampler import SamplingBatch
from rollout.sample.sampler import sample as sample_ref
from rollout_kernels.triton import gumbel_noise_triton, sample

pytestmark = pytest.mark.interpreter

VOCAB = 1500  # more than one BLOCK_V chunk, not a multiple of it


def tie_free_logits(batch: int, vocab: int, seed: int, spread: float = 12.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(vocab, generator=gen).float() * (spread / vocab) for _ in range(batch)]
    return torch.stack(rows).to(DEVICE)


def random_logits(batch: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, vocab, generator=gen) * 3).to(DEVICE)


def check(logits, temperature, top_k, top_p, min_p, seed=None, position=None):
    batch = logits.shape[0]
    seed = seed if seed is not None else [1000003 * i - 7 for i in range(batch)]
    position = position if position is not None else [17 + 5 * i for i in range(batch)]
    params = SamplingBatch.build(temperature, top_k, top_p, min_p, seed, position, DEVICE)
    tokens, logprobs = sample(logits, params.temperature, params.top_k, params.top_p,
                              params.min_p, params.seed, params.position)
    ref_tokens, ref_logprobs = sample_ref(logits, params)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert tokens.tolist() == ref_tokens.tolist()
    # log_softmax(logits / T) at the tokens (T = 1 on greedy rows), in float64
    t = torch.where(params.temperature == 0, 1.0, params.temperature).double()[:, None]
    exact = (logits.double() / t).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    assert_as_exact_as(logprobs, exact, ref_logprobs, "logprob")
    return tokens


def test_noise_is_bit_identical():
    gen = torch.Generator().manual_seed(0)
    seed = torch.randint(-2**31, 2**31 - 1, (4,), generator=gen, dtype=torch.int32).to(DEVICE)
    position = torch.tensor([0, 1, 4095, 2**31 - 1], dtype=torch.int32, device=DEVICE)
    bits, uniform, noise = gumbel_noise_triton(seed, position, VOCAB)
    tokens = torch.arange(VOCAB, dtype=torch.int32, device=DEVICE)
    assert torch.equal(bits, mix32(row_keys(seed, position)[:, None] ^ mix32(tokens)[None, :]))
    assert torch.equal(uniform, uniform_noise(seed, position, VOCAB))
    ref = gumbel_noise(seed, position, VOCAB)
    if ON_GPU:
        # libdevice logf is the routine torch's CUDA log runs.
        diff = (noise.view(torch.int32) - ref.view(torch.int32)).abs()
        assert torch.equal(noise, ref), (
            f"{int((diff > 0).sum())} of {diff.numel()} Gumbel values differ, "
            f"by up to {int(diff.max())} ulp")
    else:
        # numpy's float32 log (the interpreter's) and torch's CPU log may differ by an ulp: the
        # inner log's moves g by up to eps, the outer's by eps * |g|. Worst seen 1.0 such
        # ulp, 4.8e-7 apart, 1.2e-7 past 1e-6 * |ref|, on AMD EPYC Zen 3 (AVX2; 1915 of 6000
        # values differ) and Intel Xeon (AVX-512; 2147 of 6000) alike: held to 3 ulps.
        ulps = 3 * torch.finfo(torch.float32).eps
        torch.testing.assert_close(noise, ref, atol=ulps, rtol=ulps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy(dtype):
    logits = random_logits(3, VOCAB, 1).to(dtype)
    check(logits, [0.0] * 3, [0] * 3, [1.0] * 3, [0.0] * 3)


def test_greedy_first_index_on_ties():
    logits = torch.zeros(2, 40, device=DEVICE)
    logits[0, [5, 9]] = 3.0
    logits[1, [0, 39]] = -1.0
    logits[1] -= 2.0
    assert check(logits, [0.0, 0.0], [0, 0], [1.0, 1.0], [0.0, 0.0]).tolist() == [5, 1]


def test_temperature_only():
    logits = random_logits(4, VOCAB, 2)
    check(logits, [1.0, 0.7, 1.3, 0.05], [0] * 4, [1.0] * 4, [0.0] * 4)


def test_top_k():
    logits = tie_free_logits(5, VOCAB, 3)
    check(logits, [1.0, 0.8, 1.5, 1.0, 2.0], [1, 5, 50, VOCAB, VOCAB + 10], [1.0] * 5, [0.0] * 5)


def test_top_p():
    logits = tie_free_logits(5, VOCAB, 4, spread=6.0)
    check(logits, [1.0, 0.8, 1.5, 1.0, 2.0], [0] * 5, [0.9, 0.5, 0.95, 0.01, 0.999], [0.0] * 5)


def test_min_p():
    logits = tie_free_logits(4, VOCAB, 5, spread=6.0)
    check(logits, [1.0, 0.8, 1.5, 1.0], [0] * 4, [1.0] * 4, [0.05, 0.2, 0.01, 1.0])


def test_top_k_then_top_p_then_min_p():
    logits = tie_free_logits(4, VOCAB, 6, spread=8.0)
    check(logits, [1.0, 0.9, 1.2, 2.0], [40, 200, 5, 100], [0.8, 0.9, 0.6, 0.95],
          [0.02, 0.0, 0.1, 0.01])


def test_ties_at_every_boundary_keep_the_same_tokens():
    """Logits on a grid of 12 values (~125 tokens tied at each): top-k and top-p cut inside a
    group of tied tokens, which both samplers keep whole (top_p clear of the groups' masses)."""
    gen = torch.Generator().manual_seed(8)
    logits = (torch.randint(0, 12, (8, VOCAB), generator=gen).float() * 0.5).to(DEVICE)
    top_k = [1, 7, 130, 700, 0, 0, 60, 300]
    top_p = [1.0, 1.0, 1.0, 1.0, 0.5, 0.9, 0.7, 0.95]
    for row, k, p in zip(logits.double().cpu(), top_k, top_p):  # no decision within 1e-3
        values = row.unique(sorted=True).flip(0)
        if 0 < k < VOCAB:
            values = values[values >= row.sort(descending=True).values[k - 1]]
        mass = torch.stack([(row == v).sum() * v.exp() for v in values])
        above = (mass.cumsum(0) - mass) / mass.sum()
        assert p == 1.0 or (above - p).abs().min() > 1e-3
    kept = filter_by_sort(logits.log_softmax(dim=-1), torch.tensor(top_k, device=DEVICE),
                          torch.tensor(top_p, device=DEVICE), torch.zeros(8, device=DEVICE))
    assert ((kept > float("-inf")).sum(dim=-1) > torch.tensor([1, 7, 130, 700, 0, 0, 0, 0],
                                                               device=DEVICE)).all()
    for rep in range(6):  # each token among its row's kept ties, and torch's token
        tokens = check(logits, [1.0] * 8, top_k, top_p, [0.0] * 8,
                       seed=[rep * 100 + i for i in range(8)])
        assert (kept.gather(-1, tokens[:, None]) > float("-inf")).all()


def test_mixed_batch_with_greedy_rows():
    logits = tie_free_logits(6, VOCAB, 7, spread=8.0)
    check(logits, [0.0, 1.0, 0.7, 0.0, 1.1, 0.9], [0, 0, 20, 30, 0, 100],
          [1.0, 0.9, 1.0, 0.5, 1.0, 0.8], [0.0, 0.0, 0.0, 0.1, 0.05, 0.0])


@pytest.mark.parametrize("case", range(4))
def test_random_configurations(case):
    """Random parameters per row; several seeds and positions, so many noise draws."""
    gen = torch.Generator().manual_seed(100 + case)
    batch = 6
    logits = tie_free_logits(batch, VOCAB, 200 + case, spread=10.0)
    temperature = [0.0 if torch.rand(1, generator=gen) < 0.2 else
                   float(torch.empty(1).uniform_(0.3, 1.7, generator=gen)) for _ in range(batch)]
    top_k = [int(torch.randint(-1, 300, (1,), generator=gen)) for _ in range(batch)]
    top_p = [float(torch.empty(1).uniform_(0.3, 1.0, generator=gen)) for _ in range(batch)]
    min_p = [float(torch.empty(1).uniform_(0.0, 0.2, generator=gen)) for _ in range(batch)]
    seed = torch.randint(-2**31, 2**31 - 1, (batch,), generator=gen).tolist()
    position = torch.randint(0, 10**6, (batch,), generator=gen).tolist()
    check(logits, temperature, top_k, top_p, min_p, seed, position)


def test_same_seed_and_position_same_token_regardless_of_batch():
    logits = tie_free_logits(3, VOCAB, 8)
    alone = check(logits[1:2], [1.0], [0], [1.0], [0.0], [42], [7])
    together = check(logits, [0.5, 1.0, 0.0], [10, 0, 0], [0.9, 1.0, 1.0], [0.0] * 3,
                     [1, 42, 3], [2, 7, 9])
    assert alone[0] == together[1]


def test_half_precision_and_strided_logits():
    wide = random_logits(3, 2 * VOCAB, 9).to(torch.float16)
    logits = wide[:, :VOCAB]  # a view with row stride 2 * VOCAB
    check(logits, [1.0, 0.0, 0.8], [0, 0, 30], [0.9, 1.0, 1.0], [0.0, 0.0, 0.05])
