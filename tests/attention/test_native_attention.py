"""The C paged-attention kernel of rollout_kernels.cpu (the cpu backend's attention for decode,
verify and later-turn rows) against a float64 reference and the torch backend's paths, and the
engine with it against the engine without it."""

import dataclasses

import pytest
import torch
from models import tiny_model
from reference import PROMPTS, assert_matches_reference, assert_paths_agree
from test_torch_shared_prefix import MIXED, assert_attention_exact, make_step, random_pool

from rollout import Engine, EngineConfig, SamplingParams
from rollout.attention.cpu import CpuAttention
from rollout.attention.registry import ATTENTION
from rollout.attention.sdpa import TorchAttention
from rollout.ops.backend import resolve_backend
from rollout.spec import SpeculativeConfig
from rollout_kernels import cpu as native
from rollout_kernels.cpu import paged_attention as native_attention

pytestmark = pytest.mark.skipif(not native.has("paged_attention_f32", "plan_chunks"),
                                reason=native.missing_reason("paged_attention_f32"))
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=True)


def native_forward(pool, meta, q, k, v, layer=0, window=None, softcap=None):
    backend = CpuAttention(pool, [window] * pool.num_layers)
    meta = dataclasses.replace(meta, plan=None)
    meta.plan = backend.plan(meta)
    return backend.forward(q, k, v, layer, meta, pool.head_dim ** -0.5, softcap), meta.plan


@pytest.mark.parametrize("kv_heads, q_heads, head_dim", [
    (2, 4, 64), (3, 9, 64), (1, 8, 128), (4, 4, 32), (2, 6, 40),  # 40: no 8-wide fast path
])
@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 20.0), (5, 3.0)])
def test_kernel_matches_float64_reference(kv_heads, q_heads, head_dim, window, softcap):
    # MIXED: decode rows in and out of sharing groups, verify rows, extend chunks, a prefill
    # (the torch path's), contexts of 2..70 slots over 1..2 key blocks, slots scattered.
    pool = random_pool(1, kv_heads, head_dim)
    meta, q, k, v = make_step(pool, MIXED, q_heads, seed=kv_heads + head_dim)
    out, plan = native_forward(pool, meta, q, k, v, window=window, softcap=softcap)
    served = plan.kernel.rows.q_start.numel() if window is None else \
        plan.by_window[window].kernel.rows.q_start.numel()
    # every decode and verify row, and the extend chunks over a context twice their length
    assert served == sum(q <= 17 or (q <= 512 and kv >= 2 * q)
                         for q, kv in zip(meta.q_lens, meta.kv_lens)) == len(meta.q_lens) - 1
    assert not out.isnan().any()
    assert_attention_exact(out, pool, meta, q, window=window, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 20.0)])
def test_a_16_bit_pool_is_read_into_float32(dtype, window, softcap):
    """A bf16 / fp16 pool: the step's distinct slots read into fp32 once a layer, the kernel
    rows attended there: every row as near the float64 answer as the torch path in the pool's
    dtype is (its own floor), the step's K/V stored in the pool."""
    pool = random_pool(1, 3, 64, dtype=dtype)
    meta, q, k, v = make_step(pool, MIXED, 9, seed=6, dtype=dtype)
    out, plan = native_forward(pool, meta, q, k, v, window=window, softcap=softcap)
    kernel_rows = plan.kernel if window is None else plan.by_window[window].kernel
    served = torch.cat([meta.kv_indices[meta.kv_indptr[b]:meta.kv_indptr[b + 1]]
                        for b in kernel_rows.rows.rows])
    assert torch.equal(kernel_rows.slots, served.unique()) and out.dtype == dtype
    assert torch.equal(pool.k(0)[meta.out_slots], k) and torch.equal(pool.v(0)[meta.out_slots], v)
    torch_path = TorchAttention(pool, [window] * pool.num_layers)
    plain = dataclasses.replace(meta, plan=None)
    plain.plan = torch_path.plan(plain)
    floor = torch_path.forward(q, k, v, 0, plain, pool.head_dim ** -0.5, softcap)
    assert_attention_exact(out, pool, meta, q, window=window, softcap=softcap, floor=floor)
    assert kernel_rows.queries.numel() < q.shape[0]  # the prefill's rows: on the torch path


