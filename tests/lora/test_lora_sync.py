"""update_weights from a PEFT model served unmerged: after the first sync only the adapter (and
what is trainable) is copied, and the engine follows PEFT's own forward through optimizer steps,
modules_to_save, in-place writes to the base, set_adapter and disable_adapter, sleep and wake."""

import copy
import gc
import weakref

import numpy as np
import pytest
import torch
from lora_models import adapter_bytes, lora_config, peft_model, randomise_b
from models import tiny_model
from reference import PROMPTS, assert_matches_reference

from rollout import Engine, EngineConfig, SamplingParams

peft = pytest.importorskip("peft")

CONFIG = dict(kv_cache_tokens=1024, max_model_len=96, max_num_seqs=16)
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=True)


def outputs(engine):
    return [(s.token_ids, s.logprobs) for o in engine.generate(PROMPTS, GREEDY)
            for s in o.samples]


def train_step(model, opt, seed: int) -> None:
    """One optimizer step on random sequences (next-token loss): moves every trainable weight."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (4, 24), generator=gen)
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()


def trainable_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("family", ["qwen2", "llama", "phi3", "qwen3_moe"])
def test_syncs_after_optimizer_steps_copy_the_adapter_only(family):
    model = peft_model(family)
    engine = Engine(model, EngineConfig(**CONFIG))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    before = outputs(engine)
    for step in range(3):
        train_step(model, opt, step)
        result = engine.update_weights(model)
        assert result["adapter_only"]
        # float32 adapters: the engine's copies are the trainer's bytes, nothing else moves.
        assert result["bytes"] == adapter_bytes(model) == trainable_bytes(model)
        assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    assert outputs(engine) != before  # the steps moved the adapter
    stats = engine.stats
    assert (stats.weight_syncs, stats.adapter_syncs) == (3, 3)
    assert stats.weight_sync_bytes == adapter_bytes(model) and stats.weight_sync_seconds > 0


def test_trainable_weights_and_modules_to_save_are_sent_every_sync():
    """modules_to_save copies and weights the trainer unfroze may change under a fused optimizer
    without a version bump: they go every time, with the adapter."""
    model = peft_model("llama", modules_to_save=["lm_head"])
    norm = model.base_model.model.model.norm.weight
    norm.requires_grad_(True)
    engine = Engine(model, EngineConfig(**CONFIG))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    for step in range(2):
        train_step(model, opt, step)
        result = engine.update_weights(model)
        assert result["adapter_only"] and result["bytes"] == trainable_bytes(model)
        assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("mode", ["auto", "merged"])
def test_an_adapter_named_lora_something_keeps_its_modules_to_save(mode):
    """PEFT names a saved copy after its adapter (lm_head.modules_to_save.lora_ft.weight): a
    weight, not one of the LoRA layers' own lora_A / lora_B."""
    model = peft.get_peft_model(tiny_model("llama"), lora_config(
        "llama", modules_to_save=["lm_head"]), adapter_name="lora_ft")
    randomise_b(model, seed=1)
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["lora_ft"].weight.normal_(0, 0.3)
    engine = Engine(model.eval(), EngineConfig(lora=mode, **CONFIG))
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))


def test_a_frozen_weight_written_since_the_last_sync_is_sent_again():
    model = peft_model("qwen2")
    engine = Engine(model, EngineConfig(**CONFIG))
    down = model.base_model.model.model.layers[1].mlp.down_proj.base_layer.weight
    gate = model.base_model.model.model.layers[0].mlp.gate_proj.base_layer.weight
    with torch.no_grad():
        down.mul_(1.5)  # in place: its version counter moves
    gate.data = gate.data * 0.5  # a new storage, the counter untouched
    result = engine.update_weights(model)
    assert result["adapter_only"]
    assert result["bytes"] == adapter_bytes(model) + 4 * (down.numel() + gate.numel())
    assert outputs(engine) == outputs(Engine(model, EngineConfig(**CONFIG)))  # read whole
    assert engine.update_weights(model)["bytes"] == adapter_bytes(model)


def test_an_expert_stack_is_compared_by_its_bits():
    """PEFT's forward bumps the version of a parameter it adapts (the MoE experts' stacks)
    without changing it: not sent again; a write to it is."""
    model = peft_model("qwen3_moe")
    engine = Engine(model, EngineConfig(**CONFIG))
    experts = model.base_model.model.model.layers[1].mlp.experts.get_base_layer()
    version = experts.down_proj._version
    with torch.no_grad():
        model(torch.tensor([PROMPTS[0]]))
    assert experts.down_proj._version > version
    assert engine.update_weights(model)["bytes"] == adapter_bytes(model)
    with torch.no_grad():
        experts.down_proj[3].mul_(1.5)
    result = engine.update_weights(model)
    assert result["adapter_only"]
    assert result["bytes"] == adapter_bytes(model) + 4 * experts.down_proj.numel()
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))


