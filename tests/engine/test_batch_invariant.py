"""EngineConfig(batch_invariant=True): a request's tokens and logprobs are the same bits alone
and in any batch. The reference is each request generated alone on an engine with no prefix
cache (nothing shared, nothing cut); the same requests then run together under everything that
changes a step's shape: mixed lengths and sampling settings, siblings, a system prompt the radix
tree shares, chunked prefill, preemption, a warm cache, speculation. fp32 and bf16, on families
with GQA, sliding windows with soft-capping (Gemma 2), and q/k norms (Qwen3)."""

from __future__ import annotations

import dataclasses
import functools
import os
import random

import pytest
import torch
from kernels_env import rows_rounded_by_position
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams
from rollout.spec import SpeculativeConfig
from rollout_kernels.cpu import paged_attention as native_attention

pytestmark = pytest.mark.skipif(not native_attention.built(),
                                reason=native_attention.why_not())

SYSTEM = [5, 9, 2, 77, 31, 8, 8, 40, 3, 61, 12, 90]  # shared by a third of the prompts


def requests(count: int = 24, seed: int = 0, longest: int = 24, body_len: int = 57):
    """Prompts of 3 to 12 + `body_len` tokens (a third behind SYSTEM, a few repeating themselves
    for the n-gram drafter) and per prompt its own settings: greedy, temperature, top-k, top-p,
    min-p, 1 to 4 samples, 4 to `longest` tokens; 66 samples in all (count 24)."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(count):
        body = [rng.randrange(128) for _ in range(rng.randrange(3, body_len + 1))]
        if i % 4 == 3:
            body = (body[:6] * 6)[:rng.randrange(12, 40)]
        prompts.append(SYSTEM + body if i % 3 == 0 else body)
        kind = i % 5
        params.append(SamplingParams(
            n=(1, 3, 3, 4)[i % 4], max_tokens=min(rng.randrange(4, 25), longest), seed=1000 + i,
            temperature=0.0 if kind == 0 else 0.8, top_k=20 if kind == 2 else -1,
            top_p=0.9 if kind == 3 else 1.0, min_p=0.05 if kind == 4 else 0.0,
            logprobs=True, top_logprobs=2, ignore_eos=True))
    return prompts, params


def record(outs) -> list:
    """Every sample's tokens, logprobs, sampling logprobs and top-2 alternatives, exactly."""
    return [[(s.token_ids, s.logprobs, s.sampling_logprobs, s.top_logprobs.ids.tolist(),
              s.top_logprobs.logprobs.tolist()) for s in out.samples] for out in outs]


def engine(model, **config) -> Engine:
    return Engine(model, EngineConfig(**{"kv_cache_tokens": 8192, "max_model_len": 160,
                                         "batch_invariant": True, **config}))


def alone(model, prompts, params) -> list:
    solo = engine(model, enable_prefix_caching=False)
    return [record(solo.generate([p], [sp]))[0] for p, sp in zip(prompts, params)]


CASES = [("llama", torch.float32), ("gemma2", torch.float32), ("qwen3", torch.float32),
         ("llama", torch.bfloat16), ("gemma2", torch.bfloat16)]


@pytest.mark.parametrize("family,dtype", CASES, ids=[f"{f}-{str(d)[6:]}" for f, d in CASES])
def test_alone_equals_batched(family, dtype):
    model = tiny_model(family, seed=1, dtype=dtype)
    prompts, params = requests()
    reference = alone(model, prompts, params)

    batched = engine(model)
    assert record(batched.generate(prompts, params)) == reference
    assert batched.stats.cache_hit_tokens > 0  # siblings and the system prompt
    # Every prompt now cached whole, the requests in reverse order.
    assert record(batched.generate(prompts[::-1], params[::-1])) == reference[::-1]

    # Prefill cut into 24-token chunks beside decodes, and a pool too small for everyone.
    tight = engine(model, max_num_batched_tokens=24, kv_cache_tokens=400)
    assert record(tight.generate(prompts, params)) == reference
    assert tight.stats.preemptions > 0
    tight.check_invariants()


def scored(eng: Engine, prompts, params, outs) -> list:
    """Engine.score of every sample (prompt + its tokens) from the prompt's end, at the
    temperature its logprobs were reported at (1 for greedy rows)."""
    return [list(r.logprobs) for p, sp, out in zip(prompts, params, outs)
            for r in eng.score([p + s.token_ids for s in out.samples], start=len(p),
                               temperature=sp.temperature or 1.0)]


