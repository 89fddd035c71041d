"""What cannot be served unmerged is merged under lora="auto" (lora_status says why) and refused
under lora="unmerged" (ValueError with the reason); a bad adapter is refused from its metadata
before anything is copied, and the engine goes on as it was."""

import copy

import pytest
import torch
from lora_models import lora_config, peft_model, randomise_b
from models import tiny_model
from reference import assert_matches_reference
from torch import nn

from rollout import Engine, EngineConfig, SamplingParams

peft = pytest.importorskip("peft")

# No prefix cache: a refused sync leaves the cache as it was, and a cached prompt's logprobs
# differ by an ulp from a computed one's; what is compared here is the weights.
CONFIG = dict(kv_cache_tokens=1024, max_model_len=96, max_num_seqs=16, enable_prefix_caching=False)
PROMPT = [[3, 1, 4, 1, 5, 9, 2, 6]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=True)


def outputs(engine):
    return [(s.token_ids, s.logprobs) for o in engine.generate(PROMPT, GREEDY) for s in o.samples]


def two_active():
    model = peft.get_peft_model(tiny_model("qwen2"), lora_config("qwen2"))
    model.add_adapter("other", lora_config("qwen2"))
    model.base_model.set_adapter(["default", "other"])
    randomise_b(model, seed=1)
    return model


def merged_in_place():
    model = peft_model("qwen2")
    model.merge_adapter()
    return model


