"""Engine checks that need CUDA (skipped elsewhere): Triton backend and sampler in the loop,
bf16, memory returned by sleep, partial rollouts carried through a sleep, scoring, LoRA. Run by
bench/gpu_check.sh on the GPU machine."""

import gc

import pytest
import torch
from models import FAMILIES, tiny_model
from reference import PROMPTS, assert_matches_reference

from rollout import Engine, EngineConfig, SamplingParams
from rollout.colocation.device_memory import clear_cublas_workspaces
from rollout.spec import SpeculativeConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_engine(model, **kw):
    cfg = dict(kv_cache_tokens=4096, max_model_len=256)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_greedy_and_logprobs_match_transformers_on_cuda(family):
    model = tiny_model(family).cuda()
    engine = cuda_engine(model)
    used = engine.implementations()
    assert used["backend"] == used["attention"] == used["sample"] == "triton", used
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, logprobs=True))
    engine.check_invariants()
    assert_matches_reference(model, PROMPTS, outs, margin=1e-3, atol=2e-4)


def test_bf16_logprobs_close_to_transformers():
    model = tiny_model("qwen2", dtype=torch.bfloat16).cuda()
    engine = cuda_engine(model)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, logprobs=True))
    for prompt, out in zip(PROMPTS, outs):
        tokens = out.samples[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens], device="cuda")).logits[0].float()
        ref = logits[len(prompt) - 1:-1].log_softmax(-1)
        ref = ref.gather(-1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(-1)
        err = (ref.cpu() - torch.tensor(out.samples[0].logprobs)).abs().max().item()
        assert err < 0.1, err


def test_seeded_sampling_same_on_cuda_and_cpu():
    """Counter-based noise: the Triton sampler and the torch sampler pick the same tokens."""
    cpu_model = tiny_model("llama")
    params = SamplingParams(n=4, temperature=0.9, top_k=20, top_p=0.9, max_tokens=12, seed=3)
    cpu = Engine(cpu_model, EngineConfig(kv_cache_tokens=2048, max_model_len=128))
    gpu = cuda_engine(tiny_model("llama").cuda())
    a = [[s.token_ids for s in o.samples] for o in cpu.generate(PROMPTS, params)]
    b = [[s.token_ids for s in o.samples] for o in gpu.generate(PROMPTS, params)]
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    assert same >= 0.9 * sum(len(r) for r in a)  # fp32 rounding may flip a rare near-tie


def test_speculative_greedy_on_cuda():
    model = tiny_model("qwen2").cuda()
    params = SamplingParams(n=2, temperature=0, max_tokens=24)
    plain = cuda_engine(model).generate(PROMPTS, params)
    spec = cuda_engine(model, speculative=SpeculativeConfig("draft", num_speculative_tokens=3,
                                                             draft_model=model))
    outs = spec.generate(PROMPTS, params)
    assert [[s.token_ids for s in o.samples] for o in outs] == \
        [[s.token_ids for s in o.samples] for o in plain]
    assert spec.stats.spec_accepted == spec.stats.spec_proposed > 0


def test_cuda_graph_decode_matches_eager_on_cuda():
    model = tiny_model("qwen2").cuda()
    params = SamplingParams(n=3, temperature=0.8, max_tokens=24, logprobs=True, seed=5)
    eager = cuda_engine(model).generate(PROMPTS, params)
    engine = cuda_engine(model, cuda_graphs=True)
    for _ in range(2):  # the second round replays graphs captured in the first
        graphed = engine.generate(PROMPTS, params)
        for a, b in zip(eager, graphed):
            for sa, sb in zip(a.samples, b.samples):
                assert sa.token_ids == sb.token_ids
                assert max(abs(x - y) for x, y in zip(sa.logprobs, sb.logprobs)) < 1e-4
    assert engine.stack.graphs.replays > 20


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_sleep_returns_cuda_memory(cuda_graphs):
    model = tiny_model("qwen2").cuda()
    # What earlier tests in this process left to the collector (engines in reference cycles)
    # or in cuBLAS's workspaces goes now: the collector may run during this test and sleep
    # clears the workspaces, so they must not count in `before` (a run with the tests spread
    # over xdist workers had 10.8 MB of them there, and sleep(1) came out below `before`).
    gc.collect()
    torch.cuda.synchronize()
    clear_cublas_workspaces()
    before = torch.cuda.memory_allocated()
    engine = cuda_engine(model, kv_cache_tokens=100_000, cuda_graphs=cuda_graphs)
    with_pool = torch.cuda.memory_allocated()
    params = SamplingParams(n=2, temperature=0, max_tokens=8)
    first = engine.generate(PROMPTS, params)
    engine.sleep(1)
    after1 = torch.cuda.memory_allocated()
    engine.wake_up()
    assert engine.generate(PROMPTS, params)[0].samples[0].token_ids == first[0].samples[0].token_ids
    engine.sleep(2)
    after2 = torch.cuda.memory_allocated()
    print(f"allocated: before engine {before}, engine up {with_pool}, sleep(1) {after1}, "
          f"sleep(2) {after2}")
    # An H200 run once left 5.6 KB / 11 KB here: the radix tree's slot tensors, alive in a
    # reference cycle until the garbage collector ran (RadixCache.reset now breaks it). With
    # CUDA graphs another left 66 MiB per capture cycle: the cuBLAS workspaces of the warm-up and
    # capture streams (cleared around each capture and at sleep now).
    assert after1 == before
    assert after2 == before
    engine.wake_up()
    engine.update_weights(model)
    assert engine.generate(PROMPTS, params)[0].samples[0].token_ids == first[0].samples[0].token_ids


@pytest.mark.parametrize("cuda_graphs,carried_kv", [(False, "recompute"), (True, "recompute"),
                                                    (True, "park")])
def test_carried_groups_resume_on_cuda(cuda_graphs, carried_kv):
    """Partial rollouts on the Triton backend (graphed decode too): groups carried through a
    level-2 sleep and an update with the same weights draw the uninterrupted run's tokens;
    logprobs within the graph test's fp32 bound. carried_kv="park": the carried K/V waits in
    pinned host memory, none of it on the GPU (added 2026-12-05, no GPU run yet)."""
    model = tiny_model("qwen2").cuda()
    params = [SamplingParams(n=2, temperature=1.0, max_tokens=4 + 8 * i, logprobs=True, seed=i)
              for i in range(len(PROMPTS))]
    want = {tuple(o.prompt_token_ids): o for o in cuda_engine(model).generate(PROMPTS, params)}
    gc.collect()
    before = torch.cuda.memory_allocated()
    engine = cuda_engine(model, cuda_graphs=cuda_graphs, carried_kv=carried_kv)
    outs = engine.rollout(PROMPTS, params, groups=1)
    assert engine.carried
    engine.sleep(2)
    assert torch.cuda.memory_allocated() == before
    assert (engine.stats.parked_bytes > 0) == (carried_kv == "park")
    engine.wake_up()
    engine.update_weights(model)
    outs += engine.rollout()
    assert engine.stats.retracted > 0 and not engine.carried
    for out in outs:
        for a, b in zip(out.samples, want[tuple(out.prompt_token_ids)].samples):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    engine.check_invariants()


def test_score_on_cuda_matches_generation_and_transformers():
    """Engine.score through the Triton backend, the prompts' K/V from the cache: the logprobs
    generation returned for the same tokens (same kernels on the same positions), and
    transformers' forward within the GPU bound of the generation tests, top-3 alternatives too
    (not run on a GPU yet: added after the 2026-12-04 session's last device call)."""
    model = tiny_model("qwen2").cuda()
    engine = cuda_engine(model)
    params = SamplingParams(n=2, temperature=0.7, max_tokens=16, logprobs=True, seed=4)
    outs = engine.generate(PROMPTS, params)
    seqs = [o.prompt_token_ids + s.token_ids for o in outs for s in o.samples]
    starts = [len(o.prompt_token_ids) for o in outs for _ in o.samples]
    hits = engine.stats.cache_hit_tokens
    scored = engine.score(seqs, temperature=0.7, start=starts, top_logprobs=3)
    assert engine.stats.cache_hit_tokens - hits == sum(p - 1 for p in starts)
    generated = [s.logprobs for o in outs for s in o.samples]
    assert max(abs(a - b) for g, o in zip(generated, scored) for a, b in zip(g, o.logprobs)) < 1e-4
    assert_matches_reference(model, PROMPTS, outs, greedy=False, temperature=0.7, atol=2e-4)
    for seq, start, out in zip(seqs, starts, scored):  # the alternatives: transformers' top 3
        with torch.no_grad():
            logits = model(torch.tensor([seq], device="cuda")).logits[0, start - 1:-1].float()
        top = (logits / 0.7).log_softmax(-1).topk(3, dim=-1)
        assert torch.equal(out.top.ids.cpu(), top.indices.cpu())
        assert (out.top.logprobs.cpu() - top.values.cpu()).abs().max().item() < 2e-4
    engine.check_invariants()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_lora_unmerged_on_cuda(cuda_graphs, family):
    """The Triton shrink and expand (kernels/triton/lora.py; on the MoE experts the grouped
    ones of kernels/triton/fused_moe.py) in the engine, graphed decode included: PEFT's
    forward within the GPU bound, and an adapter-only sync followed by the graphs (replayed on
    the new A and B, copied in place)."""
    pytest.importorskip("peft")
    from lora_models import adapter_bytes, peft_model, randomise_b

    model = peft_model(family).cuda()
    engine = cuda_engine(model, cuda_graphs=cuda_graphs)
    assert engine.lora_status == "unmerged"
    assert engine.stack.implementations()["lora"] == "triton"
    greedy = SamplingParams(temperature=0, max_tokens=24, logprobs=True)
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, greedy), margin=1e-3,
                             atol=2e-4)
    randomise_b(model, seed=9)
    result = engine.update_weights(model)
    assert result["adapter_only"] and result["bytes"] == adapter_bytes(model)
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, greedy), margin=1e-3,
                             atol=2e-4)
