"""Loading a model the ways a user brings one: a checkpoint folder as transformers reads it, and
the in-memory models the engine cannot take (on the meta device: no values to copy)."""

import json
import os

import pytest
import torch
from models import char_tokenizer, tiny_config, tiny_model
from reference import PROMPTS, assert_matches_reference
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from rollout import Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=True)


def engine_for(model) -> Engine:
    return Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=64, device="cpu"))


def saved(model, path, **kwargs):
    model.save_pretrained(path, **kwargs)
    char_tokenizer().save_pretrained(path)
    return path


def as_transformers_reads_it(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def test_only_the_files_transformers_reads_are_loaded(tmp_path):
    """Mistral's Hub repositories ship their own format (`consolidated.safetensors`, other
    tensor names) beside the transformers shards; a PEFT adapter may be saved into the same
    folder. transformers reads the files its index names and nothing else; the engine read
    every *.safetensors and refused the checkpoint ("no such parameter")."""
    path = saved(tiny_model("mistral"), tmp_path, max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    save_file({"layers.0.attention.wq.weight": torch.zeros(64, 64)},
              str(tmp_path / "consolidated.safetensors"))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)},
              str(tmp_path / "adapter_model.safetensors"))
    reference = as_transformers_reads_it(path)
    outs = engine_for(path).generate(PROMPTS[:2], GREEDY)
    assert_matches_reference(reference, PROMPTS[:2], outs)


def test_sharded_pytorch_bin_files_by_their_index(tmp_path):
    """The older layout (pytorch_model-0000i-of-0000n.bin and their index), of a checkpoint
    whose safetensors files are another format's."""
    model = tiny_model("llama")
    state = model.state_dict()
    names = sorted(state)
    files = {n: f"pytorch_model-0000{1 + i % 2}-of-00002.bin" for i, n in enumerate(names)}
    for f in set(files.values()):
        torch.save({n: state[n] for n in names if files[n] == f}, tmp_path / f)
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": files}))
    model.config.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    save_file({"layers.0.attention.wq.weight": torch.zeros(64, 64)},
              str(tmp_path / "consolidated.safetensors"))
    outs = engine_for(tmp_path).generate(PROMPTS[:2], GREEDY)
    assert_matches_reference(model, PROMPTS[:2], outs)


def test_a_folder_without_model_weights_is_refused_naming_what_it_looked_for(tmp_path):
    saved(tiny_model("llama"), tmp_path)
    os.rename(tmp_path / "model.safetensors", tmp_path / "consolidated.safetensors")
    with pytest.raises(ValueError, match=r"^model: no model\.safetensors or .*pytorch_model\.bin"):
        engine_for(tmp_path)


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_model_on_the_meta_device_is_refused(device):
    """A model built on the meta device (or offloaded there by accelerate) has no values: the
    engine said "device must be cpu or cuda, got meta", or, given a device, failed in the
    copy with torch's NotImplementedError."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    with pytest.raises(ValueError, match=r"^model: .*meta device"):
        Engine(model, EngineConfig(kv_cache_tokens=512, max_model_len=64, device=device))


def mistied(path):
    """Untied Llama weights saved under a config that says they are tied (the checkpoint
    holds both tensors, with different values)."""
    saved(tiny_model("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return path


def test_a_checkpoint_holding_its_own_lm_head_is_served_untied_as_transformers_does(tmp_path):
    """transformers does not tie a pair the checkpoint holds with different values (the
    config is wrong about the checkpoint): it serves the checkpoint's lm_head. The engine
    dropped it and served the embedding as the head: logprobs 7.8 nats off, silently."""
    reference = as_transformers_reads_it(mistied(tmp_path))
    assert reference.lm_head.weight is not reference.model.embed_tokens.weight
    engine = engine_for(tmp_path)
    assert engine.model.lm_head is not None
    assert_matches_reference(reference, PROMPTS[:2], engine.generate(PROMPTS[:2], GREEDY))


def test_a_checkpoint_holding_both_tensors_of_a_tied_pair_stays_tied(tmp_path):
    """PyTorch .bin checkpoints (and some sharders) store a tied pair as two equal tensors."""
    model = tiny_model("qwen2")  # tied
    torch.save({**model.state_dict(), "lm_head.weight": model.lm_head.weight.clone()},
               tmp_path / "pytorch_model.bin")
    model.config.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    engine = engine_for(tmp_path)
    assert engine.model.lm_head is None
    assert_matches_reference(model, PROMPTS[:2], engine.generate(PROMPTS[:2], GREEDY))


def test_an_in_memory_model_whose_config_ties_a_head_it_does_not_tie_is_refused(tmp_path):
    """The model transformers loads from such a checkpoint keeps tie_word_embeddings=True in
    its config and multiplies by its own lm_head: the engine served the embedding instead."""
    model = as_transformers_reads_it(mistied(tmp_path))
    with pytest.raises(ValueError, match=r"^model: its config has tie_word_embeddings=True.*"
                                         r"lm_head"):
        engine_for(model)


def test_a_sync_from_a_model_whose_config_ties_a_head_it_does_not_tie_is_refused(tmp_path):
    """The same model as the source of update_weights into a tied engine: its head would be
    dropped and the embedding served in its place. Refused before anything is read: the
    engine keeps its weights and serves."""
    model = as_transformers_reads_it(mistied(tmp_path))
    engine = engine_for(tiny_model("llama", tie_word_embeddings=True))
    before = engine.generate(PROMPTS[:2], GREEDY)
    with pytest.raises(ValueError, match=r"^model: its config has tie_word_embeddings=True.*"
                                         r"lm_head"):
        engine.update_weights(model)
    assert [s.token_ids for o in engine.generate(PROMPTS[:2], GREEDY) for s in o.samples] == \
        [s.token_ids for o in before for s in o.samples]


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


def test_a_quantized_checkpoint_is_refused_naming_its_quantization(tmp_path):
    """An FP8 checkpoint (Qwen3-8B-FP8's layout: float8 weights and their block scales) was
    refused as an unknown weight `...weight_scale_inv`; without scale tensors its float8
    values were served as they are, unscaled. The engine serves unquantized weights only."""
    model = tiny_model("qwen3")
    saved(model, tmp_path)
    save_file({n: t.to(torch.float8_e4m3fn) if n.endswith("proj.weight") else t
               for n, t in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": FP8}))
    with pytest.raises(ValueError, match=r"^model: quantization_config \(quant_method 'fp8'\)"):
        engine_for(tmp_path)


def test_an_in_memory_quantized_model_is_refused():
    """transformers sets config.quantization_config on the models it quantizes (bitsandbytes,
    GPTQ, ...), whose packed weights and scales the engine's copy would read as plain ones."""
    model = tiny_model("llama")
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    with pytest.raises(ValueError, match=r"^model: quantization_config \(quant_method "
                                         r"'bitsandbytes'\)"):
        engine_for(model)


def test_a_checkpoint_without_a_tokenizer_serves_token_ids(tmp_path):
    """A trainer's save_pretrained of the model alone: as an in-memory model without a
    tokenizer, token-id prompts (the engine failed in transformers' AutoTokenizer, with a
    message about sentencepiece and tiktoken)."""
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    engine = engine_for(tmp_path)
    assert engine.tokenizer is None
    assert_matches_reference(model, PROMPTS[:2], engine.generate(PROMPTS[:2], GREEDY))


def test_the_single_file_is_read_before_a_stale_index(tmp_path):
    """transformers reads model.safetensors when it is there, whatever shards an earlier save
    left beside it (their index included)."""
    saved(tiny_model("llama", seed=1), tmp_path, max_shard_size="20KB")
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "single")
    os.rename(tmp_path / "single" / "model.safetensors", tmp_path / "model.safetensors")
    reference = as_transformers_reads_it(tmp_path)
    assert torch.equal(reference.lm_head.weight, model.lm_head.weight)
    outs = engine_for(tmp_path).generate(PROMPTS[:2], GREEDY)
    assert_matches_reference(reference, PROMPTS[:2], outs)


