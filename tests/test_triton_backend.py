"""The engine on the Triton backend (interpreter on CPU) against the torch reference backend."""

import pytest
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.interpreter


def test_triton_backend_matches_torch_backend():
    model = tiny_model("qwen3")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12] * 5]
    params = SamplingParams(n=2, temperature=0.8, max_tokens=6, logprobs=True, seed=1)
    outs = {}
    for backend in ("torch", "triton"):
        engine = Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=64,
                                            attention_backend=backend, max_num_batched_tokens=9))
        outs[backend] = engine.generate(prompts, params)
        engine.check_invariants()
    for a, b in zip(outs["torch"], outs["triton"]):
        for sa, sb in zip(a.samples, b.samples):
            assert sa.token_ids == sb.token_ids
            assert max(abs(x - y) for x, y in zip(sa.logprobs, sb.logprobs)) < 1e-4
