"""EngineStats accounts for a step's time by phase (the parts never exceed the whole) and counts
tokens as the docs define them, against counts taken from the outputs."""

import pytest
from models import char_tokenizer, tiny_model

from rollout import Engine, EngineConfig, SamplingParams
from rollout.engine.stats import STEP_PHASES as PHASES
from rollout.spec import SpeculativeConfig


def test_step_time_splits_into_phases():
    for spec in (None, SpeculativeConfig("ngram", num_speculative_tokens=3)):
        engine = Engine(tiny_model("qwen2"), EngineConfig(kv_cache_tokens=1024,
                                                          max_model_len=64, speculative=spec))
        engine.generate([[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6]],
                        SamplingParams(n=3, max_tokens=12, temperature=0))
        stats = engine.stats.as_dict()
        parts = [stats[name] for name in PHASES]
        assert all(p >= 0 for p in parts), dict(zip(PHASES, parts))
        assert stats["forward_seconds"] > 0 and stats["commit_seconds"] > 0
        assert sum(parts) <= stats["step_seconds"] + 1e-9
        assert stats["steps"] > 10


PROMPTS = ["the cat sat on", "zz top", "a b c d e f", "ab 1+2=3 and 4"]


def returned_tokens(outs) -> int:
    return sum(len(s.token_ids) for out in outs for s in out.samples)


def test_cache_hits_count_each_samples_prompt_once_under_preemption():
    """prompt_hit_tokens counts prompt tokens matched at a sample's first admission: a sample
    re-admitted after a preemption matches its own output again, which cache_hit_tokens counts
    (217 of 90 prompt tokens here) and the recipes' prefix_cache_hit_rate had divided by the
    prompt tokens (2.4). Each sample computes its last prompt token, so prompt hits stay below
    prompt_tokens by one a sample."""
    tok = char_tokenizer()
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    counts = {}
    for pool in (512, 64):
        engine = Engine(tiny_model("qwen2", vocab_size=len(tok)),
                        EngineConfig(kv_cache_tokens=pool, max_model_len=64, max_num_seqs=8),
                        tokenizer=tok)
        engine.generate(PROMPTS, params)
        counts[pool] = engine.stats
    big, small = counts[512], counts[64]
    assert big.preemptions == 0 and small.preemptions > 0
    assert small.prompt_tokens == big.prompt_tokens
    assert small.prompt_hit_tokens <= small.prompt_tokens - 2 * len(PROMPTS)
    assert small.cache_hit_tokens > small.prompt_tokens  # the preempted samples' own tokens
    assert big.prompt_hit_tokens == big.cache_hit_tokens
    assert big.prompt_hit_tokens + big.prompt_tokens_computed == big.prompt_tokens


def test_generated_tokens_are_the_tokens_the_samples_kept():
    """Drafts verification accepted past a stop were never the sample's: generated_tokens had
    counted them (59 against 57 returned here), so tokens_per_second too."""
    tok = char_tokenizer()
    draft = tiny_model("qwen2", seed=3, num_hidden_layers=1, vocab_size=len(tok))
    for spec in (None, SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=draft),
                 SpeculativeConfig("ngram", num_speculative_tokens=3)):
        engine = Engine(tiny_model("qwen2", vocab_size=len(tok)),
                        EngineConfig(kv_cache_tokens=512, max_model_len=64, speculative=spec),
                        tokenizer=tok)
        outs = engine.generate(PROMPTS + ["ab 1+2="], SamplingParams(
            n=2, temperature=1.0, seed=2, max_tokens=20, stop_token_ids=[5, 7, 9]))
        assert engine.stats.generated_tokens == returned_tokens(outs)


@pytest.mark.parametrize("method", [None, "ngram", "suffix"])
def test_every_step_after_a_lone_samples_prefill_is_a_decode_step(method):
    """One sample, its prompt prefilled in one step: every later step advances it by decode
    tokens, verifying drafts or not (spec_steps are "decode steps that drafted"). A step
    whose every sample verified drafts had not counted (35 of the 39 here)."""
    tok = char_tokenizer()
    spec = method and SpeculativeConfig(method, num_speculative_tokens=3)
    engine = Engine(tiny_model("qwen2", vocab_size=len(tok)),
                    EngineConfig(kv_cache_tokens=512, max_model_len=64, speculative=spec),
                    tokenizer=tok)
    engine.generate(["ab ab ab ab ab"], SamplingParams(temperature=0, max_tokens=40,
                                                        ignore_eos=True))
    stats = engine.stats
    assert stats.decode_steps == stats.steps - 1
    assert (stats.spec_steps > 0) == (method is not None)


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
def test_a_failed_admission_counts_no_prompt_hits(kind, monkeypatch):
    """A step that fails after its scheduling admitted samples rolls the admission back, the
    samples' first-admission mark with it: streamed on, they count their prompt hits once,
    as an engine without the fault does (not twice, nor never)."""
    tok = char_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tok))
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=6)

    def run(fault: bool) -> tuple[int, int]:
        engine = Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=64),
                        tokenizer=tok)
        engine.generate(PROMPTS[:1], params)  # a prompt in the cache to match
        ids = [engine.add_request(p, params) for p in PROMPTS[:2]]
        if fault:
            schedule = engine.scheduler.schedule

            def failing():
                schedule()
                raise kind("injected")
            monkeypatch.setattr(engine.scheduler, "schedule", failing)
            with pytest.raises(kind, match="injected"):
                engine.step()
            monkeypatch.undo()
            engine.check_invariants()
        done = set()
        while engine.has_unfinished:
            done.update(o.request_id for o in engine.step())
        assert done == set(ids)
        return engine.stats.prompt_hit_tokens, engine.stats.cache_hit_tokens

    assert run(fault=True) == run(fault=False)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_sync_failing_while_packing_counts_what_it_wrote(error, monkeypatch):
    """The copy completed (the version moves, the outputs carry it) and packing the weights'
    derived copies failed after it: the sync counts whole, its adapter and bytes included
    (the bytes of the adapter's A and B, in the engine's float32 as the source's)."""
    pytest.importorskip("peft")
    from lora_models import adapter_bytes, peft_model
    model = peft_model("qwen2")
    engine = Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=64))

    def pack():
        raise error("injected")

    monkeypatch.setattr(engine.stack.model, "pack_weights", pack)
    with pytest.raises(error, match="injected"):
        engine.update_weights(model)
    stats = engine.stats
    assert (engine.weights_version, stats.weight_syncs, stats.adapter_syncs,
            stats.weight_sync_bytes) == (1, 1, 1, adapter_bytes(model))
