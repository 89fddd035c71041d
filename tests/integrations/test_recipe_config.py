"""RecipeConfig refuses, before any model is built, the keys a run would ignore without a word
or only refuse once the model is loaded: recipes/run/config.py, recipes/run/build.py."""

import os
import typing

import peft
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from rollout_recipes.run.build import load_model
from rollout_recipes.run.config import RecipeConfig


def test_cuda_graphs_without_a_cuda_device_is_refused_by_the_config(monkeypatch):
    """The engine captures CUDA graphs with its Triton backend only, which it picks on CUDA;
    without a device it refused the flag in build_engine, after the model was built."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="^cuda_graphs: .*CUDA"):
        RecipeConfig(cuda_graphs=True)
    assert RecipeConfig(cuda_graphs=False).cuda_graphs is False


def test_eval_every_is_refused_where_it_would_be_ignored():
    """trl_async scores the held-out set before and after RL alone (its worker owns the
    engine while TRL trains), and ran with eval_every > 0 as with 0; the custom loop and the
    trl trainer score between steps (test_recipes.py: test_trl_two_steps)."""
    with pytest.raises(ValueError, match="^eval_every: .*trl_async"):
        RecipeConfig(eval_every=5, trainer="trl_async")
    assert RecipeConfig(eval_every=0, trainer="trl_async").eval_every == 0
    for trainer in ("custom", "trl"):
        assert RecipeConfig(eval_every=5, trainer=trainer).eval_every == 5


@pytest.mark.parametrize("overrides", [dict(trainer="trl", model="org/moe"),
                                       dict(task="calculator", model="org/moe"),
                                       dict()])  # the built-in tiny Llama: dense
def test_routing_replay_is_refused_where_nothing_is_routed(overrides):
    """The custom loop records routes for single-turn rollouts of an MoE policy only; the TRL
    trainers, episodes and the built-in dense model ran with routing_replay set as without."""
    with pytest.raises(ValueError, match="^routing_replay: "):
        RecipeConfig(routing_replay=True, **overrides)


@pytest.fixture
def saved(tmp_path):
    """Tiny random checkpoints, dense (Llama) and MoE (Qwen3-MoE), saved as a named model."""
    def save(name, model):
        path = tmp_path / name
        model.save_pretrained(path)
        return str(path)

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return {"dense": save("dense", LlamaForCausalLM(LlamaConfig(**sizes))),
            "moe": save("moe", Qwen3MoeForCausalLM(Qwen3MoeConfig(
                **sizes, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)))}


def test_routing_replay_on_a_dense_named_model_is_refused_when_it_loads(saved):
    """Whether a named model routes is known once it is loaded: a dense one is refused then,
    before the engine and any step; an MoE one loads."""
    with pytest.raises(ValueError, match="^routing_replay: .*no MoE router"):
        load_model(RecipeConfig(model=saved["dense"], routing_replay=True), None,
                   torch.device("cpu"))
    load_model(RecipeConfig(model=saved["moe"], routing_replay=True), None, torch.device("cpu"))


def test_an_output_dir_that_cannot_be_a_directory_is_refused(tmp_path):
    """The tracker creates output_dir before the model loads; an empty name or a path through
    an existing file failed there with FileNotFoundError / FileExistsError / NotADirectoryError,
    not a ValueError naming the key."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for bad in ("", str(blocker), str(blocker / "run")):
        with pytest.raises(ValueError, match=r"^output_dir\b"):
            RecipeConfig(output_dir=bad)
    assert RecipeConfig(output_dir=str(tmp_path / "new" / "run")).output_dir.endswith("run")


