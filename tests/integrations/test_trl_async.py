"""TRL's AsyncGRPOTrainer on the engine (trainer_hooks/trl_async.py), on CPU.

The trainer's own training forward needs two things only a GPU has (a flash-attention kernel
fetched at run time, a CUDA peak-FLOPs lookup); tests/support/flash_varlen.py stands in for them
with a torch reference, so what runs here is TRL's loop, queue, staleness filter and weight sync
around the engine's worker and transfer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import time
import warnings

import flash_varlen
import numpy as np
import pytest
import torch
from datasets import Dataset
from models import char_tokenizer, tiny_model
from transformers import TrainerCallback

from rollout import Engine, EngineConfig, SamplingParams
from trainer_hooks import trl_async
from trainer_hooks.trl_async import EngineRolloutWorker, EngineWeightTransfer, engine_async_grpo

AsyncGRPOConfig = pytest.importorskip("trl.experimental.async_grpo").AsyncGRPOConfig

PROMPTS = ["abc", "hello", "1+1=", "xyz", "the cat", "zz top"]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    flash_varlen.install(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def checkpoint(tmp_path):
    tok = char_tokenizer()
    path = tmp_path / "model"
    tiny_model("qwen2", vocab_size=len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), tok


def length_reward(prompts, completions, completion_ids, **kwargs):
    return [float(len(c)) for c in completions]


def async_args(tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to=[],
                  max_steps=3, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=8, logging_steps=1, save_strategy="no", seed=0,
                  max_staleness=1, queue_maxsize=16)
    kwargs.update(overrides)
    return AsyncGRPOConfig(**kwargs)


@pytest.mark.parametrize("token_budget, past", [(-1, 1), (None, 2)],
                         ids=["fixed_count", "token_budget"])
def test_async_grpo_trains_on_the_engine(tmp_path, checkpoint, monkeypatch, token_budget, past):
    """3 optimizer steps: every sync goes through the engine (cold sync + one a step), samples
    are tagged with the trainer's model version of their oldest token, none older than
    max_staleness is taken from the queue, and on the first (on-policy) step TRL's ratio
    against the engine's logprobs is 1 up to fp32 rounding. What is *trained* can be older,
    by TRL 1.16's own pipeline: accelerate's dispatcher pulls the next micro-batch before the
    current one trains (so across the step's sync: 1 version past), and TokenBudgetBatcher
    holds the sample that closed a micro-batch over into the one after (2 past); the default
    token_budget (None) is the engine's max_model_len, as TRL's is the server's."""
    from trl.experimental.async_grpo import async_grpo_trainer

    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64, max_num_seqs=32),
                    tokenizer=tok)
    trainer = engine_async_grpo(engine, path, length_reward,
                                async_args(tmp_path, token_budget=token_budget),
                                Dataset.from_dict({"prompt": PROMPTS}), tok)
    worker = trainer.rollout_worker
    pushed = []
    put = worker.rollout_buffer.put
    worker.rollout_buffer.put = lambda sample, *a, **k: (pushed.append(sample),
                                                         put(sample, *a, **k))[1]
    # Each micro-batch's samples when collated (at the pull), then the trainer's version when
    # it trains them; a sample's metrics dict is the one its RolloutSample carries.
    collated, trained = [], []
    collate = async_grpo_trainer.DataCollatorForRollout.torch_call
    monkeypatch.setattr(async_grpo_trainer.DataCollatorForRollout, "torch_call",
                        lambda self, examples: (collated.append(
                            [id(e["metrics"]) for row in examples[0] for e in row.samples]),
                            collate(self, examples))[1])
    compute_loss = trainer.compute_loss

    def training_version(model, inputs, *args, **kwargs):
        version = {id(s.metrics): s.model_version for s in pushed}
        trained.extend(trainer.model_version - version[i] for i in collated.pop(0))
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = training_version
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 3
    assert engine.weights_version == 4  # the cold sync at train begin, then one per step
    assert engine.config.max_staleness == 1  # the engine restarts what TRL would drop
    # fp32 rounding: worst seen 1.2e-7 from 1, kl -1.1e-9 (AMD EPYC Zen 3, AVX2), 6.0e-8 and
    # -6.1e-10 (Intel Xeon, AVX-512); the bounds leave >800x for other ISAs
    assert abs(steps[0]["ratio"] - 1) < 1e-4 and steps[0]["kl"] < 1e-6
    assert all(h["sample/staleness_max"] <= 1 for h in steps)  # at the pull
    assert trained and max(trained) <= 1 + past
    # The worker starts after the cold sync, which made the trainer's version 1: the first
    # samples are version 1's. The third step (version 3, max_staleness 1) trains on none of
    # version 1, so newer ones came; none is newer than the last sync.
    assert pushed[0].model_version == 1
    assert 2 <= max(s.model_version for s in pushed) <= 4
    for s in pushed:
        completion = s.completion_mask.astype(bool)
        assert s.input_ids.shape == s.old_log_probs.shape == s.completion_mask.shape
        assert (s.old_log_probs[~completion] == 0).all()
        assert (s.old_log_probs[completion] < 0).all()
    assert not worker._thread.is_alive() and not engine.running_requests


