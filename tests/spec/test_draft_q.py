"""What a draft model's proposals carry for verification: under "rejection" the q each token
was drawn from (the filtered draft distribution, read by the min(1, p/q) rule); under
"coupled" none, which verify.py never reads there (they held k x V floats a drafting sample:
1.2 GB a step at 256 samples, k = 8 and a 152k vocabulary, computed and dropped)."""

import pytest
import torch
from helpers import run_checked, samples
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams, SpeculativeConfig

PROMPTS = [[1, 2, 3, 4, 5] * 3, [7, 8, 9]]
PARAMS = SamplingParams(n=2, temperature=1.0, top_k=20, max_tokens=20, seed=6)


@pytest.fixture(scope="module")
def models():
    return tiny_model("qwen2"), tiny_model("qwen2", seed=3, num_hidden_layers=1)


def drafted(models, acceptance: str):
    """(outputs, every verified draft with the q it carried)."""
    target, draft = models
    engine = Engine(target, EngineConfig(kv_cache_tokens=2048, max_model_len=96, speculative=(
        SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=draft,
                          acceptance=acceptance))))
    seen = []

    def watched(logits, rows, items, want_support=None, verify=engine.speculator.verify):
        seen.extend((list(it.draft), it.draft_probs) for it in items if it.draft)
        return verify(logits, rows, items, want_support)
    engine.speculator.verify = watched
    return run_checked(engine, PROMPTS, PARAMS), seen


def test_coupled_drafts_carry_no_q(models):
    outs, seen = drafted(models, "coupled")
    assert seen and all(q is None for _, q in seen)
    plain = Engine(models[0], EngineConfig(kv_cache_tokens=2048, max_model_len=96))
    assert samples(outs) == samples(run_checked(plain, PROMPTS, PARAMS))


def test_rejection_drafts_carry_the_q_they_were_drawn_from(models):
    _, seen = drafted(models, "rejection")
    assert seen
    for draft, q in seen:
        assert q.shape == (len(draft), models[1].config.vocab_size)
        assert torch.allclose(q.sum(-1), torch.ones(len(draft)))
        assert (q > 0).sum(-1).max() <= 20  # top_k = 20, as the target's
        assert (q[torch.arange(len(draft)), draft] > 0).all()  # each token drawn from its q