def randomise_embedding_lora(model, seed: int = 2) -> None:
    """PEFT starts an embedding's A at zero (randomise_b leaves lora_embedding_*): both random,
    so the embedding's delta counts in what is compared."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_embedding_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def embedding_lora():
    model = peft_model("llama", target_modules=["embed_tokens", "q_proj"])
    randomise_embedding_lora(model)
    return model


CASES = {
    "dora": (lambda: peft_model("qwen2", use_dora=True), "LoRA variant"),
    # Qwen2's q/k/v have biases (PEFT merges a LoRA bias into the base's)
    "bias": (lambda: peft_model("qwen2", lora_bias=True, target_modules=["q_proj", "v_proj"]),
             "LoRA bias"),
    "two-active": (two_active, "2 adapters are active at once"),
    "merge_adapter": (merged_in_place, "merged into the base weight"),
    "lm_head": (lambda: peft_model("llama", target_modules=["q_proj", "lm_head"]),
                "lm_head: the engine holds it as a VocabParallelEmbedding"),
    "embedding": (embedding_lora, "LoRA on a Embedding"),
    # A 2-D targeted parameter the engine holds outside a projection: the MoE router.
    "router": (lambda: peft_model("qwen3_moe", target_modules=["q_proj"],
                                  target_parameters=["mlp.gate.weight"]),
               "mlp.gate: the engine holds it as a Linear"),
}


@pytest.mark.parametrize("case", CASES)
def test_auto_merges_what_unmerged_cannot_serve(case):
    make, reason = CASES[case]
    model = make()
    # PEFT's in-place merge (LoRA on a parameter: the router) drifts the base by an ulp per
    # read: each engine reads a copy of the model as it was.
    auto = Engine(copy.deepcopy(model), EngineConfig(**CONFIG))
    assert auto.lora_status.startswith("merged: ") and reason in auto.lora_status
    merged = Engine(copy.deepcopy(model), EngineConfig(lora="merged", **CONFIG))
    outs = auto.generate(PROMPT, GREEDY)
    assert [(s.token_ids, s.logprobs) for o in outs for s in o.samples] == outputs(merged)
    assert_matches_reference(model, PROMPT, outs)  # what is merged is PEFT's adapter
    with pytest.raises(ValueError, match=f"lora='unmerged': .*{reason}"):
        Engine(model, EngineConfig(lora="unmerged", **CONFIG))


@pytest.mark.parametrize("case", ["dora", "bias"])
def test_reading_such_an_adapter_leaves_the_trainers_weights_exact(case):
    """DoRA and a LoRA bias are added out of place, as plain LoRA is: PEFT's merge and unmerge
    in place would round the trainer's frozen base a little at every sync."""
    model = CASES[case][0]()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = Engine(model, EngineConfig(**CONFIG))
    for _ in range(3):
        engine.update_weights(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not any(getattr(m, "_caches", None) for m in model.modules())  # (DoRA's norms)
    assert_matches_reference(model, PROMPT, engine.generate(PROMPT, GREEDY))


def test_an_unmerged_engine_refuses_such_a_sync_and_keeps_serving():
    model = peft_model("qwen2")
    engine = Engine(model, EngineConfig(lora="unmerged", **CONFIG))
    want = outputs(engine)
    with pytest.raises(ValueError, match="LoRA variant"):
        engine.update_weights(peft_model("qwen2", use_dora=True))
    assert not engine.needs_weights and engine.lora_status == "unmerged"
    assert outputs(engine) == want
    assert engine.update_weights(model)["adapter_only"]


def test_a_refused_sync_leaves_what_is_served_and_its_status():
    """A plain model (or a DoRA one under "auto") refused from its metadata changes neither
    the adapter the projections hold nor Engine.lora_status."""
    model = peft_model("qwen2")
    engine = Engine(model, EngineConfig(**CONFIG))
    want = outputs(engine)
    wrong = tiny_model("qwen2", hidden_size=32)  # shapes the engine's weights do not have
    dora = peft.get_peft_model(tiny_model("qwen2", hidden_size=32),
                               lora_config("qwen2", use_dora=True))
    for source in (wrong, dora):
        with pytest.raises(ValueError, match="shape"):
            engine.update_weights(source)
        assert engine.lora_status == "unmerged" and not engine.needs_weights
        assert outputs(engine) == want


def swap(model, path: str, tensor: torch.Tensor) -> None:
    module, name = path.rsplit(".", 1)
    setattr(model.get_submodule(module), name, nn.Parameter(tensor))


V_B = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default"
V_A = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.default"


@pytest.mark.parametrize("bad, match", [
    ((V_B, lambda w: torch.zeros(w.shape[0], w.shape[1] + 1)), "do not share a rank"),
    ((V_A, lambda w: torch.zeros(w.shape[0], w.shape[1] + 2)), "do not fit its base weight"),
    ((V_B, lambda w: torch.zeros(w.shape, dtype=torch.int32)), "not floating point"),
    ((V_A, lambda w: torch.empty(w.shape, device="meta")), "a meta tensor"),
], ids=["rank", "in-features", "integer", "meta"])
def test_a_bad_adapter_is_refused_before_any_copy(bad, match):
    model = peft_model("qwen2")
    engine = Engine(model, EngineConfig(**CONFIG))
    want = outputs(engine)
    path, make = bad
    linear = model.get_submodule(path)
    old = linear.weight
    linear.weight = nn.Parameter(make(old), requires_grad=False)
    with pytest.raises(ValueError, match=match):
        engine.update_weights(model)
    assert not engine.needs_weights and outputs(engine) == want
    linear.weight = old
    assert engine.update_weights(model)["adapter_only"]


EXPERTS_A = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.default"


@pytest.mark.parametrize("rows, match", [(1, "do not share a rank over 8 experts"),
                                         (8, "do not share a rank")],
                         ids=["not-a-multiple-of-E", "rank-mismatch"])
def test_a_bad_expert_adapter_is_refused_before_any_copy(rows, match):
    """PEFT's expert A holds E*r rows: one row more, or one more rank per expert than B has."""
    model = peft_model("qwen3_moe")
    engine = Engine(model, EngineConfig(**CONFIG))
    want = outputs(engine)
    linear = model.get_submodule(EXPERTS_A)
    old = linear.weight
    linear.weight = nn.Parameter(torch.zeros(old.shape[0] + rows, old.shape[1]),
                                 requires_grad=False)
    with pytest.raises(ValueError, match=match):
        engine.update_weights(model)
    assert not engine.needs_weights and outputs(engine) == want
    linear.weight = old
    assert engine.update_weights(model)["adapter_only"]


def test_non_finite_adapter_values_are_refused_and_a_good_sync_restores():
    model = peft_model("qwen2")
    engine = Engine(model, EngineConfig(**CONFIG))
    want = outputs(engine)
    b = model.get_submodule(V_B).weight
    with torch.no_grad():
        saved = b.clone()
        b[0, 0] = float("nan")
        with pytest.raises(ValueError, match="non-finite"):
            engine.update_weights(model)
        assert engine.needs_weights  # found after the copy, as for any weight
        b.copy_(saved)
    assert not engine.update_weights(model)["adapter_only"]  # the base goes again
    assert outputs(engine) == want


def test_lora_mode_is_checked():
    with pytest.raises(ValueError, match="lora must be one of"):
        EngineConfig(lora="fused")


TIED_ALONE = {"saved-head": dict(modules_to_save=["lm_head"]),
              "saved-embedding": dict(modules_to_save=["embed_tokens"]),
              "lora-embedding": dict(target_modules=["q_proj", "embed_tokens"]),
              "lora-head": dict(target_modules=["q_proj", "lm_head"])}


@pytest.mark.parametrize("mode", ["auto", "unmerged", "merged"])
@pytest.mark.parametrize("adapt", TIED_ALONE)
def test_a_tied_head_adapted_alone_is_refused(adapt, mode):
    """PEFT's modules_to_save of a tied model's head or embedding trains a copy of one, and its
    LoRA on one adds a delta to that one only (the other multiplies by the plain tied weight):
    the engine's tied model would serve the embedding as the head. Refused at build and at a
    sync in every mode, the engine serving on; with the adapter disabled it is served."""
    model = peft_model("qwen2", **TIED_ALONE[adapt])
    randomise_embedding_lora(model)
    assert model.config.tie_word_embeddings
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        Engine(model, EngineConfig(lora=mode, **CONFIG))
    engine = Engine(peft_model("qwen2"), EngineConfig(lora=mode, **CONFIG))
    before = outputs(engine)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        engine.update_weights(model)
    assert not engine.needs_weights and outputs(engine) == before
    if adapt.startswith("lora"):
        with model.disable_adapter():
            engine.update_weights(model)
            assert_matches_reference(model, PROMPT, engine.generate(PROMPT, GREEDY))


def arrow_router():
    """PEFT's Arrow: a router adapter active over two task adapters, chosen per token."""
    model = peft.get_peft_model(tiny_model("llama"), lora_config("llama", target_modules=[
        "q_proj"]), adapter_name="task_0")
    model.add_adapter("task_1", lora_config("llama", target_modules=["q_proj"]))
    arrow = peft.ArrowConfig(top_k=1)
    arrow.task_adapter_names, arrow.gks_adapter_names = ["task_0", "task_1"], []
    model.add_adapter("arrow_router", lora_config("llama", target_modules=["q_proj"],
                                                  arrow_config=arrow))
    randomise_b(model, seed=1)
    model.set_adapter("arrow_router")
    return model.eval()


Q_PROJ = r"model\.layers\.0\.self_attn\.q_proj"
SERVED_IN_NO_MODE = {
    # (a TrainableTokensWrapper on the embedding)
    "trainable-tokens": (lambda: peft_model("llama", target_modules=["q_proj"],
                                            trainable_token_indices=[1, 2, 3]),
                         r"model\.embed_tokens: a peft\.\S+\.TrainableTokensWrapper adapter "
                         r".* in no lora mode"),
    # aLoRA adds its delta only after the invocation tokens, Arrow per token to the task
    # adapters it routes to: no weight holds either, and PEFT's merge raises.
    "alora": (lambda: peft_model("llama", target_modules=["q_proj", "v_proj"],
                                 alora_invocation_tokens=[5, 9]),
              rf"{Q_PROJ}: adapter 'default' \(alora_invocation_tokens\) .* in no lora mode"),
    "arrow": (arrow_router,
              rf"{Q_PROJ}: adapter 'arrow_router' \(arrow_config\) .* in no lora mode"),
}


@pytest.mark.parametrize("mode", ["auto", "unmerged", "merged"])
@pytest.mark.parametrize("kind", SERVED_IN_NO_MODE)
def test_adapters_served_in_no_mode_are_refused_in_every_mode(kind, mode):
    """Refused by name from their metadata, at build and at a sync, the engine serving on."""
    make, why = SERVED_IN_NO_MODE[kind]
    with pytest.raises(ValueError, match=why):
        Engine(make(), EngineConfig(lora=mode, **CONFIG))
    engine = Engine(peft_model("llama", target_modules=["q_proj"]),
                    EngineConfig(lora=mode, **CONFIG))
    before = outputs(engine)
    with pytest.raises(ValueError, match=why):
        engine.update_weights(make())
    assert not engine.needs_weights and outputs(engine) == before


def infinite_scale():
    model = peft_model("llama")
    model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj").scaling["default"] = (
        float("inf"))
    return model