def logprobs_of(outs) -> list:
    return [s.logprobs for out in outs for s in out.samples]


SCORE_CASES = [("llama", torch.float32), ("llama", torch.bfloat16), ("qwen3_moe", torch.float32)]


@pytest.mark.parametrize("family,dtype", SCORE_CASES,
                         ids=[f"{f}-{str(d)[6:]}" for f, d in SCORE_CASES])
def test_score_gives_the_rollout_logprobs(family, dtype):
    """The trainer's recomputation of the behaviour logprobs (Engine.score of prompt +
    completion: one prefill, the tokens as prompt rows) gives the rollout's logprobs bit for
    bit, so a first PPO/GRPO ratio against them is exactly 1; the default mode's differ (its
    prefill rows round otherwise than its decode rows)."""
    model = tiny_model(family, seed=1, dtype=dtype)
    prompts, params = requests(count=12)
    sampler = engine(model)
    outs = sampler.generate(prompts, params)
    assert scored(sampler, prompts, params, outs) == logprobs_of(outs)  # prompts cached
    assert scored(engine(model), prompts, params, outs) == logprobs_of(outs)  # a fresh engine
    default = Engine(model, EngineConfig(kv_cache_tokens=8192, max_model_len=160))
    outs = default.generate(prompts, params)
    gaps = [max(abs(a - b) for a, b in zip(got, want))
            for got, want in zip(scored(default, prompts, params, outs), logprobs_of(outs))]
    assert sum(g == 0 for g in gaps) < len(gaps) / 2 and max(gaps) > 0, gaps


def test_bf16_at_model_shapes():
    """SmolLM2-135M's widths (one layer): at K = 576 and 1536 oneDNN's packed bf16 layout with
    AMX rounded a row by how many rows shared its call, which the tiny widths above never
    showed (bench/batch_invariance.py: 7.8e-3 apart in logprob on a 25M Qwen2)."""
    model = tiny_model("llama", seed=3, dtype=torch.bfloat16, hidden_size=576,
                       intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                       num_hidden_layers=1)
    prompts, params = requests(count=9, longest=8)
    reference = alone(model, prompts, params)
    batched = engine(model, max_num_batched_tokens=40)
    assert record(batched.generate(prompts, params)) == reference


def test_alone_equals_batched_on_two_threads_with_a_long_vocabulary():
    """The suite runs on one thread; with two, torch splits the sum of a lone row of 32,768
    elements or more across them (a request decoding alone, n = 1): its logprobs must still be
    the bits it gets in a batch (rollout/sample/log_softmax.py as_batch)."""
    model = tiny_model("llama", seed=1, vocab_size=40000)
    prompts, params = requests(count=6)
    params = [dataclasses.replace(sp, n=1) for sp in params]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        reference = alone(model, prompts, params)
        assert record(engine(model).generate(prompts, params)) == reference
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_speculation_changes_nothing(dtype):
    """Coupled acceptance keeps every token; verify rows (k + 1 per sample) must round as the
    decode rows of a run without speculation do."""
    model = tiny_model("llama", seed=1, dtype=dtype)
    prompts, params = requests(count=12)
    reference = alone(model, prompts, params)
    draft = tiny_model("llama", seed=4, dtype=dtype, num_hidden_layers=1)
    for spec in (SpeculativeConfig("ngram", num_speculative_tokens=3),
                 SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=draft)):
        speculating = engine(model, speculative=spec)
        assert record(speculating.generate(prompts, params)) == reference
        assert speculating.stats.spec_proposed > 0


