"""Stop conditions: EOS, stop ids, stop strings, max_tokens, max_model_len; abort."""

from helpers import run_checked
from models import char_tokenizer, tiny_model

from rollout import Engine, EngineConfig, SamplingParams


def greedy_run(engine, prompt, **kw):
    params = SamplingParams(temperature=0, **kw)
    return run_checked(engine, [prompt], params)[0].samples[0]


def test_stop_token_ids_eos_and_ignore_eos():
    model = tiny_model("qwen2")
    engine = Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=128))
    free = greedy_run(engine, [3, 4, 5], max_tokens=30)
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    stop_at = free.token_ids[10]
    first = free.token_ids.index(stop_at)
    cut = greedy_run(engine, [3, 4, 5], max_tokens=30, stop_token_ids=[stop_at])
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[:first + 1]
    engine.eos_ids = frozenset({stop_at})
    eos = greedy_run(engine, [3, 4, 5], max_tokens=30)
    assert eos.token_ids == cut.token_ids and eos.finish_reason == "stop"
    ignored = greedy_run(engine, [3, 4, 5], max_tokens=30, ignore_eos=True)
    assert ignored.token_ids == free.token_ids


def test_a_checkpoints_generation_config_ends_samples_too(tmp_path):
    """A checkpoint's generation_config.json may name end ids its config.json does not (an
    instruct model's end of turn): loaded from the path, the engine stops on them, as it
    does for the same model in memory."""
    from transformers import GenerationConfig

    model = tiny_model("qwen2")
    free = greedy_run(Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=128)),
                      [3, 4, 5], max_tokens=30)
    end = free.token_ids[10]  # a token greedy decoding reaches
    model.generation_config = GenerationConfig(eos_token_id=[model.config.eos_token_id, end])
    model.save_pretrained(tmp_path)
    first = free.token_ids.index(end)
    for source in (model, tmp_path):
        engine = Engine(source, EngineConfig(kv_cache_tokens=1024, max_model_len=128,
                                             device="cpu"))
        cut = greedy_run(engine, [3, 4, 5], max_tokens=30)
        assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[:first + 1]


def test_max_model_len_ends_with_length():
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=256, max_model_len=20))
    out = greedy_run(engine, list(range(1, 16)), max_tokens=100)
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_stop_strings_and_text():
    tok = char_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tok))
    engine = Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=128), tokenizer=tok)
    free = greedy_run(engine, "ab 1+2=", max_tokens=40, ignore_eos=True)
    text = tok.decode(free.token_ids, skip_special_tokens=True)
    assert free.text == text
    stop = text[12:14]
    cut = greedy_run(engine, "ab 1+2=", max_tokens=40, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == text[:text.index(stop)]
    assert tok.decode(cut.token_ids).endswith(stop) or stop in tok.decode(cut.token_ids)


def test_a_stop_string_completed_by_a_stop_id_is_cut_too():
    """stop=["\\n"] with stop_token_ids=[the newline's id] (a common pairing): the stop id's
    own text completes the stop string, which is cut from the text as when it is given alone
    (it had been left in: strings were searched only before a stop id)."""
    tok = char_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tok))
    engine = Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=128), tokenizer=tok)
    free = greedy_run(engine, "ab 1+2=", max_tokens=40, ignore_eos=True)
    c = next(ch for ch in free.text[3:] if ch.strip())  # a visible character it reaches
    alone = greedy_run(engine, "ab 1+2=", max_tokens=40, ignore_eos=True, stop=[c])
    both = greedy_run(engine, "ab 1+2=", max_tokens=40, ignore_eos=True, stop=[c],
                      stop_token_ids=[tok.convert_tokens_to_ids(c)])
    assert (both.token_ids, both.text, both.finish_reason) == \
        (alone.token_ids, alone.text, "stop")
    assert c not in both.text


def test_stop_strings_match_the_visible_text_special_tokens_skipped():
    tok = char_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok))
    engine = Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)
    params = dict(temperature=1.0, seed=0, max_tokens=40, ignore_eos=True)
    free = run_checked(engine, ["abc"], SamplingParams(**params))[0].samples[0]
    assert tok.pad_token_id in free.token_ids[:8]  # a special token early in the output
    visible = free.text
    assert visible == tok.decode(free.token_ids, skip_special_tokens=True)
    stop = visible[4:7]  # spans the skipped special token
    cut = run_checked(engine, ["abc"], SamplingParams(**params, stop=[stop]))[0].samples[0]
    assert cut.finish_reason == "stop" and cut.text == visible[:visible.index(stop)]
    # "pad" is only in the special token's own text, which the caller never sees.
    padded = run_checked(engine, ["abc"], SamplingParams(**params, stop=["pad"]))[0].samples[0]
    assert padded.finish_reason == "length" and padded.text == visible


def test_abort_mid_generation_frees_everything():
    engine = Engine(tiny_model("qwen3"), EngineConfig(kv_cache_tokens=1024, max_model_len=64))
    params = SamplingParams(n=3, temperature=1.0, max_tokens=30, seed=0)
    a = engine.add_request([1, 2, 3, 4], params)
    b = engine.add_request([5, 6, 7], params)
    for _ in range(5):
        engine.step()
    engine.abort(a)
    engine.check_invariants()
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
        engine.check_invariants()
    assert [o.request_id for o in outs] == [b]
    assert engine.inspect().kv_free + engine.inspect().cached_tokens == engine.inspect().kv_slots
