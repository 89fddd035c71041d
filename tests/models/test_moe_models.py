"""Qwen3-MoE and Mixtral beyond the shared parity test (test_parity.py runs both families'
default tiny configs): the router variants and dense layers mixed in, against transformers'
own models (fp32, tiny random configs), and expert weights loaded from either layout: the
stacked tensors transformers 5 models hold, or one tensor per expert as Hub checkpoints (and
save_pretrained) name them."""

import pytest
import torch
from models import char_tokenizer, per_expert_tensors, tiny_config, tiny_model
from reference import PROMPTS, assert_matches_reference

from rollout import Engine, EngineConfig, SamplingParams
from rollout.colocation.weights import model_tensors
from rollout.models.loader import build_model, load_into

GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=True)


def engine_for(model, **config) -> Engine:
    return Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=96, **config))


def num_sparse(model) -> int:
    return sum(type(layer.mlp).__name__.endswith("SparseMoeBlock")
               for layer in model.model.layers)


@pytest.mark.parametrize("family,overrides", [
    ("qwen3_moe", dict(norm_topk_prob=False)),
    # Layers 1 and 3 sparse by the step, 3 made dense again by mlp_only_layers: one MoE layer.
    ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])),
    ("qwen3_moe", dict(num_experts_per_tok=1)),
    ("mixtral", dict(num_experts_per_tok=4, sliding_window=8)),
], ids=["qwen3_moe-unnormalised", "qwen3_moe-dense-layers", "qwen3_moe-top1",
        "mixtral-top4-window"])
def test_variants_match_transformers(family, overrides):
    model = tiny_model(family, **overrides)
    engine = engine_for(model)
    assert len(engine.model.moe_layers) == num_sparse(model)
    outs = engine.generate(PROMPTS, GREEDY)
    assert_matches_reference(model, PROMPTS, outs)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_per_expert_and_stacked_names_load_the_same_weights(family):
    model = tiny_model(family)
    per_expert = list(per_expert_tensors(model))
    assert any(".experts.0." in name for name, _ in per_expert)
    stacked = build_model(model.config, 64, torch.float32, torch.device("cpu"))
    split = build_model(model.config, 64, torch.float32, torch.device("cpu"))
    load_into(stacked, model_tensors(model))
    load_into(split, per_expert)
    for (name, a), (_, b) in zip(stacked.named_parameters(), split.named_parameters()):
        assert torch.equal(a, b), name
    # One expert's tensor short: the load is incomplete, and says which piece is missing.
    fresh = build_model(model.config, 64, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"experts\.down_proj\[3\]"):
        load_into(fresh, [(n, t) for n, t in per_expert if ".experts.3.w2." not in n
                          and ".experts.3.down_proj." not in n])
    name, tensor = next((n, t) for n, t in per_expert if ".experts.7." in n)
    with pytest.raises(ValueError, match="expert 8, but this model has 8"):
        fresh.check_weights([(name.replace(".experts.7.", ".experts.8."), tensor.shape)])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_loads_a_saved_checkpoint(family, tmp_path):
    """save_pretrained writes one tensor per expert (Mixtral under `block_sparse_moe`)."""
    model = tiny_model(family, decoder_sparse_step=2, num_hidden_layers=3) \
        if family == "qwen3_moe" else tiny_model(family)
    model.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    engine = Engine(str(tmp_path), EngineConfig(kv_cache_tokens=512, max_model_len=64,
                                                device="cpu"))
    outs = engine.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=8,
                                                       logprobs=True))
    assert_matches_reference(model, PROMPTS[:3], outs)


def test_update_weights_after_deep_sleep_takes_per_expert_names():
    """sleep(level=2) drops the weights; per-expert pairs bring them back, and one expert
    short is refused before anything is copied."""
    model, other = tiny_model("mixtral", seed=0), tiny_model("mixtral", seed=1)
    engine = engine_for(model)
    before = engine.generate(PROMPTS, GREEDY)
    engine.sleep(level=2)
    engine.wake_up()
    partial = [(n, t) for n, t in per_expert_tensors(other) if ".experts.5.w1." not in n]
    with pytest.raises(ValueError, match="every weight is needed"):
        engine.update_weights(partial)
    engine.update_weights(list(per_expert_tensors(other)))
    assert_matches_reference(other, PROMPTS, engine.generate(PROMPTS, GREEDY))
    engine.update_weights(list(per_expert_tensors(model)))
    again = engine.generate(PROMPTS, GREEDY)
    assert [o.samples[0].token_ids for o in again] == [o.samples[0].token_ids for o in before]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_cpu_backend_multiplies_the_experts_by_packed_copies(family, monkeypatch):
    """The router and every expert multiply by packed copies, as the dense projections do:
    nothing in the MoE block calls F.linear, the copies hold at least the experts' bytes, are
    dropped at sleep and made again, and the tokens and logprobs still match transformers.
    With pack_cpu_weights=False the block multiplies by F.linear and holds no copies."""
    from types import SimpleNamespace

    from rollout.models.layers import moe

    def unpacked(*args):
        raise AssertionError("F.linear in the MoE block")

    model = tiny_model(family)
    monkeypatch.setattr(moe, "F", SimpleNamespace(linear=unpacked))
    engine = engine_for(model)
    blocks = [m for m in engine.model.modules() if isinstance(m, moe.SparseMoE)]
    assert blocks
    expert_bytes = sum(p.numel() * p.element_size() for b in blocks
                       for p in (b.gate.weight, b.experts.gate_up_proj, b.experts.down_proj))
    assert sum(b.derived_bytes() for b in blocks) >= expert_bytes
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    held = engine.memory_held()
    engine.sleep(1)
    assert sum(b.derived_bytes() for b in blocks) == 0
    engine.wake_up()
    assert engine.memory_held() == held
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))

    plain = engine_for(model, pack_cpu_weights=False)
    assert all(b.derived_bytes() == 0 for b in plain.model.modules()
               if isinstance(b, moe.SparseMoE))
    with pytest.raises(AssertionError, match="F.linear in the MoE block"):
        plain.generate(PROMPTS[:1], GREEDY)


@pytest.mark.parametrize("family, experts_field", [("qwen3_moe", "num_experts"),
                                                   ("mixtral", "num_local_experts")])
def test_router_sizes_out_of_range_are_refused_at_build(family, experts_field):
    """top-k outside 1..experts failed the first step with torch.topk's RuntimeError (k=9 of 8:
    'selected index k out of range'; k=0: a reduction over an empty tensor); over 2**15
    experts the int16 routes wrapped (an expert 40000 returned as -25536, which replay reads
    as 'not routed')."""
    def build(**overrides):
        build_model(tiny_config(family, **overrides), 64, torch.float32, torch.device("cpu"))

    for k in (9, 0):
        with pytest.raises(ValueError, match=f"num_experts_per_tok={k}.*1 to {experts_field}=8"):
            build(num_experts_per_tok=k)
    with pytest.raises(ValueError, match=f"{experts_field}=32769.*at most 32768"):
        build(num_hidden_layers=1, hidden_size=8, num_attention_heads=1, num_key_value_heads=1,
              head_dim=8, intermediate_size=1, moe_intermediate_size=1,
              **{experts_field: (1 << 15) + 1})
