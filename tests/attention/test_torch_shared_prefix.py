"""The torch backend's shared-prefix path (samples of one prompt read its K/V once per step)
against its plain gather path, and the engine's outputs with it against prefix caching off."""

import dataclasses

import pytest
import torch
from floors import assert_as_exact_as
from helpers import run_checked, samples
from models import tiny_model
from reference import assert_matches_reference, assert_paths_agree

from rollout import Engine, EngineConfig, SamplingParams
from rollout.attention import shared_prefix as shared_prefix_attention
from rollout.attention.metadata import AttentionMetadata, indptr
from rollout.attention.sdpa import TorchAttention
from rollout.attention.shared_prefix import MAX_SHARED_Q_LEN, MIN_COMMON_LEN
from rollout.kv.pool import KVPool
from rollout.spec import SpeculativeConfig
from rollout_kernels.triton import paged_attention_ref

# (group, shared_len, kv_len, q_len): a group's first shared_len context slots are the same
# slots for every request of it, the rest are private; the last q_len are the new tokens.
MIXED = [
    ("a", 37, 40, 1), ("b", 1, 9, 1), ("a", 37, 38, 1), ("c", 20, 31, 1),  # c: a group of one
    ("d", 0, 17, 1), ("a", 37, 61, 1), ("b", 1, 2, 1), ("e", 0, 30, 30),  # e: a prefill
    ("f", 12, 19, 5), ("f", 12, 13, 1), ("f", 12, 30, 3),  # f: verify rows and a decode
    ("g", 25, 50, 20), ("g", 25, 40, 20),  # g: extend chunks, too long for the shared path
    ("a", 37, 45, 1), ("h", 64, 66, 1), ("h", 64, 70, 2), ("h", 64, 65, 1),
]


def make_step(pool, requests, num_q_heads, seed=0, dtype=torch.float32, common=0,
              contiguous=False):
    """Metadata (no plan yet) and q/k/v of one step over `requests`. Every group's prefix
    begins with the same `common` slots (consecutive ones when `contiguous`), as a system
    prompt the radix tree holds once for all prompts."""
    gen = torch.Generator().manual_seed(seed)
    free = iter(torch.randperm(pool.num_slots, generator=gen).tolist())
    if contiguous:
        run = next(free) % (pool.num_slots - common)
        system = list(range(run, run + common))
        free = iter(s for s in free if not run <= s < run + common)
    else:
        system = [next(free) for _ in range(common)]
    prefixes, kv_indices = {}, []
    for group, shared, kv_len, _ in requests:
        if group not in prefixes:
            prefixes[group] = system[:shared] + [next(free) for _ in range(shared - common)]
        prefix = prefixes[group]
        kv_indices.append(prefix[:shared] + [next(free) for _ in range(kv_len - shared)])
    q_lens = [q for *_, q in requests]
    kv_lens = [kv for _, _, kv, _ in requests]
    meta = AttentionMetadata(
        qo_indptr=indptr(q_lens, "cpu"), kv_indptr=indptr(kv_lens, "cpu"),
        kv_indices=torch.tensor([s for slots in kv_indices for s in slots]),
        out_slots=torch.tensor([s for slots, q in zip(kv_indices, q_lens) for s in slots[-q:]]),
        q_lens=q_lens, kv_lens=kv_lens, groups=[g for g, *_ in requests],
        shared_lens=[s for _, s, _, _ in requests])
    t, d = sum(q_lens), pool.head_dim
    q = torch.randn(t, num_q_heads, d, generator=gen).to(dtype)
    k, v = torch.randn(2, t, pool.kv_heads, d, generator=gen).to(dtype)
    return meta, q, k, v


def reference(pool, meta, q, layer, scale, window=None, softcap=None, dtype=torch.float64):
    """Every request's rows from its whole context, computed in `dtype` (paged_attention_ref):
    [T, Hq, D]. In float64 the exact answer; in float32 torch's own rounding of the formula."""
    return paged_attention_ref(q, pool.k(layer), pool.v(layer), meta.qo_indptr, meta.kv_indptr,
                               meta.kv_indices, scale, window=window, softcap=softcap,
                               dtype=dtype)


