"""CPU projections on packed weights: oneDNN's layout (rollout/models/layers/packed_linear.py)
and rollout_kernels.cpu's panels (linear.c, the cpu backend's fp32 default): F.linear's
results to fp32 rounding, each row independent of the others, a copy that follows every change
of its weight, dropped at sleep and counted in memory_held; the engine's outputs the same with
packing off, and transformers' within the parity tests' bounds (those run packed: it is the CPU
default)."""

import pytest
import torch
from floors import assert_as_exact_as
from models import tiny_model
from torch.nn import functional as F

from rollout import Engine, EngineConfig, SamplingParams
from rollout.models.layers.packed_linear import (NativePackedWeight, PackedWeight, RoundedPanels,
                                                 can_pack)
from rollout_kernels import cpu as native
from rollout_kernels.cpu import linear as native_linear

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN")

CONFIG = dict(kv_cache_tokens=512, max_model_len=96, max_num_seqs=16)
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [1, 2, 3, 4, 5, 6, 10, 11]]
SAMPLED = SamplingParams(n=3, temperature=0.9, top_p=0.95, max_tokens=12, logprobs=True, seed=7)


# linear.c on whichever path this build has: its intrinsics, else its portable C
# (ROLLOUT_NATIVE_MARCH=x86-64: tests/kernels/test_cpu_build.py)
PANELS_RUN = pytest.mark.skipif(not native_linear.invariant_supported(torch.device("cpu")),
                                reason=native.missing_reason("pack_panels_f32", "linear_f32"))
PACKINGS = [PackedWeight, pytest.param(NativePackedWeight, marks=PANELS_RUN)]