def test_pause_waits_for_the_engine_and_a_dead_worker_says_why(checkpoint):
    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)
    failing = threading.Event()

    def reward(prompts, completions, completion_ids, **kwargs):
        if failing.is_set():
            raise ZeroDivisionError("reward function bug")
        return [1.0] * len(completions)

    worker = EngineRolloutWorker(engine, Dataset.from_dict({"prompt": PROMPTS}), [reward], tok,
                                 num_generations=2, params=SamplingParams(max_tokens=6),
                                 groups_in_flight=3, queue_maxsize=4)
    transfer = EngineWeightTransfer(worker)
    worker.start()
    worker.rollout_buffer.get(timeout=60)
    transfer.pause()  # returns with the thread outside the engine: the update may run
    transfer.send_weights(tiny_model("qwen2", seed=1, vocab_size=len(tok)).named_parameters())
    worker.update_model_version(1)
    transfer.resume()
    # Samples sampled after the update carry version 1 from their first token on. Before them
    # come at most the 4 queued, the last call's group and the 3 carried groups, tagged 0.
    versions = [worker.rollout_buffer.get(timeout=60).model_version for _ in range(40)]
    assert 1 in versions
    worker.check_health(60)
    failing.set()
    deadline = time.time() + 60
    while worker._thread.is_alive() and time.time() < deadline:  # room for its next group
        with contextlib.suppress(queue.Empty):
            worker.rollout_buffer.get(timeout=0.5)
    with pytest.raises(RuntimeError, match="rollout thread failed") as info:
        worker.check_health(60)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    worker.stop()
    engine.check_invariants()
    failing.clear()  # started again, the worker is judged by its new thread alone
    worker.start()
    worker.rollout_buffer.get(timeout=60)
    worker.check_health(60)
    worker.stop()


def test_what_the_engine_cannot_give_is_refused(tmp_path, checkpoint):
    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)
    data = Dataset.from_dict({"prompt": PROMPTS})
    with pytest.raises(ValueError, match="repetition_penalty"):
        engine_async_grpo(engine, path, length_reward,
                          async_args(tmp_path, repetition_penalty=1.2), data, tok)
    with pytest.raises(ValueError, match="tools"):
        engine_async_grpo(engine, path, length_reward, async_args(tmp_path), data, tok,
                          tools=[len])
    dropping = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64,
                                         stale_groups="drop"), tokenizer=tok)
    with pytest.raises(ValueError, match="stale_groups='drop'"):
        engine_async_grpo(dropping, path, length_reward, async_args(tmp_path), data, tok)
    with pytest.raises(ValueError, match="dataset"):
        EngineRolloutWorker(engine, Dataset.from_dict({"prompt": []}), [length_reward], tok, 2,
                            SamplingParams())
    with pytest.raises(ValueError, match="groups_in_flight"):
        EngineRolloutWorker(engine, data, [length_reward], tok, 2, SamplingParams(),
                            groups_in_flight=0)
    # Refused when built, not when the thread reads a row or scores a group (it had died
    # there, and check_health said so steps later).
    with pytest.raises(ValueError, match="dataset: rows must be dicts with a 'prompt'"):
        EngineRolloutWorker(engine, Dataset.from_dict({"question": PROMPTS}),
                            [length_reward], tok, 2, SamplingParams())
    with pytest.raises(ValueError, match="conversations: the tokenizer has no chat template"):
        EngineRolloutWorker(engine, [{"prompt": [{"role": "user", "content": "abc"}]}],
                            [length_reward], tok, 2, SamplingParams())
    with pytest.raises(ValueError, match="reward_funcs"):
        engine_async_grpo(engine, path, None, async_args(tmp_path), data, tok)


