"""Every public call with junk in one argument at a time (wrong types, out-of-range numbers,
tensors, NaN, huge ints, nested lists): it either works or raises ValueError naming the
argument, never a TypeError / RuntimeError / AttributeError from deep inside; the engine stays
consistent and then generates what it generated before. test_bad_input.py and
test_bad_fields.py hold the cases that need a chosen message or limit."""

from __future__ import annotations

import math
import pathlib
import re

import numpy as np
import pytest
import torch
from models import char_tokenizer, tiny_model

from rollout import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from rollout.agent import Step, run_episodes
from trainer_hooks import ColocatedRollout
from trainer_hooks.trl_async import EngineRolloutWorker
from trainer_hooks.trl_rollout import make_rollout_func

TOK = char_tokenizer()
TOK.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
GREEDY = SamplingParams(temperature=0, max_tokens=4)
ROWS = [{"prompt": "ab"}]  # an async worker's dataset (rows as TRL's Dataset gives them)
CHAT_ROWS = [{"prompt": [{"role": "user", "content": "ab"}]}]
JUNK = [None, True, False, 0, -1, 1, 2, 3, 2**70, -2**70, 1.5, math.nan, math.inf, "x", "",
        b"x", [], [1], [[1]], [None], [1.5], [-1], [10**9], {}, {"a": 1}, (1,), ("a", 0),
        ("a", "b"), torch.tensor(1), torch.tensor([1, 2]), torch.tensor([[1]]), np.int64(1),
        np.array([1]), object(), 1j]


class Done:
    def reset(self, prompt_ids):
        pass

    def step(self, turn_ids, text):
        return Step(observation="", reward=0.0, done=True)


