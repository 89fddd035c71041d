"""Admission order under the two schedule policies, and the automatically sized KV pool.

`schedule_policy="lpm"` admits the waiting request with the longest cached prefix first; "fcfs"
admits in arrival order. With max_num_seqs=1 one request runs at a time, so the order in which
outputs come out of step() is the admission order, and the cache hits counted after the first
step tell which request that step admitted.

`kv_cache_tokens=None` sizes the pool from what max_num_seqs requests of max_model_len could
use, capped by `kv_memory_fraction` of the free memory the device reports (rollout/kv/pool.py)
and, on the CPU, by a build-time budget (CPU_POOL_BYTES, never below one max_model_len request);
it refuses to start when one max_model_len request cannot fit. The free-memory reading is
replaced here, so the sizes are exact.
"""

import random
import time

import pytest
import torch
from models import tiny_model

import rollout.kv.pool as kv_pool
from rollout import Engine, EngineConfig, SamplingParams
from rollout.config import DEFAULT_MAX_MODEL_LEN

CACHED = list(range(1, 21))  # 20 tokens, in the prefix cache before the race below
COLD = [30, 31, 32, 33]  # shares nothing with CACHED
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def race(policy: str, **config):
    """COLD is queued first, CACHED + [40] second. Returns (request ids in the order they
    finished, their names, cache-hit tokens counted by the first step)."""
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=256, max_model_len=64,
                                                      max_num_seqs=1, schedule_policy=policy,
                                                      **config))
    engine.generate([CACHED], PARAMS)
    hits = engine.stats.cache_hit_tokens
    names = {engine.add_request(COLD, PARAMS): "cold",
             engine.add_request(CACHED + [40], PARAMS): "warm"}
    order = [o.request_id for o in engine.step()]
    first_step_hits = engine.stats.cache_hit_tokens - hits
    while engine.has_unfinished:
        order += [o.request_id for o in engine.step()]
        engine.check_invariants()
    return [names[r] for r in order], first_step_hits


def test_lpm_admits_the_cache_hitting_request_first():
    order, hits = race("lpm")
    assert order == ["warm", "cold"]
    assert hits == len(CACHED)  # the first step admitted the warm request, on the cache


def test_fcfs_admits_in_arrival_order():
    order, hits = race("fcfs")
    assert order == ["cold", "warm"]
    assert hits == 0  # the first step admitted the cold request


def test_lpm_falls_back_to_fcfs_above_lpm_max_waiting():
    order, hits = race("lpm", lpm_max_waiting=1)  # 2 waiting: sorting is skipped
    assert order == ["cold", "warm"] and hits == 0


def test_lpm_without_prefix_caching_is_fcfs():
    order, hits = race("lpm", enable_prefix_caching=False)
    assert order == ["cold", "warm"] and hits == 0


def test_lpm_admits_a_cold_request_after_bounded_passing():
    """Cache-hitting requests keep arriving behind a cold one: lpm puts each before it, but
    once passed over by LPM_PATIENCE admissions it goes first (it had waited for ever)."""
    from rollout.engine.scheduler import LPM_PATIENCE

    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=256, max_model_len=64,
                                                      max_num_seqs=1))
    engine.generate([CACHED], PARAMS)
    engine.add_request(COLD, PARAMS, request_id="cold")
    done, k = [], 0
    while "cold" not in done and len(done) < 4 * LPM_PATIENCE:
        while engine.inspect().waiting < 3:  # warm ones always waiting beside it
            k += 1
            engine.add_request(CACHED + [40 + k % 50], PARAMS, request_id=f"warm{k}")
        done += [o.request_id for o in engine.step()]
    assert done.index("cold") == LPM_PATIENCE
    engine.check_invariants()