def test_stop_while_the_thread_is_in_a_long_engine_call(checkpoint, monkeypatch):
    """stop() returns only once the thread's engine call has returned and the thread ended
    (past STOP_WAIT it says it is still waiting), then aborts what the engine holds: the
    engine is the caller's again (a call from two threads is refused as busy)."""
    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)
    inside, release = threading.Event(), threading.Event()
    step = engine._step_or_raise

    def slow_step():  # the first step of the thread's first call waits
        inside.set()
        release.wait(60)
        return step()
    monkeypatch.setattr(engine, "_step_or_raise", slow_step)
    monkeypatch.setattr(trl_async, "STOP_WAIT", 0.2)
    worker = EngineRolloutWorker(engine, Dataset.from_dict({"prompt": PROMPTS}),
                                 [length_reward], tok, num_generations=2,
                                 params=SamplingParams(max_tokens=6), groups_in_flight=3)
    worker.start()
    assert inside.wait(60)
    timer = threading.Timer(1.0, release.set)  # the call goes on a while after STOP_WAIT
    timer.start()
    with pytest.warns(RuntimeWarning, match="still in an engine call"):
        worker.stop()
    assert release.is_set() and not worker._thread.is_alive() and worker._error is None
    assert not engine.has_unfinished and not engine.carried
    engine.check_invariants()
    hold = threading.Event()  # a thread still running: start() refuses a second one
    worker._thread = threading.Thread(target=hold.wait)
    worker._thread.start()
    with pytest.raises(RuntimeError, match="still running"):
        worker.start()
    hold.set()
    worker._thread.join()


def test_unscorable_completions_get_no_advantage():
    """A completion every reward function returned None for is unscorable: reward NaN,
    advantage 0, left out of the group's mean and spread (as TRL's own worker scores it);
    a None beside another function's reward counts as 0 there. By hand: rewards 1, 0, 1
    scored, mean 2/3, spread sqrt(2)/3."""
    rewards, advantages, spread = trl_async.group_advantages(
        [[1.0, 0.0, None, None], [None, 0.0, 1.0, None]])
    assert np.isnan(rewards[3]) and rewards[:3].tolist() == [1.0, 0.0, 1.0]
    assert spread == pytest.approx(2 ** 0.5 / 3)
    s = 2 ** 0.5 / 3 + 1e-8
    assert advantages.tolist() == pytest.approx([(1 / 3) / s, (-2 / 3) / s, (1 / 3) / s, 0.0])
    _, advantages, spread = trl_async.group_advantages([[None, None]])
    assert advantages.tolist() == [0.0, 0.0] and np.isnan(spread)


def test_a_group_the_engine_aborted_is_not_pushed(checkpoint):
    """An aborted group (non-finite logits) has no completions to train on: none of its
    samples reaches TRL's queue, and its dataset row is not paired with a later group."""
    from rollout import RolloutOutput, Sample

    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)
    worker = EngineRolloutWorker(engine, Dataset.from_dict({"prompt": PROMPTS}),
                                 [length_reward], tok, num_generations=2,
                                 params=SamplingParams(max_tokens=6))
    row = {"prompt": PROMPTS[0]}
    ids = worker._prompt_ids(row, 0)
    worker._rows["0"] = (0, row)  # (its position in the draws, the row)
    aborted = [Sample(index=i, token_ids=[], logprobs=[], finish_reason="abort", text="")
               for i in range(2)]
    worker._push(RolloutOutput("0", ids, aborted, error="logits: the model produced "
                               "non-finite values (nan/inf) for sample 0 at position 3"))
    assert worker.rollout_buffer.empty() and not worker._rows


