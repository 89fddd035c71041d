"""RuntimeError and KeyboardInterrupt at each point an unmerged LoRA sync adds: planning (nothing
changes), attaching a new layout, copying the adapter half way, remembering what was copied.
Afterwards the engine's bookkeeping holds, it refuses to generate with half-copied weights, and
the next sync copies the base again and gives exactly what a fresh engine gives."""

import pytest
import torch
from lora_models import lora_config, peft_model, randomise_b
from models import tiny_model
from reference import PROMPTS, assert_matches_reference

import rollout.colocation.checksum as checksum
import rollout.lora.layout as layout
import rollout.models.layers.moe as moe_layer
from rollout import Engine, EngineConfig, SamplingParams
from rollout.lora.sync import LoraSync

peft = pytest.importorskip("peft")

CONFIG = dict(kv_cache_tokens=1024, max_model_len=96, max_num_seqs=16)
PROMPT = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 8, 9]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=True)


def outputs(engine):
    return [(s.token_ids, s.logprobs) for o in engine.generate(PROMPT, GREEDY) for s in o.samples]


# The second adapter's targets; on the MoE family PEFT wants every adapter on the same
# parameters, so "other" adapts the experts too (at another rank: new ExpertLora modules).
OTHER = {"qwen2": ["q_proj", "o_proj"], "qwen3_moe": ["q_proj", "gate_proj", "up_proj",
                                                      "down_proj"]}


def model_and_engine(family: str = "qwen2"):
    model = peft.get_peft_model(tiny_model(family), lora_config(family))
    model.add_adapter("other", lora_config(family, r=8, target_modules=OTHER[family]))
    randomise_b(model, seed=1)
    return model.eval(), Engine(model, EngineConfig(**CONFIG))