def assert_as_exact_as_f_linear(got, x, w, b=None):
    """A projection `got` of x by w (and b) as near the float64 answer as F.linear's float32
    one is (no rows: nothing to measure but the shape)."""
    want = F.linear(x, w, b)
    assert got.shape == want.shape
    if want.numel():
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert_as_exact_as(got, exact, want, "projection")


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("rows", [0, 1, 7, 16, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_f_linear_to_rounding(packing, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=g)  # 300 outputs: a last panel of 12 columns
    b = torch.randn(300, generator=g) if bias else None
    x = torch.randn(rows, 96, generator=g)
    assert_as_exact_as_f_linear(packing().linear(x, w, b), x, w, b)


@PANELS_RUN
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rounded_panels_round_once_to_the_weights_dtype(dtype):
    """The batch-invariant packing of a bf16/fp16 weight multiplies in fp32 and adds the bias
    there: its output is in the weight's dtype and as near the float64 answer as F.linear's."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(300, 576, generator=g).to(dtype), torch.randn(300, generator=g).to(dtype)
    x = torch.randn(7, 576, generator=g).to(dtype)
    got = RoundedPanels().linear(x, w, b)
    assert got.dtype == dtype
    exact = F.linear(x.double(), w.double(), b.double())
    assert_as_exact_as(got, exact, F.linear(x, w, b), "projection")


@PANELS_RUN
@pytest.mark.parametrize("rows", [0, 1, 7, 64])
def test_linear_add_accumulates_into_a_column_slice(rows):
    """linear_add (a LoRA block's expand): y[:, cols] += alpha * x W^T in place, x a column
    slice of a wider tensor, y a column slice of a wider output (300 columns: a last panel of
    12); what lies outside the slice is untouched."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 16, generator=g)
    wide_x = torch.randn(rows, 48, generator=g)
    y = torch.randn(rows, 500, generator=g)
    want = y.clone()
    want[:, 100:400] += 0.5 * F.linear(wide_x[:, 16:32], w)
    exact = y[:, 100:400].double() + 0.5 * F.linear(wide_x[:, 16:32].double(), w.double())
    native_linear.linear_add(wide_x[:, 16:32], native_linear.pack_panels(w), y[:, 100:400], 0.5)
    if rows:
        assert_as_exact_as(y[:, 100:400], exact, want[:, 100:400], "linear_add")
    assert torch.equal(y[:, :100], want[:, :100]) and torch.equal(y[:, 400:], want[:, 400:])
    with pytest.raises(ValueError, match="does not fit"):
        native_linear.linear_add(wide_x, native_linear.pack_panels(w), y[:, :300].t(), 1.0)


@pytest.mark.parametrize("shape", [(5, 3, 40), (2, 1, 7)])
def test_panels_take_any_leading_shape_and_strided_rows(shape):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(33, shape[-1], generator=g)
    x = torch.randn(shape, generator=g)
    panels = native_linear.invariant_supported(torch.device("cpu"))
    packed = NativePackedWeight() if panels else PackedWeight()
    assert_as_exact_as_f_linear(packed.linear(x, w, None), x, w)
    wide = torch.randn(6, 2 * shape[-1], generator=g)
    view = wide[:, ::2]  # rows with a stride of 2 within
    assert_as_exact_as_f_linear(packed.linear(view, w, None), view, w)


@PANELS_RUN
def test_panels_hand_long_prefills_to_f_linear(monkeypatch):
    monkeypatch.setattr(native_linear, "MAX_ROWS", 8)
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(20, 16, generator=g), torch.randn(9, 16, generator=g)
    packed = NativePackedWeight()
    assert torch.equal(packed.linear(x, w, None), F.linear(x, w))
    assert packed.packed is None  # never packed for it


@pytest.mark.parametrize("packing", PACKINGS)
def test_a_row_does_not_depend_on_the_others(packing):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(576, 96, generator=g), torch.randn(64, 96, generator=g)
    packed = packing()
    whole = packed.linear(x, w, None)
    for r in (0, 13, 63):
        assert torch.equal(packed.linear(x[r:r + 1], w, None), whole[r:r + 1])
    assert torch.equal(packed.linear(x[5:21], w, None), whole[5:21])


@PANELS_RUN
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_invariant_packing_keeps_rows_apart_at_every_row_count(dtype):
    """EngineConfig(batch_invariant=True)'s projections: a row's bits the same alone, in a
    decode-sized batch and in a prefill past the panels' MAX_ROWS (where the default hands
    rows to F.linear, whose rows depend on how many there are)."""
    from rollout.models.layers.packed_linear import invariant_packing

    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 96, generator=g).to(dtype)
    x = torch.randn(native_linear.MAX_ROWS + 300, 96, generator=g).to(dtype)
    packing = invariant_packing(dtype)

    def project(rows):
        return packing.linear(rows, w, None)

    whole = project(x)
    for lo, hi in [(0, 1), (7, 8), (5, 21), (0, 64), (100, 1100), (3, native_linear.MAX_ROWS)]:
        assert torch.equal(project(x[lo:hi]), whole[lo:hi]), (lo, hi)


# Decode batches one by one to 33 rows (oneDNN's bf16 AMX kernels differ at 8, 16 and 32), then
# prefill-sized calls.
ROW_COUNTS = [*range(1, 34), 48, 63, 64, 65, 100, 127, 128, 129, 160]


@PANELS_RUN
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n,k", [(576, 576), (300, 576), (576, 1536)])
def test_batch_invariant_packing_keeps_rows_apart_at_model_shapes(dtype, n, k):
    """The same at SmolLM2-135M's o_proj and down_proj (and a last panel of 12 columns): each
    row's bits in a call of m rows the same as alone and as in the largest call. K = 96 hid
    what K = 576 and 1536 showed on an Intel Xeon with AMX: oneDNN's packed bf16 layout rounded
    a row by how many rows shared its call (and fp16's F.linear a lone row)."""
    from rollout.models.layers.packed_linear import invariant_packing

    g = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(ROW_COUNTS[-1], k, generator=g).to(dtype)
    packing = invariant_packing(dtype)

    def project(rows):
        return packing.linear(rows, w, None)

    whole = project(x)
    alone = torch.cat([project(x[r:r + 1]) for r in range(len(x))])
    apart = [m for m in ROW_COUNTS if not torch.equal(project(x[:m]), whole[:m])]
    assert not apart, f"rows differ from the largest call's in calls of {apart} rows"
    assert torch.equal(alone, whole), "rows differ alone from the largest call's"


@pytest.mark.parametrize("packing", PACKINGS)
def test_follows_in_place_changes_and_swapped_storage(packing):
    w = torch.nn.Parameter(torch.randn(64, 32))
    x = torch.randn(4, 32)
    packed = packing()
    packed.linear(x, w, None)
    with torch.no_grad():
        w.mul_(-2)  # in place: same storage, a new version
    assert_as_exact_as_f_linear(packed.linear(x, w, None), x, w.detach())
    w.data = torch.randn(64, 32)  # a new storage, as sleep/wake swaps it
    assert_as_exact_as_f_linear(packed.linear(x, w, None), x, w.detach())


def run(engine):
    return [[(s.token_ids, s.logprobs) for s in o.samples]
            for o in engine.generate(PROMPTS, SAMPLED)]


def close(a, b):
    """Same tokens, logprobs to fp32 rounding of a differently ordered matmul."""
    for ga, gb in zip(a, b, strict=True):
        for (ta, la), (tb, lb) in zip(ga, gb, strict=True):
            assert ta == tb
            # two engines' fp32 logprobs, no float64 answer taken: worst gap seen 1.9e-6
            # (test_engine_packed_matches_unpacked, tiny llama; AMD EPYC Zen 3, AVX2), 9.5e-7
            # (every family, both packings; Intel Xeon, AVX-512)
            torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), atol=2e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("native", [True, False])
def test_engine_packed_matches_unpacked(family, native, monkeypatch):
    """native: the C panels where they build; else oneDNN's layout, which the cpu backend
    takes where the C linear kernel does not build."""
    model = tiny_model(family)
    if not native:
        monkeypatch.setattr(native_linear, "supported", lambda device, dtype: False)
    packed = Engine(model, EngineConfig(**CONFIG))
    plain = Engine(model, EngineConfig(**CONFIG, pack_cpu_weights=False))
    kinds = {type(m.packing) for m in packed.model.modules() if hasattr(m, "packing")}
    cpu, f32 = torch.device("cpu"), torch.float32
    want = NativePackedWeight if native and native_linear.supported(cpu, f32) else PackedWeight
    assert kinds == {want}
    assert packed.model.derived_bytes() > 0 and plain.model.derived_bytes() == 0
    close(run(packed), run(plain))


def test_packs_follow_sleep_wake_and_update_weights():
    model = tiny_model("qwen2")
    engine = Engine(model, EngineConfig(**CONFIG))
    held = engine.memory_held()
    # Every matrix is packed (the tied embedding for the LM head), the norms' vectors not.
    matrices = sum(p.numel() * 4 for p in engine.model.parameters() if p.dim() == 2)
    assert engine.model.derived_bytes() >= matrices
    before = run(engine)
    assert engine.memory_held() == held  # packed when built, not at the first step
    engine.sleep(1)
    assert engine.model.derived_bytes() == 0
    engine.wake_up()
    assert engine.memory_held() == held
    assert run(engine) == before
    # New weights: the engine must follow them, packed again, not keep the old copies.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    engine.sleep(2)
    engine.wake_up()
    engine.update_weights(model)
    assert engine.memory_held() == held
    close(run(engine), run(Engine(model, EngineConfig(**CONFIG, pack_cpu_weights=False))))


def test_pack_cpu_weights_must_be_a_bool():
    with pytest.raises(ValueError, match="pack_cpu_weights"):
        EngineConfig(pack_cpu_weights="maybe")
