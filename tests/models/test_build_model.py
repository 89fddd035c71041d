"""Building the engine's model (rollout/models/loader.py build_model): its modules are allocated
for the weights a load then writes, nothing more. No random initialisation, which would draw from
the process's generators a trainer seeded for its own dropout, shuffles and inits; no weights in
float32 first, which would peak at three times a bf16 model's bytes. That the built model
computes what transformers computes: test_parity.py, test_model_families.py."""

from __future__ import annotations

import pytest
import torch
from models import FAMILIES, tiny_config, tiny_model
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from rollout import Engine, EngineConfig
from rollout.models.loader import build_model
from rollout.spec import SpeculativeConfig

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))]


def generator_states() -> list[torch.Tensor]:
    """The CPU generator's state and every CUDA device's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return [torch.get_rng_state(), *cuda]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_building_an_engine_draws_nothing_from_torchs_generators(family, device):
    model = tiny_model(family).to(device)
    draft = SpeculativeConfig("draft", num_speculative_tokens=2, draft_model=model)
    torch.manual_seed(1234)
    if device == "cuda":
        torch.cuda.manual_seed_all(1234)
    before = generator_states()
    Engine(model, EngineConfig(kv_cache_tokens=256, max_model_len=64, speculative=draft))
    after = generator_states()
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


class NewStorageBytes(TorchDispatchMode):
    """Counts the bytes of every storage an op makes off the meta device (an op's output that
    shares no storage with its inputs). Frees are not subtracted: an upper bound of the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.device.type != "meta"
                    and t.untyped_storage().data_ptr() not in inputs):
                self.bytes += t.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_model_is_allocated_in_its_dtype_once(dtype):
    """Everything build_model allocates is the weights in `dtype` and the RoPE tables (fp32,
    with what computing them takes): a bf16 model built in fp32 and cast made 3x its bytes."""
    config = tiny_config("llama", vocab_size=4096, hidden_size=256, intermediate_size=512)
    with NewStorageBytes() as counted:
        model = build_model(config, 64, dtype, torch.device("cpu"))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    tables = sum(b.numel() * b.element_size() for b in model.buffers())
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert {b.dtype for b in model.buffers()} == {torch.float32}
    assert weights <= counted.bytes <= weights + 4 * tables
    assert tables < weights / 20  # so the bound is the weights', not the tables'
