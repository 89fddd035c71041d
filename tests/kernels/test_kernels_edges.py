"""Edge shapes and metadata of the attention kernels that the per-kernel tests leave out:
GQA groups that are not powers of two (Qwen2: 14/2, Qwen2.5-7B: 28/4), head dims 80/96/256,
the varlen grid together with split-KV, CUDA-graph style upper bounds (max_kv_len far above the
real lengths, kv_indices longer than used), uneven split lengths, strided q/out/pool views,
empty requests at the batch edges, merge_states with empty (-inf) splits, store_kv corners.
All against the torch references; shapes stay tiny for the CPU interpreter.
"""

import pytest
import torch
from floors import assert_as_exact_as
from kernels_env import (DEVICE, assert_attention_as_exact, indptr, poison_unused_slots,
                         scattered_slots)
from test_kernels_shared_prefix import run_case as run_shared_prefix

from rollout_kernels.triton import (
    merge_states,
    paged_attention,
    paged_attention_ref,
    store_kv,
    store_kv_ref,
)
from rollout_kernels.triton.paged_attention import _interpreting, _tile_config

pytestmark = pytest.mark.interpreter

MIXED_Q = [1, 4, 6, 11, 1, 0, 19]  # decode, verify, extend, prefill, decode, empty, prefill
MIXED_KV = [30, 20, 15, 11, 2, 3, 19]


