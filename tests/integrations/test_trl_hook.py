"""TRL GRPOTrainer with the engine as its rollout backend (trainer_hooks/trl.py), on CPU."""

import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from floors import MIN_ULPS, TAIL_MULTIPLE, alone_logprobs, tolerance
from models import always_picks, char_tokenizer, tiny_model
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from rollout import Engine, EngineConfig
from trainer_hooks.trl import RolloutGRPOTrainer, make_rollout_func
from trainer_hooks.trl_rollout import EngineRollout

ENGINE = EngineConfig(kv_cache_tokens=512, max_model_len=64, max_num_seqs=16)
PROMPTS = ["abc", "hello", "1+1=", "xyz"]
EPS = torch.finfo(torch.float32).eps
SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads cost more than they give on 2 cores
    yield
    torch.set_num_threads(before)


def grpo_args(tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], max_steps=2,
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  logging_steps=1, save_strategy="no", seed=0)
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


class Recorder:
    """A reward function that keeps what TRL scored, row by row."""

    def __init__(self):
        self.prompts, self.completion_ids = [], []
        self.__name__ = "length"

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.prompts += prompts
        self.completion_ids += completion_ids
        return [float(len(c)) for c in completions]


class SleepCheck(TrainerCallback):
    def __init__(self):
        self.engine, self.seen = None, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.seen.append((self.engine.is_sleeping, self.engine.inspect().kv_bytes))


def spy_rollouts(trainer):
    calls = []
    inner = trainer.rollout_func

    def spy(prompts, t):
        out = inner(prompts, t)
        calls.append((list(prompts), out))
        return out

    trainer.rollout_func = spy
    return calls


def test_grpo_steps_generate_with_engine_and_sleep_before_each_optimizer_step(tmp_path):
    tok = char_tokenizer()
    reward, check = Recorder(), SleepCheck()
    trainer = RolloutGRPOTrainer(
        tiny_model("qwen2", vocab_size=len(tok)), reward_funcs=reward, args=grpo_args(tmp_path),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
        callbacks=[check], engine_config=ENGINE)
    engine = check.engine = trainer.engine
    assert engine.is_sleeping and engine.device == torch.device("cpu")
    calls = spy_rollouts(trainer)
    trainer.train()

    # TRL hands over each prompt repeated num_generations times (RepeatSampler), and wants one
    # completion per entry, in order: the rows the reward scored are the rows we returned.
    assert len(calls) == 2
    for prompts, out in calls:
        assert prompts == [prompts[0]] * 4 + [prompts[4]] * 4 and prompts[0] != prompts[4]
        assert out["prompt_ids"] == tok(text=prompts)["input_ids"]
        assert [len(c) for c in out["completion_ids"]] == [len(lp) for lp in out["logprobs"]]
    assert reward.prompts == [p for prompts, _ in calls for p in prompts]
    assert reward.completion_ids == [c for _, out in calls for c in out["completion_ids"]]
    assert engine.stats.generated_tokens == sum(len(c) for c in reward.completion_ids) > 0
    assert engine.stats.cache_hit_tokens > 0  # the 4 copies of a prompt share its KV

    assert check.seen == [(True, 0), (True, 0)]  # asleep, pool freed, at every optimizer step
    assert engine.is_sleeping
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    for h in steps:
        for key in ("tokens_per_second", "prefix_cache_hit_rate", "wake_seconds", "sync_seconds",
                    "sleep_seconds", "generate_seconds"):
            assert h[f"rollout/{key}"] >= 0, key
        assert h["rollout/tokens_per_second"] > 0
        assert h["rollout/weight_syncs"] == 1  # first rollout, then after each optimizer step
        # fp32 forwards, the engine's and TRL's: worst seen 7.2e-7 from 1 (AMD EPYC Zen 3, AVX2),
        # 1.3e-6 (Intel Xeon, AVX-512); 1e-4 leaves ~75x for other ISAs
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4