@pytest.mark.parametrize("n", [1, 4])
def test_lpm_admits_a_cold_request_passed_over_behind_preempted_ones(n):
    """A short pool preempts all the time, and the preempted rejoin the front of the queue
    (their tokens cached: lpm admits them first). A cold request that arrived after them is
    the oldest waiting once they are gone: the admissions that pass it over count wherever it
    sits in the queue, and after LPM_PATIENCE of them it goes first (it used to wait 2307
    steps, behind 460 other requests). With n=4 its samples, admitted a round apart (siblings
    wait for the first one's prefill), come through as one request."""
    from rollout.engine.scheduler import LPM_PATIENCE

    rng = random.Random(0)
    shared = [rng.randrange(128) for _ in range(40)]
    cold = [rng.randrange(128) for _ in range(30)]
    engine = Engine(tiny_model("qwen2"), EngineConfig(kv_cache_tokens=120, max_model_len=100,
                                                      seed=1, max_num_batched_tokens=64))
    params = SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)
    waiting = 6  # warm requests always waiting: at most that many admitted a round
    done, step = [], 0
    while "cold" not in done and len(done) < LPM_PATIENCE * waiting:
        while engine.inspect().waiting < waiting:
            engine.add_request(shared + [rng.randrange(128) for _ in range(rng.randrange(1, 6))],
                               params)
        if step == 30:  # 21 requests came before it
            engine.add_request(cold, SamplingParams(n=n, temperature=1.0, max_tokens=5),
                               request_id="cold")
        done += [o.request_id for o in engine.step()]
        step += 1
    assert engine.stats.preemptions > 0
    assert "cold" in done, f"passed over by {len(done)} requests"
    engine.check_invariants()


def test_a_full_batch_orders_no_queue(monkeypatch):
    """With max_num_seqs running nobody can be admitted: the steps in between order no queue
    (each lpm sort walks the radix tree once per waiting sequence) and admission resumes as a
    sequence ends, in lpm order."""
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=256, max_model_len=64,
                                                      max_num_seqs=1))
    walks = []
    prefix_len = engine.kv.prefix_len
    monkeypatch.setattr(engine.kv, "prefix_len", lambda t: walks.append(1) or prefix_len(t))
    engine.generate([CACHED], PARAMS)
    names = {engine.add_request(COLD, PARAMS): "cold",
             engine.add_request(CACHED + [40], PARAMS): "warm"}
    order, sorted_at = [], []
    while engine.has_unfinished:
        before = len(walks)
        order += [names[o.request_id] for o in engine.step()]
        sorted_at.append(len(walks) > before)
        engine.check_invariants()
    assert order == ["warm", "cold"]
    # 3 tokens each: the first step admits warm (2 waiting: sorted), the next two decode it
    # with cold waiting (full: no sort), then cold is admitted alone (1 waiting: sorted once).
    assert sorted_at == [True, False, False, True, False, False]


# --- the automatically sized pool -------------------------------------------------------------
MAX_MODEL_LEN, MAX_NUM_SEQS = 64, 16


def per_token_bytes() -> int:
    """K and V bytes per token of the tiny model, read off an engine with a known pool size."""
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=100, max_model_len=64))
    assert engine.inspect().kv_slots == 100
    return engine.inspect().kv_bytes // 100


def auto_engine(monkeypatch, free_bytes: int, fraction: float = 0.5) -> Engine:
    devices = []
    monkeypatch.setattr(kv_pool, "available_memory",
                        lambda device: devices.append(device) or free_bytes)
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=None,
                                                      kv_memory_fraction=fraction,
                                                      max_model_len=MAX_MODEL_LEN,
                                                      max_num_seqs=MAX_NUM_SEQS))
    assert devices == [torch.device("cpu")]  # the engine's device was asked, once
    return engine


@pytest.mark.parametrize("tokens, fraction", [(300, 0.5), (300, 0.25), (64, 1.0)])
def test_auto_pool_takes_its_fraction_of_free_memory(monkeypatch, tokens, fraction):
    per_token = per_token_bytes()
    # Free memory worth 300 tokens / fraction, plus less than one token that must not count.
    free = int(tokens * per_token / fraction) + per_token // 3
    engine = auto_engine(monkeypatch, free, fraction)
    assert engine.inspect().kv_slots == tokens
    assert engine.inspect().kv_bytes == tokens * per_token
    outs = engine.generate([[1, 2, 3]], SamplingParams(n=2, temperature=0, max_tokens=4))
    assert len(outs[0].samples) == 2
    engine.check_invariants()


def test_auto_pool_is_capped_at_what_the_sequences_can_use(monkeypatch):
    engine = auto_engine(monkeypatch, 1 << 40)  # 1 TiB free
    assert engine.inspect().kv_slots == MAX_NUM_SEQS * MAX_MODEL_LEN