def two_adapters():
    """'default' (r=4 on attention and MLP) and 'other' (r=8 on q and o only)."""
    model = peft.get_peft_model(tiny_model("qwen2"), lora_config("qwen2"))
    model.add_adapter("other", lora_config("qwen2", r=8, target_modules=["q_proj", "o_proj"]))
    randomise_b(model, seed=1)
    return model.eval()


def active_blocks(engine) -> dict[str, tuple]:
    return {name: m.lora.blocks for name, m in engine.model.named_modules()
            if getattr(m, "lora_active", False)}


def test_set_adapter_and_disable_adapter_change_what_is_served():
    model = two_adapters()
    engine = Engine(model, EngineConfig(**CONFIG))
    default = active_blocks(engine)
    model.set_adapter("other")
    result = engine.update_weights(model)  # another adapter, the same base: not sent again
    assert result["adapter_only"] and result["bytes"] == adapter_bytes(model)
    other = active_blocks(engine)
    assert other.keys() != default.keys() and {b.rank for v in other.values() for b in v} == {8}
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    with model.disable_adapter():
        engine.update_weights(model)
        assert active_blocks(engine) == {} and engine.lora_status == "unmerged"
        assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    model.set_adapter("default")
    engine.update_weights(model)
    assert active_blocks(engine) == default
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))


def test_a_plain_engine_takes_the_adapter_at_its_first_peft_sync():
    base = tiny_model("qwen2")
    model = peft.get_peft_model(copy.deepcopy(base), lora_config("qwen2"))
    randomise_b(model, seed=1)
    engine = Engine(base, EngineConfig(**CONFIG))
    assert engine.lora_status is None
    first = engine.update_weights(model)
    assert not first["adapter_only"] and engine.lora_status == "unmerged"
    assert engine.update_weights(model)["adapter_only"]
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    engine.update_weights(base)  # a plain model again: no adapter served
    assert active_blocks(engine) == {} and engine.lora_status is None
    assert outputs(engine) == outputs(Engine(base, EngineConfig(**CONFIG)))



def merged_stream(model) -> list[tuple[str, torch.Tensor]]:
    """What TRL's async GRPO sends for a PEFT model (its _sync_weight_merged): every base
    weight under its checkpoint name, the adapter merged into it (copies, the merge undone)."""
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params
    model.merge_adapter()
    try:
        return [(name, p.detach().clone()) for name, p in _iter_vllm_named_params(model)]
    finally:
        model.unmerge_adapter()


def test_pairs_replace_an_unmerged_adapter_only_whole():
    """(name, tensor) pairs are merged weights: they carry no adapter. A partial update would
    have served the base without the adapter (gap to PEFT ~5): refused, the engine serving on
    as it was. A full merged stream (TRL's async path) replaces the adapter, which goes."""
    pytest.importorskip("trl")
    model = peft_model("qwen2")
    # No prefix cache: a cached prompt's logprobs differ by an ulp from a computed one's, and
    # what is compared across the refusal is the weights.
    engine = Engine(model, EngineConfig(**CONFIG, enable_prefix_caching=False))
    before = outputs(engine)
    norm = dict(model.named_parameters())["base_model.model.model.norm.weight"]
    why = r"replace the adapter served unmerged and must hold every weight.*\(1 given\)"
    with pytest.raises(ValueError, match=why):
        engine.update_weights([("model.norm.weight", norm.detach().clone())])
    assert engine.lora_status == "unmerged" and not engine.needs_weights
    assert outputs(engine) == before and engine.weights_version == 0
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    engine.update_weights(merged_stream(model))
    assert engine.lora_status is None and active_blocks(engine) == {}
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    # No adapter served now: pairs may update some weights only.
    engine.update_weights([("model.norm.weight", norm.detach().clone())])
    assert engine.weights_version == 2


def test_a_sync_from_another_peft_model_lets_the_first_ones_adapter_go():
    """The placement is reused across syncs of the same adapter layout, not the tensors it was
    first computed from: a trainer that builds a new PeftModel (a resumed run, another
    policy) gets the old one's adapter (and its gradients) back once it drops it."""
    first = peft_model("llama")
    engine = Engine(first, EngineConfig(**CONFIG))
    second = peft_model("llama", seed=2)
    assert engine.update_weights(second)["adapter_only"] is False
    adapter = [weakref.ref(p) for n, p in first.named_parameters() if "lora_" in n]
    assert adapter
    del first
    gc.collect()
    assert [r for r in adapter if r() is not None] == []
    assert_matches_reference(second, PROMPTS, engine.generate(PROMPTS, GREEDY))
    assert engine.update_weights(second)["adapter_only"]  # the placement still reused