def test_a_nan_query_spoils_its_own_row_only():
    """NaN through the kernel's softmax (its exp takes NaN without undefined behaviour, which
    `make sanitize` checks): the row with a NaN query gives NaN, every other row its value."""
    pool = random_pool(1, 2, 64)
    meta, q, k, v = make_step(pool, MIXED, 4, seed=3)
    q[0, 1, 5] = float("nan")  # the first request is a decode row: the kernel's
    out, _ = native_forward(pool, meta, q, k, v)
    assert out[0, 1].isnan().all()
    rest = torch.ones(out.shape[:2], dtype=torch.bool)
    rest[0, 1] = False
    assert_attention_exact(out, pool, meta, q, rows=rest)


def test_long_contexts_and_a_strided_query():
    # Contexts across many blocks (the online softmax rescales), q a view of a fused QKV
    # projection's output (token stride past the heads), as the models hand it over.
    pool = random_pool(1, 3, 64, slots=8192)
    requests = [("a", 700, 1500, 1), ("a", 700, 900, 1), ("b", 0, 129, 1), ("c", 0, 64, 1),
                ("c", 0, 65, 3)]
    meta, q, k, v = make_step(pool, requests, 9, seed=3)
    qkv = torch.cat([q.flatten(1), torch.randn(q.shape[0], 2 * 3 * 64)], dim=1)
    q_view = qkv[:, :9 * 64].view(q.shape)
    assert not q_view.is_contiguous()
    out, _ = native_forward(pool, meta, q_view, k, v)
    assert_attention_exact(out, pool, meta, q)


def test_agrees_with_the_torch_paths_on_every_layer():
    # The layer's K/V are stored before attending (the new tokens see themselves).
    pool = random_pool(3, 2, 64)
    meta, q, k, v = make_step(pool, MIXED, 8, seed=5, common=24)
    torch_backend = TorchAttention(pool)
    for layer in range(3):
        out, _ = native_forward(pool, meta, q, k, v, layer)
        m = dataclasses.replace(meta, plan=None)
        m.plan = torch_backend.plan(m)
        assert_attention_exact(out, pool, meta, q, layer,
                               floor=torch_backend.forward(q, k, v, layer, m, 0.125))


def test_the_kernel_stores_the_steps_kv_as_index_copy_would():
    """The step's K/V go into the pool inside the kernel's call, before any row reads them: k
    and v as views of the fused QKV output (token stride past their heads), padding slots
    (negative) left alone, every other slot of the pool untouched."""
    pool, reference_pool = random_pool(2, 3, 64), random_pool(2, 3, 64)
    meta, q, k, v = make_step(pool, MIXED, 9, seed=11)
    tokens = q.shape[0]
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    k_view = qkv[:, 9 * 64:12 * 64].view(tokens, 3, 64)
    v_view = qkv[:, 12 * 64:].view(tokens, 3, 64)
    assert not k_view.is_contiguous()
    slots = meta.out_slots.clone()
    slots[1] = -1  # a padded token writes nowhere
    assert meta.q_lens[0] == 1
    rows = native_attention.NativeRows.of([0], meta.qo_indptr.tolist(), meta.q_lens,
                                          meta.kv_indptr.tolist(), meta.kv_lens, meta.kv_indices)
    out = torch.empty_like(q)
    native_attention.paged_attention(q, pool.k(1), pool.v(1), out, rows, 0.125, None, None,
                                     store=(k_view, v_view, slots))
    keep = slots >= 0
    reference_pool.k(1).index_copy_(0, slots[keep], k[keep])
    reference_pool.v(1).index_copy_(0, slots[keep], v[keep])
    assert torch.equal(pool.buffer, reference_pool.buffer)
    # and the request served read the pool after the store: its context ends at its new token
    assert_attention_exact(out, reference_pool, meta, q, 1, rows=slice(1))
    # a slot past the pool raises, as index_copy_ does, and writes nothing
    slots[-1] = pool.num_slots
    before = pool.buffer.clone()
    with pytest.raises(IndexError, match=f"slot {pool.num_slots} of token {tokens - 1}"):
        native_attention.paged_attention(q, pool.k(1), pool.v(1), out, rows, 0.125, None, None,
                                         store=(k_view, v_view, slots))
    assert torch.equal(pool.buffer, before)


