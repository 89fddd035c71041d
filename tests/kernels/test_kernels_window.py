"""paged_attention with a sliding window and score soft-capping (Gemma 2/3, Mistral) against the
torch reference, and shared_prefix_attention with soft-capping: prefill, extend, decode with
split-KV, verify, windows shorter and longer than the contexts, a tile wider than the window."""

import pytest
import torch
from floors import FLOOR_MULTIPLE, assert_as_exact_as
from kernels_env import (DEVICE, DTYPES, attention_in, indptr, paged_case, poison_unused_slots,
                         scattered_slots)

from rollout_kernels.triton import paged_attention, paged_attention_ref, shared_prefix_attention

pytestmark = pytest.mark.interpreter


def run_case(*args, **kwargs):
    """paged_case with queries scaled by 3, so soft-capping bites."""
    return paged_case(*args, q_scale=3, **kwargs)


@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_prefill_and_extend_with_a_window(window):
    """Prefills and chunks over cached prefixes; 16 is the interpreter's tile width, 37 crosses
    tiles, 1 leaves each query its own key only."""
    q_lens = [19, 1, 7, 23, 4]
    kv_lens = [19, 9, 7 + 30, 23 + 41, 4]
    run_case(q_lens, kv_lens, 4, 2, 64, torch.float32, window=window, seed=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3, None])
def test_decode_with_a_window_and_split_kv(dtype, splits):
    """Splits that lie wholly before the window contribute nothing."""
    kv_lens = [1, 17, 40, 70]
    run_case([1] * len(kv_lens), kv_lens, 8, 2, 64, dtype, window=12, splits=splits, seed=3)


def test_verify_rows_with_a_window():
    run_case([5, 3, 1], [30, 12, 50], 8, 1, 64, torch.float32, window=7, splits=2, seed=5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_with_and_without_window(dtype):
    q_lens, kv_lens = [9, 1, 4], [9, 33, 20]
    capped = run_case(q_lens, kv_lens, 4, 2, 64, dtype, softcap=2.0, seed=6)
    plain = run_case(q_lens, kv_lens, 4, 2, 64, dtype, seed=6)
    assert (capped - plain).abs().max() > 1e-2  # the cap changes the result
    run_case(q_lens, kv_lens, 4, 2, 64, dtype, softcap=2.0, window=6, splits=3, seed=6)


@pytest.mark.parametrize("cap", [30.0, 50.0])
@pytest.mark.parametrize("q_lens, kv_lens, splits, invariant", [
    ([24], [48], 1, False), ([1, 1, 1], [40, 70, 17], 3, False), ([9, 1, 4], [9, 33, 20], 1, True)],
    ids=["prefill", "split-decode", "invariant"])
def test_softcap_at_gemma_caps_is_as_exact_as_torch(cap, q_lens, kv_lens, splits, invariant):
    """At Gemma 2's cap (50) scores / cap are small, where tanh as 1 - 2 / (e^2x + 1) cancels:
    every score ~cap * eps off. The output is held to torch fp32's own error against float64,
    measured here: assert_as_exact_as's 8-ulp floor let that loss pass (mean error 11-24x
    torch's, largest 6-21x, with the cancelling tanh; 0.9-1.3x and 0.5-1.4x since)."""
    gen = torch.Generator().manual_seed(9)
    num_slots, head_dim = sum(kv_lens) + 13, 64
    k_pool = torch.randn(num_slots, 2, head_dim, generator=gen).to(DEVICE)
    v_pool = torch.randn(num_slots, 2, head_dim, generator=gen).to(DEVICE)
    kv_indices = scattered_slots(num_slots, sum(kv_lens), gen)
    poison_unused_slots(k_pool, v_pool, kv_indices)
    q = (0.3 * torch.randn(sum(q_lens), 4, head_dim, generator=gen)).to(DEVICE)
    qo_indptr, kv_indptr = indptr(q_lens), indptr(kv_lens)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    paged_attention(q, k_pool, v_pool, out, qo_indptr, kv_indptr, kv_indices, sm_scale=scale,
                    max_q_len=max(q_lens), max_kv_len=max(kv_lens), num_kv_splits=splits,
                    softcap=cap, invariant=invariant)
    args = (q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, scale)
    exact = attention_in(torch.float64, *args, softcap=cap)
    errors = (out.cpu().double() - exact).abs()
    floor = (paged_attention_ref(*args, softcap=cap).cpu().double() - exact).abs()
    gaps = (f"error {errors.mean():.3g} mean, {errors.max():.3g} max; torch fp32's "
            f"{floor.mean():.3g}, {floor.max():.3g}")
    assert errors.mean() <= FLOOR_MULTIPLE * floor.mean(), gaps
    # One element's error varies more than the mean of hundreds: 1.5x seen over 6 seeds.
    assert errors.max() <= 3 * floor.max(), gaps


def test_window_longer_than_every_context_changes_nothing():
    q_lens, kv_lens = [6, 1], [6, 20]
    a = run_case(q_lens, kv_lens, 4, 2, 64, torch.float32, window=20, seed=7)
    b = run_case(q_lens, kv_lens, 4, 2, 64, torch.float32, seed=7)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_shared_prefix_attention_with_softcap():
    """Two groups sharing prefixes, decode queries: the capped result equals the plain paged
    kernel's over each request's whole context."""
    gen = torch.Generator().manual_seed(8)
    kv_heads, head_dim, q_heads = 2, 32, 4
    prefixes, suffix_lens = [20, 9], [[3, 5, 1], [4, 2]]
    num_slots = 200
    k_pool = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(DEVICE)
    v_pool = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(DEVICE)
    free = iter(torch.randperm(num_slots, generator=gen).tolist())
    prefix_slots = [[next(free) for _ in range(p)] for p in prefixes]
    suffix_slots = [[next(free) for _ in range(n)] for lens in suffix_lens for n in lens]
    contexts = [prefix_slots[g] + suffix_slots[i] for i, g in
                enumerate(g for g, lens in enumerate(suffix_lens) for _ in lens)]
    num_req = len(contexts)
    q = (3 * torch.randn(num_req, q_heads, head_dim, generator=gen)).to(DEVICE)
    scale, cap = head_dim ** -0.5, 1.5
    out = torch.empty_like(q)
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    shared_prefix_attention(
        q, k_pool, v_pool, out, indptr([len(lens) for lens in suffix_lens]), indptr(prefixes),
        ints([s for p in prefix_slots for s in p]), indptr([len(s) for s in suffix_slots]),
        ints([s for sl in suffix_slots for s in sl]), sm_scale=scale,
        max_group_size=max(map(len, suffix_lens)), max_prefix_len=max(prefixes),
        max_suffix_len=max(map(len, suffix_slots)), softcap=cap)
    ref = paged_attention_ref(q, k_pool, v_pool, indptr([1] * num_req),
                              indptr([len(c) for c in contexts]),
                              ints([s for c in contexts for s in c]), scale, softcap=cap)
    # the float64 answer: each request's one query over its whole context
    k64, v64 = (p.cpu().double().repeat_interleave(q_heads // kv_heads, 1)
                for p in (k_pool, v_pool))
    scores = [torch.einsum("hd,khd->hk", q[i].cpu().double(), k64[c]) * scale
              for i, c in enumerate(contexts)]
    exact = torch.stack([torch.einsum("hk,khd->hd", (cap * torch.tanh(s / cap)).softmax(-1),
                                      v64[c]) for s, c in zip(scores, contexts)])
    assert_as_exact_as(out.cpu(), exact, ref.cpu(), "shared-prefix attention output")