def test_samples_end_on_trls_end_ids_only(tmp_path):
    """The model's config names an end id ('.') TRL's eos_token_ids lack: TRL's own generate
    goes on past it, and so must the engine (ending there, TRL would count the row as ended
    where its policy had not, and as truncated for mask_truncated_completions)."""
    tok = char_tokenizer()
    dot = tok.convert_tokens_to_ids(".")
    model = always_picks(tiny_model("qwen2", vocab_size=len(tok), tie_word_embeddings=False),
                         dot)
    model.config.eos_token_id = dot
    trainer = RolloutGRPOTrainer(
        model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=grpo_args(tmp_path, max_steps=1), processing_class=tok, engine_config=ENGINE,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    assert dot in trainer.engine.eos_ids and dot not in trainer.eos_token_ids  # the rig held
    calls = spy_rollouts(trainer)
    trainer.train()
    completions = [c for _, out in calls for c in out["completion_ids"]]
    assert completions and all(c == [dot] * 8 for c in completions)


class Capture(RolloutGRPOTrainer):
    """Keeps what TRL computed for each generation batch: the trainer's recomputed ("old")
    logprobs next to the sampling logprobs it took from the engine, and each row's logprobs
    from a forward of that row alone (the reference's own spread: tests/support/floors.py)."""

    captured: list

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        out["alone_logps"] = alone_logprobs(
            self.model, out["prompt_ids"], out["prompt_mask"], out["completion_ids"],
            out["completion_mask"], self.temperature)
        self.captured = getattr(self, "captured", []) + [out]
        return out


def assert_engine_within_floor(captured, masks=None) -> None:
    """The engine's logprobs are TRL's recomputed ones within a multiple of transformers' own
    batched-vs-alone spread over the same rows (measured on Intel Xeon, AVX-512: 4.8e-7 to
    4.8e-6, the engine's gap 3.6e-6 to 5.7e-6), and TRL's importance ratios as near 1 as that
    spread could put them: exp of each token's spread (at least MIN_ULPS of its logprob, as
    tolerance() takes), summed over each row where TRL's mode sums. Its size, not its signed
    sum: how much a row's roundings cancel is chance (on AMD EPYC Zen 3, AVX2, a tool episode
    row's signed spread 8.3e-7 against the engine's 2.4e-6 from 1; so measured, the rows'
    floor 2.8e-5 to 5.5e-5, the engine's 2.4e-6 to 1.3e-5; on Intel Xeon, AVX-512, the tool
    episodes' largest signed spread 1.7e-6 against the engine's 8.0e-6, the rows' floor 2.3e-5
    to 5.4e-5, the engine's 7.3e-6 to 9.7e-6). `masks`: the tokens compared, else
    completion_mask."""
    masks = masks or [out["completion_mask"].bool() for out in captured]
    old = torch.cat([out["old_per_token_logps"][m] for out, m in zip(captured, masks)])
    sampled = torch.cat([out["sampling_per_token_logps"][m] for out, m in zip(captured, masks)])
    alone = torch.cat([out["alone_logps"][m] for out, m in zip(captured, masks)])
    floor = (old - alone).abs().max().item()
    err = (old - sampled).abs().max().item()
    # the largest gap against the largest spread: TAIL_MULTIPLE (1.45x headroom at 2)
    assert err <= tolerance(floor, old, TAIL_MULTIPLE), (err, floor)
    ratios, spreads = [], []
    for out, m in zip(captured, masks):
        ratio = out["importance_sampling_ratio"]
        trl = out["old_per_token_logps"]
        gap = torch.maximum((trl - out["alone_logps"]).abs(), MIN_ULPS * EPS * trl.abs()) * m
        spreads.append((gap.sum(-1, keepdim=True) if ratio.shape[-1] == 1 else gap).exp())
        ratios.append(ratio)
    ratios, spreads = torch.cat(ratios), torch.cat(spreads)
    err, floor = ((r - 1).abs().max().item() for r in (ratios, spreads))
    assert err <= tolerance(floor, ratios), ("importance ratio", err, floor)


def test_engine_logprobs_equal_trl_recomputed_logprobs(tmp_path):
    tok = char_tokenizer()
    args = grpo_args(tmp_path, temperature=0.7, top_p=0.9, learning_rate=1e-3,
                     max_completion_length=12)
    trainer = Capture(tiny_model("qwen2", vocab_size=len(tok)), reward_funcs=Recorder(),
                      args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                      processing_class=tok, engine_config=ENGINE)
    trainer.train()
    assert len(trainer.captured) == 2  # the second comes after an optimizer step and a sync
    assert_engine_within_floor(trainer.captured)  # the importance ratios too


def test_plain_grpo_trainer_eval_with_chat_template(tmp_path, monkeypatch):
    """make_rollout_func with a given engine, conversational prompts, evaluation mode."""
    tok = char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}={{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}a={% endif %}")
    model = tiny_model("llama", vocab_size=len(tok))
    engine = Engine(model, ENGINE, tokenizer=tok)
    syncs = []
    real = engine.update_weights
    monkeypatch.setattr(engine, "update_weights", lambda src, **kw: syncs.append(1) or real(src))
    chats = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    args = grpo_args(tmp_path, per_device_eval_batch_size=4, num_generations_eval=2)
    trainer = GRPOTrainer(model, reward_funcs=Recorder(), args=args, train_dataset=chats,
                          eval_dataset=chats, processing_class=tok,
                          rollout_func=make_rollout_func(engine, seed=0))
    calls = spy_rollouts(trainer)
    first = trainer.evaluate()
    trainer.evaluate()
    assert len(syncs) == 1  # a given engine is synced once; evaluation changes no weights
    assert "eval_rollout/tokens_per_second" in first and first["eval_reward"] >= 0
    for prompts, out in calls:
        assert prompts[0] == prompts[1] and prompts[2] == prompts[3]  # num_generations_eval=2
        text = tok.apply_chat_template(prompts[0], add_generation_prompt=True, tokenize=False)
        assert text.endswith("a=") and out["prompt_ids"][0] == tok(text)["input_ids"]
    assert engine.is_sleeping and engine.stats.generated_tokens > 0


def test_a_request_the_engine_aborted_fails_the_step_saying_why(tmp_path, monkeypatch):
    """Non-finite logits abort a request with no tokens; TRL needs a completion for every row
    (an empty one failed deep in TRL with an IndexError): the step raises the engine's error."""
    tok = char_tokenizer()
    trainer = RolloutGRPOTrainer(
        tiny_model("qwen2", vocab_size=len(tok)), reward_funcs=Recorder(),
        args=grpo_args(tmp_path, max_steps=1), processing_class=tok, engine_config=ENGINE,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    generate = trainer.rollout.colocated.generate

    def poisoned(prompts, params, **kw):
        outs = generate(prompts, params, **kw)
        aborted = [dataclasses.replace(s, token_ids=[], logprobs=[], sampling_logprobs=[],
                                       finish_reason="abort") for s in outs[1].samples]
        outs[1] = dataclasses.replace(outs[1], samples=aborted, error="logits: the model "
                                      "produced non-finite values (nan/inf) for sample 0 at "
                                      "position 3")
        return outs
    monkeypatch.setattr(trainer.rollout.colocated, "generate", poisoned)
    with pytest.raises(RuntimeError, match="aborted a request .* non-finite"):
        trainer.train()
    assert trainer.engine.is_sleeping


def test_unsupported_settings_are_refused(tmp_path):
    tok = char_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tok))
    data = Dataset.from_dict({"prompt": PROMPTS})
    with pytest.raises(ValueError, match="use_vllm"):
        RolloutGRPOTrainer(model, reward_funcs=Recorder(), args=grpo_args(tmp_path, use_vllm=True),
                           train_dataset=data, processing_class=tok, engine_config=ENGINE)
    trainer = RolloutGRPOTrainer(model, reward_funcs=Recorder(), train_dataset=data,
                                 args=grpo_args(tmp_path), processing_class=tok,
                                 engine_config=ENGINE)
    trainer.args.repetition_penalty = 1.2  # set after construction: refused at the rollout
    with pytest.raises(ValueError, match="repetition_penalty"):
        trainer.rollout_func(PROMPTS, trainer)
    assert trainer.engine.is_sleeping
    # Refused before an engine is built (it would hold its memory): an engine_config of
    # another type (a dict had failed inside dataclasses.replace), temperature 0 (TRL divides
    # its logits by it: a ZeroDivisionError after a whole rollout), vespo's sampling mode,
    # the generation settings the engine lacks.
    built = []
    refusals = [({"engine_config": {"max_model_len": 64}}, "^engine_config must be"),
                ({"args": grpo_args(tmp_path, repetition_penalty=1.2)}, "^repetition_penalty"),
                ({"args": grpo_args(tmp_path, temperature=0.0)}, "^temperature: TRL divides"),
                ({"args": grpo_args(tmp_path, loss_type="vespo",
                                    vllm_importance_sampling_mode="sequence_mask")},
                 "^vllm_importance_sampling_mode")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineRollout, "setup", lambda *a, **k: built.append(1))
        for kwargs, refusal in refusals:
            given = {"args": grpo_args(tmp_path), "engine_config": ENGINE, **kwargs}
            with pytest.raises(ValueError, match=refusal):
                RolloutGRPOTrainer(model, reward_funcs=Recorder(), train_dataset=data,
                                   processing_class=tok, **given)
    assert not built


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_each_with_its_own_engine(tmp_path):
    # `accelerate launch --cpu` starts a single process in accelerate 1.x (multi-CPU needs an
    # mpirun hostfile); `--multi_gpu` on a machine without (visible) GPUs starts 2 ranks over
    # gloo, and the script's use_cpu=True keeps them on the CPU.
    env = dict(os.environ, WANDB_MODE="offline", TRL_EXPERIMENTAL_SILENCE="1",
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           os.path.join(SUPPORT, "trl_two_process.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    assert ranks[0]["pid"] != ranks[1]["pid"]
    for r in ranks:
        assert r["model_wrapper"] == "DistributedDataParallel"
        assert r["calls"] == 2 and r["generated_tokens"] > 0 and r["is_sleeping"]
        assert r["asleep_at_optimizer_step"] == [True, True]
        assert r["collectives_in_rollout"] == []  # no rank waits on the other's generation
    # Each rank's engine generated for its own slice of the batch, not the other's.
    seen = [{p for batch in r["prompts"] for p in batch} for r in ranks]
    assert seen[0].isdisjoint(seen[1])


def test_peft_lora_training_serves_the_adapter_unmerged(tmp_path):
    """RolloutGRPOTrainer(peft_config=...): the engine loads the base once and each sync after
    a step copies the adapter's A and B only (rollout/lora/); TRL's logprobs stay the engine's
    within the floor, and the trainer's frozen base is never written."""
    peft = pytest.importorskip("peft")
    tok = char_tokenizer()
    args = grpo_args(tmp_path, learning_rate=1e-2, temperature=0.7)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.0)
    trainer = Capture(tiny_model("llama", vocab_size=len(tok)), reward_funcs=Recorder(),
                      args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                      processing_class=tok, peft_config=lora, engine_config=ENGINE)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    trainer.train()
    # lora_B starts at zero: only the second rollout (after a step moved it) tests the adapter.
    assert_engine_within_floor(trainer.captured)
    engine = trainer.engine
    assert engine.lora_status == "unmerged" and engine.stats.adapter_syncs >= 1
    adapter = sum(p.numel() * p.element_size() for n, p in trainer.model.named_parameters()
                  if "lora_" in n)
    assert engine.stats.weight_sync_bytes == adapter
    for n, p in trainer.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base[n]), f"{n}: the frozen base weights were written"