def test_a_group_is_scored_with_its_own_row(checkpoint, monkeypatch):
    """Two rows with one prompt and other answers, their groups completing in the other
    order (as carried groups do): each is scored with its own row's columns (they had been
    paired by prompt, first in first out, so the answers were swapped)."""
    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)

    def answer_reward(prompts, completions, completion_ids, answer, **kwargs):
        return [float(a) for a in answer]

    data = Dataset.from_dict({"prompt": ["abc", "abc"], "answer": [1, 2]})
    worker = EngineRolloutWorker(engine, data, [answer_reward], tok, num_generations=2,
                                 params=SamplingParams(max_tokens=4), groups_in_flight=2)
    rollout = engine.rollout
    asked = []

    def last_first(prompts, params, groups, **kw):  # every group, the last asked first
        asked.append(prompts)
        return list(reversed(rollout(prompts, params, groups=None, **kw)))

    monkeypatch.setattr(engine, "rollout", last_first)
    worker.start()
    rewards = [worker.rollout_buffer.get(timeout=60).metrics["reward"] for _ in range(4)]
    worker.stop()
    assert len(asked[0]) == 2 and rewards == [2.0, 2.0, 1.0, 1.0]
    assert not worker._rows  # stop() forgets the rows of the groups it aborted


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt], ids=["error", "interrupt"])
def test_an_update_failing_after_its_copy_still_tags_its_samples(checkpoint, monkeypatch, kind):
    """send_weights fails after the engine took the new weights (packing them, out of memory
    say): the engine counts the update (its weights_version moved), so the worker records
    that version as the trainer's next one, as a complete sync does; its samples had been
    tagged version 0, the oldest, and dropped as stale once training went on."""
    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)
    worker = EngineRolloutWorker(engine, Dataset.from_dict({"prompt": PROMPTS}),
                                 [length_reward], tok, num_generations=2,
                                 params=SamplingParams(max_tokens=6), groups_in_flight=2)
    worker.update_model_version(3)
    transfer = EngineWeightTransfer(worker)

    def pack():
        raise kind("packing the new weights")

    monkeypatch.setattr(engine.stack.model, "pack_weights", pack)
    transfer.pause()
    with pytest.raises(kind):
        transfer.send_weights(tiny_model("qwen2", seed=1, vocab_size=len(tok)).named_parameters())
    monkeypatch.undo()
    assert engine.weights_version == 1
    transfer.resume()
    worker.start()
    try:
        versions = {worker.rollout_buffer.get(timeout=60).model_version for _ in range(4)}
    finally:
        worker.stop()
    assert versions == {4}


@pytest.mark.parametrize("importance_ratio", ["untruncated", "full_policy"])
def test_old_log_probs_are_the_importance_ratios_behaviour_logprobs(checkpoint,
                                                                     importance_ratio):
    """Under top-k, TRL's old_log_probs are the engine's untruncated logprobs (its ratio then
    measures the engine-trainer mismatch alone, as trl_rollout's "untruncated") or, with
    "full_policy", the truncated distribution's each token was drawn from (pi / mu): they had
    been the untruncated ones whatever was asked."""
    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)
    worker = EngineRolloutWorker(engine, Dataset.from_dict({"prompt": PROMPTS}),
                                 [length_reward], tok, num_generations=4,
                                 params=SamplingParams(max_tokens=6, top_k=3, seed=0),
                                 importance_ratio=importance_ratio)
    row = {"prompt": PROMPTS[0]}
    worker._rows["0"] = (0, row)  # (its position in the draws, the row)
    out, = engine.rollout([worker._prompt_ids(row, 0)], worker.params, request_ids=["0"])
    worker._push(out)
    pushed = [worker.rollout_buffer.get_nowait() for _ in out.samples]
    for s, sample in zip(out.samples, pushed):
        sent = sample.old_log_probs[sample.completion_mask.astype(bool)]
        want = s.sampling_logprobs if importance_ratio == "full_policy" else s.logprobs
        assert sent.tolist() == pytest.approx(want, abs=1e-6)
        # top-k 3 of the tiny model's vocabulary cuts mass at every token: the two differ
        assert all(t > u for t, u in zip(s.sampling_logprobs, s.logprobs))
    with pytest.raises(ValueError, match="importance_ratio"):
        EngineRolloutWorker(engine, Dataset.from_dict({"prompt": PROMPTS}), [length_reward],
                            tok, 2, SamplingParams(), importance_ratio="on_support")


def run_stop(worker) -> tuple[bool, list]:
    """stop() in a thread: (whether it returned within 30 s, the warnings it gave)."""
    done, caught = threading.Event(), []

    def stop():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            worker.stop()
        caught.extend(str(w.message) for w in seen)
        done.set()

    threading.Thread(target=stop, daemon=True).start()
    return done.wait(30), caught


