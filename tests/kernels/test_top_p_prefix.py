"""kernels/cpu/top_p_prefix.c (the top-p filter's fused scan of sorted rows) against the torch
ops it replaces (rollout/sample/filters.py `_prefix_exact_ops`), in its result:
rows of every shape the filter makes (peaked, flat, bf16-valued with ties, top-k masked with
-inf tails), top_p from tiny to 1, k below, inside and past the examined length, the whole row
and a prefix of it."""

import pytest
import torch

from rollout.sample.filters import _prefix_exact_ops
from rollout_kernels import cpu as native
from rollout_kernels.cpu import top_p_prefix

pytestmark = pytest.mark.skipif(not top_p_prefix.supported(),
                                reason=native.missing_reason("top_p_prefix_f32"))


def sorted_probs(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(rows, 1, generator=gen) * 6  # flat (0) to peaked (6)
    x = torch.randn(rows, vocab, generator=gen) * scale
    x[rows // 3] = x[rows // 3].to(torch.bfloat16).float()  # ties
    x = x.sort(dim=-1, descending=True).values
    x[rows // 2, vocab // 3:] = float("-inf")  # a top-k mask
    return x.softmax(dim=-1)


@pytest.mark.parametrize("vocab,length", [(50, 50), (3001, 3001), (3001, 256),
                                          (49152, 4096), (49152, 49152)])
@pytest.mark.parametrize("seed", range(3))
def test_the_scan_is_the_torch_ops(vocab, length, seed):
    rows = 24
    probs = sorted_probs(rows, vocab, seed)
    gen = torch.Generator().manual_seed(100 + seed)
    top_p = torch.rand(rows, generator=gen)
    top_p[:4] = torch.tensor([1e-7, 0.5, 0.999999, 1.0])
    k = torch.randint(1, vocab + 1, (rows,), generator=gen)
    k[4:8] = torch.tensor([vocab, length, max(1, length - 1), 1])
    if length < vocab:  # rows cut at the last examined position, and just past it
        probs[8] = 1.0 / vocab  # flat: top-k cuts at `length`, top_p does not
        k[8], top_p[8] = length, 0.999999
        # The mass before the last examined position, as the scan computes it, and just past it.
        before = probs[9].double().cumsum(0)[length - 1].float() - probs[9, length - 1]
        k[9], top_p[9] = vocab, before
        k[11], top_p[11] = vocab, torch.nextafter(before, torch.tensor(1.0))
    top_p[10] = 0.0  # the top token survives anyway
    want = _prefix_exact_ops(probs, k, top_p, length)
    got = top_p_prefix.prefix_lengths(probs, k, top_p, length)
    assert torch.equal(got, want)
    assert (want >= 0).any() and (want < 0).any() or length == vocab


def test_rows_with_a_stride():
    probs = sorted_probs(6, 800, 7)
    wide = torch.zeros(6, 1000)
    wide[:, :800] = probs
    k, top_p = torch.full((6,), 800), torch.full((6,), 0.9)
    assert torch.equal(top_p_prefix.prefix_lengths(wide[:, :800], k, top_p, 800),
                       _prefix_exact_ops(probs, k, top_p, 800))
