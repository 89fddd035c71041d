"""RolloutGRPOTrainer with TRL's `tools=` and `environment_factory=`: every turn from the engine.

The tiny model is rigged so that greedy or sampled, it always opens its answer with the same tool
call (`add(3, 4)`): an added token per element of the call and a deterministic chain
assistant-header -> <tool_call> -> call -> </tool_call> -> <eos> written into a few hidden
dimensions that only the embedding feeds and only the chain's next tokens read. After the tool
result, the template opens the next turn with a different header (<ans>), where the model's
random weights take over: that turn's tokens and logprobs are ordinary samples.
"""

import dataclasses
import re
import string

import pytest
import torch
from datasets import Dataset
from models import char_tokenizer, tiny_model
from test_trl_hook import Capture, assert_engine_within_floor
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from rollout import EngineConfig
from trainer_hooks.trl import EngineGeneration, RolloutGRPOTrainer, make_rollout_func

CALL = '{"name": "add", "arguments": {"a": 3, "b": 4}}'
RESULT = "<tool>7</tool><ans>"  # the template's rendering of the tool message + next header
MAX_COMPLETION = 24
ENGINE = EngineConfig(kv_cache_tokens=4096, max_model_len=128, max_num_seqs=16)
PROMPTS = ["3+4", "1+2", "5+5", "2+7"]

TEMPLATE = (
    "{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<u>{{ m.content }}\n"
    "{% elif m.role == 'assistant' %}"
    "{% if loop.index0 > 0 and messages[loop.index0 - 1].role == 'tool' %}<ans>"
    "{% else %}<asst>{% endif %}{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}<eos>"
    "{% elif m.role == 'tool' %}<tool>{{ m.content }}</tool>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{% if messages[-1].role == 'tool' %}<ans>{% else %}<asst>{% endif %}{% endif %}")

# transformers' new-style response parser (what `parse_response` reads), as TRL's own templates
# for Qwen3 are written, with this template's tags.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": ["<asst>", "<ans>"],
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*",
                       "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<eos>\s*", "content": "text"},
    },
}


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tool_tokenizer():
    tok = char_tokenizer(string.ascii_letters + string.digits + ' _+=.,:;"{}[]()\n-')
    tok.add_tokens(["<u>", "<asst>", "<ans>", "<tool_call>", "</tool_call>", "<tool>", "</tool>",
                    CALL])
    tok.chat_template = TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    return tok


def tool_model(tok):
    """A random tiny Llama whose assistant turn always starts with the tool call (see top)."""
    model = tiny_model("llama", vocab_size=len(tok))
    chain = [tok.convert_tokens_to_ids(t) for t in ("<asst>", "<tool_call>", CALL, "</tool_call>")]
    chain.append(tok.eos_token_id)
    hidden = model.config.hidden_size
    dims = list(range(hidden - len(chain) + 1, hidden))
    with torch.no_grad():
        for layer in model.model.layers:  # nothing but the embedding writes these dimensions
            layer.self_attn.o_proj.weight[dims] = 0
            layer.mlp.down_proj.weight[dims] = 0
        model.model.embed_tokens.weight[:, dims] = 0
        model.lm_head.weight[:, dims] = 0
        for dim, (token, following) in zip(dims, zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token, dim] = 30.0
            model.lm_head.weight[following, dim] = 10.0
    return model


ADD_CALLS = []


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    ADD_CALLS.append((a, b))
    return a + b


class Calculator:
    """TRL's environment protocol: public methods are tools, reset(**row), get_reward()."""

    log: list = []

    def reset(self, **row):
        self.calls = []
        return None

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls.append((a, b))
        Calculator.log.append((a, b))
        return a + b

    def get_reward(self) -> float:
        return float(len(self.calls))


def token_sum(completion_ids, **kwargs):
    """Varies with the sampled answer, so advantages are not all zero."""
    return [float(sum(ids) % 7) for ids in completion_ids]


class SleepCheck(TrainerCallback):
    def __init__(self):
        self.engine, self.seen = None, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.seen.append(self.engine.is_sleeping)


def spy_engine(trainer):
    """Every engine.generate call: its step, prompts, params and what the prefix cache served."""
    engine, calls = trainer.engine, []
    real = engine.generate

    def generate(prompts, params=None, **kwargs):
        before = dataclasses.replace(engine.stats)
        outs = real(prompts, params, **kwargs)
        after = engine.stats
        calls.append(dict(step=trainer.state.global_step, prompts=[list(p) for p in prompts],
                          params=list(params),
                          computed=after.prompt_tokens_computed - before.prompt_tokens_computed,
                          hit=after.cache_hit_tokens - before.cache_hit_tokens))
        return outs

    engine.generate = generate
    return calls


