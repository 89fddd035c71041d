"""A draft model whose vocab_size differs from the target's by padding rows past every id of
the engine's tokenizer (Qwen2.5: 151,936 in its 0.5B to 3B models, 152,064 in its 7B and larger,
one tokenizer of 151,665 ids; such a pair was refused): it drafts over the target's vocabulary,
its proposals are its own greedy ones (transformers, over the ids the target has), the outputs
those of speculation off; a target's padding id (a random model emits some) reaches the draft
as an id it can embed. Sizes that differ where the tokenizer has ids, or with no tokenizer to
tell, are refused as before."""

import functools

import pytest
import torch
from helpers import run_checked, samples
from models import char_tokenizer, tiny_model

from rollout import Engine, EngineConfig, SamplingParams, SpeculativeConfig

TOK = char_tokenizer()
IDS = len(TOK)
TARGET_VOCAB = IDS + 16
PROMPTS = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [12, 13]]
PARAMS = [SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True),
          SamplingParams(n=2, temperature=1.0, top_k=30, max_tokens=24, seed=3, ignore_eos=True)]


@functools.cache
def target():
    return tiny_model("llama", vocab_size=TARGET_VOCAB)


@functools.cache
def draft(vocab: int):
    return tiny_model("llama", seed=4, num_hidden_layers=1, vocab_size=vocab)


def engine(spec=None, tokenizer=TOK) -> Engine:
    return Engine(target(), EngineConfig(kv_cache_tokens=2048, max_model_len=96,
                                         speculative=spec), tokenizer=tokenizer)


def greedy_draft(model, tokens: list[int], k: int) -> list[int]:
    """k greedy tokens of the draft model in transformers, over the ids the target has."""
    ids = list(tokens)
    with torch.no_grad():
        for _ in range(k):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1, :TARGET_VOCAB].argmax()))
    return ids[len(tokens):]


@pytest.mark.parametrize("vocab", [IDS + 3, TARGET_VOCAB + 24], ids=["smaller", "larger"])
def test_a_draft_padded_apart_drafts_for_the_target(vocab):
    spec = engine(SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=draft(vocab)))
    drafter, checked, padding = spec.speculator.drafter, [], []

    def watched(wanted, siblings, propose=drafter.propose_batch):
        proposals = propose(wanted, siblings)
        for (seq, _), (tokens, _) in zip(wanted, proposals):
            if tokens and seq.params.temperature == 0:
                if max(seq.token_ids) < vocab:
                    checked.append(tokens == greedy_draft(draft(vocab), seq.token_ids,
                                                          len(tokens)))
                else:
                    padding.append(seq.seq_id)
        return proposals
    drafter.propose_batch = watched
    plain = engine()
    for params in PARAMS:
        assert samples(run_checked(spec, PROMPTS, params)) == \
            samples(run_checked(plain, PROMPTS, params))
    assert checked and all(checked)
    assert padding or vocab > TARGET_VOCAB  # the smaller draft read a padding id
    assert spec.stats.spec_proposed > 0


def test_rejection_q_spans_the_target_vocabulary():
    """Under "rejection" q is over the target's ids: nothing on those the draft lacks."""
    vocab = IDS + 3
    spec = engine(SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=draft(vocab),
                                    acceptance="rejection"))
    seen = []

    def watched(logits, rows, items, want_support=None, verify=spec.speculator.verify):
        seen.extend(it.draft_probs for it in items if it.draft)
        return verify(logits, rows, items, want_support)
    spec.speculator.verify = watched
    run_checked(spec, PROMPTS, PARAMS[1])
    assert seen
    for q in seen:
        assert q.shape[1] == TARGET_VOCAB and (q[:, vocab:] == 0).all()
        assert torch.allclose(q.sum(-1), torch.ones(len(q)))


@pytest.mark.parametrize("vocab, tokenizer", [(IDS - 1, TOK), (TARGET_VOCAB + 1, None)],
                         ids=["short_of_the_tokenizer", "no_tokenizer"])
def test_sizes_apart_where_ids_may_differ_are_refused(vocab, tokenizer):
    with pytest.raises(ValueError, match=rf"^speculative.draft_model: vocab_size {vocab} "
                                         rf"differs from the target's {TARGET_VOCAB}"):
        engine(SpeculativeConfig("draft", draft_model=draft(vocab)), tokenizer)