def test_resumed_run_samples_what_the_uninterrupted_run_sampled(tmp_path):
    """The engine's seeds follow the trainer's step (restored from a checkpoint), not a count
    of rollout calls (which restarts at 0 in a resumed process and replays step 1's noise)."""
    tok = char_tokenizer()
    data = Dataset.from_dict({"prompt": PROMPTS})

    def trainer():
        reward = Recorder()
        args = grpo_args(tmp_path, learning_rate=1e-2, save_strategy="steps", save_steps=1)
        return RolloutGRPOTrainer(tiny_model("qwen2", vocab_size=len(tok)), reward_funcs=reward,
                                  args=args, train_dataset=data, processing_class=tok,
                                  engine_config=ENGINE), reward

    whole, whole_reward = trainer()
    whole.train()
    resumed, resumed_reward = trainer()
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert resumed_reward.prompts == whole_reward.prompts[8:]  # TRL replays the same prompts
    assert resumed_reward.completion_ids == whole_reward.completion_ids[8:]


def test_ref_model_is_used_as_the_kl_reference(tmp_path):
    """TRL reloads the reference from the policy's config path: an in-memory model has none."""
    tok = char_tokenizer()
    data = Dataset.from_dict({"prompt": PROMPTS})
    model = tiny_model("llama", vocab_size=len(tok))
    ref = tiny_model("llama", vocab_size=len(tok), seed=1)
    trainer = RolloutGRPOTrainer(model, reward_funcs=Recorder(), train_dataset=data,
                                 args=grpo_args(tmp_path, beta=0.1), processing_class=tok,
                                 engine_config=ENGINE, ref_model=ref)
    assert trainer.ref_model is ref  # prepared by TRL as its own (CPU: the module itself)
    with pytest.raises(ValueError, match="ref_model"):
        RolloutGRPOTrainer("some/model", reward_funcs=Recorder(), train_dataset=data,
                           args=grpo_args(tmp_path, beta=0.1), processing_class=tok,
                           engine_config=ENGINE, ref_model=ref)
    # Where TRL takes no reference of its own making (beta 0, or PEFT: the policy with its
    # adapter off), the given one would be dropped without a word.
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.0)
    for args, extra in ((grpo_args(tmp_path, beta=0.0), {}),
                        (grpo_args(tmp_path, beta=0.1), {"peft_config": lora})):
        with pytest.raises(ValueError, match="^ref_model: (TRL uses no|with PEFT)"):
            RolloutGRPOTrainer(tiny_model("llama", vocab_size=len(tok)), reward_funcs=Recorder(),
                               train_dataset=data, args=args, processing_class=tok,
                               engine_config=ENGINE, ref_model=ref, **extra)


