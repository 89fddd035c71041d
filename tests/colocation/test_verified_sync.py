"""Verified weight syncs (rollout/colocation/checksum.py): every copy is summed on both sides
and read back for non-finite values; a corrupted copy, a NaN source or a value that overflows
the engine's dtype leaves the engine refusing to generate until a good update, which recovers
it; bad sources are refused before anything changes; each complete update bumps
`weights_version`, which every output carries."""

import pytest
import torch
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams
from rollout.colocation import checksum
from rollout_kernels import cpu as native
from rollout_kernels.cpu import checked_copy as native_copy

CONFIG = dict(kv_cache_tokens=512, max_model_len=64)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=True)


def tokens(engine):
    return [o.samples[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(params=[False, True], ids=["in-place", "bucketed"])
def engine_and_models(request):
    """An engine and two other models of its shapes; `bucketed`: the GPU's code path (host
    memory separate from the device's), every tensor through the flat buckets."""
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    extra = {"separate_host_memory": True} if request.param else {}
    return Engine(a, EngineConfig(**CONFIG, extra=extra)), a, b


def test_versions_count_complete_updates_and_are_stamped(engine_and_models):
    engine, a, b = engine_and_models
    assert engine.weights_version == 0
    assert {o.weights_version for o in engine.generate(PROMPTS, GREEDY)} == {0}
    engine.update_weights(b)
    engine.update_weights(a)
    assert engine.weights_version == 2
    assert {o.weights_version for o in engine.generate(PROMPTS, GREEDY)} == {2}
    with pytest.raises(ValueError):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])  # refused: no change
    assert engine.weights_version == 2 and not engine.needs_weights


@pytest.mark.parametrize("path", ["torch", "native"])
def test_a_corrupted_copy_is_caught_and_a_good_update_recovers(engine_and_models, path,
                                                               monkeypatch):
    """A bit flipped in one weight's destination: by the torch copy (its checks read the
    destination afterwards), or as the C checked copy would read it back (rollout_kernels.cpu
    checked_copy; off the CPU, or without the library, the torch path serves both cases)."""
    engine, a, b = engine_and_models
    want = tokens(Engine(b, EngineConfig(**CONFIG)))
    norm = engine.model.model.norm.weight

    def flip(dst):
        if dst.shape == norm.shape and dst.dim() == 1:
            dst.view(torch.int32)[3] ^= 1  # one bit of one element of one weight

    real_copy, real_native = checksum._copy, checksum._native_copy

    def flipping(dst, src):
        real_copy(dst, src)
        flip(dst)

    def flipping_native(dst, src):
        source, _, finite = real_native(dst, src)
        flip(dst)
        return source, int(checksum.bit_sum(dst)), finite

    if path == "torch":
        monkeypatch.setattr(checksum.native_copy, "supported", lambda dst, src: False)
    monkeypatch.setattr(checksum, "_copy", flipping)
    monkeypatch.setattr(checksum, "_native_copy", flipping_native)
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        engine.update_weights(b)
    assert engine.needs_weights and engine.weights_version == 0
    with pytest.raises(RuntimeError, match="weights are incomplete"):
        engine.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    engine.update_weights(b)
    assert not engine.needs_weights and engine.weights_version == 1
    assert tokens(engine) == want


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(engine_and_models, bad):
    engine, a, b = engine_and_models
    weights = dict(b.state_dict())
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name].clone()
    weights[name][2, 5] = bad
    with pytest.raises(ValueError, match=f"weight '{name}' holds non-finite values"):
        engine.update_weights(weights)
    assert engine.needs_weights
    engine.update_weights(b)
    assert tokens(engine) == tokens(Engine(b, EngineConfig(**CONFIG)))


def test_a_value_beyond_the_engines_dtype_is_refused():
    """A finite float32 too large for bf16 becomes inf in the engine's bf16 weights."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    engine = Engine(model, EngineConfig(**CONFIG))
    weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    weights["model.norm.weight"][0] = 3.4e38  # < float32's max, rounds to inf in bf16
    with pytest.raises(ValueError, match="'model.norm.weight' holds non-finite"):
        engine.update_weights(weights)


@pytest.mark.parametrize("source, match", [
    (None, "got NoneType"), ("a string", "got str"), (3, "got int"),
    ([1, 2], "item 0 must be a \\(name, tensor\\) pair"),
    ([("model.norm.weight",)], "item 0 must be a \\(name, tensor\\) pair"),
    ({3: torch.zeros(2)}, "item 0 must be a \\(name, tensor\\) pair with a str name"),
])
def test_bad_sources_are_refused_and_change_nothing(source, match):
    model = tiny_model("llama")
    engine = Engine(model, EngineConfig(**CONFIG))
    before = tokens(engine)
    with pytest.raises(ValueError, match=f"^update_weights: .*{match}"):
        engine.update_weights(source)
    assert not engine.needs_weights and engine.weights_version == 0
    assert tokens(engine) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("numel", [1000, 999, 3])
def test_the_checksum_sees_one_flipped_bit_anywhere_and_not_the_layout(dtype, numel):
    t = torch.randn(numel, dtype=torch.float64).to(dtype)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    for i in (0, numel // 2, numel - 1):
        for bit in (0, 7, t.element_size() * 8 - 2):
            u = t.clone()
            u.view(bits)[i] ^= 1 << bit
            assert checksum.bit_sum(u) != checksum.bit_sum(t)
    # A strided view and a copy of it at another offset: the same values, the same sum.
    wide = torch.randn(2 * numel + 1, dtype=torch.float64).to(dtype)
    assert checksum.bit_sum(wide[1::2]) == checksum.bit_sum(wide[1::2].clone())


@pytest.mark.skipif(not native.has("checked_copy"), reason=native.missing_reason("checked_copy"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("numel", [1, 3, 1000, 8192 * 4 + 1, 300_001])
def test_the_c_checked_copy_sums_as_bit_sum_and_sees_non_finite(dtype, numel):
    """checked_copy.c against the torch checks: the copy, both sums as bit_sum's (odd 2-byte
    tails, sizes past one block and one thread's share), and a nan, +inf or -inf anywhere."""
    src = torch.randn(numel, dtype=torch.float64).to(dtype)
    dst = torch.empty_like(src)
    version = dst._version
    source, written, finite = native_copy.checked_copy(dst, src)
    assert torch.equal(dst, src) and dst._version > version  # derived copies see the write
    assert source == written == int(checksum.bit_sum(src)) and finite
    for i, bad in [(0, float("nan")), (numel // 2, float("inf")), (numel - 1, float("-inf"))]:
        src[i] = bad
        assert native_copy.checked_copy(dst, src)[2] is False
        src[i] = 1.0
    assert native_copy.checked_copy(dst, src)[2] is True