def test_off_where_it_cannot_run(monkeypatch):
    cpu = torch.device("cpu")

    def chosen(backend, dtype=torch.float32):
        return resolve_backend(backend, cpu).choose(ATTENTION.implementations, dtype)

    assert chosen("cpu") == "cpu" and chosen("auto") == "cpu"
    assert chosen("torch") == "torch"
    # 16-bit pools are read into fp32 for the kernel; float64 has no kernel.
    assert chosen("cpu", torch.bfloat16) == chosen("cpu", torch.float16) == "cpu"
    assert chosen("cpu", torch.float64) == "torch"
    monkeypatch.setattr(native_attention, "_kernel", lambda: None)  # no compiler, a failed build
    assert chosen("cpu") == chosen("cpu", torch.bfloat16) == "torch"


def test_a_failed_build_leaves_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("ROLLOUT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    native.library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="building the CPU kernels failed"):
            assert native.library() is None
        model = tiny_model("llama")
        engine = Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=64))
        assert engine.implementations()["attention"] == "torch"
        assert_matches_reference(model, PROMPTS[:2], engine.generate(PROMPTS[:2], GREEDY))
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.library() is not None  # the cached build, found again


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mistral"])
def test_engine_matches_transformers_and_the_torch_path(family):
    # gemma2: soft-capping and alternating sliding windows; mistral: a window cutting the
    # context. n = 3 siblings decode beside each other.
    model = tiny_model(family)
    engine = Engine(model, EngineConfig(kv_cache_tokens=2048, max_model_len=128))
    assert engine.implementations()["attention"] == "cpu"
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    params = SamplingParams(n=3, temperature=0.9, max_tokens=16, logprobs=True, seed=4)
    torch_engine = Engine(model, EngineConfig(kv_cache_tokens=2048, max_model_len=128,
                                              backend="torch"))
    assert torch_engine.implementations()["attention"] == "torch"
    assert_paths_agree(model, PROMPTS, params, engine.generate(PROMPTS, params),
                       torch_engine.generate(PROMPTS, params))


def test_speculative_verify_rows():
    model = tiny_model("qwen2")
    greedy = SamplingParams(temperature=0, max_tokens=20)
    plain = Engine(model, EngineConfig(kv_cache_tokens=2048, max_model_len=128))
    spec = Engine(model, EngineConfig(kv_cache_tokens=2048, max_model_len=128,
                                      speculative=SpeculativeConfig("ngram",
                                                                    num_speculative_tokens=4)))
    assert spec.implementations()["attention"] == "cpu"
    outs = spec.generate(PROMPTS, greedy)
    assert [o.samples[0].token_ids for o in outs] == \
        [o.samples[0].token_ids for o in plain.generate(PROMPTS, greedy)]
    assert spec.stats.spec_proposed > 0