# (argument, call with the junk value in that argument); the ValueError must name it (the
# trailing spaces keep the keys apart; `source`'s message names the weight).
CALLS = {
    "request_id": lambda e, v: e.abort(v),
    "key": lambda e, v: e.release_hold(v),
    "tokens": lambda e, v: e.cached_prefix_len(v),
    "prompt": lambda e, v: e.add_request(v, GREEDY),
    "params": lambda e, v: e.add_request([1, 2], v),
    "request_id ": lambda e, v: e.add_request([1, 2], GREEDY, request_id=v),
    "hold_kv": lambda e, v: e.add_request([1, 2], GREEDY, hold_kv=v),
    "resume": lambda e, v: e.add_request([1, 2], GREEDY, resume=v),
    "prompt ": lambda e, v: e.generate(v, GREEDY),  # (generate's message names one prompt)
    "params ": lambda e, v: e.generate([[1, 2]], v),
    "use_tqdm": lambda e, v: e.generate([[1, 2]], GREEDY, use_tqdm=v),
    "groups": lambda e, v: e.rollout([[1, 2]], GREEDY, groups=v),
    "abort_rest": lambda e, v: e.rollout([[1, 2]], GREEDY, groups=1, abort_rest=v),
    "use_tqdm ": lambda e, v: e.rollout([[1, 2]], GREEDY, use_tqdm=v),
    "request_ids": lambda e, v: e.rollout([[1, 2]], GREEDY, request_ids=v),
    "conversations": lambda e, v: e.chat(v, GREEDY),
    "chat_template_kwargs": lambda e, v: e.chat([{"role": "user", "content": "a"}], GREEDY,
                                                chat_template_kwargs=v),
    "sequences": lambda e, v: e.score(v),
    "temperature": lambda e, v: e.score([[1, 2, 3]], temperature=v),
    "top_logprobs": lambda e, v: e.score([[1, 2, 3]], top_logprobs=v),
    "start": lambda e, v: e.score([[1, 2, 3]], start=v),
    "use_tqdm  ": lambda e, v: e.score([[1, 2, 3]], use_tqdm=v),
    "level": lambda e, v: e.sleep(v),
    "bucket_bytes": lambda e, v: e.update_weights(e.model_for_test, bucket_bytes=v),
    "source": lambda e, v: e.update_weights(v),
    "probe": lambda e, v: e.update_weights(e.model_for_test, probe=v),
    "probe_reference": lambda e, v: e.update_weights(e.model_for_test, probe=[1, 2, 3],
                                                     probe_reference=v),
    "prompts": lambda e, v: run_episodes(e, v, Done, GREEDY),
    "env_factory": lambda e, v: run_episodes(e, ["ab"], v, GREEDY),
    "params  ": lambda e, v: run_episodes(e, ["ab"], Done, v),
    "max_turns": lambda e, v: run_episodes(e, ["ab"], Done, GREEDY, max_turns=v),
    "max_episode_tokens": lambda e, v: run_episodes(e, ["ab"], Done, GREEDY,
                                                    max_episode_tokens=v),
    "use_tqdm   ": lambda e, v: run_episodes(e, ["ab"], Done, GREEDY, use_tqdm=v),
    "env_workers": lambda e, v: run_episodes(e, ["ab"], Done, GREEDY, env_workers=v),
    "env_timeout": lambda e, v: run_episodes(e, ["ab"], Done, GREEDY, env_timeout=v),
    # trainer_hooks: what they are built with
    "engine": lambda e, v: ColocatedRollout(v, e.model_for_test),
    "model": lambda e, v: ColocatedRollout(e, v),
    "sleep_level": lambda e, v: ColocatedRollout(e, e.model_for_test, sleep_level=v),
    "gather": lambda e, v: ColocatedRollout(e, e.model_for_test, gather=v),
    "synced": lambda e, v: ColocatedRollout(e, e.model_for_test, synced=v),
    "optimizer": lambda e, v: ColocatedRollout(e, e.model_for_test, optimizer=v),
    "carry": lambda e, v: ColocatedRollout(e, e.model_for_test, carry=v),
    "engine_or_factory": lambda e, v: make_rollout_func(v),
    "sleep_level ": lambda e, v: make_rollout_func(e, sleep_level=v),
    "seed": lambda e, v: make_rollout_func(e, seed=v),
    "importance_ratio": lambda e, v: make_rollout_func(e, importance_ratio=v),
    "engine ": lambda e, v: EngineRolloutWorker(v, ROWS, [len], TOK, 2, GREEDY),
    "dataset": lambda e, v: EngineRolloutWorker(e, v, [len], TOK, 2, GREEDY),
    "reward_funcs": lambda e, v: EngineRolloutWorker(e, ROWS, v, TOK, 2, GREEDY),
    "num_generations": lambda e, v: EngineRolloutWorker(e, ROWS, [len], TOK, v, GREEDY),
    "params   ": lambda e, v: EngineRolloutWorker(e, ROWS, [len], TOK, 2, v),
    "groups_in_flight": lambda e, v: EngineRolloutWorker(e, ROWS, [len], TOK, 2, GREEDY, v),
    "queue_maxsize": lambda e, v: EngineRolloutWorker(e, ROWS, [len], TOK, 2, GREEDY,
                                                      queue_maxsize=v),
    "chat_template_kwargs ": lambda e, v: EngineRolloutWorker(
        e, CHAT_ROWS, [len], TOK, 2, GREEDY, chat_template_kwargs=v),
    "max_pending": lambda e, v: EngineRolloutWorker(e, ROWS, [len], TOK, 2, GREEDY,
                                                    max_pending=v),
}


# Where the message names an item or the argument's role rather than the argument.
NAMED = {"prompt ": r"prompt", "sequences": r"sequences(\[\d\])? ", "key": r"(key|hold)",
         "source": r"(weight|update_weights: source)", "prompts": r"prompts?\b",
         "tokens": r"tokens?\b"}


@pytest.fixture(scope="module")
def engine():
    model = tiny_model("llama", vocab_size=len(TOK))
    engine = Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=64, seed=0),
                    tokenizer=TOK)
    engine.model_for_test = model
    return engine


def outputs(engine):
    return [s.token_ids for o in engine.generate([[1, 2, 3], "ab"], GREEDY) for s in o.samples]


