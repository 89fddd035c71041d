"""The Triton kernels' wrappers refuse, with a ValueError naming the argument and its limit, what
their kernels would read or write past or compute wrong: shapes, dtypes and strides that do not
fit, a window or soft cap that is no bound, per-row parameters shorter than the batch, an empty
vocabulary (not asserts: python -O drops them). Per-request lengths and pool slots live on the
device: only under Triton's CPU interpreter are they read and checked, slots out of the pool
with an IndexError as the C kernels' wrappers and torch's indexing give. Each refusal leaves
the kernel working for the next, good, call."""

import re

import pytest
import torch
from kernels_env import DEVICE, assert_attention_as_exact, indptr

from rollout_kernels.triton import (accept_drafts, merge_states, paged_attention,
                                    paged_attention_ref, sample, shared_prefix_attention,
                                    store_kv, store_kv_ref)
from rollout_kernels.triton.fused_moe import fused_moe
from rollout_kernels.triton.lora import lora_expand_add, lora_shrink
from rollout_kernels.triton.paged_attention import _interpreting
from rollout_kernels.triton.row_invariant import linear, rms_norm

pytestmark = pytest.mark.interpreter

interpreted = pytest.mark.skipif(not _interpreting(),
                                 reason="compiled, the metadata is trusted, never read")


def ints(xs, dtype=torch.int32):
    return torch.tensor(xs, dtype=dtype, device=DEVICE)


def attention_case(head_dim=16):
    """Requests of 1 and 3 queries over contexts of 3 and 4 in a 9-slot pool of 2 KV heads,
    4 query heads: (q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices)."""
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool = (torch.randn(9, 2, head_dim, generator=gen).to(DEVICE) for _ in range(2))
    q = torch.randn(4, 4, head_dim, generator=gen).to(DEVICE)
    return q, k_pool, v_pool, indptr([1, 3]), indptr([3, 4]), ints([1, 2, 8, 3, 4, 5, 6])


def attend(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, out=None, **kwargs):
    out = torch.full_like(q, float("nan")) if out is None else out
    paged_attention(q, k_pool, v_pool, out, qo_indptr, kv_indptr, kv_indices, sm_scale=0.25,
                    **{"max_q_len": 3, "max_kv_len": 4, **kwargs})
    return out


def assert_attention_works():
    q, k_pool, v_pool, *meta = attention_case()
    for splits in (1, 2):
        out = attend(q, k_pool, v_pool, *meta, num_kv_splits=splits)
        ref = paged_attention_ref(q, k_pool, v_pool, *meta, 0.25)
        assert_attention_as_exact(out, ref, q, k_pool, v_pool, *meta, 0.25)