def hub_snapshot(cache, repo: str):
    """The folder of `repo`'s snapshot in a Hugging Face hub cache laid out as downloads
    leave it (refs/main naming the snapshot)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    return folder / "snapshots" / ("0" * 40)


def test_a_hub_id_loads_from_the_hub_cache(tmp_path, monkeypatch):
    """A hub id (which the recipes accept for speculative.draft_model): transformers reads its
    config, tokenizer and weights from the hub cache (downloading what is not there); the
    engine read config and tokenizer so, then looked for the weights in a local folder named
    like the id and refused it."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no network: the cache only
    model = tiny_model("llama")
    saved(model, hub_snapshot(tmp_path, "org/tiny"), max_shard_size="20KB")
    engine = engine_for("org/tiny")
    assert engine.tokenizer is not None
    assert_matches_reference(model, PROMPTS[:2], engine.generate(PROMPTS[:2], GREEDY))


def test_a_shard_its_index_names_but_the_folder_lacks_is_named(tmp_path):
    saved(tiny_model("llama"), tmp_path, max_shard_size="20KB")
    os.remove(tmp_path / "model-00003-of-00014.safetensors")
    with pytest.raises(ValueError, match=r"^model: model\.safetensors\.index\.json names the "
                                         r"shard 'model-00003-of-00014\.safetensors'"):
        engine_for(tmp_path)


def test_generate_takes_a_home_relative_folder_and_a_hub_id(tmp_path, monkeypatch):
    """rollout.generate names its cached engine by the folder's real path: it took `~/ckpt`
    and a hub id for folders under the working directory and refused both ("no checkpoint
    directory at '<cwd>/~/ckpt'"), which Engine takes. Spellings of one folder share an
    engine."""
    from huggingface_hub import constants

    import rollout

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no network: the cache only
    monkeypatch.setenv("HOME", str(tmp_path))
    model = tiny_model("llama")
    saved(model, tmp_path / "ckpt")
    saved(model, hub_snapshot(tmp_path / "hub", "org/tiny"))
    config = dict(kv_cache_tokens=512, max_model_len=64, device="cpu")
    for name in ("~/ckpt", str(tmp_path / "ckpt"), "org/tiny"):
        outs = rollout.generate(name, PROMPTS[:2], GREEDY, **config)
        assert_matches_reference(model, PROMPTS[:2], outs)
    assert rollout.api.engine_for("~/ckpt", **config) is rollout.api.engine_for(
        str(tmp_path / "ckpt"), **config)
