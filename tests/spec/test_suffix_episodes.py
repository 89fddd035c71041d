"""Drafts from history in multi-turn episodes (issue 27, item 4): a later turn of an episode
drafts from the same turn of earlier epochs' episodes, and the episodes stay those of
speculation off (greedy, and seeded sampling under the default coupled acceptance)."""

from __future__ import annotations

import functools

import pytest
from models import char_tokenizer, tiny_model

from rollout import Engine, EngineConfig, SamplingParams
from rollout.agent import Step, run_episodes
from rollout.spec import SpeculativeConfig

TOK = char_tokenizer()
PROMPTS = ["ab 1+2=", "the cat", "zz top 9"]
TURNS, TURN_TOKENS = 3, 8


class Echo:
    """The same observation after every turn, done after TURNS turns."""

    def reset(self, prompt_ids):
        self.turns = 0

    def step(self, turn_ids, text):
        self.turns += 1
        return Step(observation="<r>42</r>\n", reward=1.0, done=self.turns >= TURNS)


@functools.cache
def model():
    return tiny_model("llama", vocab_size=len(TOK))


def engine(spec=None) -> Engine:
    return Engine(model(), EngineConfig(kv_cache_tokens=4096, max_model_len=256,
                                        speculative=spec), tokenizer=TOK)


def summary(episodes):
    return [[(e.token_ids, e.mask) for e in row] for row in episodes]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_later_turns_draft_from_earlier_episodes(temperature):
    params = SamplingParams(n=1, temperature=temperature, max_tokens=TURN_TOKENS, seed=3,
                            ignore_eos=True)
    want = summary(run_episodes(engine(), PROMPTS, Echo, params, max_turns=TURNS))
    spec = engine(SpeculativeConfig("suffix", num_speculative_tokens=5))
    assert summary(run_episodes(spec, PROMPTS, Echo, params, max_turns=TURNS)) == want
    before = spec.stats.spec_sources.get("history", [0, 0])[1]
    assert summary(run_episodes(spec, PROMPTS, Echo, params, max_turns=TURNS)) == want
    accepted = spec.stats.spec_sources["history"][1] - before
    # A first turn's first token comes from its prefill, so the first turns of the epoch can
    # accept at most TURN_TOKENS - 1 history drafts each: more than that came from later turns
    # drafting from the previous epoch's.
    assert accepted > len(PROMPTS) * (TURN_TOKENS - 1)
    spec.check_invariants()