@pytest.mark.parametrize("change, error", [
    (lambda c: c | {"q": c["q"][..., :8]}, "q's head size 8 differs from the pools' 16"),
    (lambda c: c | {"q": c["q"][:, :3]}, "q's 3 heads are not a multiple of the pools' 2"),
    (lambda c: c | {"v_pool": c["v_pool"][:8]}, "k_pool \\(9, 2, 16\\) and v_pool \\(8, 2, 16\\)"),
    (lambda c: c | {"k_pool": c["k_pool"][:, 0]}, "k_pool \\(9, 16\\) and v_pool"),
    (lambda c: c | {"q": c["q"].half()}, "q torch.float16 and the pools torch.float32"),
    (lambda c: c | {"out": torch.empty(4, 4, 8, device=DEVICE)}, "out \\(4, 4, 8\\) must have"),
    (lambda c: c | {"q": c["q"].transpose(1, 2).contiguous().transpose(1, 2)},
     "the head dimension of q must be contiguous"),
    (lambda c: c | {"kv_indptr": c["kv_indptr"][:2]}, "kv_indptr \\(2,\\) must be as long as"),
    (lambda c: c | {"kv_indices": c["kv_indices"].float()}, "kv_indices must hold int32 or"),
    (lambda c: c | {"qo_indptr": c["qo_indptr"].float()}, "qo_indptr must hold int32 or"),
    (lambda c: c | {"kv_indices": c["kv_indices"].repeat_interleave(2)[::2]},
     "kv_indices must hold int32 or int64 in one contiguous dimension, got torch.int32 "
     "\\(7,\\) with stride \\(2,\\)"),
    (lambda c: c | {"max_q_len": 1}, "4 query rows, past 2 requests of at most max_q_len 1"),
    (lambda c: c | {"window": 0}, "window must be >= 1, got 0"),
    (lambda c: c | {"window": -3}, "window must be >= 1, got -3"),
    (lambda c: c | {"softcap": 0.0}, "softcap must be finite and > 0, got 0.0"),
    (lambda c: c | {"softcap": -30.0}, "softcap must be finite and > 0, got -30.0"),
    (lambda c: c | {"softcap": float("inf")}, "softcap must be finite and > 0, got inf"),
    (lambda c: c | {"softcap": float("nan")}, "softcap must be finite and > 0, got nan"),
])
@pytest.mark.parametrize("splits", [1, 2])
def test_attention_refuses_what_does_not_fit(change, error, splits):
    q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices = attention_case()
    case = change(dict(q=q, k_pool=k_pool, v_pool=v_pool, qo_indptr=qo_indptr,
                       kv_indptr=kv_indptr, kv_indices=kv_indices, out=None))
    args = [case.pop(k) for k in ("q", "k_pool", "v_pool", "qo_indptr", "kv_indptr",
                                  "kv_indices")]
    with pytest.raises(ValueError, match=f"^paged_attention: {error}"):
        attend(*args, num_kv_splits=splits, **case)
    assert_attention_works()


@interpreted
@pytest.mark.parametrize("change, error, match", [
    (lambda c: c | {"qo_indptr": ints([0, 3, 4]), "max_q_len": 2},
     ValueError, "a request has 3 queries, past max_q_len 2"),
    (lambda c: c | {"qo_indptr": ints([0, 1, 3])}, ValueError, "qo_indptr must run from 0 to"),
    (lambda c: c | {"qo_indptr": ints([0, 5, 4])}, ValueError, "qo_indptr must not decrease"),
    (lambda c: c | {"max_kv_len": 3}, ValueError, "a context of 4 tokens, past max_kv_len 3"),
    (lambda c: c | {"kv_indptr": ints([0, 3, 8]), "max_kv_len": 5}, ValueError,
     "kv_indptr reaches 8, past kv_indices' 7 entries"),
    (lambda c: c | {"kv_indptr": ints([0, 3, 2])}, ValueError, "kv_indptr must not decrease"),
    (lambda c: c | {"kv_indptr": ints([0, 3, 5])}, ValueError,
     "a request has 3 queries over a context of 2"),
    (lambda c: c | {"kv_indices": ints([1, 2, 9, 3, 4, 5, 6])}, IndexError,
     "kv_indices hold slot 9, past the pool's 9 slots"),
    (lambda c: c | {"kv_indices": ints([1, 2, 2**32 + 3, 3, 4, 5, 6], torch.int64)},
     IndexError, "kv_indices hold slot 4294967299, past"),  # not 3 in int32
    (lambda c: c | {"kv_indices": ints([1, 2, -1, 3, 4, 5, 6])}, IndexError,
     "kv_indices hold slot -1, below 0"),
])
def test_attention_refuses_metadata_past_its_bounds_when_interpreted(change, error, match):
    """Rows past max_q_len would be left unwritten, contexts past max_kv_len cut by split-KV,
    kv_indptr past kv_indices and slots past the pool read out of bounds."""
    q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices = attention_case()
    case = change(dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices))
    with pytest.raises(error, match=f"^paged_attention: {match}"):
        attend(q, k_pool, v_pool, case.pop("qo_indptr"), case.pop("kv_indptr"),
               case.pop("kv_indices"), num_kv_splits=2, **case)
    assert_attention_works()