def interpreted(test):
    """A test of the Triton backend on the CPU, under TRITON_INTERPRET=1, with the
    interpreter's matmul rounding a row by its place in the tile, as on AVX2 hosts
    (kernels_env.rows_rounded_by_position): the invariance must not rest on this host's BLAS."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        with rows_rounded_by_position():
            return test(*args, **kwargs)

    return pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
        reason="the Triton backend on the CPU runs under TRITON_INTERPRET=1")(run)


def interpreted_requests():
    """Three requests, 7 samples of 4 tokens, prompts of 22, 29 and 29 tokens (seed 3): the
    interpreter runs a kernel's programs one by one in Python, so its cost grows with the
    query tiles times the key tiles. Each prompt still spans 16-token chunks and two 16-key
    tiles (BLOCK_N under the interpreter) past Gemma 2's window of 8; siblings share their
    prompt."""
    return requests(count=3, seed=3, longest=4, body_len=32)


@interpreted
def test_triton_backend_under_the_interpreter():
    """The Triton backend's invariant mode, every kernel of it run by the interpreter: the
    attention's (one tile shape, no split-KV, no shared-prefix path, window blocks aligned:
    Gemma 2's sliding window found that one), the projections' and the norms' (kernels/triton/
    row_invariant.py). The kernels' own cases: tests/attention/test_invariant_attention.py,
    tests/kernels/test_row_invariant.py."""
    model = tiny_model("gemma2", seed=1)
    prompts, params = interpreted_requests()
    solo = engine(model, backend="triton", enable_prefix_caching=False)
    reference = [record(solo.generate([p], [sp]))[0] for p, sp in zip(prompts, params)]
    batched = engine(model, backend="triton", max_num_batched_tokens=40)
    kinds = batched.implementations()
    assert (kinds["attention"], kinds["RMSNorm"]) == ("triton-invariant", "triton")
    assert kinds["projection"] == kinds["lm_head"] == "triton-invariant"
    outs = batched.generate(prompts, params)
    assert record(outs) == reference
    assert batched.stats.cache_hit_tokens > 0
    assert scored(batched, prompts, params, outs) == logprobs_of(outs)
    # a pool too small for everyone (3 preemptions), prefill in 16-token chunks; n-gram
    # drafts verified; CUDA graphs' padded batches
    tight = engine(model, backend="triton", max_num_batched_tokens=16, kv_cache_tokens=48,
                   max_model_len=40)
    assert record(tight.generate(prompts, params)) == reference
    assert tight.stats.preemptions > 0
    speculating = engine(model, backend="triton",
                         speculative=SpeculativeConfig("ngram", num_speculative_tokens=3))
    assert record(speculating.generate(prompts, params)) == reference
    assert speculating.stats.spec_proposed > 0
    # decode steps padded to graph buckets (7 samples: a padded row in the bucket of 8; off
    # CUDA the graphs' eager stand-in)
    graphed = engine(model, backend="triton", cuda_graphs=True)
    assert record(graphed.generate(prompts, params)) == reference
    assert graphed.stats.graph_captures > 0
    # and the default Triton backend on the same requests is not invariant
    default = Engine(model, EngineConfig(kv_cache_tokens=8192, max_model_len=160,
                                         backend="triton", max_num_batched_tokens=40))
    assert record(default.generate(prompts, params)) != reference


@interpreted
def test_triton_backend_fp32_head_of_an_fp16_model():
    """An fp16 model (the interpreter runs no bf16) with its logits in float32
    (EngineConfig.lm_head_dtype): the head multiplies a float32 copy of its weight."""
    model = tiny_model("llama", seed=2, dtype=torch.float16)
    prompts, params = interpreted_requests()
    config = dict(backend="triton", lm_head_dtype=torch.float32)
    solo = engine(model, enable_prefix_caching=False, **config)
    reference = [record(solo.generate([p], [sp]))[0] for p, sp in zip(prompts, params)]
    batched = engine(model, max_num_batched_tokens=40, **config)
    kinds = batched.implementations()
    assert (kinds["projection"], kinds["lm_head"]) == ("triton-invariant", "triton-invariant-fp32")
    assert record(batched.generate(prompts, params)) == reference
    held = batched.memory_held()
    batched.sleep(1)
    batched.wake_up()
    assert batched.memory_held() == held  # the float32 copy made again, once
    assert record(batched.generate(prompts, params)) == reference


@interpreted
def test_triton_backend_unmerged_lora():
    """A PEFT adapter served unmerged by the Triton shrink and expand (kernels/triton/
    lora.py): their tiles do not depend on the row count; interpreted, they sum explicitly."""
    from lora_models import peft_model

    model = peft_model("llama")
    prompts, params = interpreted_requests()
    solo = engine(model, backend="triton", enable_prefix_caching=False)
    reference = [record(solo.generate([p], [sp]))[0] for p, sp in zip(prompts, params)]
    batched = engine(model, backend="triton", max_num_batched_tokens=40)
    assert batched.lora_status == "unmerged"
    assert batched.implementations()["lora"] == "triton"
    assert record(batched.generate(prompts, params)) == reference


@interpreted
def test_triton_backend_moe_under_the_interpreter():
    """The router through the row-invariant linear, the experts through fused_moe's
    invariant tiles, their k outputs added in one order."""
    model = tiny_model("qwen3_moe", seed=1)
    prompts, params = interpreted_requests()
    solo = engine(model, backend="triton", enable_prefix_caching=False)
    reference = [record(solo.generate([p], [sp]))[0] for p, sp in zip(prompts, params)]
    batched = engine(model, backend="triton", max_num_batched_tokens=40)
    assert batched.implementations()["SparseMoE"] == "triton"
    assert record(batched.generate(prompts, params)) == reference


CUDA_CASES = [("llama", torch.float32), ("llama", torch.bfloat16), ("gemma2", torch.bfloat16),
              ("qwen3_moe", torch.bfloat16)]
on_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                             reason="the Triton backend compiled, on CUDA")


def cuda_model(family: str, dtype: torch.dtype):
    """Sizes at which cuBLAS and torch's CUDA row sums change their split with the row
    count (a 40,000-token vocabulary: a lone row's sum is split across blocks)."""
    return tiny_model(family, seed=1, dtype=dtype, vocab_size=40000, hidden_size=256,
                      intermediate_size=512).cuda()


@on_cuda
@pytest.mark.parametrize("family,dtype", CUDA_CASES,
                         ids=[f"{f}-{str(d)[6:]}" for f, d in CUDA_CASES])
def test_triton_backend_on_cuda(family, dtype):
    """Compiled: the case list of test_alone_equals_batched (its sampler supports and
    alternatives summing rows through rollout/sample/log_softmax.py and the top-p scan),
    Engine.score giving the rollout's logprobs, CUDA graphs, and the fp32 head of a bf16 model; in bf16 the default mode, the control,
    must differ somewhere."""
    model = cuda_model(family, dtype)
    prompts, params = requests()
    reference = alone(model, prompts, params)
    batched = engine(model)
    kinds = batched.implementations()
    assert (kinds["attention"], kinds["projection"], kinds["lm_head"]) == ("triton-invariant",) * 3
    outs = batched.generate(prompts, params)
    assert record(outs) == reference
    assert scored(batched, prompts, params, outs) == logprobs_of(outs)
    tight = engine(model, max_num_batched_tokens=24, kv_cache_tokens=400)
    assert record(tight.generate(prompts, params)) == reference
    assert tight.stats.preemptions > 0
    assert record(engine(model, cuda_graphs=True).generate(prompts, params)) == reference
    if dtype == torch.bfloat16:
        default = Engine(model, EngineConfig(kv_cache_tokens=8192, max_model_len=160))
        assert record(default.generate(prompts, params)) != reference
        solo = engine(model, enable_prefix_caching=False, lm_head_dtype=torch.float32)
        head = [record(solo.generate([p], [sp]))[0] for p, sp in zip(prompts, params)]
        fp32_head = engine(model, lm_head_dtype=torch.float32, max_num_batched_tokens=40)
        assert record(fp32_head.generate(prompts, params)) == head


@on_cuda
def test_triton_backend_unmerged_lora_on_cuda():
    from lora_models import peft_model

    model = peft_model("llama").cuda()
    prompts, params = requests(count=9)
    reference = alone(model, prompts, params)
    batched = engine(model, max_num_batched_tokens=40)
    assert batched.implementations()["lora"] == "triton"
    assert record(batched.generate(prompts, params)) == reference


def test_fp32_head_of_a_bf16_model():
    model = tiny_model("llama", seed=2, dtype=torch.bfloat16)
    prompts, params = requests(count=9)
    solo = engine(model, enable_prefix_caching=False, lm_head_dtype=torch.float32)
    reference = [record(solo.generate([p], [sp]))[0] for p, sp in zip(prompts, params)]
    batched = engine(model, lm_head_dtype=torch.float32, max_num_batched_tokens=40)
    assert record(batched.generate(prompts, params)) == reference


def test_unmerged_lora():
    """A PEFT adapter served unmerged: its shrink and expand take the panels for any number
    of rows, like the base projections."""
    from lora_models import peft_model

    model = peft_model("llama")
    prompts, params = requests(count=9)
    reference = alone(model, prompts, params)
    batched = engine(model, max_num_batched_tokens=40)
    assert batched.lora_status == "unmerged"
    assert record(batched.generate(prompts, params)) == reference


def test_default_mode_is_not_invariant_where_it_says():
    """The check above can fail: without the mode, the same requests batched differ in some
    logprob (shared-prefix blocks, SDPA prefill, F.linear past the panels' row limit)."""
    model = tiny_model("llama", seed=1)
    prompts, params = requests()
    solo = Engine(model, EngineConfig(kv_cache_tokens=8192, max_model_len=160,
                                      enable_prefix_caching=False))
    reference = [record(solo.generate([p], [sp]))[0] for p, sp in zip(prompts, params)]
    batched = Engine(model, EngineConfig(kv_cache_tokens=8192, max_model_len=160))
    assert record(batched.generate(prompts, params)) != reference


@pytest.mark.parametrize("config,message", [
    (dict(backend="torch"), "backend 'torch'"),
    (dict(pack_cpu_weights=False), "pack_cpu_weights"),
    (dict(batch_invariant="yes"), "batch_invariant"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size"),
])
def test_refused_where_rows_cannot_be_kept_apart(config, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_model("llama"), EngineConfig(**{"batch_invariant": True, **config}))


def test_refused_where_the_panels_did_not_load(monkeypatch):
    """Without linear.c (no C compiler, ROLLOUT_NATIVE=0) the cpu backend's projections would
    be oneDNN's or F.linear's, whose rows round with the row count: refused, saying why."""
    from rollout_kernels.cpu import linear as native_linear

    monkeypatch.setattr(native_linear, "invariant_supported", lambda device: False)
    with pytest.raises(ValueError, match="batch_invariant: .*linear.c"):
        Engine(tiny_model("llama"), EngineConfig(batch_invariant=True))


MOE_CASES = [("qwen3_moe", torch.float32), ("mixtral", torch.float32),
             ("qwen3_moe", torch.bfloat16)]


@pytest.mark.parametrize("family,dtype", MOE_CASES,
                         ids=[f"{f}-{str(d)[6:]}" for f, d in MOE_CASES])
def test_moe(family, dtype):
    """The router and every expert multiply through packed copies (rows apart), made with
    the engine, dropped at sleep and made again."""
    model = tiny_model(family, seed=1, dtype=dtype)
    prompts, params = requests(count=9)
    reference = alone(model, prompts, params)
    batched = engine(model, max_num_batched_tokens=40)
    held = batched.memory_held()
    assert record(batched.generate(prompts, params)) == reference
    batched.sleep(1)
    batched.wake_up()
    assert batched.memory_held() == held
    assert record(batched.generate(prompts[::-1], params[::-1])) == reference[::-1]


def test_expert_lora_refused_unmerged_and_merged_under_auto():
    """LoRA on the experts has no batch-invariant unmerged path: "unmerged" refuses it, "auto"
    merges it, at build and at a sync of an engine serving another adapter, which goes on
    serving either way."""
    from lora_models import peft_model
    from reference import PROMPTS, assert_matches_reference

    experts = peft_model("qwen3_moe")
    with pytest.raises(ValueError, match="MoE experts"):
        Engine(experts, EngineConfig(batch_invariant=True, lora="unmerged"))
    greedy = SamplingParams(temperature=0, max_tokens=8, logprobs=True)
    config = EngineConfig(batch_invariant=True, kv_cache_tokens=1024, max_model_len=96)
    assert Engine(experts, config).lora_status.startswith("merged: LoRA on the MoE experts")
    attention = peft_model("qwen3_moe", target_modules=["q_proj", "v_proj"])
    served = Engine(attention, dataclasses.replace(config, lora="unmerged"))
    with pytest.raises(ValueError, match="MoE experts"):
        served.update_weights(experts)
    assert not served.needs_weights and served.lora_status == "unmerged"
    assert_matches_reference(attention, PROMPTS, served.generate(PROMPTS, greedy))
    served = Engine(attention, config)
    served.update_weights(experts)
    assert served.lora_status.startswith("merged")
    assert_matches_reference(experts, PROMPTS, served.generate(PROMPTS, greedy))
