"""EngineConfig(lm_head_dtype=torch.float32): a bf16 model's logits come from an fp32 copy of the
LM head times the hidden state in fp32, equal to that product computed by hand; the copy is
counted in memory_held, dropped at sleep and made again from the new weights after sleep(2)
and update_weights; other dtypes are refused."""

import pytest
import torch
from floors import assert_as_exact_as
from kernels_env import device_for
from models import tiny_model
from torch.nn import functional as F

from rollout import Engine, EngineConfig, SamplingParams

CONFIG = dict(kv_cache_tokens=512, max_model_len=64)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=True)


# On CUDA the triton backend too (its head is the same fp32 copy, on the device).
@pytest.mark.parametrize("backend", ["cpu", "torch"] + (
    ["triton"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("family", ["llama", "gemma2"])  # tied head; gemma2: soft-capped
def test_logits_are_the_fp32_product_computed_by_hand(family, backend):
    device = device_for(backend)
    model = tiny_model(family, dtype=torch.bfloat16).to(device)
    engine = Engine(model, EngineConfig(**CONFIG, lm_head_dtype=torch.float32, backend=backend))
    plain = Engine(model, EngineConfig(**CONFIG, backend=backend))
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0)
                         ).to(device, torch.bfloat16)
    weight = engine.model.head.weight
    want = F.linear(hidden.float(), weight.float())
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        want = torch.tanh(want / cap) * cap
    exact = F.linear(hidden.double(), weight.double())
    if cap is not None:
        exact = torch.tanh(exact / cap) * cap
    got = engine.model.compute_logits(hidden)
    assert_as_exact_as(got, exact, want, "logits")
    rounded = plain.model.compute_logits(hidden)  # the head in bf16: logits rounded to bf16
    assert (rounded - want).abs().max() > 10 * (got - want).abs().max()


def test_the_copy_is_held_dropped_at_sleep_and_made_again_after_an_update():
    a = tiny_model("llama", dtype=torch.bfloat16, seed=0)
    b = tiny_model("llama", dtype=torch.bfloat16, seed=1)
    engine = Engine(a, EngineConfig(**CONFIG, lm_head_dtype=torch.float32))
    plain = Engine(a, EngineConfig(**CONFIG))
    head = engine.model.head.weight
    # The head's fp32 copy takes the place of its packed bf16 one (oneDNN, where the CPU has it).
    assert engine.model.head.derived_bytes() == head.numel() * 4
    assert engine.memory_held() - plain.memory_held() == (
        head.numel() * 4 - plain.model.head.derived_bytes())
    engine.sleep(2)
    assert engine.model.derived_bytes() == 0
    engine.wake_up()
    engine.update_weights(b)
    fresh = Engine(b, EngineConfig(**CONFIG, lm_head_dtype=torch.float32))
    assert engine.generate(PROMPTS, GREEDY)[0].samples[0].logprobs == \
        fresh.generate(PROMPTS, GREEDY)[0].samples[0].logprobs
    torch.testing.assert_close(engine.model.head.packing.refresh(head).float()
                               if engine.model.head.packing.kind == "fp32" else head.float(),
                               b.lm_head.weight.float() if b.lm_head is not None
                               else b.model.embed_tokens.weight.float())


def test_an_fp32_model_needs_no_copy():
    model = tiny_model("llama")
    engine = Engine(model, EngineConfig(**CONFIG, lm_head_dtype="float32"))
    assert engine.memory_held() == Engine(model, EngineConfig(**CONFIG)).memory_held()


@pytest.mark.parametrize("value", ["float16", torch.bfloat16, "int8", 3])
def test_other_head_dtypes_are_refused(value):
    with pytest.raises(ValueError, match="^lm_head_dtype"):
        EngineConfig(lm_head_dtype=value)