def test_unused_kv_indices_past_the_pool_are_not_refused():
    """A CUDA graph's kv_indices buffer is longer than used; only the used entries are slots."""
    q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices = attention_case()
    spare = torch.cat([kv_indices, ints([-5, 99])])
    torch.testing.assert_close(attend(q, k_pool, v_pool, qo_indptr, kv_indptr, spare),
                               attend(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices),
                               atol=0, rtol=0)


def test_shared_prefix_refuses_a_suffix_indptr_of_another_batch():
    q, k_pool, v_pool, *_ = attention_case()
    with pytest.raises(ValueError, match="^shared_prefix_attention: suffix_indptr \\(4,\\) must "
                                         "have one entry per query row \\+ 1: 5"):
        shared_prefix_attention(q, k_pool, v_pool, torch.empty_like(q), indptr([2, 2]),
                                indptr([2, 2]), ints([1, 2, 3, 4]), indptr([1, 1, 1]),
                                ints([5, 6, 7]), sm_scale=0.25, max_group_size=2,
                                max_prefix_len=2, max_suffix_len=1)


# --- store_kv ----------------------------------------------------------------------------------

def store_case():
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(3, 2, 16, generator=gen).to(DEVICE) for _ in range(2))
    return k, v, torch.zeros(8, 2, 16, device=DEVICE), torch.zeros(8, 2, 16, device=DEVICE)


def assert_store_works():
    k, v, k_pool, v_pool = store_case()
    slots = ints([7, -1, 0], torch.int64)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    store_kv_ref(k, v, want_k, want_v, slots)
    store_kv(k, v, k_pool, v_pool, slots)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)


@pytest.mark.parametrize("change, error", [
    (lambda c: c | {"slots": c["slots"].float()}, "out_slots must hold int32 or int64"),
    (lambda c: c | {"slots": c["slots"][:2]}, "out_slots \\(2,\\) must be \\(3,\\)"),
    (lambda c: c | {"slots": c["slots"].repeat_interleave(2)[::2]},
     "out_slots \\(3,\\) must be \\(3,\\), contiguous"),
    (lambda c: c | {"v": c["v"][:2]}, "k \\(3, 2, 16\\) and v \\(2, 2, 16\\) must be one"),
    (lambda c: c | {"v_pool": c["v_pool"][:, :1]}, "k_pool \\(8, 2, 16\\) and v_pool \\(8, 1, 16"),
    (lambda c: c | {"k_pool": c["k_pool"][..., :8], "v_pool": c["v_pool"][..., :8]},
     "k \\(3, 2, 16\\) does not fit the pools' rows \\(2, 8\\)"),
    (lambda c: c | {"k": c["k"].half(), "v": c["v"].half()},
     "k and v torch.float16 / torch.float16 must be the pools' torch.float32"),
    (lambda c: c | {"k": c["k"].transpose(1, 2).contiguous().transpose(1, 2)},
     "the head dimension of k must be contiguous"),
])
def test_store_kv_refuses_what_does_not_fit(change, error):
    k, v, k_pool, v_pool = store_case()
    case = change(dict(k=k, v=v, k_pool=k_pool, v_pool=v_pool, slots=ints([1, 2, 3])))
    with pytest.raises(ValueError, match=f"^store_kv: {error}"):
        store_kv(case["k"], case["v"], case["k_pool"], case["v_pool"], case["slots"])
    assert not k_pool.any() and not v_pool.any()
    assert_store_works()


@interpreted
def test_store_kv_refuses_a_slot_past_the_pool_when_interpreted():
    k, v, k_pool, v_pool = store_case()
    with pytest.raises(IndexError, match="^store_kv: slot 8 of token 1, past the pool's 8 slots"):
        store_kv(k, v, k_pool, v_pool, ints([1, 8, -1]))
    assert not k_pool.any() and not v_pool.any()
    assert_store_works()


# --- sample ------------------------------------------------------------------------------------