def test_stop_returns_while_a_reward_function_hangs(checkpoint, monkeypatch):
    """A reward function that never returns (a remote judge gone silent): check_health says
    so, and stop() (TRL's cleanup) returns after STOP_WAIT, saying the thread is outside the
    engine, with the engine's groups aborted; it had said "still in an engine call" and joined
    forever. Released later, the thread ends without calling the engine again."""
    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)
    hang, release = threading.Event(), threading.Event()

    def reward(prompts, completions, completion_ids, **kwargs):
        if hang.is_set():
            release.wait(60)
        return [1.0] * len(completions)

    monkeypatch.setattr(trl_async, "STOP_WAIT", 0.2)
    worker = EngineRolloutWorker(engine, Dataset.from_dict({"prompt": PROMPTS}), [reward], tok,
                                 num_generations=2, params=SamplingParams(max_tokens=4),
                                 groups_in_flight=3)
    rollout = engine.rollout
    calls = []
    monkeypatch.setattr(engine, "rollout", lambda *a, **k: (calls.append(1), rollout(*a, **k))[1])
    worker.start()
    worker.rollout_buffer.get(timeout=60)
    hang.set()
    deadline = time.time() + 60
    with pytest.raises(RuntimeError, match="pushed nothing"):
        while time.time() < deadline:  # the trainer's wait: taking what comes, till a stall
            with contextlib.suppress(queue.Empty):
                worker.rollout_buffer.get(timeout=0.1)
            worker.check_health(0.5)
    returned, caught = run_stop(worker)
    try:
        assert returned, "stop() did not return with the thread in a reward function"
        assert any("outside the engine" in w for w in caught), caught
        assert not any("engine call" in w for w in caught), caught
        assert worker._thread.is_alive() and not engine.carried and not worker._rows
        engine.check_invariants()
        called = len(calls)
    finally:
        release.set()
    worker._thread.join(30)
    assert not worker._thread.is_alive() and worker._error is None and len(calls) == called
    engine.check_invariants()


def test_a_stop_between_the_threads_checks_keeps_it_out_of_the_engine(checkpoint, monkeypatch):
    """stop() may abort the engine's groups as soon as the thread is outside the engine: one
    that comes just as the thread marks itself inside must keep it out (it had gone on into
    one more engine call, with stop() aborting beside it)."""
    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)
    worker = EngineRolloutWorker(engine, Dataset.from_dict({"prompt": PROMPTS}),
                                 [length_reward], tok, num_generations=2,
                                 params=SamplingParams(max_tokens=4))
    calls = []
    monkeypatch.setattr(engine, "rollout", lambda *a, **k: calls.append(1) or [])
    idle = worker._idle
    inside = idle.clear

    def clear():  # stop() lands between the thread's last check and its engine call
        worker._stop.set()
        inside()
    monkeypatch.setattr(idle, "clear", clear)
    worker.start()
    worker._thread.join(30)
    assert not worker._thread.is_alive() and not calls and idle.is_set()
    assert worker._error is None


@pytest.mark.parametrize("form", ["function", "partial", "callable_object"])
def test_async_reward_functions_are_awaited(checkpoint, form):
    """AsyncGRPOTrainer takes reward functions "synchronous or asynchronous" (TRL's worker
    awaits the latter): a coroutine function, a partial of one or an object whose __call__ is
    one is awaited, beside a synchronous one (the thread had died on the coroutine, TypeError:
    'coroutine' object is not iterable)."""
    import functools

    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)

    async def bonus(prompts, completions, completion_ids, weight=1.0, **kwargs):
        await asyncio.sleep(0)
        return [weight * 100.0] * len(completions)

    class Judge:
        async def __call__(self, prompts, completions, completion_ids, **kwargs):
            return await bonus(prompts, completions, completion_ids)

    reward = {"function": bonus, "partial": functools.partial(bonus, weight=1.0),
              "callable_object": Judge()}[form]
    worker = EngineRolloutWorker(engine, Dataset.from_dict({"prompt": PROMPTS}),
                                 [length_reward, reward], tok, num_generations=2,
                                 params=SamplingParams(max_tokens=4), groups_in_flight=2)
    worker.start()
    try:
        samples = [worker.rollout_buffer.get(timeout=60) for _ in range(4)]
        worker.check_health(60)
    finally:
        worker.stop()
    for s in samples:
        assert s.metrics["reward"] == 100.0 + len(s.completion)


