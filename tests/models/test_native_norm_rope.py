"""RMSNorm and rotary embedding in rollout_kernels.cpu's C against the torch layers they replace on
the CPU in fp32: rotary bit for bit, RMSNorm to a float32 rounding; and the engine's layers take
them exactly when the engine's backend is cpu."""

import pytest
import torch
from floors import assert_as_exact_as
from models import tiny_model

from rollout import Engine, EngineConfig
from rollout.models.layers.norm import RMSNorm
from rollout.models.layers.rotary import _rotate
from rollout_kernels import cpu as native
from rollout_kernels.cpu import norm_rope

pytestmark = pytest.mark.skipif(not native.has("rms_norm_f32", "rotary_f32"),
                                reason=native.missing_reason("rms_norm_f32", "rotary_f32"))


def cos_sin(tokens, rot, seed=0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).float()
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
    emb = torch.cat([positions[:, None] * inv] * 2, dim=-1)
    return emb.cos()[:, None, :] * 1.5, emb.sin()[:, None, :] * 1.5  # a scaled table


def assert_norm_as_exact_as_torch(got, x, layer, want):
    """`got`, the layer's norm of x, as near the float64 RMSNorm, element by element relative
    to its size, as the torch layer's float32 `want` is."""
    h = x.double()
    exact = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + layer.eps)
    exact = exact * (layer.weight.double() + (1.0 if layer.offset else 0.0))
    assert_as_exact_as(got, exact, want, "RMSNorm", relative=True)


@pytest.mark.parametrize("tokens, q_heads, k_heads, head_dim, rot",
                         [(1, 1, 1, 8, 8), (37, 9, 3, 64, 64), (130, 14, 2, 64, 64),
                          (5, 4, 2, 96, 48), (300, 8, 8, 128, 128)])
def test_rotary_is_the_torch_rotation_bit_for_bit(tokens, q_heads, k_heads, head_dim, rot):
    """q and k as the QKV projection leaves them: views of one [T, (Hq + 2 Hk) D] output, so
    their token stride is not their width; rot < head_dim: partial rotary (Phi-4-mini)."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim, generator=gen) * 4
    q, k, _ = qkv.split([q_heads * head_dim, k_heads * head_dim, k_heads * head_dim], dim=-1)
    q, k = q.view(tokens, q_heads, head_dim), k.view(tokens, k_heads, head_dim)
    cos, sin = cos_sin(tokens, rot)
    want_q, want_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    v_before = qkv[:, (q_heads + k_heads) * head_dim:].clone()
    norm_rope.rotary_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (q_heads + k_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("shape", [(1, 8), (128, 576), (3, 7, 64), (1000, 896)])
@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm_matches_the_torch_layer(shape, offset):
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=gen) * 5
    layer = RMSNorm(shape[-1], 1e-6, offset)
    layer.weight.data = torch.randn(shape[-1], generator=gen)
    want = layer(x)
    layer.implementation = "cpu"
    got = layer(x)
    assert got.shape == x.shape
    assert_norm_as_exact_as_torch(got, x, layer, want)


def test_rms_norm_of_a_strided_view():
    x = torch.randn(10, 3, 64)
    view = x[:, 1]  # rows 192 floats apart
    layer = RMSNorm(64, 1e-5)
    layer.weight.data = torch.randn(64)
    want = layer(view)
    layer.implementation = "cpu"
    assert_norm_as_exact_as_torch(layer(view), view, layer, want)


@pytest.mark.parametrize("shape", [(1, 8), (128, 576), (3, 7, 64)])
@pytest.mark.parametrize("native", [False, True])
def test_add_forward_is_the_sum_bit_for_bit_and_its_norm(shape, native):
    """The residual step and the next norm in one pass: the sum is torch's add exactly (the
    stream carries it through every layer), the norm the layer's own; the delta a view whose
    rows are apart, and no delta is the norm alone."""
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=gen) * 5
    wide = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)
    delta = wide[..., :shape[-1]]  # rows 2 dim apart: the C pass's own delta stride
    layer = RMSNorm(shape[-1], 1e-6)
    layer.weight.data = torch.randn(shape[-1], generator=gen)
    want_sum = x + delta
    want = layer(want_sum)
    layer.implementation = "cpu" if native else "torch"
    x_before = x.clone()
    total, h = layer.add_forward(x, delta)
    assert torch.equal(total, want_sum)
    assert_norm_as_exact_as_torch(h, want_sum, layer, want)
    assert torch.equal(x, x_before)  # the stream the caller holds is not written
    same, alone = layer.add_forward(x, None)
    assert same is x and torch.equal(alone, layer(x))


@pytest.mark.parametrize("native", [True, False])
def test_the_engine_layers_follow_the_config(native):
    model = tiny_model("llama")
    engine = Engine(model, EngineConfig(kv_cache_tokens=256, max_model_len=64,
                                        backend="cpu" if native else "torch"))
    chosen = engine.implementations()
    want = "cpu" if native else "torch"
    assert chosen["RMSNorm"] == chosen["RotaryEmbedding"] == want