def test_cpu_auto_pool_is_capped_at_its_build_budget(monkeypatch):
    per_token = per_token_bytes()
    # A budget worth 300.5 tokens: the pool takes the 300 whole ones, though the sequences
    # (16 x 64) and the free memory (1 TiB) would allow more.
    monkeypatch.setattr(kv_pool, "CPU_POOL_BYTES", 300 * per_token + per_token // 2)
    engine = auto_engine(monkeypatch, 1 << 40)
    assert engine.inspect().kv_slots == 300 and engine.inspect().kv_bytes == 300 * per_token
    # Free memory below the budget still decides.
    assert auto_engine(monkeypatch, 200 * per_token * 2).pool.num_slots == 200
    # A budget below one max_model_len request gives way to that request.
    monkeypatch.setattr(kv_pool, "CPU_POOL_BYTES", per_token)
    assert auto_engine(monkeypatch, 1 << 40).pool.num_slots == MAX_MODEL_LEN


def test_cpu_budget_does_not_apply_on_cuda(monkeypatch):
    monkeypatch.setattr(kv_pool, "available_memory", lambda device: 1 << 40)
    args = dict(kv_cache_tokens=None, memory_fraction=0.3, max_model_len=4096, max_num_seqs=256,
                bytes_per_token=46080)
    assert kv_pool.size_pool(**args, device=torch.device("cuda")) == 256 * 4096
    assert kv_pool.size_pool(**args, device=torch.device("cpu")) == (256 << 20) // 46080


def test_default_cpu_pool_of_a_135m_model_builds_in_well_under_a_second():
    """SmolLM2-135M's KV layout (30 layers, 3 KV heads of 64, fp32: 45 KiB a token) under the
    default config (256 sequences x 4096 tokens, 30 % of free memory) on this machine: the
    budget, not the 5+ GiB the fraction alone allows. The build is timed on the real pool."""
    layers, kv_heads, head_dim = 30, 3, 64
    per_token = kv_pool.kv_bytes_per_token(layers, kv_heads, head_dim, torch.float32)
    config = EngineConfig()
    max_model_len = DEFAULT_MAX_MODEL_LEN  # (SmolLM2's 8192 positions keep the default's)
    slots = kv_pool.size_pool(None, config.kv_memory_fraction, max_model_len,
                              config.max_num_seqs, per_token, torch.device("cpu"))
    assert slots * per_token <= kv_pool.CPU_POOL_BYTES and slots >= max_model_len
    seconds = []
    for _ in range(2):  # built, then rebuilt as wake_up does after sleep
        start = time.perf_counter()
        pool = kv_pool.KVPool(layers, slots, kv_heads, head_dim, torch.float32,
                              torch.device("cpu"))
        seconds.append(time.perf_counter() - start)
        assert pool.nbytes == slots * per_token
        pool.release()
    # On huge pages a rebuild takes ~0.02 s on a quiet 2-core machine; the first build in a
    # process can take ~1 s on a VM whose host backs never-touched memory on first use. 2 s
    # for the faster of the two leaves room for noise and still catches the 6.5 s the
    # fraction alone cost.
    assert min(seconds) < 2.0, seconds


def test_auto_pool_refuses_when_one_request_cannot_fit(monkeypatch):
    per_token = per_token_bytes()
    free = 2 * (MAX_MODEL_LEN - 1) * per_token  # half of it: one token short
    with pytest.raises(ValueError, match=rf"kv_cache_tokens: the KV pool holds "
                                         rf"{MAX_MODEL_LEN - 1} tokens .* one request of "
                                         rf"max_model_len={MAX_MODEL_LEN} tokens needs "
                                         rf"{MAX_MODEL_LEN}"):
        auto_engine(monkeypatch, free)
    # One token more is enough.
    assert auto_engine(monkeypatch, free + 2 * per_token).pool.num_slots == MAX_MODEL_LEN


def test_explicit_pool_beyond_free_memory_is_refused_naming_both_sizes(monkeypatch):
    per_token = per_token_bytes()
    monkeypatch.setattr(kv_pool, "available_memory", lambda device: 1000 * per_token + 1)
    config = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)
    with pytest.raises(ValueError, match=rf"^kv_cache_tokens=1001 needs {1001 * per_token} "
                                         rf"bytes .* but cpu has {1000 * per_token + 1} bytes "
                                         rf"\(.* MiB\) available \(room for 1000 tokens\)"):
        Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=1001, **config))
    # What the memory holds is taken as asked (not cut to kv_memory_fraction of it).
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=1000, **config))
    assert engine.inspect().kv_slots == 1000


def test_explicit_pool_of_a_terabyte_is_a_value_error_with_the_real_reading():
    # It had been a bare OSError from mmap: no field named, no size compared.
    with pytest.raises(ValueError, match=r"^kv_cache_tokens=2147483647 needs .* available"):
        Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=2**31 - 1, max_model_len=64))