def test_a_prompt_past_max_model_len_names_its_row(checkpoint):
    """Row 0 is checked when the worker is built (a prompt past max_model_len is refused
    there); a later row too long fails the thread when it is read, the error naming the row
    (it had named max_model_len alone, the thread's batch refused by the engine)."""
    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)
    prompts = list(PROMPTS)
    prompts[2] = "a" * 80
    with pytest.raises(ValueError, match=r"dataset row 0: prompt: 80 tokens, more than "
                                         r"max_model_len - 1 = 63"):
        EngineRolloutWorker(engine, Dataset.from_dict({"prompt": prompts[2:]}),
                            [length_reward], tok, 2, SamplingParams(max_tokens=4))
    worker = EngineRolloutWorker(engine, Dataset.from_dict({"prompt": prompts}),
                                 [length_reward], tok, num_generations=2,
                                 params=SamplingParams(max_tokens=4), groups_in_flight=3)
    worker.start()
    worker._thread.join(60)
    with pytest.raises(RuntimeError, match="rollout thread failed") as info:
        worker.check_health(60)
    assert isinstance(info.value.__cause__, ValueError)
    assert "dataset row 2: prompt: 80 tokens, more than max_model_len - 1 = 63" in str(
        info.value.__cause__)
    worker.stop()
    assert not engine.carried and not worker._rows
    engine.check_invariants()


def test_a_refused_call_leaves_the_engine_and_args_as_they_were(tmp_path, checkpoint,
                                                                monkeypatch):
    """engine_async_grpo rebinds the engine's config (max_staleness) and args.token_budget
    only once the trainer is built: a call refused by the worker's checks, or failing in
    TRL's constructor, leaves both as they were (max_staleness had gone None -> 0 after a
    refused call)."""
    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)
    config = engine.config
    args = async_args(tmp_path, max_staleness=0)
    with pytest.raises(ValueError, match="reward_funcs"):
        engine_async_grpo(engine, path, None, args, Dataset.from_dict({"prompt": PROMPTS}), tok)
    with pytest.raises(ValueError, match="dataset: empty"):
        engine_async_grpo(engine, path, length_reward, args, Dataset.from_dict({"prompt": []}),
                          tok)

    def fail(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(trl_async.engine_trainer_class(), "__init__", fail)
    with pytest.raises(KeyboardInterrupt):
        engine_async_grpo(engine, path, length_reward, args,
                          Dataset.from_dict({"prompt": PROMPTS}), tok)
    assert engine.config is config and config.max_staleness is None
    assert args.token_budget is None


def test_the_worker_keeps_what_the_trainer_can_take_within_max_staleness(tmp_path, checkpoint,
                                                                         monkeypatch):
    """With fixed-count batches the worker keeps at most max_staleness steps' samples produced
    and not yet taken by the trainer (queued, or of groups in the engine; TRL takes a step's
    one step early): whenever it calls the engine, and when training ends. It had filled TRL's
    queue far ahead (queue_maxsize 64: two thirds of the samples produced were dropped as
    stale). An explicit max_inflight_tasks (TRL's concurrent generations) sets the groups kept
    in the engine; under a token budget only they and queue_maxsize bound the worker."""
    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64, max_num_seqs=32),
                    tokenizer=tok)
    args = async_args(tmp_path, max_staleness=1, per_device_train_batch_size=8, queue_maxsize=64,
                      token_budget=-1, max_steps=4)
    trainer = engine_async_grpo(engine, path, length_reward, args,
                                Dataset.from_dict({"prompt": PROMPTS}), tok)
    worker, bound = trainer.rollout_worker, 8  # 1 step of 8 samples
    q = worker.rollout_buffer
    produced, taken, ahead = [0], [0], []
    put, get = q.put, q.get
    q.put = lambda *a, **k: (produced.__setitem__(0, produced[0] + 1), put(*a, **k))[1]
    q.get = lambda *a, **k: (taken.__setitem__(0, taken[0] + 1), get(*a, **k))[1]
    rollout = engine.rollout

    def counted(prompts, params, **kwargs):  # the trainer only takes meanwhile
        ahead.append(q.qsize() + (len(engine.carried) + len(prompts)) * params.n)
        return rollout(prompts, params, **kwargs)

    monkeypatch.setattr(engine, "rollout", counted)
    trainer.train()
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 4
    assert ahead and max(ahead) <= bound
    assert produced[0] - taken[0] <= bound
    built = engine_async_grpo(engine, path, length_reward,
                              async_args(tmp_path, max_inflight_tasks=8),
                              Dataset.from_dict({"prompt": PROMPTS}), tok)
    assert built.rollout_worker.groups_in_flight == 2  # 8 generations, 4 a group
    assert built.rollout_worker.max_pending is None and built.args.token_budget == 64
    # Over two processes a step is both ranks' samples: the worker, on the main one, feeds
    # them all (it had bounded itself by one rank's, halving what TRL could train on).
    monkeypatch.setattr(type(args), "world_size", property(lambda self: 2))
    two = engine_async_grpo(engine, path, length_reward, args,
                            Dataset.from_dict({"prompt": PROMPTS}), tok)
    assert two.rollout_worker.max_pending == 16  # 1 step of 8 samples on each of 2
    with pytest.raises(ValueError, match="max_pending"):
        EngineRolloutWorker(engine, Dataset.from_dict({"prompt": PROMPTS}), [length_reward],
                            tok, 4, SamplingParams(), max_pending=3)