@pytest.mark.parametrize("family, separate", [("llama", False), ("llama", True),
                                              ("qwen3_moe", False)],
                         ids=["cpu", "separate-host", "experts"])
def test_sleep_keeps_the_base_and_level_2_is_refilled_by_a_full_sync(family, separate):
    model = peft_model(family)
    engine = Engine(model, EngineConfig(extra={"separate_host_memory": separate}, **CONFIG))
    want = outputs(engine)
    engine.sleep(1)
    engine.wake_up()
    assert outputs(engine) == want
    assert engine.update_weights(model)["adapter_only"]
    engine.sleep(2)
    engine.wake_up()
    assert engine.needs_weights
    with pytest.raises(RuntimeError, match=r"update_weights\(peft_model\): it copies the base"):
        engine.generate(PROMPTS, GREEDY)
    result = engine.update_weights(model)
    assert not result["adapter_only"] and not engine.needs_weights
    assert outputs(engine) == want
    assert engine.update_weights(model)["adapter_only"]


# --- what a sync cannot see by counters, and sources it must refuse or merge ------------------
def test_a_write_through_data_is_copied_by_a_full_sync():
    """`.data.mul_` moves no version counter: a plain sync keeps the engine's old base weight
    (documented), `full=True` and a forced ColocatedRollout sync copy it again."""
    from trainer_hooks import ColocatedRollout

    model = peft_model("qwen2")
    engine = Engine(model, EngineConfig(**CONFIG))
    down = model.base_model.model.model.layers[1].mlp.down_proj.base_layer.weight
    down.data.mul_(3.0)
    assert engine.update_weights(model)["bytes"] == adapter_bytes(model)  # not seen
    result = engine.update_weights(model, full=True)
    assert result["bytes"] > adapter_bytes(model) + 4 * down.numel()  # the whole base
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    down.data.mul_(0.5)
    hook = ColocatedRollout(engine, model)
    assert hook.sync_weights(force=True)
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    with pytest.raises(ValueError, match="full"):
        engine.update_weights(model, full="yes")
    assert engine.update_weights(model, full=np.True_)["bytes"] > adapter_bytes(model)
    assert hook.sync_weights(force=1)


def test_a_frozen_weight_swapped_onto_its_old_address_is_sent_again():
    """Two `p.data = ...` between syncs, the second at the address the engine copied from (the
    allocator hands it out again): the storage differs, so it is sent."""
    model = peft_model("qwen2")
    engine = Engine(model, EngineConfig(**CONFIG))
    gate = model.base_model.model.model.layers[0].mlp.gate_proj.base_layer.weight
    for _ in range(20):
        address = gate.data_ptr()
        gate.data = gate.data * -1
        held = [torch.empty_like(gate.data) for _ in range(64)]
        hit = next((t for t in held if t.data_ptr() == address), None)
        if hit is not None:
            gate.data = hit.copy_(gate.data * 2)
            break
        engine.update_weights(model)  # the swap was seen by its address: try again
    else:
        pytest.skip("this allocator never handed the freed address out again")
    result = engine.update_weights(model)
    assert result["bytes"] == adapter_bytes(model) + 4 * gate.numel()
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))


def test_a_base_made_under_inference_mode_is_served_unmerged():
    with torch.inference_mode():
        base = tiny_model("qwen2")
    model = peft.get_peft_model(base, lora_config("qwen2"))
    randomise_b(model, seed=1)
    engine = Engine(model.eval(), EngineConfig(**CONFIG))
    assert engine.lora_status == "unmerged"
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    with torch.inference_mode():
        base.model.layers[0].mlp.up_proj.base_layer.weight.mul_(1.5)  # no counter: bits
    result = engine.update_weights(model)
    assert result["adapter_only"] and result["bytes"] > adapter_bytes(model)
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))


def test_syncs_under_inference_mode_keep_the_adapter_plain():
    """An adapter attached by a sync under inference_mode is made of plain tensors: the next
    syncs (in the mode or out of it) copy into them and the panels see the change."""
    model = peft_model("qwen2", target_modules=["q_proj"])
    engine = Engine(model, EngineConfig(**CONFIG))
    model.add_adapter("wide", lora_config("qwen2", r=8))
    model.set_adapter("wide")
    randomise_b(model, seed=5)
    with torch.inference_mode():
        engine.update_weights(model)  # a new layout: new adapter modules
    for step, mode in enumerate([torch.inference_mode, torch.no_grad, torch.inference_mode]):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B.wide" in name:
                    p.add_(0.05 * (step + 1))
        with mode():
            assert engine.update_weights(model)["adapter_only"]
        assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("mode", ["auto", "merged"])
