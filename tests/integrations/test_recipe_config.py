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


@pytest.mark.parametrize("trainer", ["trl", "trl_async"])
def test_eval_every_is_refused_where_it_would_be_ignored(trainer):
    """Only the custom loop scores the held-out set between steps; the TRL trainers score it
    before and after RL alone, and ran with eval_every > 0 as with 0."""
    with pytest.raises(ValueError, match="^eval_every: .*custom"):
        RecipeConfig(eval_every=5, trainer=trainer)
    assert RecipeConfig(eval_every=0, trainer=trainer).eval_every == 0
    assert RecipeConfig(eval_every=5).eval_every == 5  # the custom loop's


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
