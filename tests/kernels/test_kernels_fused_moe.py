"""fused_moe (kernels/triton/fused_moe.py) against the engine's torch experts (moe_torch), which the
model tests hold to transformers: uneven expert loads, experts no token chose, every token on
one expert, k = 1, 2 and 8 (= E), one token (decode), sizes that are not multiples of the
tiles."""

import pytest
import torch
from floors import assert_as_exact_as
from kernels_env import ATOL, DEVICE, DTYPES, rows_rounded_by_position
from transformers.activations import ACT2FN

from rollout.models.layers.moe import moe_torch
from rollout_kernels.triton.fused_moe import align, fused_moe

pytestmark = pytest.mark.interpreter


def routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator,
            experts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids over `experts` (default all) with skewed loads, and normalised weights."""
    pool = torch.tensor(experts if experts is not None else range(num_experts))
    # Skewed logits: low experts are chosen far more often than high ones.
    logits = torch.randn(num_tokens, len(pool), generator=gen) - torch.arange(len(pool)) * 0.7
    weights, picks = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(DEVICE), pool[picks].to(DEVICE)


def adapter(num_experts, out_features, in_features, rank, gen):
    """A LoRA adapter on a stacked expert parameter: (A [E, r, in], B [E, out, r], scale)."""
    if rank is None:
        return None
    a = torch.randn(num_experts, rank, in_features, generator=gen) / in_features ** 0.5
    b = torch.randn(num_experts, out_features, rank, generator=gen) / rank ** 0.5
    return a.to(DEVICE), b.to(DEVICE), 0.7


def exact_moe(x, w_gate_up, w_down, weights, ids, activation="silu", lora=None):
    """The experts (and an adapter's delta, unmerged) in float64 on the CPU: the exact answer.
    moe_torch accumulates the experts in fp32, the adapter's delta too, whatever x's dtype."""
    def project(w, factors, h):  # each token's k experts' w (+ scale * B A) applied to h
        y = torch.einsum("tkoi,tki->tko", w.cpu().double()[ids], h)
        if factors is not None:
            a, b, scale = (f.cpu().double()[ids] if torch.is_tensor(f) else f for f in factors)
            y = y + scale * torch.einsum("tkor,tkri,tki->tko", b, a, h)
        return y

    ids = ids.cpu()
    lora = lora or (None, None)
    h = x.cpu().double()[:, None].expand(-1, ids.shape[1], -1)
    gate, up = project(w_gate_up, lora[0], h).chunk(2, dim=-1)
    down = project(w_down, lora[1], ACT2FN[activation](gate) * up)
    return (down * weights.cpu().double()[..., None]).sum(1)


def check(num_tokens, num_experts, top_k, hidden, inter, dtype, experts=None,
          activation="silu", seed=0, ranks=(None, None)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5)
    w_down = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5)
    w_gate_up, w_down = w_gate_up.to(DEVICE, dtype), w_down.to(DEVICE, dtype)
    weights, ids = routing(num_tokens, num_experts, top_k, gen, experts)
    lora = (adapter(num_experts, 2 * inter, hidden, ranks[0], gen),
            adapter(num_experts, hidden, inter, ranks[1], gen))
    lora = None if lora == (None, None) else lora
    got = fused_moe(x, w_gate_up, w_down, weights, ids, activation, lora)
    ref = moe_torch(x, w_gate_up, w_down, weights, ids, activation, lora)
    assert got.dtype == dtype and got.shape == x.shape
    # moe_torch rounds where the kernel does: torch's own computation in the kernel's dtype
    exact = exact_moe(x, w_gate_up, w_down, weights, ids, activation, lora)
    assert_as_exact_as(got.cpu(), exact, ref.cpu(), "experts' output")
    return x, w_gate_up, w_down, weights, ids, lora, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter", [
    (1, 8, 2, 64, 48),  # decode: one token, two blocks of padding rows
    (37, 8, 2, 48, 40),  # uneven loads across several blocks, tails in H and I
    (13, 4, 1, 32, 64),  # k = 1
    (6, 8, 8, 32, 24),  # k = E: every expert gets every token
])
def test_matches_torch_experts(dtype, num_tokens, num_experts, top_k, hidden, inter):
    check(num_tokens, num_experts, top_k, hidden, inter, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_never_chosen_and_all_tokens_on_one_expert(dtype):
    # Experts 0, 2, 5 and 7 of 8 get no token (their weights hold garbage that must not leak).
    check(21, 8, 2, 32, 32, dtype, experts=[1, 3, 4, 6], seed=1)
    check(19, 8, 1, 32, 32, dtype, experts=[5], seed=2)


def test_gelu_activation_and_no_tokens():
    check(9, 4, 2, 32, 32, torch.float32, activation="gelu_pytorch_tanh")
    x = torch.zeros(0, 32, device=DEVICE)
    w_gate_up, w_down = torch.zeros(4, 64, 32, device=DEVICE), torch.zeros(4, 32, 32,
                                                                          device=DEVICE)
    empty = torch.zeros(0, 2, device=DEVICE)
    assert fused_moe(x, w_gate_up, w_down, empty, empty.long()).shape == (0, 32)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, w_gate_up, w_down, empty, empty.long(), "relu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ranks", [(4, 8), (16, None), (None, 1), (24, 40)],
                         ids=["both", "gate-up", "down-rank-1", "ranks-past-a-tile"])
def test_lora_on_the_experts(dtype, ranks):
    """An unmerged LoRA adapter's delta (kernels' grouped shrink and expand, moe_torch's per
    expert matmuls) against the experts with the adapter merged into their weights, in fp32."""
    x, w_gate_up, w_down, weights, ids, lora, ours = check(29, 8, 2, 48, 40, dtype, ranks=ranks)
    merged = []
    for w, factors in zip((w_gate_up, w_down), lora):
        w = w.float()
        if factors is not None:
            a, b, scale = factors
            w = w + scale * torch.bmm(b, a)
        merged.append(w.to(dtype))
    assert (ours.float() - moe_torch(x, w_gate_up, w_down, weights, ids).float()).abs().max() \
        > 50 * ATOL[dtype]  # the adapter matters
    # the floor: torch's experts with the adapter merged, in the kernel's dtype
    assert_as_exact_as(ours.cpu(), exact_moe(x, w_gate_up, w_down, weights, ids, lora=lora),
                       moe_torch(x, *merged, weights, ids).cpu(), "experts' output")


def test_align_pads_each_experts_run_to_whole_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [3, 0]], device=DEVICE)
    sorted_pairs, block_expert = align(ids, num_experts=6, block_m=4)
    pad = ids.numel()
    runs = sorted_pairs.view(-1, 4).tolist()
    # Pair t*k + j. Expert 0: pairs 1, 4, 9; 1: 3; 2: 7; 3: 0, 2, 5, 6, 8 (two blocks); 4, 5:
    # none (no block).
    assert runs[:5] == [[1, 4, 9, pad], [3, pad, pad, pad], [7, pad, pad, pad],
                        [0, 2, 5, 6], [8, pad, pad, pad]]
    assert block_expert.tolist()[:5] == [0, 1, 2, 3, 3]
    assert all(e == -1 for e in block_expert.tolist()[5:])
    assert all(p == pad for row in runs[5:] for p in row)


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_tokens_do_not_depend_on_the_batch(dtype):
    """`invariant=True` (EngineConfig.batch_invariant): each token's output is the same bits
    alone and among 1,500 pairs (where the default tiles grow on a GPU), as exact as the
    default; its k = 3 outputs are added in one order (with two the order could not show)."""
    x, w_gate_up, w_down, weights, ids, _, ref = check(500, 8, 3, 32, 24, dtype, seed=3)
    batched = fused_moe(x, w_gate_up, w_down, weights, ids, invariant=True)
    exact = exact_moe(x, w_gate_up, w_down, weights, ids)
    assert_as_exact_as(batched.cpu(), exact, ref.cpu(), "invariant experts' output")
    with rows_rounded_by_position():  # a token's row rounded alike wherever it sits
        batched = fused_moe(x, w_gate_up, w_down, weights, ids, invariant=True)
        for t in (0, 17, 499):
            alone = fused_moe(x[t:t + 1], w_gate_up, w_down, weights[t:t + 1], ids[t:t + 1],
                              invariant=True)
            assert torch.equal(alone, batched[t:t + 1]), t