def test_a_resumed_run_draws_from_the_first_group_it_had_not_trained(tmp_path, checkpoint):
    """TRL writes rollout_state.json (where the prompts resume) and reads it back only for its
    own worker: a run with the engine's, resumed from a checkpoint, drew from row 0 again,
    training the first prompts twice, and its epoch count started from 0. The reference is
    TRL's rule (the first group not trained, in the order the groups were drawn), applied to
    what the first run drew and trained."""
    path, tok = checkpoint
    prompts = [f"q{i}" for i in range(24)]  # fewer draws than rows: a row is its position
    out = tmp_path / "out"

    def run(resume=None, max_steps=2):
        engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64,
                                           max_num_seqs=32), tokenizer=tok)
        args = async_args(tmp_path, token_budget=-1, max_steps=max_steps,
                          save_strategy="steps", save_steps=2)
        trainer = engine_async_grpo(engine, path, length_reward, args,
                                    Dataset.from_dict({"prompt": prompts}), tok,
                                    groups_in_flight=2)
        worker, drawn, pushed, saved = trainer.rollout_worker, [], {}, {}
        prompt_ids, put = worker._prompt_ids, worker.rollout_buffer.put
        worker._prompt_ids = lambda row, index: (drawn.append(index), prompt_ids(row, index))[1]
        worker.rollout_buffer.put = lambda sample, *a, **k: (
            pushed.__setitem__(sample.group_id, prompts.index(sample.prompt)),
            put(sample, *a, **k))[1]

        class AtSave(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):
                trained = {pushed[g] for g in trainer._trained_groups}
                saved["first"] = next(row for row in drawn if row not in trained)

        trainer.add_callback(AtSave())
        trainer.train(resume_from_checkpoint=resume)
        return trainer, drawn, saved

    trainer, _, saved = run()
    with open(out / "checkpoint-2" / "rollout_state.json") as f:
        state = json.load(f)
    assert state == {"prompt_index": saved["first"], "model_version": trainer.model_version}
    assert 0 < saved["first"]
    resumed, drawn, _ = run(resume=str(out / "checkpoint-2"), max_steps=3)
    assert drawn[0] == saved["first"]
    assert resumed._groups_before_resume == saved["first"]  # TRL's epoch count goes on
    # Its versions go on from the checkpoint's: the cold sync at train begin, then step 3's.
    assert resumed.model_version == state["model_version"] + 2


def test_a_second_train_call_starts_the_worker_again(tmp_path, checkpoint):
    """Each train() stops the worker when it ends (TRL's _inner_training_loop), but TRL's
    train-begin callback (cold sync, worker start) fires once per trainer: a second train()
    on the same trainer (going on after a first, resuming in the process) found no thread
    and failed after TRL's 5 s poll ("rollout thread is not running"). Each call is a run
    of its own: a cold sync, then one sync a step, as the first."""
    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64, max_num_seqs=32),
                    tokenizer=tok)
    trainer = engine_async_grpo(engine, path, length_reward, async_args(tmp_path, max_steps=1),
                                Dataset.from_dict({"prompt": PROMPTS}), tok)
    trainer.train()
    assert engine.weights_version == 2  # the cold sync, then step 1's
    trainer.args.max_steps = 2
    trainer.train()
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 2  # this run's
    assert engine.weights_version == 5  # again: a cold sync, then steps 1 and 2
    assert not trainer.rollout_worker._thread.is_alive() and not engine.running_requests