def test_a_peft_model_lacking_a_served_weight_is_refused(mode):
    """A model source is the whole policy, served unmerged too: a 2-layer PEFT model synced into
    a 3-layer engine is refused before anything changes (its frozen base is checked whole, even
    where an adapter-only sync would send none of it), the engine serving on."""
    # No prefix cache: a cached prompt's logprobs differ by an ulp from a computed one's.
    engine = Engine(tiny_model("llama", num_hidden_layers=3, seed=7),
                    EngineConfig(lora=mode, **CONFIG | dict(enable_prefix_caching=False)))
    want = outputs(engine)
    with pytest.raises(ValueError, match="must hold every weight the engine serves"):
        engine.update_weights(peft_model("llama"))
    assert not engine.needs_weights and engine.lora_status is None
    assert outputs(engine) == want


@pytest.mark.parametrize("mode", ["auto", "merged"])
def test_replicated_layers_are_served_each_with_its_adapter(mode):
    """PEFT's layer_replication: layers share their base weights (one tensor under several
    names), each with its own adapter; every layer's base is listed and gets its own delta."""
    model = peft.get_peft_model(tiny_model("llama"),
                                lora_config("llama", layer_replication=[[0, 2], [1, 2]]))
    randomise_b(model, seed=2)
    model.eval()
    engine = Engine(tiny_model("llama", num_hidden_layers=3, seed=7),
                    EngineConfig(lora=mode, **CONFIG))
    assert not engine.update_weights(model)["adapter_only"]
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    built = Engine(model, EngineConfig(lora=mode, **CONFIG))
    assert_matches_reference(model, PROMPTS, built.generate(PROMPTS, GREEDY))
    if mode == "auto":
        assert engine.lora_status == "unmerged" and engine.update_weights(model)["adapter_only"]


def injected_lora():
    """LoRA layers put into a transformers model without PEFT's PeftModel around it."""
    model = peft.inject_adapter_in_model(lora_config("llama"), tiny_model("llama"))
    randomise_b(model, seed=1)
    return model.eval()


@pytest.mark.parametrize("mode", ["auto", "unmerged", "merged"])
@pytest.mark.parametrize("wrapper", ["injected", "tuner"])
def test_lora_outside_a_peft_model_is_served(wrapper, mode):
    """peft.inject_adapter_in_model, and a PeftModel's tuner (`peft_model.base_model`): the
    adapter is found layer by layer, served as from the PeftModel."""
    model = injected_lora() if wrapper == "injected" else peft_model("llama").base_model
    engine = Engine(model, EngineConfig(lora=mode, **CONFIG))
    assert engine.lora_status == (None if mode == "merged" else "unmerged")
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    train_step(model, opt, 0)
    assert engine.update_weights(model)["adapter_only"] == (mode != "merged")
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("mode", ["auto", "merged"])
def test_colocated_rollout_syncs_after_the_adapter_scale_changes(mode):
    """PEFT changes an adapter's scaling without touching a parameter (set_scale, scale_layer,
    rescale_adapter_scale): the next block sees it and syncs."""
    from trainer_hooks import ColocatedRollout

    model = peft_model("llama")
    engine = Engine(model, EngineConfig(lora=mode, **CONFIG))
    hook = ColocatedRollout(engine, model)
    with hook:
        assert not hook.synced
    for module in model.modules():
        if hasattr(module, "set_scale") and "default" in module.scaling:
            module.set_scale("default", 0.25)
    with hook:
        assert hook.synced
        assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    with hook:
        assert not hook.synced


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_an_adapter_sync_counts_the_bytes_written_not_the_sources(dtype):
    """The engine's adapter is float32 whatever the source's dtype: an adapter-only sync from
    a float64 (or bf16) PEFT model writes the float32 adapter's bytes, which it reports."""
    model = peft_model("qwen2")
    engine = Engine(model, EngineConfig(**CONFIG))
    written = adapter_bytes(model)  # float32, as the engine's copy
    cast = copy.deepcopy(model).to(dtype)
    engine.update_weights(cast)  # a new source: its base crosses too
    result = engine.update_weights(cast)
    assert result["adapter_only"] and result["bytes"] == written
    assert engine.stats.weight_sync_bytes == written