def test_chunks_share_the_longest_common_run_of_slots(monkeypatch):
    """plan_chunks: consecutive requests with leading slots in common attend together over
    them (what every member holds and sees), within the row and request budgets; a request
    with nothing in common starts a new chunk."""
    system, a, b = [50, 51, 52, 53], [60, 61], [70, 71, 72]
    contexts = [  # (slots, q_len)
        (system + a + [1, 2], 1), (system + a + [3], 1), (system + b + [4, 5, 6], 2),
        ([90, 91, 92], 1),  # shares nothing: its own chunk
        (system + a + [7], 1), (system + a + [8, 9], 1),
        (system[:2] + [99], 1),  # sees only 2 of the system slots
    ]
    kv = [s for slots, _ in contexts for s in slots]
    starts = [sum(len(c) for c, _ in contexts[:i]) for i in range(len(contexts))]
    rows = native_attention.NativeRows.of(
        list(range(len(contexts))), list(range(len(contexts))), [q for _, q in contexts], starts,
        [len(c) for c, _ in contexts], torch.tensor(kv))
    monkeypatch.setattr(native_attention, "ITEMS_PER_THREAD", 1)
    chunks = rows.chunks(rep=3, threads=1)
    # members: [0, 1, 2] (system only, request 2 being of another prompt), [3], [4, 5, 6]
    # (the last sees 2 slots of the system prompt: its query sits at position 2)
    assert chunks.first.tolist() == [0, 3, 4]
    assert chunks.count.tolist() == [3, 1, 3]
    assert chunks.prefix.tolist() == [4, 0, 2]
    # 4 threads want a chunk each at least: 2 requests a chunk at most; request 2 alone, its
    # 2 queries share the 8 slots before them
    assert rows.chunks(3, 4).count.tolist() == [2, 1, 1, 2, 1]
    assert rows.chunks(3, 4).prefix.tolist() == [6, 8, 0, 6, 0]
    # rows: 48 a chunk at most, so 16 decode rows of 3 query heads
    many = native_attention.NativeRows.of(list(range(40)), list(range(40)), [1] * 40,
                                          [i * 6 for i in range(40)], [6] * 40,
                                          torch.tensor((system + a) * 40))
    assert many.chunks(3, 1).count.tolist() == [16, 16, 8]
    assert many.chunks(3, 1).prefix.tolist() == [5, 5, 5]


@pytest.mark.parametrize("window", [None, 30, 200])
@pytest.mark.parametrize("head_dim", [64, 40, 128, 36])
@pytest.mark.parametrize("samples, softcap", [(12, None), (13, None), (7, 20.0)])
def test_siblings_in_one_chunk_match_float64_reference(monkeypatch, window, head_dim, samples,
                                                       softcap):
    """Samples of a prompt (a 70-slot prefix: two key blocks, the second of 6 keys) decoding
    and verifying side by side in chunks: the prefix read once for all their rows (42 and 30,
    42 and 33, 39 a KV head: every remainder of 4 rows; the keys go onto the lanes where
    head_dim % 8 == 0), each suffix after it; a window of 30 cuts into every context (each
    row then reads its own range)."""
    monkeypatch.setattr(native_attention, "ITEMS_PER_THREAD", 1)
    requests = [("a", 70, 71 + 3 * i, 1 + (i % 3 == 2) * 3) for i in range(samples)]
    pool = random_pool(1, 2, head_dim)
    meta, q, k, v = make_step(pool, requests, 6, seed=11)
    out, plan = native_forward(pool, meta, q, k, v, window=window, softcap=softcap)
    native = (plan.kernel if window is None else plan.by_window[window].kernel).rows
    chunks = native.chunks(rep=3, threads=torch.get_num_threads())
    assert chunks.count.tolist()[0] >= min(8, samples) and chunks.prefix.tolist()[0] == 70
    assert_attention_exact(out, pool, meta, q, window=window, softcap=softcap)


def test_extend_chunks_over_a_context_match_float64_reference():
    """Later turns of conversations: 100 and 37 new tokens after 300 and 80 of context (each
    chunk's context read once for all its queries, the new tokens among themselves query by
    query), beside decode rows; a prefill (no context) stays with SDPA."""
    requests = [("x", 0, 400, 100), ("y", 0, 117, 37), ("z", 0, 50, 1), ("w", 0, 60, 60)]
    pool = random_pool(1, 2, 64)
    meta, q, k, v = make_step(pool, requests, 6, seed=12)
    out, plan = native_forward(pool, meta, q, k, v)
    assert plan.kernel.rows.q_len.tolist() == [100, 37, 1]
    assert_attention_exact(out, pool, meta, q)