def test_each_reward_function_is_logged_under_trls_name(checkpoint):
    """TRL's worker puts each reward function's reward on a sample's metrics as
    rewards/<name> (trl's get_callable_name: a partial's function, a callable object's class),
    None as NaN, beside the sum; the engine's had the sum alone, so a run with several
    functions logged none of them."""
    import functools

    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)

    def scaled(prompts, completions, completion_ids, scale, **kwargs):
        return [scale * len(c) for c in completions]

    class Unscorable:
        def __call__(self, prompts, completions, completion_ids, **kwargs):
            return [None] * len(completions)

    worker = EngineRolloutWorker(engine, Dataset.from_dict({"prompt": PROMPTS}),
                                 [length_reward, functools.partial(scaled, scale=2.0),
                                  Unscorable()], tok, num_generations=2,
                                 params=SamplingParams(max_tokens=6, seed=0))
    row = {"prompt": PROMPTS[0]}
    worker._rows["0"] = (0, row)
    out, = engine.rollout([worker._prompt_ids(row, 0)], worker.params, request_ids=["0"])
    worker._push(out)
    for s in out.samples:
        metrics = worker.rollout_buffer.get_nowait().metrics
        length = float(len(s.text))
        assert metrics["rewards/length_reward"] == length
        assert metrics["rewards/scaled"] == 2 * length
        assert np.isnan(metrics["rewards/Unscorable"])
        assert metrics["reward"] == 3 * length


def test_conversational_completions_are_parsed_as_trls_worker_parses_them():
    """TRL's worker hands reward functions each completion parsed with the tokenizer's
    response template (add_response_schema, for the chat templates TRL knows): a Qwen3
    answer's reasoning apart from its content. The engine's gave the decoded text as content,
    <think> block included, so a reward reading the content scored other text than under
    TRL's worker. The reference: TRL's own parse_response. A template TRL does not know keeps
    the decoded text (TRL's worker refuses it)."""
    import string

    from rollout import RolloutOutput, Sample
    from trl.chat_template_utils import add_response_schema, parse_response, qwen3_chat_template

    def tokenizer(template):
        tok = char_tokenizer(string.ascii_letters + string.digits + " \n+=")
        tok.add_tokens(["<think>", "</think>", "<|im_start|>", "<|im_end|>"])
        tok.chat_template = template
        return tok

    seen = []

    def reward(prompts, completions, completion_ids, **kwargs):
        seen.extend(completions)
        return [1.0] * len(completions)

    answers = ["<think>\nsum\n</think>\n\nTwo<|im_end|>", "Three<|im_end|>"]
    for template in (qwen3_chat_template, "{% for m in messages %}{{ m.content }}{% endfor %}"):
        tok = tokenizer(template)
        engine = Engine(tiny_model("qwen2", vocab_size=len(tok)),
                        EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)
        row = {"prompt": [{"role": "user", "content": "1+1"}]}
        worker = EngineRolloutWorker(engine, Dataset.from_list([row]), [reward], tok,
                                     num_generations=2, params=SamplingParams(max_tokens=6))
        ids = worker._prompt_ids(row, 0)
        samples = [Sample(index=i, token_ids=tok.encode(a, add_special_tokens=False),
                          logprobs=[-1.0] * len(tok.encode(a, add_special_tokens=False)),
                          finish_reason="stop", text=tok.decode(tok.encode(
                              a, add_special_tokens=False), skip_special_tokens=True))
                   for i, a in enumerate(answers)]
        worker._rows["0"] = (0, row)
        seen.clear()
        worker._push(RolloutOutput("0", ids, samples))
        pushed = [worker.rollout_buffer.get_nowait().completion for _ in samples]
        assert seen == pushed
        if template == qwen3_chat_template:
            reference = add_response_schema(tokenizer(template))
            want = [[parse_response(reference, s.token_ids, prefix=ids)] for s in samples]
            assert want[0] == [{"role": "assistant", "reasoning_content": "sum",
                                "content": "Two"}]
        else:
            want = [[{"role": "assistant", "content": s.text}] for s in samples]
        assert pushed == want


def test_no_max_completion_length_generates_to_the_engines_context(tmp_path, checkpoint):
    """max_completion_length=None: completions run to what the engine's context leaves, as the
    synchronous hook (and TRL's vLLM path) generate; the worker had been built with
    max_tokens=None and refused with the engine's field name, not TRL's."""
    path, tok = checkpoint
    engine = Engine(path, EngineConfig(kv_cache_tokens=1024, max_model_len=64), tokenizer=tok)
    trainer = engine_async_grpo(engine, path, length_reward,
                                async_args(tmp_path, max_completion_length=None),
                                Dataset.from_dict({"prompt": PROMPTS}), tok)
    assert trainer.rollout_worker.params.max_tokens == engine.config.max_model_len
