"""The recipes' chat prompts go through rollout/engine/chat.py (recipes/tasks/gsm8k.py, tasks/base.py):
a chat task's `prompt` column holds the conversation, Task.encode gives the ids `Engine.chat`
would, and TRL (trainer_hooks.trl) feeds the engine those same ids. The reference is the
tokenizer's own `apply_chat_template(..., tokenize=True)`. The tokenizer (tests/support/models.py)
prepends <bos> to plain encodes and its template writes the BOS itself, so templated text
encoded with special tokens added would show up as a doubled BOS.
"""

import json

import pytest
from models import bos_chat_tokenizer, tiny_model

from rollout.engine.chat import render_conversations
from rollout_recipes.run.config import RecipeConfig
from rollout_recipes.tasks import load_task

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
# As some real templates do (Gemma's, older Mistral's): a system message is refused.
NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}"
             "{{ raise_exception('system role not supported') }}{% endif %}" + TEMPLATE)
SYSTEM = {"role": "system", "content": "be brief"}


def load(tmp_path, tok, **keys):
    """The gsm8k task over a 6-row JSONL file, 2 rows held out (the model is never loaded)."""
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"question": f"what is {a}+{a}", "answer": f"#### {2 * a}"})
                            + "\n" for a in range(6)))
    cfg = RecipeConfig(model="org/tiny", dataset=str(path), prompt_template="{question}",
                       eval_size=2, **keys)
    return load_task(cfg, tok)


def reference_ids(tok, conversations):
    return [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"]
            for c in conversations]


def test_chat_prompts_are_conversations_encoded_as_the_chat_templates_ids(tmp_path):
    tok = bos_chat_tokenizer(TEMPLATE)
    task = load(tmp_path, tok, system_prompt="be brief")
    assert task.chat
    for split in (task.train, task.eval):
        prompts = split["prompt"]
        assert [p[0] for p in prompts] == [SYSTEM] * len(prompts)
        assert all(p[1]["role"] == "user" and p[1]["content"].startswith("what is ")
                   for p in prompts)
        ids = task.encode(tok, prompts)
        assert ids == reference_ids(tok, prompts)
        assert ids == [i for _, i in render_conversations(tok, prompts)]  # Engine.chat's ids
        assert all(row[0] == tok.bos_token_id != row[1] for row in ids)  # one BOS


def test_trl_feeds_the_engine_the_same_prompt_ids(tmp_path, monkeypatch):
    # TRL's own rendering of the recipe's `prompt` column: with templated text it would
    # re-encode it with special tokens added (a doubled BOS).
    from trl import GRPOConfig

    from rollout import EngineConfig
    from rollout_recipes.algo.trl_loop import correctness_reward
    from trainer_hooks.trl import RolloutGRPOTrainer
    from trainer_hooks.trl_rollout import tokenize_prompts

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tok = bos_chat_tokenizer(TEMPLATE)
    task = load(tmp_path, tok, system_prompt="be brief")
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to=[],
                      max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, save_strategy="no", seed=0)
    trainer = RolloutGRPOTrainer(
        tiny_model("llama", vocab_size=len(tok)),
        reward_funcs=correctness_reward(task, tok, {tok.eos_token_id}),
        args=args, train_dataset=task.train, processing_class=tok,
        engine_config=EngineConfig(kv_cache_tokens=512, max_model_len=96, max_num_seqs=8))
    prompts = list(task.train["prompt"])  # TRL hands over its batch's rows as a list
    assert tokenize_prompts(prompts, trainer) == task.encode(tok, prompts)


@pytest.mark.parametrize("template, keys", [
    (NO_SYSTEM, dict(system_prompt="be brief")),  # the template raises
    (None, dict(chat_template=True)),  # asked for, but the tokenizer has none
])
def test_a_chat_template_that_fails_is_a_value_error_naming_the_field(tmp_path, template, keys):
    with pytest.raises(ValueError, match="chat_template: the tokenizer's chat template fails "
                                         "on the prompt 'what is "):
        load(tmp_path, bos_chat_tokenizer(template), **keys)


@pytest.mark.parametrize("template, keys", [
    (None, {}),  # no chat template
    (TEMPLATE, dict(chat_template=False)),  # one, turned off
])
def test_without_the_chat_template_prompts_stay_text(tmp_path, template, keys):
    tok = bos_chat_tokenizer(template)
    task = load(tmp_path, tok, system_prompt="be brief", **keys)
    assert not task.chat
    prompts = task.train["prompt"]
    assert all(p.startswith("be brief\nwhat is ") for p in prompts)
    ids = task.encode(tok, prompts)
    assert ids == [tok(p)["input_ids"] for p in prompts]  # the tokenizer's special tokens added
    assert all(row[0] == tok.bos_token_id != row[1] for row in ids)