@pytest.mark.parametrize("mode", ["auto", "unmerged", "merged"])
@pytest.mark.parametrize("make, value", [(infinite_scale, "inf"),
                                         (lambda: peft_model("llama", lora_alpha=float("nan")),
                                          "nan")], ids=["scaling", "lora_alpha"])
def test_a_non_finite_scale_is_refused_in_every_mode(make, value, mode):
    """A LoRA layer's scale (lora_alpha / r, or set by set_scale) that is not finite makes every
    logit NaN: refused from the metadata, at build and at a sync, the engine serving on."""
    why = rf"{Q_PROJ}: scaling\['default'\] is {value}"
    with pytest.raises(ValueError, match=why):
        Engine(make(), EngineConfig(lora=mode, **CONFIG))
    engine = Engine(peft_model("llama"), EngineConfig(lora=mode, **CONFIG))
    before = outputs(engine)
    with pytest.raises(ValueError, match=why):
        engine.update_weights(make())
    assert not engine.needs_weights and outputs(engine) == before


def test_adalora_is_merged_not_crashed():
    """AdaLoRA's layers look like LoRA's (lora_A, get_delta_weight) but hold bare factors
    scaled by lora_E: "auto" merges it (its bookkeeping `ranknum` is no weight), "unmerged"
    refuses it by name."""
    from reference import PROMPTS

    config = peft.AdaLoraConfig(init_r=4, target_r=2, lora_alpha=8, total_step=100,
                                target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(tiny_model("llama"), config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_E" in name or "lora_B" in name:
                p.normal_(0, 0.3)
    with pytest.raises(ValueError, match="SVDLinear"):
        Engine(model, EngineConfig(**CONFIG, lora="unmerged"))
    engine = Engine(model, EngineConfig(**CONFIG))
    assert engine.lora_status.startswith("merged")
    greedy = SamplingParams(temperature=0, max_tokens=8, logprobs=True)
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, greedy))