@pytest.mark.parametrize("importance_ratio", ["untruncated", "full_policy", "on_support"])
def test_importance_ratio_under_top_p(tmp_path, importance_ratio):
    """top_p = 0.8, on-policy: with the untruncated logprobs TRL's ratio is the engine-trainer
    mismatch alone (1); with the sampled distribution's it is the kept set's mass under the
    policy, below 1 on every token (TRL's default mode multiplies them over the sequence);
    on the support, TRL's side renormalised over the same kept sets, it is 1 again, now with
    the truncated distribution as the behaviour policy."""
    tok = char_tokenizer()
    trainer = RolloutGRPOTrainer(
        tiny_model("qwen2", vocab_size=len(tok)), reward_funcs=Recorder(),
        args=grpo_args(tmp_path, top_p=0.8, max_steps=1, per_device_train_batch_size=16,
                       num_generations=8, max_completion_length=16),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
        engine_config=ENGINE, importance_ratio=importance_ratio)
    trainer.train()
    (h,) = [h for h in trainer.state.log_history if "loss" in h]
    ratio = h["sampling/importance_sampling_ratio/mean"]
    if importance_ratio == "full_policy":
        assert 0 < ratio < 0.95 and h["sampling/importance_sampling_ratio/max"] < 1
    else:  # fp32 engine vs trainer: 1 within its floor, no token outside [0.9, 1.1]
        # worst seen: mean 5.4e-7 from 1, min 1 - 1.2e-5, max 1 + 8.5e-6 (AMD EPYC Zen 3,
        # AVX2); mean 4.2e-7, min 1 - 9.7e-6, max 1 + 7.7e-6 (Intel Xeon, AVX-512); 1e-4 leaves
        # ~8x for other ISAs
        assert abs(ratio - 1) < 1e-4
        assert 1 - 1e-4 < h["sampling/importance_sampling_ratio/min"]
        assert h["sampling/importance_sampling_ratio/max"] < 1 + 1e-4
    if importance_ratio == "on_support":
        assert len(trainer.rollout.supports) > 0