def step(model) -> None:
    """What a trainer's step does to the adapter: every LoRA weight moves."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.01)


def fail_at(call: int, error: type[BaseException]):
    """A wrapper that raises `error` at its `call`-th call (1-based) and passes the rest on."""
    def wrap(fn):
        count = [0]

        def wrapped(*args, **kwargs):
            count[0] += 1
            if count[0] == call:
                raise error("injected")
            return fn(*args, **kwargs)
        return wrapped
    return wrap


POINTS = {
    # (object, attribute, call to fail at, changes the adapter selection first, family)
    "attach": (layout, "LoraWeights", 2, True, "qwen2"),
    "attach-experts": (moe_layer, "ExpertLora", 2, True, "qwen3_moe"),
    "copy": (checksum, "_copy", 3, False, "qwen2"),
    "copy-experts": (checksum, "_copy", 3, False, "qwen3_moe"),
    "remember": (LoraSync, "remember", 1, False, "qwen2"),
}


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("point", POINTS)
def test_a_failed_sync_leaves_the_engine_exact_after_the_next(point, error, monkeypatch):
    owner, attr, call, switch, family = POINTS[point]
    model, engine = model_and_engine(family)
    if switch:
        model.set_adapter("other")  # a new layout: projections get new LoraWeights
    step(model)
    monkeypatch.setattr(owner, attr, fail_at(call, error)(getattr(owner, attr)))
    with pytest.raises(RuntimeError if error is RuntimeError else KeyboardInterrupt):
        engine.update_weights(model)
    monkeypatch.undo()
    assert engine.needs_weights
    engine.check_invariants()
    with pytest.raises(RuntimeError, match="incomplete"):
        engine.generate(PROMPT, GREEDY)
    result = engine.update_weights(model)
    assert not result["adapter_only"]  # nothing of the failed sync is trusted
    assert outputs(engine) == outputs(Engine(model, EngineConfig(**CONFIG)))
    step(model)
    assert engine.update_weights(model)["adapter_only"]
    assert outputs(engine) == outputs(Engine(model, EngineConfig(**CONFIG)))


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_plan_changes_nothing(error, monkeypatch):
    """Planning runs before anything changes."""
    model, engine = model_and_engine()
    want = outputs(engine)
    step(model)
    monkeypatch.setattr(LoraSync, "plan", fail_at(1, error)(LoraSync.plan))
    with pytest.raises(error):
        engine.update_weights(model)
    monkeypatch.undo()
    assert not engine.needs_weights and engine.weights_version == 0
    engine.check_invariants()
    assert outputs(engine)[0][0] == want[0][0]
    assert engine.update_weights(model)["adapter_only"]


def test_a_corrupted_adapter_copy_is_caught_and_a_good_sync_recovers(monkeypatch):
    model, engine = model_and_engine()
    step(model)
    real = checksum._copy
    calls = [0]

    def flipping(dst, src):
        real(dst, src)
        calls[0] += 1
        if calls[0] == 7:  # one bit of one adapter tensor
            dst.view(-1)[:1].view(torch.int32).bitwise_xor_(1)

    monkeypatch.setattr(checksum, "_copy", flipping)
    with pytest.raises(checksum.CopyMismatch, match="lora_"):
        engine.update_weights(model)
    monkeypatch.undo()
    assert engine.needs_weights
    engine.update_weights(model)
    assert outputs(engine) == outputs(Engine(model, EngineConfig(**CONFIG)))


def test_batched_verification_names_the_bad_copy_and_clears_large_values():
    """copy_all_verified: a NaN and a flipped bit are named; values whose sum overflows to
    inf are finite and pass; a non-zero left between the copied blocks is caught."""
    def case(src_values, garbage=False):
        covers = [torch.zeros(4, 4), torch.zeros(2, 4)]
        srcs = [torch.full((2, 4), v) for v in src_values]
        copies = [("w0", covers[0][:2], srcs[0]), ("w1", covers[1], srcs[1])]
        if garbage:
            covers[0][3, 3] = 1.0
        checksum.copy_all_verified(copies, covers)

    case([1.0, 2.0])
    case([3e38, 3e38])  # their sum is inf; each is finite
    with pytest.raises(ValueError, match="'w1' holds non-finite"):
        case([1.0, float("nan")])
    with pytest.raises(checksum.CopyMismatch, match="outside the copied blocks"):
        case([1.0, 2.0], garbage=True)


def two_dora():
    """Two DoRA adapters active on each layer: PEFT's merge folds them in place (lora_layers),
    layer by layer, while the weights are read."""
    model = peft_model("qwen2", use_dora=True)
    model.add_adapter("b", lora_config("qwen2", use_dora=True))
    randomise_b(model, 2, 0.3)
    model.base_model.set_adapter(["default", "b"])
    return model


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["second_layer", "second_adapter_of_a_layer"])
def test_a_failed_in_place_merge_unmerges_the_layers_it_merged(where, error, monkeypatch):
    """A fault at the second layer's merge, or inside a layer after its first adapter merged
    (PEFT counts each as merged as it goes), leaves no layer merged and the trainer's base
    weights as they were, the engine's weights untouched (every layer merges before the first
    weight is read), and the next sync serving PEFT's adapters."""
    model = two_dora()
    linear = peft.tuners.lora.layer.Linear
    engine = None
    if where == "second_layer":  # at an update
        engine = Engine(model, EngineConfig(**CONFIG))
        monkeypatch.setattr(linear, "merge", fail_at(2, error)(linear.merge))
    else:  # at the engine's construction
        delta = linear.get_delta_weight
        monkeypatch.setattr(linear, "get_delta_weight", lambda self, adapter: (
            fail_at(1, error)(delta) if adapter == "b" else delta)(self, adapter))
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    with pytest.raises(RuntimeError if error is RuntimeError else KeyboardInterrupt):
        if engine is None:
            engine = Engine(model, EngineConfig(**CONFIG))
        else:
            engine.update_weights(model)
    monkeypatch.undo()
    assert not any(m.merged for m in model.modules() if isinstance(m, linear))
    # (merge + unmerge round in floating point: close, not equal; a layer left merged is 0.3 off)
    assert all(torch.allclose(p, base[n], atol=1e-5) for n, p in model.named_parameters()
               if n in base)
    if engine is None:
        engine = Engine(model, EngineConfig(**CONFIG))
    assert engine.lora_status.startswith("merged")
    if where == "second_layer":
        assert not engine.needs_weights and engine.weights_version == 0
        engine.update_weights(model)
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("written", [False, True])
def test_a_failed_read_of_the_source_says_whether_weights_were_written(written, error,
                                                                       monkeypatch):
    """A PEFT model read merged fails part way: two DoRA adapters on a layer merge every layer
    in place before the first weight is read, so nothing is written and the engine keeps its
    weights, version and outputs (and says so); LoRA adds each delta as its weight is read,
    after the embedding went in (on the CPU each tensor is copied as it comes), so the engine
    needs a complete update (and says that)."""
    model = peft_model("qwen2") if written else two_dora()
    engine = Engine(model, EngineConfig(lora="merged", **CONFIG))
    want = outputs(engine)
    step(model)
    linear = peft.tuners.lora.layer.Linear
    read = "get_delta_weight" if written else "merge"
    monkeypatch.setattr(linear, read, fail_at(1, error)(getattr(linear, read)))
    with pytest.raises(RuntimeError if error is RuntimeError else KeyboardInterrupt) as info:
        engine.update_weights(model)
    monkeypatch.undo()
    if error is RuntimeError:
        assert ("after some weights were written" if written
                else "before any weight was written") in str(info.value)
    assert engine.needs_weights == written and engine.weights_version == 0
    engine.check_invariants()
    if not written:
        assert outputs(engine) == want
    engine.update_weights(model)
    assert engine.weights_version == 1
    # (DoRA's merge + unmerge round in floating point: a fresh engine reads other bits)
    assert_matches_reference(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