@pytest.mark.parametrize("other", ["short_of_memory", "asking_fewer"])
def test_ranks_agree_on_an_explicit_pool(other):
    """Tensor-parallel ranks offer their spare room, then their sizes: a rank short of memory
    makes every rank refuse (none goes on to build its pool alone); a rank that asked for
    fewer tokens (kv_cache_tokens may differ per rank) gives every rank its smaller pool."""
    offered = []
    spare, size = {"short_of_memory": (-90, 10), "asking_fewer": (1 << 30, 50)}[other]
    others = iter([spare, size])  # what the other rank offers to each agreement

    def agree(value):
        offered.append(value)
        return min(value, next(others))

    args = (100, 0.3, 8, 4)
    if other == "short_of_memory":
        with pytest.raises(ValueError, match=r"kv_cache_tokens=100 needs .*a rank's cpu lacks "
                                             r"room for 90 of the tokens it asks for"):
            kv_pool.size_pool(*args, bytes_per_token=64, device=torch.device("cpu"),
                              agree=agree)
        assert len(offered) == 1 and offered[0] > 0  # this rank's memory holds it all
    else:
        assert kv_pool.size_pool(*args, bytes_per_token=64, device=torch.device("cpu"),
                                 agree=agree) == 50
        assert offered[1] == 100


def test_auto_pool_with_the_real_reading():
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=None, max_model_len=32,
                                                      max_num_seqs=4))
    assert engine.inspect().kv_slots == 4 * 32  # this machine has far more than 128 tokens' worth


def test_free_memory_reading_on_cuda_is_what_the_driver_reports(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: asked.append(device) or (123 << 20, 80 << 30))
    assert kv_pool.available_memory(torch.device("cuda", 1)) == 123 << 20
    assert asked == [torch.device("cuda", 1)]


# --- per-slot extras: an MoE model's routed experts --------------------------------------------
def test_moe_slot_costs_its_kv_and_its_routed_experts(monkeypatch):
    """An MoE model's slot holds its K/V, its int16 expert ids (MoE layers x k) and their int32
    weights version: all count in the bytes per token, so a pool sized by memory holds fewer
    slots than K/V alone would allow, and all count in pool.nbytes and memory_held."""
    from rollout.colocation.device_memory import tensor_bytes

    model = tiny_model("qwen3_moe")  # fp32, every layer sparse
    c = model.config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    extras = c.num_hidden_layers * c.num_experts_per_tok * 2 + 4  # int16 ids, int32 version
    # Free memory worth 300 slots at half of it (and a third of a slot that must not count):
    # K/V alone would make 303 slots of it.
    free = 2 * 300 * (kv + extras) + (kv + extras) // 3
    assert free // 2 // kv == 303
    monkeypatch.setattr(kv_pool, "available_memory", lambda device: free)
    engine = Engine(model, EngineConfig(kv_cache_tokens=None, kv_memory_fraction=0.5,
                                        max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS))
    layout = engine.model.kv_layout
    assert kv_pool.kv_bytes_per_token(layout.num_layers, layout.kv_heads, layout.head_dim,
                                      torch.float32, engine.model.slot_extras()) == kv + extras
    assert engine.inspect().kv_slots == 300
    # The ids and versions have a row more than the slots: padded CUDA-graph tokens write
    # there.
    assert engine.inspect().kv_bytes == 300 * kv + 301 * extras

    def model_bytes() -> int:  # weights, RoPE tables and the CPU's packed weights (awake)
        return (tensor_bytes([*engine.model.parameters(), *engine.model.buffers()])
                + engine.model.derived_bytes())

    free_stack, table = 300 * 8, tensor_bytes([engine.stack.table.table])
    assert engine.memory_held() == model_bytes() + engine.inspect().kv_bytes + free_stack + table
    engine.sleep(level=1)  # the pool goes with its extras; on the CPU the weights stay
    assert engine.inspect().kv_bytes == 0 and engine.memory_held() == model_bytes()


def test_a_pool_alloc_whose_copy_fails_takes_no_slot(monkeypatch):
    """The slots are copied off the free stack before its count drops: a copy that fails
    (out of memory) had left n slots counted as taken that nobody holds, leaked for good."""
    pool = kv_pool.KVPool(num_layers=1, num_slots=8, kv_heads=1, head_dim=1,
                          dtype=torch.float32, device=torch.device("cpu"))

    def failing_clone(self, *args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(torch.Tensor, "clone", failing_clone)
    with pytest.raises(RuntimeError, match="out of memory"):
        pool.alloc(3)
    monkeypatch.undo()
    assert pool.num_free == 8
    assert sorted(pool.alloc(8).tolist()) == list(range(8))