def test_on_support_with_truncated_rows_masked(tmp_path):
    """on_support where TRL masks truncated completions whole: those rows name no completion
    and drop out of the loss; the ratio on the rows that count is 1 within the floor above."""
    tok = char_tokenizer()
    trainer = RolloutGRPOTrainer(
        tiny_model("qwen2", vocab_size=len(tok)), reward_funcs=Recorder(),
        args=grpo_args(tmp_path, top_p=0.8, max_steps=1, max_completion_length=16,
                       mask_truncated_completions=True),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
        engine_config=ENGINE, importance_ratio="on_support")
    trainer.train()
    (h,) = [h for h in trainer.state.log_history if "loss" in h]
    assert h["completions/clipped_ratio"] > 0  # rows masked whole (7 of 8 here)
    if h["completions/clipped_ratio"] < 1:  # rows that count (1 of 8 here)
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4


def test_on_support_with_an_evaluation_between_steps_of_one_generation(tmp_path):
    """An evaluation generates between the two optimizer steps of one generation batch: its
    kept sets do not replace the batch's, which the second step still needs."""
    tok = char_tokenizer()
    trainer = RolloutGRPOTrainer(
        tiny_model("qwen2", vocab_size=len(tok)), reward_funcs=Recorder(),
        args=grpo_args(tmp_path, top_p=0.8, max_steps=2, steps_per_generation=2,
                       per_device_train_batch_size=4, eval_strategy="steps", eval_steps=1,
                       per_device_eval_batch_size=8),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        eval_dataset=Dataset.from_dict({"prompt": ["qq", "rr"]}), processing_class=tok,
        engine_config=ENGINE, importance_ratio="on_support")
    trainer.train()
    history = trainer.state.log_history
    assert [h["step"] for h in history if "loss" in h] == [1, 2]
    assert any("eval_loss" in h for h in history)


