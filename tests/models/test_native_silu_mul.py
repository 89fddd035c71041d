"""silu(gate) * up in rollout_kernels.cpu's C against torch's ops it replaces in the gated MLP
(CPU, fp32), over the float range and on the halves of a fused gate-up output; the engine's MLPs
take it exactly when the engine's backend is cpu and the activation is SiLU."""

import pytest
import torch
from floors import assert_as_exact_as
from models import tiny_model

from rollout import Engine, EngineConfig
from rollout.models.layers.mlp import GatedMLP
from rollout.ops.backend import resolve_backend
from rollout_kernels import cpu as native
from rollout_kernels.cpu import silu_mul

pytestmark = pytest.mark.skipif(not native.has("silu_mul_f32"),
                                reason=native.missing_reason("silu_mul_f32"))


def reference(gate, up):
    return torch.nn.functional.silu(gate) * up


def assert_as_exact_as_torch(got, gate, up):
    """Each element as near the float64 silu(gate) * up, relative to its size, as torch's own
    float32 ops are."""
    assert_as_exact_as(got, reference(gate.double(), up.double()), reference(gate, up),
                       "silu(gate) * up", relative=True)


@pytest.mark.parametrize("rows, dim", [(1, 8), (128, 1536), (3, 13), (700, 96)])
def test_matches_torch_on_the_halves_of_a_fused_output(rows, dim):
    gen = torch.Generator().manual_seed(dim)
    gate_up = torch.randn(rows, 2 * dim, generator=gen) * 6
    gate, up = gate_up.split([dim, dim], dim=-1)  # rows 2 * dim apart
    got = silu_mul.silu_mul(gate, up)
    assert got.shape == (rows, dim) and got.is_contiguous()
    assert_as_exact_as_torch(got, gate, up)


def test_the_whole_float_range():
    """Both tails (exp overflowing one way, silu -> x the other), zeros, every exponent, and
    NaN and infinities as torch gives them."""
    gate = torch.cat([torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 87.0, -87.0, 88.5,
                                    -88.5, 100.0, -100.0, 3e38, -3e38, float("nan"),
                                    float("inf"), float("-inf")]),
                      torch.logspace(-30, 30, 241), -torch.logspace(-30, 30, 241)])
    up = torch.linspace(-3, 3, gate.numel())
    got = silu_mul.silu_mul(gate, up)
    want = reference(gate, up)
    # No float64 floor here: torch's float32 overflow (3e38 * up: inf in both), NaN and the
    # underflowing tail are what is checked. Below the kernel's cutoff (-88, silu_mul.c) silu is
    # g * 0 by design, where torch gives at most |silu(-88) * up| (9.4e-37 here).
    cut = gate < -88.0
    torch.testing.assert_close(got[cut], gate[cut] * 0.0 * up[cut], rtol=0, atol=0,
                               equal_nan=True)
    # rtol: headroom for another ISA's exp. Largest relative gap: 8.6e-8 on Intel Xeon (AVX-512),
    # at gate = -87; AMD EPYC Zen 3 (AVX2): 0 wherever |want| > 1e-35, not recorded below.
    torch.testing.assert_close(got[~cut], want[~cut], rtol=2e-6, atol=0, equal_nan=True)


def test_strided_inputs():
    x = torch.randn(6, 128)
    gate, up = x[:, ::2], x[:, 1::2]  # last stride 2
    assert_as_exact_as_torch(silu_mul.silu_mul(gate, up), gate, up)
    y = torch.randn(3, 4, 64)
    gate, up = y.transpose(0, 1), y.transpose(0, 1) * 2
    assert_as_exact_as_torch(silu_mul.silu_mul(gate, up), gate, up)


def test_a_3d_input():
    gate, up = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    assert_as_exact_as_torch(silu_mul.silu_mul(gate, up), gate, up)


@pytest.mark.parametrize("native", [True, False])
def test_the_engine_mlps_follow_the_config(native):
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_tokens=256, max_model_len=64,
                                                       backend="cpu" if native else "torch"))
    assert engine.implementations()["GatedMLP"] == ("cpu" if native else "torch")
    mlp = GatedMLP(32, 64, "silu")
    x = torch.randn(4, 32)
    mlp.implementation = "cpu"
    native_out = mlp(x)
    mlp.implementation = "torch"
    torch_out = mlp(x)
    assert_as_exact_as(native_out, mlp.double()(x.double()), torch_out, "MLP output")


def test_other_activations_keep_torch():
    mlp = GatedMLP(16, 32, "gelu_pytorch_tanh")
    mlp.use_backend(resolve_backend("cpu", torch.device("cpu")), torch.float32)
    assert mlp.implementation == "torch"