@pytest.mark.parametrize("argument", list(CALLS))
def test_junk_in_any_argument_works_or_names_it(engine, argument):
    before = outputs(engine)
    for value in JUNK:
        try:
            CALLS[argument](engine, value)
        except ValueError as e:
            # The message begins with the argument's name, or an item's (prompt,
            # sequences[0], ...), and the refused call left nothing behind.
            name = NAMED.get(argument, argument.strip())
            assert re.match(name, str(e)), (value, str(e))
            assert not (engine.has_unfinished or engine.inspect().holds or engine.is_sleeping
                        or engine.needs_weights), value
        finally:
            if engine.is_sleeping:
                engine.wake_up()
            if engine.needs_weights:  # sleep(2)
                engine.update_weights(engine.model_for_test)
            engine.abort_all()
            for key in list(engine.inspect().holds):
                engine.release_hold(key)
            engine.check_invariants()
    assert outputs(engine) == before


def test_prompts_and_prefixes_as_numpy_arrays(engine):
    """A numpy array of ids is a prompt like the list; an empty one an empty prefix."""
    ids = [1, 2, 3, 4]
    assert outputs_of(engine, np.array(ids)) == outputs_of(engine, ids)
    assert engine.cached_prefix_len(np.array(ids)) == engine.cached_prefix_len(ids) > 0
    for empty in ([], (), "", torch.tensor([], dtype=torch.long), np.array([], np.int64)):
        assert engine.cached_prefix_len(empty) == 0


def outputs_of(engine, prompt):
    return [s.token_ids for s in engine.generate([prompt], GREEDY)[0].samples]


CONFIG = EngineConfig(kv_cache_tokens=256, max_model_len=32)
# What the engine is built with (strings are left out for the models: a name is a checkpoint
# to look up, and tests use no network).
BUILDS = {
    "model": lambda model, v: Engine(v, CONFIG),
    "config": lambda model, v: Engine(model, v),
    "tokenizer": lambda model, v: Engine(model, CONFIG, tokenizer=v),
    "process_group": lambda model, v: Engine(model, CONFIG, process_group=v),
    "speculative": lambda model, v: Engine(model, CONFIG, speculative=v),
    "speculative.draft_model": lambda model, v: Engine(model, CONFIG, speculative=(
        SpeculativeConfig(method="draft", draft_model=v))),
}


@pytest.mark.parametrize("argument", list(BUILDS))
def test_junk_to_build_an_engine_with_names_the_argument(engine, argument):
    for value in JUNK:
        if value is None or isinstance(value, (str, bytes)) and "model" in argument:
            continue
        with pytest.raises(ValueError, match=rf"^{re.escape(argument)}\b"):
            BUILDS[argument](engine.model_for_test, value)


@pytest.mark.parametrize("path", ["/nonexistent/checkpoint", "./no_such_dir", "~/no_such_dir",
                                  pathlib.Path("/nonexistent/checkpoint")])
def test_a_checkpoint_path_that_is_not_there_is_named(path):
    """Not looked up as a hub id (refused as a badly formed one, or retried over the network)."""
    with pytest.raises(ValueError, match=r"^model: no checkpoint directory at"):
        Engine(path, CONFIG)
    with pytest.raises(ValueError, match=r"^speculative.draft_model: no checkpoint directory"):
        Engine(tiny_model("llama", vocab_size=len(TOK)), CONFIG, speculative=SpeculativeConfig(
            method="draft", draft_model=path))


@pytest.mark.parametrize("field, value", [("max_num_seqs", -5), ("kv_cache_tokens", 0),
                                          ("max_model_len", "32")])
def test_a_config_field_set_after_construction_is_checked_when_the_engine_is_built(
        engine, field, value):
    """EngineConfig checks its fields when built; one set afterwards reached torch as a bare
    RuntimeError ("zeros: Dimension size must be non-negative"). The engine checks its own copy
    as the constructor does (the same message), and a later edit of the caller's object leaves
    the running engine's config as it was."""
    config = EngineConfig(kv_cache_tokens=256, max_model_len=32)
    setattr(config, field, value)
    with pytest.raises(ValueError) as constructor:
        EngineConfig(**{**vars(EngineConfig(kv_cache_tokens=256, max_model_len=32)),
                        field: value})
    with pytest.raises(ValueError) as built:
        Engine(engine.model_for_test, config)
    assert str(built.value) == str(constructor.value) and str(built.value).startswith(field)
    config = EngineConfig(kv_cache_tokens=256, max_model_len=32)
    running = Engine(engine.model_for_test, config, tokenizer=TOK)
    config.max_num_seqs = 1
    assert running.config is not config and running.config.max_num_seqs != 1