def test_on_support_logps_against_a_masked_log_softmax():
    """trl_support.on_support_logps against a naive masked log-softmax of the model's own
    logits, gradients included; padding rows get the full log-softmax."""
    from rollout.sample.support import Support
    from trainer_hooks.trl_support import SupportTable, on_support_logps

    torch.manual_seed(0)
    model = tiny_model("qwen2")
    vocab, prompt, width = model.config.vocab_size, [5, 6, 7], 4
    completions = [[9, 3, 11, 2], [4, 4]]  # the second right-padded to the width
    kept = [[torch.tensor(sorted({t, 1, 2, 30 + j})) for j, t in enumerate(c)]
            for c in completions]
    table = SupportTable()
    ids, mask = [], []
    for c, k in zip(completions, kept):
        table.add(prompt, c, Support(k, vocab))
        ids.append(prompt + c + [0] * (width - len(c)))
        mask.append([1] * (len(prompt) + len(c)) + [0] * (width - len(c)))
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    got, entropy, _ = on_support_logps(model, table, ids, mask, width, 0.7, 1, True, False,
                                       torch.enable_grad)
    got.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(ids, attention_mask=mask).logits[:, -width - 1:-1].float() / 0.7
    want = logits.log_softmax(-1).gather(-1, ids[:, -width:, None]).squeeze(-1).clone()
    for r, (c, k) in enumerate(zip(completions, kept)):
        for j, support in enumerate(k):
            masked = torch.full((vocab,), float("-inf")).index_copy(0, support,
                                                                    logits[r, j, support])
            want[r, j] = masked.log_softmax(-1)[c[j]]
    want.sum().backward()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-5)
    probs = logits.softmax(-1)
    torch.testing.assert_close(entropy, -(probs * probs.log()).sum(-1), atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="no sampled support"):
        on_support_logps(model, SupportTable(), ids, mask, width, 0.7, 2, False, False,
                         torch.no_grad)


def test_on_support_needs_the_rollout_trainer(tmp_path):
    with pytest.raises(ValueError, match="use RolloutGRPOTrainer"):
        make_rollout_func(lambda t: None, importance_ratio="on_support")
    with pytest.raises(ValueError, match="importance_ratio must be one of"):
        make_rollout_func(lambda t: None, importance_ratio="support")
