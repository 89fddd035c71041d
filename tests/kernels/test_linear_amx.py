"""linear_amx.c (bf16 projections on AMX tiles, the batch-invariant mode's where the CPU has
them): as near the float64 answer as F.linear's bf16 result, before and after the rounding
to bf16, over every tail of its padding (rows past 16 and 32, inputs past the 32 of a tile
and odd, a last panel alone and partial); each row's bits the same whatever the other rows;
bad input refused. Skipped where the CPU has no AMX, or the process was not granted it."""

import pytest
import torch
from floors import assert_as_exact_as
from torch.nn import functional as F

from rollout.models.layers.packed_linear import AmxPanels, invariant_packing
from rollout_kernels import cpu as native
from rollout_kernels.cpu import linear_amx

pytestmark = pytest.mark.skipif(
    not linear_amx.supported(torch.device("cpu")),
    reason=native.missing_reason("linear_amx_bf16", "amx_ready") if not native.has(
        "linear_amx_bf16") else "the tile registers were not granted to this process")


# (rows, outputs, inputs): 1 and 17 panels (the last alone in its pair, partial), inputs
# under one tile, odd, past two tiles; rows 1, 16, 17, 33 (one and two A tiles, tails)
SHAPES = [(1, 16, 32), (16, 300, 576), (17, 40, 33), (33, 272, 65), (5, 7, 1), (40, 576, 1536)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_products_are_as_exact_as_f_linear(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k + 3, generator=g).bfloat16()[:, :k]  # rows with a stride
    got = linear_amx.linear(x, linear_amx.pack_panels(w), n, k)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    exact = x.double() @ w.double().T
    assert_as_exact_as(got, exact, x.float() @ w.float().T, "fp32 tile products")


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_a_row_does_not_depend_on_the_others(m, n, k):
    g = torch.Generator().manual_seed(k)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(m, k, generator=g).bfloat16()
    packed = linear_amx.pack_panels(w)
    whole = linear_amx.linear(x, packed, n, k)
    alone = torch.cat([linear_amx.linear(x[r:r + 1], packed, n, k) for r in range(m)])
    assert torch.equal(alone, whole)
    assert all(torch.equal(linear_amx.linear(x[:r], packed, n, k), whole[:r]) for r in range(m))


def test_the_invariant_packing_of_bf16_is_the_tiles_rounded_once_after_the_bias():
    assert isinstance(invariant_packing(torch.bfloat16), AmxPanels)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 576, generator=g).bfloat16()
    b = torch.randn(300, generator=g).bfloat16()
    x = torch.randn(7, 2, 576, generator=g).bfloat16()  # any leading shape
    packing = AmxPanels()
    got = packing.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (7, 2, 300)
    assert torch.equal(got, (linear_amx.linear(x, packing.packed, 300, 576) + b.float()).bfloat16())
    exact = F.linear(x.double(), w.double(), b.double())
    assert_as_exact_as(got, exact, F.linear(x, w, b), "projection")
    assert packing.nbytes == linear_amx.pack_panels(w).numel() * 2  # bf16, once


def test_bad_input_is_refused():
    w = torch.randn(40, 64).bfloat16()
    packed = linear_amx.pack_panels(w)
    with pytest.raises(ValueError, match="must be bf16"):
        linear_amx.linear(torch.randn(3, 64), packed, 40, 64)
    # 40 and 96 inputs: the first pads to the weight's panels, the second does not
    for k in (40, 96):
        with pytest.raises(ValueError, match="in-features"):
            linear_amx.linear(torch.randn(3, k).bfloat16(), packed, 40, 64)
    with pytest.raises(ValueError, match="bf16 matrix"):
        linear_amx.pack_panels(torch.randn(40, 64))
    assert linear_amx.linear(torch.randn(0, 64).bfloat16(), packed, 40, 64).shape == (0, 40)