def make_pools(num_slots, kv_heads, head_dim, dtype, gen, *, interleaved=False):
    """K/V pools; `interleaved` makes them views of one [S, 2, Hkv, D] buffer (slot stride
    2 * Hkv * D), so the kernels must use the pools' own strides."""
    if interleaved:
        buf = torch.randn(num_slots, 2, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
        return buf[:, 0], buf[:, 1]
    k_pool = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_pool = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return k_pool, v_pool


def run_case(q_lens, kv_lens, q_heads, kv_heads, head_dim, dtype, *, causal=True, splits=None,
             seed=0, index_dtype=torch.int32, max_q_len=None, max_kv_len=None, spare_indices=0,
             strided=False):
    """paged_attention vs the reference. max_q_len / max_kv_len: the bounds passed (default:
    the real maxima); spare_indices: unused trailing kv_indices entries (a graph's fixed
    buffer); strided: q sliced from a fused QKV output, out a view with padded heads, pools
    interleaved."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(kv_lens) + 13
    k_pool, v_pool = make_pools(num_slots, kv_heads, head_dim, dtype, gen, interleaved=strided)
    kv_indices = scattered_slots(num_slots, sum(kv_lens), gen)
    poison_unused_slots(k_pool, v_pool, kv_indices)
    kv_indices = torch.cat([kv_indices, torch.zeros(spare_indices, dtype=kv_indices.dtype,
                                                    device=DEVICE)]).to(index_dtype)
    num_tokens = sum(q_lens)
    if strided:
        qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen)
        q = qkv.to(DEVICE, dtype)[:, :q_heads * head_dim].view(num_tokens, q_heads, head_dim)
        out_buf = torch.full((num_tokens, q_heads, head_dim + 8), float("nan"), dtype=dtype,
                             device=DEVICE)
        out = out_buf[:, :, 4:4 + head_dim]
        assert not q.is_contiguous() and not out.is_contiguous()
    else:
        q = torch.randn(num_tokens, q_heads, head_dim, generator=gen).to(DEVICE, dtype)
        out = torch.full_like(q, float("nan"))
    qo_indptr, kv_indptr = indptr(q_lens), indptr(kv_lens)
    scale = head_dim ** -0.5
    paged_attention(q, k_pool, v_pool, out, qo_indptr, kv_indptr, kv_indices, sm_scale=scale,
                    max_q_len=max_q_len or max(q_lens), max_kv_len=max_kv_len or max(kv_lens),
                    causal=causal, num_kv_splits=splits)
    meta = qo_indptr, kv_indptr, kv_indices
    ref = paged_attention_ref(q, k_pool, v_pool, *meta, scale, causal)
    assert_attention_as_exact(out, ref, q, k_pool, v_pool, *meta, scale, causal)
    if strided:  # the padding around each head is untouched
        assert out_buf[:, :, :4].isnan().all() and out_buf[:, :, 4 + head_dim:].isnan().all()


# --- non-power-of-two GQA groups: padded rows in every tile ------------------------------------

@pytest.mark.parametrize("q_heads,kv_heads", [(14, 2), (28, 4), (15, 5), (12, 2), (10, 2)])
def test_non_power_of_two_groups_every_step_kind(q_heads, kv_heads):
    """Groups 7, 7, 3, 6, 5: a mixed prefill/extend/decode/verify batch, decode with split-KV
    forced and verify (k + 1 = 4) with split-KV, fp32 and fp16."""
    run_case(MIXED_Q, MIXED_KV, q_heads, kv_heads, 32, torch.float16, seed=20)
    run_case([1, 1, 1], [5, 40, 33], q_heads, kv_heads, 64, torch.float32, splits=3, seed=21)
    run_case([4, 4], [4, 37], q_heads, kv_heads, 32, torch.float16, splits=2, seed=22)


def test_non_power_of_two_group_long_prefill_spans_query_blocks():
    """Group 7: BLOCK_Q is 9 (fp32) or 18 (fp16) tokens, not a power of two; a 40-token prefill
    needs several query blocks whose diagonal cuts KV tiles."""
    for dtype in (torch.float32, torch.float16):
        run_case([40, 3], [40, 20], 14, 2, 32, dtype, seed=23)


@pytest.mark.parametrize("head_dim", [80, 96, 256])
def test_head_dims_with_odd_group(head_dim):
    """Head dims 80 and 96 (BLOCK_D masking) and 256 (the wide tile), with a group of 7."""
    run_case([5, 17], [9, 17], 14, 2, head_dim, torch.float32, seed=24)
    run_case([1, 1], [9, 50], 14, 2, head_dim, torch.float16, splits=3, seed=24)


# --- grids, splits and bounds --------------------------------------------------------------------

def test_varlen_grid_with_split_kv():
    """Group 9 in fp32 makes BLOCK_Q 7, so an 8-token verify needs two query blocks and the
    short requests beside it switch to the varlen grid while split-KV is on."""
    q_lens, kv_lens = [8, 1, 1, 0, 1, 1, 5], [40, 3, 17, 6, 60, 1, 33]
    block_q = _tile_config(9, max(q_lens), 32, torch.float32, _interpreting())[0]
    blocks_per_req = -(-max(q_lens) // block_q)
    if _interpreting():  # the launch really takes the varlen grid (GPU tiles differ)
        assert sum(q_lens) // block_q + len(q_lens) < len(q_lens) * blocks_per_req
    run_case(q_lens, kv_lens, 9, 1, 32, torch.float32, splits=3, seed=25)


def test_varlen_grid_odd_group_int64_indices():
    """One long chunk among short requests with a group of 7 and the engine's int64 slots."""
    q_lens = [1, 1, 45, 1, 3, 0, 1, 2, 1, 17, 1]
    kv_lens = [9, 30, 50, 2, 3, 4, 20, 2, 40, 17, 1]
    run_case(q_lens, kv_lens, 14, 2, 32, torch.float16, seed=26, index_dtype=torch.int64)


def test_split_lengths_not_multiples_of_the_tile():
    """kv lengths of 1, 97 and 201 over 5 splits (41 -> 48 positions per split, not a multiple
    of every length); verify over 7 splits; int64 slots."""
    run_case([1, 1, 1], [1, 201, 97], 14, 2, 32, torch.float32, splits=5, seed=27,
             index_dtype=torch.int64)
    run_case([3, 3], [3, 201], 14, 2, 32, torch.float16, splits=7, seed=27)


def test_cuda_graph_style_upper_bounds():
    """A replayed decode graph passes max_kv_len = max_model_len (far above the real contexts)
    and a kv_indices buffer longer than used: most splits are empty for every request."""
    kv_lens = [1, 17, 40, 3]
    run_case([1] * 4, kv_lens, 14, 2, 32, torch.float32, max_kv_len=600, spare_indices=50,
             seed=28)  # automatic split count, sized for 600
    run_case([1] * 4, kv_lens, 14, 2, 32, torch.float16, splits=8, max_kv_len=600,
             spare_indices=50, seed=28)
    run_case([1] * 4, kv_lens, 14, 2, 32, torch.float32, max_q_len=8, seed=28)  # loose q bound


def test_empty_requests_at_batch_edges():
    run_case([0, 3, 0], [5, 3, 0], 14, 2, 32, torch.float32, seed=29)
    run_case([0, 1, 0, 1], [5, 3, 0, 40], 14, 2, 32, torch.float32, splits=2, seed=29)


@pytest.mark.parametrize("splits", [1, 3])
def test_strided_q_out_and_pools(splits):
    """q sliced from a fused QKV output, out a view whose heads are padded, K/V pools views of
    one interleaved buffer: every stride is the tensors' own."""
    run_case(MIXED_Q if splits == 1 else [1, 1, 4], MIXED_KV if splits == 1 else [9, 50, 20],
             14, 2, 32, torch.float32, splits=splits, seed=30, strided=True)


def test_non_contiguous_head_dim_is_rejected():
    q = torch.randn(2, 4, 32, device=DEVICE).transpose(1, 2).contiguous().transpose(1, 2)
    k_pool = torch.randn(8, 2, 32, device=DEVICE)
    meta = indptr([1, 1]), indptr([2, 2]), torch.arange(1, 5, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="the head dimension of q must be contiguous"):
        paged_attention(q, k_pool, k_pool.clone(), torch.empty(2, 4, 32, device=DEVICE), *meta,
                        sm_scale=1.0, max_q_len=1, max_kv_len=2)


# --- shared prefix -------------------------------------------------------------------------------

@pytest.mark.parametrize("q_heads,kv_heads,dtype,splits", [
    (14, 2, torch.float32, 3), (15, 5, torch.float16, 1), (12, 2, torch.float32, None)])
def test_shared_prefix_non_power_of_two_groups(q_heads, kv_heads, dtype, splits):
    run_shared_prefix([3, 1, 4], [21, 5, 37], [1, 4, 2, 9, 3, 1, 6, 2], q_heads, kv_heads, 32,
                      dtype, splits=splits, seed=31)


def test_shared_prefix_varlen_grid():
    """One large sample group (two query blocks at group 7, BLOCK_Q 9) among lone requests:
    the prefix launch takes the varlen grid; one prefix is empty."""
    groups, prefixes = [12, 1, 1, 1, 1, 1], [30, 7, 0, 5, 40, 3]
    suffixes = [1 + i % 4 for i in range(12)] + [2, 1, 3, 1, 2]
    run_shared_prefix(groups, prefixes, suffixes, 14, 2, 32, torch.float32, seed=32)
    run_shared_prefix(groups, prefixes, suffixes, 14, 2, 32, torch.float16, splits=2, seed=32)


def test_shared_prefix_odd_head_dim_and_surplus_splits():
    """Head dim 80; then 8 prefix splits over prefixes of 5 and 0 tokens (most splits empty:
    lse -inf in the merge)."""
    run_shared_prefix([3, 2], [21, 9], [1, 2, 3, 1, 5], 14, 2, 80, torch.float32, splits=2,
                      seed=33)
    run_shared_prefix([3, 2], [5, 0], [1, 2, 3, 1, 5], 14, 2, 32, torch.float32, splits=8,
                      seed=33)


# --- merge_states --------------------------------------------------------------------------------

@pytest.mark.parametrize("num_splits", [1, 3, 5])
@pytest.mark.parametrize("head_dim", [32, 80])
def test_merge_states_with_empty_splits(num_splits, head_dim):
    """Splits with lse = -inf (no visible key) weigh nothing; a row whose every split is empty
    becomes 0, not NaN. Non-power-of-two split counts and head dims are masked."""
    gen = torch.Generator().manual_seed(num_splits * 100 + head_dim)
    tokens, heads = 4, 3
    part_out = torch.randn(tokens, heads, num_splits, head_dim, generator=gen)
    part_lse = torch.randn(tokens, heads, num_splits, generator=gen) * 4
    empty = torch.rand(tokens, heads, num_splits, generator=gen) < 0.4
    empty[0] = True  # token 0: every split empty
    empty[1, :, 0] = False  # token 1: at least one live split per head
    part_lse[empty] = float("-inf")
    part_out[empty] = 0.0  # what the attention kernel writes for an empty split
    part_out, part_lse = part_out.to(DEVICE), part_lse.to(DEVICE)
    def merged(dtype):  # lse is base 2
        weights = torch.softmax(part_lse.to(dtype) * torch.log(torch.tensor(2.0, dtype=dtype)),
                                dim=-1).nan_to_num(0.0)
        return (weights[..., None] * part_out.to(dtype)).sum(2).cpu()

    ref, exact = merged(torch.float32), merged(torch.float64)
    for dtype in (torch.float32, torch.float16):
        out_buf = torch.full((tokens, heads, head_dim + 3), float("nan"), dtype=dtype,
                             device=DEVICE)
        out = out_buf[:, :, :head_dim]  # a strided view: padded heads
        merge_states(part_out, part_lse, out)
        # the kernel merges in fp32 and rounds once to out's dtype: torch's fp32 rounded so
        assert_as_exact_as(out.cpu(), exact, ref.to(dtype), "merged output")
        assert out_buf[:, :, head_dim:].isnan().all()


# --- store_kv ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_heads,head_dim", [(5, 80), (2, 96), (1, 256)])
def test_store_kv_odd_shapes_into_interleaved_pools(kv_heads, head_dim):
    """Non-power-of-two heads/head dims, k/v from a fused QKV output, pools that are views of one
    [S, 2, Hkv, D] buffer, int32 slots with padding (-1)."""
    gen = torch.Generator().manual_seed(kv_heads + head_dim)
    num_tokens, q_heads, num_slots = 6, 2 * kv_heads, 24
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen)
    _, k, v = qkv.to(DEVICE, torch.float16).split(
        [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k = k.view(num_tokens, kv_heads, head_dim)
    v = v.view(num_tokens, kv_heads, head_dim)
    slots = scattered_slots(num_slots, num_tokens, gen)
    slots[3] = -1
    k_pool, v_pool = make_pools(num_slots, kv_heads, head_dim, torch.float16, gen,
                                interleaved=True)
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    store_kv(k, v, k_pool, v_pool, slots)
    store_kv_ref(k, v, ref_k, ref_v, slots)
    assert torch.equal(k_pool, ref_k) and torch.equal(v_pool, ref_v)


def test_store_kv_empty_step_is_a_no_op():
    k_pool = torch.randn(8, 2, 32, device=DEVICE)
    v_pool, before = torch.randn(8, 2, 32, device=DEVICE), k_pool.clone()
    empty = torch.empty(0, 2, 32, device=DEVICE)
    store_kv(empty, empty, k_pool, v_pool, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_pool, before)
