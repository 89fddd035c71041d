"""Shared-prefix decode against the plain reference over each request's full context."""

import pytest
import torch
from kernels_env import (DEVICE, DTYPES, assert_attention_as_exact, indptr,
                         poison_unused_slots, scattered_slots)

from rollout_kernels.triton import paged_attention_ref, shared_prefix_attention
from rollout_kernels.triton.shared_prefix import shared_prefix_kv_bytes

pytestmark = pytest.mark.interpreter


def run_case(group_sizes, prefix_lens, suffix_lens, q_heads, kv_heads, head_dim, dtype,
             splits=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_req = sum(group_sizes)
    assert len(suffix_lens) == num_req
    num_slots = sum(prefix_lens) + sum(suffix_lens) + 5
    k_pool = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_pool = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    slots = scattered_slots(num_slots, sum(prefix_lens) + sum(suffix_lens), gen)
    poison_unused_slots(k_pool, v_pool, slots)
    prefix_indices, suffix_indices = slots[:sum(prefix_lens)], slots[sum(prefix_lens):]
    q = torch.randn(num_req, q_heads, head_dim, generator=gen).to(DEVICE, dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    shared_prefix_attention(
        q, k_pool, v_pool, out, indptr(group_sizes), indptr(prefix_lens), prefix_indices,
        indptr(suffix_lens), suffix_indices, sm_scale=scale, max_group_size=max(group_sizes),
        max_prefix_len=max(prefix_lens), max_suffix_len=max(suffix_lens),
        num_prefix_splits=splits)

    # The same requests as plain decode: context = group prefix + own suffix.
    kv_indices, kv_lens, p_off, s_off, req = [], [], 0, 0, 0
    for n, plen in zip(group_sizes, prefix_lens):
        for _ in range(n):
            slen = suffix_lens[req]
            kv_indices += [prefix_indices[p_off:p_off + plen], suffix_indices[s_off:s_off + slen]]
            kv_lens.append(plen + slen)
            s_off += slen
            req += 1
        p_off += plen
    meta = indptr([1] * num_req), indptr(kv_lens), torch.cat(kv_indices)
    ref = paged_attention_ref(q, k_pool, v_pool, *meta, scale)
    assert_attention_as_exact(out, ref, q, k_pool, v_pool, *meta, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("splits", [1, 2, None])
def test_shared_prefix_matches_plain_decode(dtype, q_heads, kv_heads, splits):
    run_case([3, 1, 4], [21, 5, 37], [1, 4, 2, 9, 3, 1, 6, 2], q_heads, kv_heads, 64, dtype,
             splits=splits)


def test_empty_prefix_and_single_token_suffix():
    run_case([2, 2], [0, 12], [1, 3, 1, 1], 8, 2, 32, torch.float32, splits=2, seed=1)


def test_large_group_spans_query_blocks():
    """More samples than fit in one tile: the prefix is read once per query block."""
    run_case([20], [30], list(range(1, 21)), 8, 1, 32, torch.float32, seed=2)


def test_kv_bytes_saving():
    plain, shared = shared_prefix_kv_bytes([8], [1000], [10] * 8, kv_row_bytes=2048)
    assert plain == 2 * (8 * 1000 + 80) * 2048 and shared == 2 * (1000 + 80) * 2048