def assert_attention_exact(out, pool, meta, q, layer=0, *, scale=None, window=None,
                           softcap=None, floor=None, rows=slice(None)):
    """`out` (its rows `rows`) as near reference()'s float64 answer as torch's own computation
    in out's dtype is: `floor` where given (a torch path's output), else reference() run in
    float32. The pool must hold the step's K/V (the forwards store them)."""
    args = (pool, meta, q, layer, scale or pool.head_dim ** -0.5, window, softcap)
    if floor is None:
        floor = reference(*args, dtype=torch.float32)
    assert_as_exact_as(out[rows], reference(*args)[rows], floor[rows], "attention output")


def run_both(pool, meta, q, k, v, layer=0):
    """(shared-prefix path output, plain path output, the shared path's plan)."""
    backend = TorchAttention(pool)
    scale = pool.head_dim ** -0.5
    plain = dataclasses.replace(meta, groups=[], shared_lens=[])
    plain.plan = backend.plan(plain)
    assert plain.plan.shared is None
    ref = backend.forward(q, k, v, layer, plain, scale)
    meta.plan = backend.plan(meta)
    return backend.forward(q, k, v, layer, meta, scale), ref, meta.plan


def random_pool(num_layers, kv_heads, head_dim, dtype=torch.float32, slots=1024, seed=1):
    pool = KVPool(num_layers, slots, kv_heads, head_dim, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    return pool


def shared_tokens(meta, plan) -> list[int]:
    """Flat query rows that took the shared-prefix path."""
    if plan.shared is None:
        return []
    return sorted(t for s in plan.shared.suffixes for t in s.q_flat.tolist())


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads,gqa", [(2, 1), (1, 3), (3, 3), (2, 7)])
def test_shared_prefix_path_matches_plain_path(kv_heads, gqa, head_dim):
    pool = random_pool(2, kv_heads, head_dim)
    meta, q, k, v = make_step(pool, MIXED, kv_heads * gqa)
    out, ref, plan = run_both(pool, meta, q, k, v, layer=1)
    assert_attention_exact(out, pool, meta, q, layer=1, floor=ref)
    # Groups a, b, f, h (decode and verify rows) take the split; the group of one, the rows
    # with no shared prefix, the prefill and the long extend chunks keep the plain path.
    starts = indptr(meta.q_lens, "cpu").tolist()
    expect = [t for b, (g, *_) in enumerate(MIXED) if g in "abfh"
              for t in range(starts[b], starts[b + 1])]
    assert shared_tokens(meta, plan) == expect
    assert MIXED[11][3] > MAX_SHARED_Q_LEN


@pytest.mark.parametrize("requests", [
    [("a", 1, 2, 1), ("a", 1, 5, 1)],  # a prefix of one token, a suffix of one
    [("a", 282, 300, 1)] * 8,  # equal rows: no padding anywhere
    [("a", 30, 31, 1), ("a", 30, 31, 1), ("b", 7, 40, 1), ("b", 7, 8, 1), ("b", 7, 9, 1)],
    [("a", 10, 20, 4), ("a", 10, 14, 4), ("a", 10, 11, 1)],  # verify only
    [("x", 5, 9, 1), ("y", 5, 9, 1), ("z", 0, 9, 3)],  # nothing to share: all plain
])
def test_edge_batches(requests):
    pool = random_pool(1, 3, 64)
    meta, q, k, v = make_step(pool, requests, 9, seed=2)
    out, ref, plan = run_both(pool, meta, q, k, v)
    assert_attention_exact(out, pool, meta, q, floor=ref)
    assert (plan.shared is None) == (requests[0][0] == "x")


# Groups whose prefixes begin with the same 20 slots: c has 5 more of its own, d none (its
# prefix is the common run), e verifies; z shares nothing.
COMMON = [
    ("a", 40, 47, 1), ("c", 25, 26, 1), ("a", 40, 41, 1), ("d", 20, 33, 1), ("b", 40, 52, 1),
    ("z", 0, 11, 1), ("d", 20, 21, 1), ("c", 25, 40, 1), ("e", 30, 35, 4), ("e", 30, 31, 1),
    ("b", 40, 45, 1), ("a", 40, 80, 1),
]


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("kv_heads,gqa", [(2, 1), (3, 3), (1, 7)])
def test_prefix_common_to_all_groups_gets_one_tile(kv_heads, gqa, contiguous):
    pool = random_pool(2, kv_heads, 64)
    meta, q, k, v = make_step(pool, COMMON, kv_heads * gqa, common=20, contiguous=contiguous)
    out, ref, plan = run_both(pool, meta, q, k, v, layer=1)
    assert_attention_exact(out, pool, meta, q, layer=1, floor=ref)
    common, own = plan.shared.prefixes
    starts = indptr(meta.q_lens, "cpu").tolist()
    shared_q = [t for b, (g, *_) in enumerate(COMMON) if g != "z"
                for t in range(starts[b], starts[b + 1])]
    assert sorted(common.q_index.flatten().tolist()) == shared_q
    assert common.kv_slots.shape == (1, 20)
    assert (common.kv_start is not None) == contiguous  # a view of the pool, no gather
    assert own.kv_slots.shape == (4, 20)  # a, b, c, e: their slots after the common 20


@pytest.mark.parametrize("common,parts", [(MIN_COMMON_LEN - 1, 1),
                                          (MIN_COMMON_LEN, 2)])
def test_short_common_run_stays_in_the_group_tiles(common, parts):
    requests = [("a", 40, 45, 1), ("a", 40, 41, 1), ("b", 30, 36, 1), ("b", 30, 33, 1)]
    pool = random_pool(1, 2, 64)
    meta, q, k, v = make_step(pool, requests, 6, common=common)
    out, ref, plan = run_both(pool, meta, q, k, v)
    assert_attention_exact(out, pool, meta, q, floor=ref)
    assert len(plan.shared.prefixes) == parts


def test_prefixes_that_are_all_common():
    """Groups whose whole prefix is the common run: one tile for everyone, no group tiles."""
    requests = [("a", 20, 25, 1), ("a", 20, 22, 1), ("b", 20, 30, 1), ("b", 20, 21, 1),
                ("c", 20, 24, 3), ("c", 20, 21, 1)]
    pool = random_pool(1, 2, 64)
    meta, q, k, v = make_step(pool, requests, 6, common=20)
    out, ref, plan = run_both(pool, meta, q, k, v)
    assert_attention_exact(out, pool, meta, q, floor=ref)
    assert [p.kv_slots.shape for p in plan.shared.prefixes] == [(1, 20)]


# n = 1 requests (multi-turn conversations) after the same 20-slot system prompt: each alone
# in its group, with more prompt of its own (s1, s2, s4) or none (s3); a pair p; z shares nothing.
ALONE = [("s1", 30, 41, 1), ("p", 28, 30, 1), ("s2", 45, 46, 1), ("z", 0, 12, 1),
         ("s3", 20, 27, 1), ("p", 28, 35, 1), ("s4", 24, 31, 3)]


@pytest.mark.parametrize("contiguous", [False, True])
def test_requests_alone_in_their_group_share_the_common_run(contiguous):
    pool = random_pool(2, 3, 64)
    meta, q, k, v = make_step(pool, ALONE, 9, seed=5, common=20, contiguous=contiguous)
    out, ref, plan = run_both(pool, meta, q, k, v, layer=1)
    assert_attention_exact(out, pool, meta, q, layer=1, floor=ref)
    starts = indptr(meta.q_lens, "cpu").tolist()
    assert shared_tokens(meta, plan) == [t for b, (g, *_) in enumerate(ALONE) if g != "z"
                                         for t in range(starts[b], starts[b + 1])]
    # The common run is one tile for all; only the pair has a tile of its own prefix (the
    # lone requests read the rest of their prompt with their suffix).
    assert [p.kv_slots.shape for p in plan.shared.prefixes] == [(1, 20), (1, 8)]


def test_requests_alone_without_a_common_run_stay_plain():
    requests = [(g, MIN_COMMON_LEN + 4, MIN_COMMON_LEN + 9, 1) for g in ("s1", "s2", "s3")]
    pool = random_pool(1, 3, 64)
    meta, q, k, v = make_step(pool, requests, 9, seed=6, common=MIN_COMMON_LEN - 1)
    out, ref, plan = run_both(pool, meta, q, k, v)
    assert_attention_exact(out, pool, meta, q, floor=ref)
    assert plan.shared is None


def test_grpo_step_shape():
    """The benchmark's step: 16 prompts x 8 samples, 314-token prompts of which 282 (a system
    prompt in consecutive slots) are common to all; SmolLM2's heads."""
    requests = [(f"p{g}", 314, 314 + 9, 1) for g in range(16) for _ in range(8)]
    pool = random_pool(1, 3, 64, slots=8192)
    meta, q, k, v = make_step(pool, requests, 9, common=282, contiguous=True)
    out, ref, plan = run_both(pool, meta, q, k, v)
    assert_attention_exact(out, pool, meta, q, floor=ref)
    assert [p.kv_slots.shape for p in plan.shared.prefixes] == [(1, 282), (16, 32)]


def test_matmul_fallback_matches(monkeypatch):
    """Off the CPU the split runs on plain matmuls; the same code on the CPU agrees."""
    monkeypatch.setattr(shared_prefix_attention, "_attention_with_lse",
                        shared_prefix_attention._attention_with_lse_matmul)
    pool = random_pool(1, 2, 64)
    for requests, common in ((MIXED, 0), (COMMON, 20)):
        meta, q, k, v = make_step(pool, requests, 6, seed=3, common=common)
        out, ref, _ = run_both(pool, meta, q, k, v)
        assert_attention_exact(out, pool, meta, q, floor=ref)


def test_bfloat16_close_to_plain_path():
    pool = random_pool(1, 3, 64, dtype=torch.bfloat16)
    meta, q, k, v = make_step(pool, MIXED, 9, seed=4, dtype=torch.bfloat16)
    out, ref, _ = run_both(pool, meta, q, k, v)
    assert_attention_exact(out, pool, meta, q, floor=ref)  # the plain path in bf16: the floor


# --- the engine ---------------------------------------------------------------------------------

def long_prompts(num=3, shared=70, own=12, vocab=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(vocab, (shared,), generator=gen).tolist()
    return [system + torch.randint(vocab, (own,), generator=gen).tolist() for _ in range(num)]


def counting_shared_steps(monkeypatch) -> list[tuple[int, int]]:
    """Records (query rows, prefix parts) of each shared-prefix forward (one per layer)."""
    calls = []
    forward = shared_prefix_attention.attend_shared

    def counted(q, k_pool, v_pool, plan, out, scale, softcap):
        calls.append((sum(s.q_flat.numel() for s in plan.suffixes), len(plan.prefixes)))
        return forward(q, k_pool, v_pool, plan, out, scale, softcap)

    monkeypatch.setattr(shared_prefix_attention, "attend_shared", counted)
    return calls


def split_model(family="llama"):
    return tiny_model(family, num_attention_heads=6, num_key_value_heads=2, hidden_size=96)


def generate_cached_and_not(prompts, params, family="llama", **overrides):
    """The engine on the torch split (the C kernel, the CPU default, off), with prefix caching
    and without."""
    outs = []
    for caching in (True, False):
        engine = Engine(split_model(family),
                        EngineConfig(kv_cache_tokens=4096, max_model_len=256,
                                     enable_prefix_caching=caching, backend="torch",
                                     **overrides))
        outs.append(run_checked(engine, prompts, params))
    return outs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_n8_same_outputs_as_prefix_caching_off(monkeypatch, temperature):
    calls = counting_shared_steps(monkeypatch)
    prompts = long_prompts()
    params = SamplingParams(n=8, temperature=temperature, max_tokens=12, logprobs=True, seed=5)
    on, off = generate_cached_and_not(prompts, params)
    assert samples(on) == samples(off)
    assert_paths_agree(split_model(), prompts, params, on, off)
    # Every sample decoded through the split, the system prompt in one tile for all prompts.
    assert calls and max(calls) == (len(prompts) * 8, 2)


def test_engine_n8_greedy_matches_transformers():
    model = tiny_model("qwen3")
    prompts = long_prompts(num=2, shared=60, own=8)
    engine = Engine(model, EngineConfig(kv_cache_tokens=2048, max_model_len=256,
                                        backend="torch"))
    outs = engine.generate(prompts, SamplingParams(n=8, temperature=0, max_tokens=16,
                                                   logprobs=True))
    assert_matches_reference(model, prompts, outs)
    for out in outs:
        assert all(s.token_ids == out.samples[0].token_ids for s in out.samples)


def test_engine_verify_rows_through_the_split(monkeypatch):
    """n-gram speculation verifies k + 1 positions per sample: those rows take the split too."""
    calls = counting_shared_steps(monkeypatch)
    prompts = [p + p[-20:] * 2 for p in long_prompts(num=2, shared=50, own=10)]  # repetitive
    params = SamplingParams(n=4, temperature=0, max_tokens=16, logprobs=True)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    on, off = generate_cached_and_not(prompts, params, speculative=spec)
    assert samples(on) == samples(off)
    assert calls and max(calls)[0] > len(prompts) * 4  # some step verified drafts in the split
