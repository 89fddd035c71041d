"""The LoRA shrink and expand kernels against their torch reference: blocks of a fused
projection with other ranks and scales, rows left without a block, padded token counts, a
16-bit output added into in place."""

import pytest
import torch
from floors import assert_as_exact_as
from kernels_env import DEVICE, DTYPES

from rollout_kernels.triton.lora import lora_add_ref, lora_expand_add, lora_shrink

pytestmark = pytest.mark.interpreter

# (row, rows, col, rank, scale): q (rank 8), nothing on k's rows, v (rank 4, another scale);
# one block of rank 20 over an output of 70 (a last tile of 6).
LAYOUTS = {"qkv": (96, [(0, 64, 0, 8, 2.0), (80, 16, 8, 4, 0.5)]),
           "single": (70, [(0, 70, 0, 20, 1.5)])}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_shrink_and_expand_match_the_reference(dtype, layout, tokens):
    out_features, blocks = LAYOUTS[layout]
    rank = sum(b[3] for b in blocks)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 72, generator=gen).to(DEVICE, dtype)
    a = torch.randn(rank, 72, generator=gen).to(DEVICE) * 0.1
    b = torch.zeros(out_features, rank)
    for row, count, col, r, _ in blocks:
        b[row:row + count, col:col + r] = torch.randn(count, r, generator=gen)
    b = b.to(DEVICE)
    y = torch.randn(tokens, out_features, generator=gen).to(DEVICE, dtype)
    want = y.clone()
    lora_add_ref(x, a, b, want, blocks)
    s = lora_shrink(x, a)
    exact_s = x.cpu().double() @ a.cpu().double().t()
    assert_as_exact_as(s.cpu(), exact_s, (x.float() @ a.t()).cpu(), "shrink")  # fp32 in, out
    rows = torch.tensor([[r, n, c] for r, n, c, _, _ in blocks], dtype=torch.int32, device=DEVICE)
    ranks = torch.tensor([blk[3] for blk in blocks], dtype=torch.int32, device=DEVICE)
    scales = torch.tensor([blk[4] for blk in blocks], dtype=torch.float32, device=DEVICE)
    before = y.clone()
    lora_expand_add(s, b, y, rows, ranks, scales, max(blk[1] for blk in blocks),
                    max(blk[3] for blk in blocks))
    exact = before.cpu().double()
    for row, count, col, r, scale in blocks:
        exact[:, row:row + count] += scale * exact_s[:, col:col + r] @ b.cpu().double()[
            row:row + count, col:col + r].t()
    # lora_add_ref adds in fp32 and rounds once to y's dtype, as the kernel does
    assert_as_exact_as(y.cpu(), exact, want.cpu(), "expanded output")
    if layout == "qkv":  # k's rows carry no block: untouched, bit for bit
        assert torch.equal(y[:, 64:80], before[:, 64:80])


def test_no_tokens_writes_nothing():
    a = torch.randn(8, 16, device=DEVICE)
    assert lora_shrink(torch.randn(0, 16, device=DEVICE), a).shape == (0, 8)
