"""Routing replay: Sample.routed_experts holds, for every position of prompt + completion but
the last, the experts each MoE layer of transformers' own model picks when it re-runs that
text (fp32, tiny random configs), however the engine computed the position's K/V: in its own
steps, from the prefix cache (siblings, a repeated prompt), recomputed after preemption or a
sleep, or as an accepted speculative draft."""

import pytest
import torch
from helpers import run_checked
from models import tiny_model
from test_spec import PROMPTS as REPETITIVE

from rollout import Engine, EngineConfig, SamplingParams
from rollout.spec import SpeculativeConfig

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [42] * 9, [5, 99, 3, 100, 6, 7]]
# Where the reference's k-th and (k+1)-th (or two chosen) router probabilities are this close,
# fp32 rounding differences between the engine's batches and the reference may reorder them.
TIE = 1e-5


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def model(request):
    if request.param == "qwen3_moe":  # dense layers mixed in: layers 1 and 2 of 3 are MoE
        return tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[0],
                          norm_topk_prob=False)
    return tiny_model("mixtral")


def reference_routes(model, tokens: list[int], past=None):
    """(expert ids [len, MoE layers, k] the reference's routers return, a bool [len, MoE
    layers] marking near-ties, its K/V cache) when it runs `tokens` after the cache `past`
    (None: from position 0)."""
    ids, logits = [], []
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]

    def keep(module, args, out):
        logits.append(out[0])
        ids.append(out[2])

    hooks = [r.register_forward_hook(keep) for r in routers]
    try:
        with torch.no_grad():
            out = model(torch.tensor([tokens]), cache=past, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    k = ids[0].shape[-1]
    probs = torch.stack(logits, 1).float().softmax(-1)
    top = probs.topk(min(k + 1, probs.shape[-1]), dim=-1).values
    return torch.stack(ids, 1), (top[..., :-1] - top[..., 1:]).min(-1).values < TIE, out.cache


def assert_replays(model, prompts, outs):
    k = model.config.num_experts_per_tok
    for prompt, out in zip(prompts, outs):
        for sample in out.samples:
            routes = sample.routed_experts
            ref, tie, _ = reference_routes(model, prompt + sample.token_ids[:-1])
            assert routes.dtype == torch.int16
            assert routes.shape == (len(prompt) + len(sample.token_ids) - 1, ref.shape[1], k)
            differs = (routes.long() != ref).any(-1)
            assert not (differs & ~tie).any(), f"{int(differs.sum())} positions route apart"


def generate(model, prompts, params, **config):
    engine = Engine(model, EngineConfig(**{"kv_cache_tokens": 1024, "max_model_len": 96,
                                           **config}))
    outs = run_checked(engine, prompts, params)
    return engine, outs


def test_decode_greedy_sampled_and_single_token(model):
    for params in [SamplingParams(temperature=0, max_tokens=12, return_routed_experts=True),
                   SamplingParams(temperature=1.0, max_tokens=12, seed=3,
                                  return_routed_experts=True),
                   SamplingParams(max_tokens=1, return_routed_experts=True)]:
        _, outs = generate(model, PROMPTS, params)
        assert_replays(model, PROMPTS, outs)


def test_prefix_cache_hits_of_siblings_and_repeated_prompts(model):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5,
                            return_routed_experts=True)
    engine, first = generate(model, PROMPTS, params)
    again = run_checked(engine, PROMPTS, params)
    assert engine.stats.cache_hit_tokens > 0
    assert_replays(model, PROMPTS, first)
    assert_replays(model, PROMPTS, again)


def test_preemption_recomputes_the_routes(model):
    prompts = [list(range(1 + 7 * i, 25 + 7 * i)) for i in range(6)]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=30, seed=7,
                            return_routed_experts=True)
    engine, outs = generate(model, prompts, params, kv_cache_tokens=120, max_model_len=80)
    assert engine.stats.preemptions > 0
    assert_replays(model, prompts, outs)


def test_accepted_ngram_drafts_keep_their_routes(model):
    params = SamplingParams(n=2, temperature=0, max_tokens=24, return_routed_experts=True)
    engine, outs = generate(model, REPETITIVE, params,
                            speculative=SpeculativeConfig("ngram", num_speculative_tokens=3))
    assert engine.stats.spec_accepted > 0
    assert_replays(model, REPETITIVE, outs)


def test_routes_survive_sleep_and_wake(model):
    """sleep() frees the pool, routes included; wake_up() allocates them again, empty."""
    params = SamplingParams(temperature=0, max_tokens=8, return_routed_experts=True)
    engine, _ = generate(model, PROMPTS, params)
    engine.sleep()
    engine.wake_up()
    assert_replays(model, PROMPTS, run_checked(engine, PROMPTS, params))


def test_off_by_default_and_refused_for_a_dense_model(model):
    _, outs = generate(model, PROMPTS[:1], SamplingParams(max_tokens=4))
    assert outs[0].samples[0].routed_experts is None
    dense = Engine(tiny_model("qwen3"), EngineConfig(kv_cache_tokens=256, max_model_len=64))
    with pytest.raises(ValueError, match="return_routed_experts.*no MoE layers"):
        dense.generate(PROMPTS[:1], SamplingParams(max_tokens=4, return_routed_experts=True))