def test_home_in_a_path_is_the_users_home(tmp_path, monkeypatch):
    """`~` marks a local path (docs/recipes.md) but was not expanded: a YAML `dataset:
    ~/sums.jsonl` or `--model=~/ckpt` (no shell expands those) was refused as not found
    although it existed; os.path.expanduser is the reference."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "sums.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = RecipeConfig(model="~/ckpt", dataset="~/sums.jsonl", output_dir="~/runs/a")
    assert (cfg.model, cfg.dataset, cfg.output_dir) == tuple(
        os.path.expanduser(p) for p in ("~/ckpt", "~/sums.jsonl", "~/runs/a"))
    assert cfg.output_dir == str(tmp_path / "runs" / "a")


@pytest.mark.parametrize("lora, match", [
    # PEFT's LoraConfig takes any string and get_peft_model raised NotImplementedError after
    # the model loaded; its annotation is the reference for the values it implements.
    ({"r": 4, "bias": "bogus"}, "lora.bias must be one of"),
    # A task type other than the recipe's CAUSAL_LM wrapped the policy as, e.g.,
    # PeftModelForSequenceClassification without a word.
    ({"r": 4, "task_type": "SEQ_CLS"}, "lora.task_type must be CAUSAL_LM"),
])
def test_lora_values_peft_takes_unchecked_are_refused(lora, match):
    with pytest.raises(ValueError, match=match):
        RecipeConfig(lora=lora)
    for bias in typing.get_args(typing.get_type_hints(peft.LoraConfig)["bias"]):
        assert RecipeConfig(lora={"r": 4, "bias": bias}).lora["bias"] == bias
    assert RecipeConfig(lora={"r": 4, "task_type": "CAUSAL_LM"}).lora["task_type"] == "CAUSAL_LM"


@pytest.mark.parametrize("mode", ["merged", "unmerged"])
def test_lora_mode_without_an_adapter_is_refused(mode):
    """EngineConfig.lora says how a PEFT policy is served; without `lora` the policy is a plain
    model and the engine built as with "auto"."""
    with pytest.raises(ValueError, match="^lora_mode: .*lora"):
        RecipeConfig(lora_mode=mode)
    assert RecipeConfig(lora_mode=mode, lora={"r": 4}).lora_mode == mode


def test_a_key_given_twice_in_a_mapping_is_named(tmp_path):
    """PyYAML keeps the last of two equal keys without a word (`steps: 10` ... `steps: 20` ran
    20 steps), at every level and in `--key value` overrides alike; a merge (`<<: *base`) is
    still overridden by the mapping's own keys, as YAML says."""
    from rollout_recipes.run.config_file import load_config, parse_overrides, read_yaml

    path = tmp_path / "twice.yaml"
    path.write_text("steps: 10\nprompts_per_step: 4\nsteps: 20\n")
    with pytest.raises(ValueError, match=r"key 'steps' given twice .*twice.yaml.* line 3"):
        load_config(str(path))
    path.write_text("tiny_model: {hidden_size: 64, hidden_size: 32}\n")
    with pytest.raises(ValueError, match="key 'hidden_size' given twice"):
        load_config(str(path))
    with pytest.raises(ValueError, match="key 'r' given twice"):
        parse_overrides(["--lora", "{r: 4, r: 8}"])
    merged = read_yaml("base: &b {r: 4, lora_alpha: 8}\nlora: {<<: *b, r: 16}\n")
    assert merged["lora"] == {"r": 16, "lora_alpha": 8}


def test_a_missing_draft_model_path_is_refused_before_any_model_is_built(tmp_path):
    """speculative.draft_model names a checkpoint as `model` does; a local one that is not
    there was refused by the engine (rollout/models/loader.py) only once the policy was
    loaded."""
    missing = str(tmp_path / "no-draft")
    with pytest.raises(ValueError, match="^speculative.draft_model: .*no-draft"):
        RecipeConfig(speculative={"method": "draft", "draft_model": missing})
    (tmp_path / "no-draft").mkdir()
    assert RecipeConfig(speculative={"method": "draft", "draft_model": missing}).speculative
    assert RecipeConfig(speculative={"method": "draft", "draft_model": "org/draft"}).speculative


def _sizes(args) -> tuple[int, int]:
    return args.per_device_train_batch_size, args.gradient_accumulation_steps


@pytest.mark.parametrize("prompts, generations, micro", [(16, 8, 8), (5, 4, 8), (24, 4, 64),
                                                         (7, 2, 4)])
def test_trl_async_forwards_at_most_micro_batch_size_sequences(prompts, generations, micro):
    """TRL got prompts_per_step x num_generations sequences a forward, no gradient accumulation:
    micro_batch_size was ignored (gsm8k_qwen.yaml's 8 ran as 128). AsyncGRPOTrainer's step is
    per_device_train_batch_size x gradient_accumulation_steps samples (its samples_per_step, one
    process): still prompts_per_step groups, in forwards of the largest count that divides
    them and holds at most micro_batch_size (a naive search is the reference)."""
    from types import SimpleNamespace

    from rollout_recipes.algo.trl_async_loop import async_args

    cpu = SimpleNamespace(device=torch.device("cpu"))
    cfg = RecipeConfig(trainer="trl_async", prompts_per_step=prompts,
                       num_generations=generations, micro_batch_size=micro)
    per_device, accumulate = _sizes(async_args(cfg, cpu))
    step = prompts * generations
    assert per_device * accumulate == step
    assert per_device == max(d for d in range(1, step + 1) if step % d == 0 and d <= micro)


def test_trl_async_keeps_the_configs_gradient_checkpointing():
    """AsyncGRPOConfig checkpoints by default (TRL's choice, not the recipe's): the recipe's
    gradient_checkpointing false was ignored."""
    from types import SimpleNamespace

    from rollout_recipes.algo.trl_async_loop import async_args

    cpu = SimpleNamespace(device=torch.device("cpu"))
    for wanted in (False, True):
        cfg = RecipeConfig(trainer="trl_async", gradient_checkpointing=wanted)
        assert async_args(cfg, cpu).gradient_checkpointing is wanted


def _longest_prompt_tokens(task: str, **sizes) -> int:
    """The longest prompt of a built-in task's generated rows under the built-in tokenizer:
    the reference for what the config computes from the task's definition."""
    from rollout_recipes.run.tiny import char_tokenizer
    from rollout_recipes.tasks import BUILTIN, load_task

    cfg = RecipeConfig(task=task, **sizes)
    loaded = load_task(cfg)
    tokenizer = char_tokenizer(BUILTIN[task].ALPHABET)
    return max(len(ids) for ids in loaded.encode(tokenizer, loaded.train["prompt"]))


