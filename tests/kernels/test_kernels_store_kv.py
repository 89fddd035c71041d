"""store_kv: scattered, padded writes into the KV pool, checked against the torch reference."""

import pytest
import torch
from kernels_env import DEVICE, DTYPES, ON_GPU, assert_attention_as_exact, scattered_slots

from rollout_kernels.triton import store_kv, store_kv_ref

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 64), (2, 128), (3, 48)])
def test_store_kv_matches_reference(dtype, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(kv_heads * 1000 + head_dim)
    num_slots, num_tokens = 64, 11
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    slots = scattered_slots(num_slots, num_tokens, gen)
    slots[[2, 7]] = -1  # padding tokens of a fixed-size (CUDA-graph) batch
    pools = [torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
             for _ in range(2)]
    ref = [p.clone() for p in pools]
    store_kv(k, v, pools[0], pools[1], slots)
    store_kv_ref(k, v, ref[0], ref[1], slots)
    assert torch.equal(pools[0], ref[0]) and torch.equal(pools[1], ref[1])


def test_store_kv_strided_views_of_fused_qkv():
    """k and v sliced out of one fused projection output (row stride != Hkv * D)."""
    gen = torch.Generator().manual_seed(1)
    num_tokens, q_heads, kv_heads, head_dim = 5, 4, 2, 16
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE)
    _, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k = k.view(num_tokens, kv_heads, head_dim)
    v = v.view(num_tokens, kv_heads, head_dim)
    slots = torch.tensor([9, -1, 0, 31, 4], dtype=torch.int64, device=DEVICE)
    pools = [torch.zeros(32, kv_heads, head_dim, device=DEVICE) for _ in range(2)]
    ref = [p.clone() for p in pools]
    store_kv(k, v, pools[0], pools[1], slots)
    store_kv_ref(k, v, ref[0], ref[1], slots)
    assert torch.equal(pools[0], ref[0]) and torch.equal(pools[1], ref[1])


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU with > 10 GB free")
def test_store_kv_and_attention_past_int32_offsets():
    """slot * row_stride beyond 2**31 elements: offsets must be computed in int64."""
    from rollout_kernels.triton import paged_attention, paged_attention_ref

    kv_heads, head_dim, q_heads = 8, 128, 32
    num_slots = (1 << 31) // (kv_heads * head_dim) + 4096
    k_pool = torch.zeros(num_slots, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    gen = torch.Generator().manual_seed(0)
    kv_len = 300
    # Context slots straddle the 2**31-element boundary; the last ones are the highest slots.
    slots = torch.arange(num_slots - kv_len, num_slots, device=DEVICE, dtype=torch.int32)
    slots = slots[torch.randperm(kv_len, generator=gen).to(DEVICE)]
    slots[:100] = torch.arange(0, 100, device=DEVICE, dtype=torch.int32)
    k = torch.randn(kv_len, kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(kv_len, kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    store_kv(k, v, k_pool, v_pool, slots)
    assert torch.equal(k_pool[slots.long()], k) and torch.equal(v_pool[slots.long()], v)
    q = torch.randn(1, q_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    qo = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    kvp = torch.tensor([0, kv_len], dtype=torch.int32, device=DEVICE)
    for splits in (1, 4):
        out = torch.empty_like(q)
        paged_attention(q, k_pool, v_pool, out, qo, kvp, slots, sm_scale=head_dim ** -0.5,
                        max_q_len=1, max_kv_len=kv_len, num_kv_splits=splits)
        ref = paged_attention_ref(q, k_pool, v_pool, qo, kvp, slots, head_dim ** -0.5)
        assert_attention_as_exact(out, ref, q, k_pool, v_pool, qo, kvp, slots,
                                  head_dim ** -0.5)