def make_trainer(tmp_path, tok, cls=Capture, **kwargs):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[],
                      max_steps=2, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=MAX_COMPLETION, logging_steps=1, save_strategy="no",
                      seed=0, learning_rate=1e-3)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    return cls(tool_model(tok), reward_funcs=token_sum, args=args, train_dataset=data,
               processing_class=tok, **kwargs)


def check_turns(trainer, tok, calls):
    """Each step: the first turn as 2 requests x n=4, then the tool turn, served from cache."""
    suffix = tok(RESULT)["input_ids"]
    chain = tok("<tool_call>" + CALL + "</tool_call><eos>")["input_ids"]
    for step in (0, 1):
        turns = [c for c in calls if c["step"] == step]
        assert len(turns) >= 2, turns
        first, second = turns[0], turns[1]
        assert len(first["prompts"]) == 2 and [p.n for p in first["params"]] == [4, 4]
        assert all(p.max_tokens == MAX_COMPLETION for p in first["params"])
        # The four samples of a prompt made the same call and got the same result: one
        # request with n=4 again, its history the prompt + the sampled call + the tool message.
        assert [p.n for p in second["params"]] == [4, 4]
        for prompt, history in zip(first["prompts"], second["prompts"]):
            assert history == prompt + chain + suffix
        # The rest of the completion budget only (TRL would truncate the turn to it).
        assert all(p.max_tokens == MAX_COMPLETION - len(chain) - len(suffix)
                   for p in second["params"])
        # KV across turns: of each history only the tool message and the call's last token
        # (<eos>, sampled but never fed) are computed, plus the last token again for each
        # further sample of the request; the rest comes from the radix tree.
        assert second["hit"] > 0
        assert second["computed"] <= sum(len(suffix) + p.n for p in second["params"]), second
    return suffix, chain


def expected_tool_mask(ids, chain, suffix):
    """0 on each tool message: the suffix right after a sampled call."""
    k, s = len(chain), len(suffix)
    mask = [1] * len(ids)
    for j in range(k, len(ids) - s + 1):
        if ids[j - k:j] == chain and ids[j:j + s] == suffix:
            mask[j:j + s] = [0] * s
    return mask


def check_masks_and_logprobs(trainer, suffix, chain):
    for out in trainer.captured:
        ids, mask, tool = out["completion_ids"], out["completion_mask"], out["tool_mask"]
        k, s = len(chain), len(suffix)
        assert (ids[:, :k] == torch.tensor(chain)).all()  # every episode opens with the call
        assert (ids[:, k:k + s] == torch.tensor(suffix)).all()
        # 0 exactly on the tool messages (a later turn may call again: the chain is one
        # sampled token away), 1 on the model's tokens and on the padding (TRL pads with 1).
        for row, length, got in zip(ids.tolist(), mask.sum(1).tolist(), tool.tolist()):
            padding = [1] * (len(row) - length)
            assert got == expected_tool_mask(row[:length], chain, suffix) + padding
        model_tokens = (mask * tool).bool()
        env_tokens = mask.bool() & (tool == 0)
        old, sampled = out["old_per_token_logps"], out["sampling_per_token_logps"]
        # The engine's logprobs of the model's tokens, every turn, equal the trainer's forward
        # over prompt + completion (tool tokens included in the context), within its floor.
        assert_engine_within_floor([out], [model_tokens])  # the importance ratios too
        assert model_tokens[:, k + s:].any()  # the second turn sampled something
        # Tool tokens: logprob 0.0 from the sampler, masked out of the importance ratio (per
        # sequence or per token, by the config): the trainer's own logprobs there are far from
        # 0, so unmasked, the ratio would be far from 1.
        assert (sampled[env_tokens] == 0).all()
        assert old[env_tokens].abs().min().item() > 1e-3


def check_loss_ignores_env_tokens(trainer):
    """The tool mask reaches the loss: perturbing the old logprobs of tool-result tokens leaves
    it unchanged, and changes it once the tool mask is dropped (the control)."""
    out = next(o for o in trainer.captured if o["advantages"].abs().sum() > 0)
    env_tokens = out["completion_mask"].bool() & (out["tool_mask"] == 0)

    def loss(inputs):
        with torch.no_grad():
            return trainer.compute_loss(trainer.model, inputs).item()

    perturbed = dict(out, old_per_token_logps=out["old_per_token_logps"] + 3.0 * env_tokens)
    assert loss(perturbed) == pytest.approx(loss(out), abs=1e-7)
    unmasked = {k: v for k, v in out.items() if k != "tool_mask"}
    unmasked_perturbed = {k: v for k, v in perturbed.items() if k != "tool_mask"}
    assert abs(loss(unmasked_perturbed) - loss(unmasked)) > 1e-4