def sample_args():
    """Two greedy rows over a vocabulary of 10."""
    gen = torch.Generator().manual_seed(2)

    def rows(dtype, value):
        return torch.full((2,), value, dtype=dtype, device=DEVICE)

    return dict(logits=torch.randn(2, 10, generator=gen).to(DEVICE),
                temperature=rows(torch.float32, 0.0), top_k=rows(torch.int32, 0),
                top_p=rows(torch.float32, 1.0), min_p=rows(torch.float32, 0.0),
                seed=rows(torch.int32, 1), position=rows(torch.int32, 1))


@pytest.mark.parametrize("name", ["temperature", "top_k", "top_p", "min_p", "seed", "position"])
def test_sample_refuses_per_row_parameters_of_another_batch(name):
    args = sample_args()
    for bad in (args[name][:1], args[name].repeat(2), args[name][:, None]):
        with pytest.raises(ValueError, match=re.escape(f"sample: {name} {tuple(bad.shape)} "
                                                      f"must be (2,): one per row of logits")):
            sample(**(args | {name: bad}))
    tokens, _ = sample(**args)
    assert tokens.tolist() == args["logits"].argmax(-1).tolist()


def test_sample_refuses_an_empty_vocabulary_and_other_shapes():
    args = sample_args()
    with pytest.raises(ValueError, match="^sample: logits \\(2, 0\\) have an empty vocabulary"):
        sample(**(args | {"logits": args["logits"][:, :0]}))
    with pytest.raises(ValueError, match="^sample: logits \\(20,\\) must be \\[B, V\\]"):
        sample(**(args | {"logits": args["logits"].flatten()}))
    tokens, _ = sample(**args)
    assert tokens.tolist() == args["logits"].argmax(-1).tolist()


def test_sample_reads_strided_per_row_parameters_as_given():
    """Per-row parameters taken as columns of wider tensors: each row gets its own values."""
    args = sample_args()
    wide = {k: torch.stack([v, torch.full_like(v, 3)], 1) for k, v in args.items() if k != "logits"}
    wide["temperature"][:, 0] = 2.0  # the column beside it holds 3: a misread moves the logprob
    strided = sample(args["logits"], **{k: v[:, 0] for k, v in wide.items()})
    dense = sample(args["logits"], **{k: v[:, 0].contiguous() for k, v in wide.items()})
    assert [t.tolist() for t in strided] == [t.tolist() for t in dense]


# --- accept_drafts -----------------------------------------------------------------------------

def accept_rows():
    """Request 0: drafts 1 2 against targets 1 2 (bonus 3); request 1: draft 4 (target 4,
    bonus 5)."""
    return dict(row_indptr=ints([0, 3, 5]), target=ints([1, 2, 3, 4, 5], torch.int64),
                draft=ints([1, 2, -1, 4, -1], torch.int64),
                greedy=torch.ones(5, dtype=torch.bool, device=DEVICE))


def test_accept_drafts_reads_strided_rows_as_given():
    """target as a column of a wider tensor (rows 2 apart) gives what the dense one does."""
    rows = accept_rows()
    wide = torch.stack([rows["target"], torch.full_like(rows["target"], 9)], 1)
    got = [t.tolist() for t in accept_drafts(**(rows | {"target": wide[:, 0]}))]
    assert got == [[2, 1], [3, 5]]


@pytest.mark.parametrize("change, error", [
    (lambda r: r | {"draft": r["draft"][:4]}, "draft \\(4,\\) must be target's \\(5,\\)"),
    (lambda r: r | {"greedy": r["greedy"][:, None]}, "greedy \\(5, 1\\) must be target's"),
    (lambda r: r | {"row_indptr": r["row_indptr"].float()}, "row_indptr must hold int32 or"),
    (lambda r: r | {"p_draft": torch.rand(5, device=DEVICE)},
     "p_draft given without q_draft, coin, residual"),
    (lambda r: r | {"p_draft": torch.rand(5, device=DEVICE),
                    "q_draft": torch.rand(5, device=DEVICE),
                    "coin": torch.rand(4, device=DEVICE), "residual": r["target"]},
     "coin \\(4,\\) must be target's \\(5,\\)"),
])
def test_accept_drafts_refuses_rows_that_do_not_fit(change, error):
    with pytest.raises(ValueError, match=f"^accept_drafts: {error}"):
        accept_drafts(**change(accept_rows()))
    assert [t.tolist() for t in accept_drafts(**accept_rows())] == [[2, 1], [3, 5]]