@pytest.mark.parametrize("task, extra", [("addition", {}), ("reverse", {}),
                                         ("calculator", {"tools": False}), ("calculator", {})])
def test_a_prompt_and_its_answer_must_fit_in_max_model_len(task, extra):
    """`--max_model_len 8 --max_new_tokens 4` on addition was accepted: the engine gave "99+99="
    2 of its 4 tokens ("198" and EOS) and every held-out answer scored 0. The built-in task's
    longest prompt and max_new_tokens must fit, refused before any model loads."""
    longest = _longest_prompt_tokens(task, train_size=2000, eval_size=0, **extra)
    new = 4
    with pytest.raises(ValueError, match=r"^max_model_len: .*max_new_tokens.*longest prompt"):
        RecipeConfig(task=task, max_model_len=longest + new - 1, max_new_tokens=new, **extra)
    assert RecipeConfig(task=task, max_model_len=longest + new, max_new_tokens=new,
                        **extra).max_model_len == longest + new


def test_a_dataset_prompt_past_max_model_len_is_refused_at_task_load(tmp_path):
    """A dataset's prompts (or a named model's tokens) are known once the tokenizer and the
    data load: refused then, naming the prompt, before the model loads."""
    from rollout_recipes.run.tiny import char_tokenizer
    from rollout_recipes.tasks import load_task

    data = tmp_path / "sums.jsonl"
    long = "1234567890+1234567890="
    data.write_text("".join(f'{{"prompt": "{p}", "answer": "1"}}\n'
                            for p in ("1+1=", long, "2+2=", "3+3=")))
    tokenizer = char_tokenizer("0123456789+=")
    settings = dict(model=str(tmp_path), dataset=str(data), eval_size=0, chat_template=False,
                    max_new_tokens=4, progress=False)
    longest = len(tokenizer.encode(long))
    with pytest.raises(ValueError, match=r"^max_model_len: .*max_new_tokens.*1234567890\+"):
        load_task(RecipeConfig(max_model_len=longest + 3, **settings), tokenizer)
    assert len(load_task(RecipeConfig(max_model_len=longest + 4, **settings), tokenizer).train)


@pytest.mark.parametrize("task, rows", [("addition", 100 * 100),
                                        ("calculator", (9999 - 100 + 1) ** 2 // 2)])
def test_train_and_eval_sizes_past_the_task_are_refused_by_the_config(task, rows):
    """The task refused them when it loaded, after the output dir and the W&B run existed.
    Addition has 100 x 100 distinct sums; the calculator takes at most half of its operand
    pairs (drawn by rejection)."""
    with pytest.raises(ValueError, match=rf"^train_size \+ eval_size: .*{rows}"):
        RecipeConfig(task=task, train_size=rows - 199, eval_size=200)
    assert RecipeConfig(task=task, train_size=rows - 200, eval_size=200).train_size


def test_config_is_read_once_and_by_its_full_name(tmp_path):
    """`--config A --config B` ran B without a word, and argparse took `--con A` for
    `--config A`: a typo of another key would have been read as the config file."""
    from rollout_recipes.grpo import config_from_args

    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("steps: 3\n")
    second.write_text("steps: 5\n")
    with pytest.raises(ValueError, match="^config: given twice"):
        config_from_args(["--config", str(first), f"--config={second}"])
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['con'\]"):
        config_from_args(["--con", str(first)])
    assert config_from_args(["--config", str(first)]).steps == 3


def test_wandb_mode_without_wandb_is_refused():
    """wandb_mode says how the W&B run logs; with `--wandb false` there is none, and the mode
    was ignored."""
    with pytest.raises(ValueError, match="^wandb_mode: .*wandb"):
        RecipeConfig(wandb=False, wandb_mode="online")
    assert RecipeConfig(wandb=True, wandb_mode="online").wandb_mode == "online"
    assert RecipeConfig(wandb=False).wandb_mode is None


@pytest.mark.parametrize("progress", [False, True])
def test_progress_false_silences_the_datasets_bars(tmp_path, capfd, progress):
    """`--progress false` left `datasets`' bars (the file's split, the prompts' map) on
    stderr; with progress on they are there (the test sees them)."""
    import datasets

    from rollout_recipes.run.tiny import char_tokenizer
    from rollout_recipes.tasks import load_task

    data = tmp_path / "sums.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(4)))
    cfg = RecipeConfig(model=str(tmp_path), dataset=str(data), eval_size=1, chat_template=False,
                       progress=progress)
    before = datasets.utils.are_progress_bars_disabled()
    load_task(cfg, char_tokenizer("0123456789+="))
    assert ("prompts" in capfd.readouterr().err) is progress
    assert datasets.utils.are_progress_bars_disabled() == before  # the caller's setting back