def replicated(second_adapter: bool):
    """PEFT's layer_replication shares layer 0's and 1's base weights with layer 2, each with its
    own DoRA adapter (and a second one active)."""
    model = peft.get_peft_model(tiny_model("llama"), lora_config(
        "llama", use_dora=True, layer_replication=[[0, 2], [1, 2]]))
    if second_adapter:
        model.add_adapter("other", lora_config("llama", use_dora=True))
        model.base_model.set_adapter(["default", "other"])
    randomise_b(model, seed=1)
    return model.eval()


@pytest.mark.parametrize("mode", ["auto", "merged"])
def test_replicated_layers_are_read_out_of_place_and_an_in_place_merge_is_refused(mode):
    """One DoRA adapter per layer is added out of place: each replicated layer reads the shared
    base weight with its own delta. Two active (merged in place, layer by layer) would put
    every layer's delta into the one tensor: refused by name before anything changes (PEFT's
    merge_adapter refuses it too)."""
    engine = Engine(tiny_model("llama", num_hidden_layers=3), EngineConfig(lora=mode, **CONFIG))
    want = outputs(engine)
    with pytest.raises(ValueError, match=r"model\.layers\.2\..*layer_replication"):
        engine.update_weights(replicated(second_adapter=True))
    assert not engine.needs_weights and outputs(engine) == want
    model = replicated(second_adapter=False)
    engine.update_weights(model)
    assert_matches_reference(model, PROMPT, engine.generate(PROMPT, GREEDY))


@pytest.mark.parametrize("mode", ["auto", "unmerged", "merged"])
@pytest.mark.parametrize("family, target", [("qwen2", "o_proj"), ("llama", "q_proj")])
def test_a_lora_bias_on_a_layer_without_a_bias_is_refused(family, target, mode):
    """PEFT adds lora_B's bias (scaled) to the output of a layer that has none of its own
    (Qwen2's o_proj, Llama's q_proj): the engine's projection has no bias to fold it into,
    and merging it dropped the delta (every logprob off by ~1, lora='merged' included).
    Refused by name in every mode, at build and at a sync, the engine serving on."""
    def make():
        return peft_model(family, lora_bias=True, target_modules=[target])

    why = rf"model.layers.0.\w+.{target}: adapter 'default' has a LoRA bias .* no bias"
    with pytest.raises(ValueError, match=why):
        Engine(make(), EngineConfig(lora=mode, **CONFIG))
    engine = Engine(peft_model(family, target_modules=[target]), EngineConfig(lora=mode, **CONFIG))
    before = outputs(engine)
    with pytest.raises(ValueError, match=why):
        engine.update_weights(make())
    assert not engine.needs_weights and outputs(engine) == before
