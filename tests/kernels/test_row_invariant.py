"""kernels/triton/row_invariant.py: the Triton backend's batch-invariant projections, RMSNorm and
row sums. Each against the float64 answer, as exact as torch's own computation in the same
dtype (floors.assert_as_exact_as), and each row the same bits computed alone, in any slice of
the batch and in the whole batch: row counts around the tiles' sizes, a lone row (which
Triton would compile separately were the row count specialised), strided inputs. Under the
interpreter a row's matmul is rounded by its place in the tile (kernels_env.
rows_rounded_by_position), which the projections must not feel; the norm's and the row sums'
invariance can fail only compiled, on a GPU (bench/gpu_check.sh owed). The engine under this
mode: tests/engine/test_batch_invariant.py."""

import random

import pytest
import torch
from floors import assert_as_exact_as
from kernels_env import DEVICE, DTYPES, rows_rounded_by_position
from torch.nn import functional as F

from rollout.models.layers.norm import RMSNorm
from rollout_kernels.triton import row_invariant

pytestmark = pytest.mark.interpreter

ROW_COUNTS = [1, 2, 31, 33, 64, 97]


def pieces(rows: int, rng: random.Random) -> list[slice]:
    """The rows cut at random places: each piece computed as a batch of its own."""
    cuts = sorted(rng.sample(range(1, rows), min(3, rows - 1))) if rows > 1 else []
    bounds = [0, *cuts, rows]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def assert_rows_apart(fn, x: torch.Tensor, seed: int = 0) -> None:
    """fn's rows are the same bits however the rows of x are batched, also where the
    interpreter's matmul rounds a row by its place in the tile (as on AVX2 hosts)."""
    rng = random.Random(seed)
    with rows_rounded_by_position():
        whole = fn(x)
        for i in rng.sample(range(x.shape[0]), min(5, x.shape[0])):
            assert torch.equal(fn(x[i:i + 1]), whole[i:i + 1]), f"row {i} alone"
        for part in pieces(x.shape[0], rng):
            assert torch.equal(fn(x[part]), whole[part]), f"rows {part}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear(dtype, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    k, n = 200, 130  # neither a multiple of the tiles
    # x a strided view: every other column of a wider tensor (the kernel copies it)
    x = torch.randn(rows, 2 * k, generator=gen)[:, ::2].to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    got = row_invariant.linear(x, w, b)
    exact = F.linear(x.cpu().double(), w.cpu().double(), None if b is None else b.cpu().double())
    ref = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype) \
        if dtype != torch.float32 else F.linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert_as_exact_as(got.cpu(), exact, ref.cpu(), what="linear")
    assert_rows_apart(lambda t: row_invariant.linear(t, w, b), x)


def test_linear_leading_dims_and_refusals():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 40, generator=gen).to(DEVICE)
    w = torch.randn(24, 40, generator=gen).to(DEVICE)
    got = row_invariant.linear(x, w)
    assert got.shape == (3, 5, 24)
    assert torch.equal(got, row_invariant.linear(x.reshape(15, 40), w).reshape(3, 5, 24))
    assert row_invariant.linear(x[:0, 0], w).shape == (0, 24)
    with pytest.raises(ValueError, match="weight"):
        row_invariant.linear(x, w[:, :39])
    with pytest.raises(ValueError, match="weight"):
        row_invariant.linear(x, w.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", [False, True], ids=["plain", "gemma"])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm(dtype, offset, rows):
    """Both forms of models/layers/norm.py, hidden sizes that are and are not powers of two,
    the input a view (q/k norms see [T, heads, head_dim])."""
    gen = torch.Generator().manual_seed(rows)
    for dim in (64, 96):
        x = (3 * torch.randn(rows, 2, dim, generator=gen)).to(DEVICE, dtype)
        norm = RMSNorm(dim, 1e-6, offset).to(DEVICE, dtype)
        with torch.no_grad():
            norm.weight.normal_(0.5, 0.3, generator=gen.manual_seed(dim))
        got = row_invariant.rms_norm(x, norm.weight, norm.eps, offset)
        exact64 = RMSNorm(dim, 1e-6, offset).double()
        exact64.load_state_dict({"weight": norm.weight.detach().cpu().double()})
        exact = exact64.forward_torch(x.cpu().double())
        ref = norm.forward_torch(x)
        assert got.dtype == ref.dtype == dtype and got.shape == x.shape
        assert_as_exact_as(got.cpu(), exact, ref.cpu(), what="rms_norm")
        assert_rows_apart(lambda t: row_invariant.rms_norm(t, norm.weight, norm.eps, offset), x)


def test_rms_norm_dtypes():
    """Without `offset` the result is the weight times x's dtype, as torch's promotion has it
    (an fp32 weight over fp16 rows gives fp32)."""
    x = torch.randn(4, 32).to(DEVICE, torch.float16)
    w = torch.rand(32).to(DEVICE)
    assert row_invariant.rms_norm(x, w, 1e-6, False).dtype == torch.float32
    assert row_invariant.rms_norm(x, w, 1e-6, True).dtype == torch.float16


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("n", [5, 4096, 9000])
def test_row_sum(rows, n):
    """Rows shorter than, as long as, and over twice the kernel's lanes; a strided input."""
    gen = torch.Generator().manual_seed(n)
    x = torch.rand(rows, n, 2, generator=gen)[..., 0].to(DEVICE)
    got = row_invariant.row_sum(x)
    assert got.shape == (rows, 1) and got.dtype == torch.float32
    exact = x.cpu().double().sum(-1, keepdim=True)
    assert_as_exact_as(got.cpu(), exact, x.sum(-1, keepdim=True).cpu(), what="row_sum")
    assert_rows_apart(row_invariant.row_sum, x)
