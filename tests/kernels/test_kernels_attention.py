"""paged_attention against the torch reference: prefill, extend, decode (split-KV on and off),
verify, GQA, head dims, scattered slots, dtypes. Shapes stay tiny: the CPU interpreter is slow.
"""

import pytest
import torch
from kernels_env import DTYPES, paged_case

from rollout_kernels.triton import choose_num_kv_splits

pytestmark = pytest.mark.interpreter

GQA = [(4, 4), (8, 2), (8, 1)]  # (q heads, kv heads): ratios 1, 4, 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill(dtype, q_heads, kv_heads, head_dim):
    lens = [1, 7, 19]
    paged_case(lens, lens, q_heads, kv_heads, head_dim, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", GQA)
def test_extend_over_cached_prefix(dtype, q_heads, kv_heads):
    """Chunked prefill: requests with cached prefixes of 0..6 tokens and chunks of 1..5."""
    prefixes = list(range(7))
    q_lens = [1 + (i * 3) % 5 for i in range(len(prefixes))]
    kv_lens = [p + n for p, n in zip(prefixes, q_lens)]
    paged_case(q_lens, kv_lens, q_heads, kv_heads, 64, dtype, seed=1)


def test_extend_longer_prefix_crosses_blocks():
    """A chunk whose causal diagonal cuts several KV tiles and query blocks."""
    paged_case([23, 9], [23 + 41, 9 + 16], 4, 2, 64, torch.float32, seed=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_decode(dtype, q_heads, kv_heads, head_dim, splits):
    """q_len 1; split-KV off (1), forced (3) and automatic (None)."""
    kv_lens = [1, 17, 40, 33]
    paged_case([1] * len(kv_lens), kv_lens, q_heads, kv_heads, head_dim, dtype, splits=splits,
             seed=3)


def test_decode_more_splits_than_tiles():
    """Some splits start past a request's context and must contribute nothing."""
    paged_case([1, 1], [3, 70], 8, 2, 64, torch.float32, splits=4, seed=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", GQA)
@pytest.mark.parametrize("splits", [1, 2])
def test_verify(dtype, q_heads, kv_heads, splits):
    """Speculative verify: k + 1 = 4 queries per request at the end of the context."""
    kv_lens = [4, 12, 37]
    paged_case([4] * len(kv_lens), kv_lens, q_heads, kv_heads, 64, dtype, splits=splits, seed=5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch(dtype):
    """Decode, verify, extend and a fresh prefill in one launch, as the scheduler builds it."""
    q_lens = [1, 4, 6, 11, 1]
    kv_lens = [30, 20, 15, 11, 2]
    paged_case(q_lens, kv_lens, 8, 2, 64, dtype, seed=6)
    paged_case(q_lens, kv_lens, 8, 2, 64, dtype, seed=6, index_dtype=torch.int64)  # engine's


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", GQA)
def test_mixed_batch_varlen_grid(dtype, q_heads, kv_heads):
    """One long chunk among many short requests: the grid follows the token count and each
    program finds its request by binary search (empty requests included)."""
    q_lens = [1, 1, 45, 1, 3, 0, 1, 2, 1, 17, 1]
    kv_lens = [9, 30, 50, 2, 3, 4, 20, 2, 40, 17, 1]
    paged_case(q_lens, kv_lens, q_heads, kv_heads, 32, dtype, seed=12)


@pytest.mark.parametrize("head_dim", [16, 32, 48, 80])
def test_small_and_non_power_of_two_head_dims(head_dim):
    paged_case([5, 1], [9, 21], 4, 2, head_dim, torch.float32, seed=7)
    paged_case([1, 1], [9, 21], 4, 2, head_dim, torch.float16, splits=2, seed=7)


def test_non_power_of_two_gqa_group():
    """Qwen2-7B style: 28 query heads over 4 KV heads (group of 7)."""
    paged_case([3, 1], [10, 25], 28, 4, 32, torch.float32, seed=8)
    paged_case([1, 1], [10, 25], 28, 4, 32, torch.float32, splits=2, seed=8)


@pytest.mark.parametrize("splits", [1, 2])
def test_non_causal(splits):
    paged_case([3, 5], [8, 5], 4, 2, 32, torch.float32, causal=False, splits=splits, seed=9)


def test_empty_request_in_batch():
    """A request contributing no query rows (q_len 0) leaves the others untouched."""
    paged_case([2, 0, 3], [5, 4, 3], 4, 2, 32, torch.float32, seed=10)


def test_choose_num_kv_splits():
    sms = 132
    assert choose_num_kv_splits(8, 1, 32768, sms) > 1  # batch 1, 8 KV heads: split
    assert choose_num_kv_splits(256 * 8, 1, 32768, sms) == 1  # batch fills the GPU already
    assert choose_num_kv_splits(8, 1, 100, sms) == 1  # too short to be worth a merge
    assert choose_num_kv_splits(8, 512, 32768, sms) == 1  # prefill never splits


def test_decode_automatic_split_on_long_context():
    """Long enough that the automatic choice splits (one request, one KV head)."""
    assert choose_num_kv_splits(1, 1, 600, 8) > 1
    paged_case([1], [600], 4, 1, 32, torch.float16, seed=11)