def test_environment_factory_episodes_come_from_the_engine(tmp_path):
    tok = tool_tokenizer()
    Calculator.log = []
    check = SleepCheck()
    trainer = make_trainer(tmp_path, tok, environment_factory=Calculator, callbacks=[check],
                           engine_config=ENGINE)
    engine = check.engine = trainer.engine
    assert isinstance(trainer.vllm_generation, EngineGeneration) and engine.is_sleeping
    calls = spy_engine(trainer)
    trainer.train()

    # Every episode called the tool at least once (its first turn always does).
    assert len(Calculator.log) >= 16 and set(Calculator.log) == {(3, 4)}
    suffix, chain = check_turns(trainer, tok, calls)
    check_masks_and_logprobs(trainer, suffix, chain)
    check_loss_ignores_env_tokens(trainer)

    assert check.seen == [True, True] and engine.is_sleeping
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    for h in steps:
        assert h["tools/call_frequency"] >= 1 and h["tools/failure_frequency"] == 0
        assert h["rewards/Calculator/mean"] >= 1  # the environment's get_reward
        assert h["rollout/generate_calls"] >= 2  # turns, in one awake period
        assert h["rollout/weight_syncs"] == 1
        assert h["rollout/prefix_cache_hit_rate"] > 0.5
        # worst seen 3.6e-7 from 1 (AMD EPYC Zen 3, AVX2), 1.4e-6 (Intel Xeon, AVX-512): 1e-4
        # leaves ~70x for other ISAs
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4


def test_plain_function_tools(tmp_path):
    tok = tool_tokenizer()
    ADD_CALLS.clear()
    trainer = make_trainer(tmp_path, tok, tools=[add], engine_config=ENGINE)
    calls = spy_engine(trainer)
    trainer.train()
    assert len(ADD_CALLS) >= 16 and set(ADD_CALLS) == {(3, 4)}
    suffix, chain = check_turns(trainer, tok, calls)
    check_masks_and_logprobs(trainer, suffix, chain)
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2 and all(h["tools/call_frequency"] >= 1 for h in steps)
    assert trainer.engine.is_sleeping


def test_refusals(tmp_path):
    tok = tool_tokenizer()
    trainer = make_trainer(tmp_path, tok, tools=[add], engine_config=ENGINE)
    with pytest.raises(ValueError, match="images"):
        trainer.vllm_generation.generate(prompts=[[5, 6]], images=[["an image"]],
                                         num_generations=1)
    with pytest.raises(NotImplementedError, match="vllm_client"):
        trainer.vllm_generation.vllm_client
    assert trainer.vllm_generation.llm.llm_engine.model_config.max_model_len == 128
    assert trainer.engine.is_sleeping
    # A plain GRPOTrainer would generate the tool turns with transformers, without logprobs.
    plain = make_trainer(tmp_path, tok, cls=GRPOTrainer, tools=[add],
                         rollout_func=make_rollout_func(trainer.engine))
    with pytest.raises(ValueError, match="RolloutGRPOTrainer"):
        plain.rollout_func([[{"role": "user", "content": "3+4"}]] * 4, plain)
    assert trainer.engine.is_sleeping


@pytest.mark.parametrize("kwargs, match", [
    (dict(importance_ratio="on_support"), "importance_ratio='on_support': tool"),
    (dict(engine_config=dataclasses.replace(ENGINE, tensor_parallel_size=2)),
     "tools / environment_factory: need tensor_parallel_size 1"),
])
def test_tools_refuse_what_they_cannot_have_before_an_engine_is_built(tmp_path, kwargs,
                                                                      match, monkeypatch):
    """Refused in the constructor before the engine exists (one would hold its memory while
    the error's traceback lives)."""
    import trainer_hooks.trl

    built = []
    build = trainer_hooks.trl.build_engine
    monkeypatch.setattr(trainer_hooks.trl, "build_engine",
                        lambda *a: built.append(a) or build(*a))
    with pytest.raises(ValueError, match=re.escape(match)):
        make_trainer(tmp_path, tool_tokenizer(), cls=RolloutGRPOTrainer, tools=[add],
                     **{"engine_config": ENGINE, **kwargs})
    assert not built