# --- row-invariant projections, RMSNorm; MoE, LoRA, merge ------------------------------------

def test_linear_refuses_a_bias_of_another_width():
    x, w = torch.ones(1, 8, device=DEVICE), torch.ones(4, 8, device=DEVICE)
    for bias in (torch.zeros(3, device=DEVICE), torch.zeros(1, 4, device=DEVICE)):
        with pytest.raises(ValueError, match=re.escape(f"linear: bias {tuple(bias.shape)} "
                                                      f"must be (4,): one per output")):
            linear(x, w, bias)
    strided = torch.arange(8.0, device=DEVICE)[::2]  # a bias view with stride 2
    assert linear(x, w, strided).tolist() == [[8.0, 10.0, 12.0, 14.0]]


def test_rms_norm_refuses_a_weight_of_another_width():
    x = torch.ones(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="^rms_norm: weight \\(5,\\) must be \\(8,\\)"):
        rms_norm(x, torch.ones(5, device=DEVICE), 1e-6, False)
    assert rms_norm(x, torch.full((8,), 2.0, device=DEVICE), 0.0, False).eq(2.0).all()


def test_fused_moe_refuses_weights_and_routing_that_do_not_fit():
    x = torch.randn(3, 16, device=DEVICE)
    w_gate_up, w_down = torch.randn(2, 32, 16, device=DEVICE), torch.randn(2, 16, 16, device=DEVICE)
    ids, weights = ints([[0, 1]] * 3, torch.int64), torch.full((3, 2), 0.5, device=DEVICE)
    for args, error in [((x, w_gate_up[:, :30], w_down, weights, ids), "w_gate_up \\(2, 30, 16\\)"),
                        ((x, w_gate_up, w_down[:, :8], weights, ids), "w_down \\(2, 8, 16\\)"),
                        ((x, w_gate_up, w_down, weights[:2], ids), "topk_weights \\(2, 2\\)"),
                        ((x, w_gate_up.half(), w_down, weights, ids), "x torch.float32, w_gate")]:
        with pytest.raises(ValueError, match=f"^fused_moe: {error}"):
            fused_moe(*args)
    assert fused_moe(x, w_gate_up, w_down, weights, ids).isfinite().all()


def test_lora_and_merge_refuse_what_does_not_fit():
    x, a = torch.randn(3, 32, device=DEVICE), torch.randn(4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="^lora_shrink: a \\(4, 16\\) torch.float32 must be"):
        lora_shrink(x, a[:, :16])
    s, b, y = torch.randn(3, 4, device=DEVICE), torch.randn(8, 4, device=DEVICE), torch.zeros(
        3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="^lora_expand_add: s, b must be contiguous"):
        lora_expand_add(s.t().contiguous().t(), b, y, ints([0]), ints([4]),
                        torch.ones(1, device=DEVICE), 8, 4)
    part_out, part_lse = torch.randn(3, 2, 2, 8, device=DEVICE), torch.randn(3, 2, 2, device=DEVICE)
    with pytest.raises(ValueError, match="^merge_states: part_lse \\(3, 2, 1\\) must be"):
        merge_states(part_out, part_lse[..., :1], torch.empty(3, 2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="^merge_states: out \\(3, 2, 4\\) must be"):
        merge_states(part_out, part_lse, torch.empty(3, 2, 4, device=DEVICE))
    assert lora_shrink(x, a).shape == (3, 4)
    assert merge_states(part_out, part_lse, torch.empty(3, 2, 8, device=DEVICE)).isfinite().all()
