"""The C kernels' wrappers refuse what their C would read or write past, or compute apart from the
torch path, rather than returning numbers: metadata that points outside the pool or past the
query rows, packed buffers that are views of wider ones, an odd rotary width, an empty vocabulary,
sort and scan arguments of the wrong shape (checked with ValueError, not assert: python -O drops
asserts). Each refusal leaves the kernel working for the next, good, call."""

import numpy as np
import pytest
import torch

from rollout_kernels import cpu as native
from rollout_kernels.cpu import (gumbel, linear, linear_amx, norm_rope, paged_attention,
                                 radix_sort, top_p_prefix)

CPU = torch.device("cpu")
needs_panels = pytest.mark.skipif(not linear.supported(CPU, torch.float32),
                                  reason=native.missing_reason("linear_f32"))
needs_amx = pytest.mark.skipif(not linear_amx.supported(CPU),
                               reason=native.missing_reason("linear_amx_bf16"))
needs_attention = pytest.mark.skipif(not paged_attention.supported(CPU, torch.float32),
                                     reason=paged_attention.why_not())


def attention_case(kv_indices, q_lens=(3, 1), kv_lens=(5, 7), tokens=4, slots=16):
    """Two requests over a `slots`-slot pool of 2 KV heads, 4 query heads of 8: (q, pools, out,
    rows)."""
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool = (torch.randn(slots, 2, 8, generator=gen) for _ in range(2))
    q = torch.randn(tokens, 4, 8, generator=gen)
    rows = paged_attention.NativeRows.of([0, 1], [0, q_lens[0]], list(q_lens),
                                         [0, kv_lens[0]], list(kv_lens), kv_indices)
    return q, k_pool, v_pool, torch.full(q.shape, float("nan")), rows


GOOD_SLOTS = [0, 1, 2, 12, 13, 3, 4, 5, 6, 7, 8, 14]


def attend(q, k_pool, v_pool, out, rows):
    paged_attention.paged_attention(q, k_pool, v_pool, out, rows, 8 ** -0.5, None, None)
    return out


@needs_attention
@pytest.mark.parametrize("bad, error", [(16, "slot 16, past the pool's 16 slots"),
                                        (40, "slot 40, past the pool's 16 slots"),
                                        (2**32 + 3, "slot 4294967299, past"),  # not 3 in int32
                                        (-1, "kv_indices hold slot -1, below 0")])
def test_a_context_slot_outside_the_pool_is_refused(bad, error):
    slots = torch.tensor(GOOD_SLOTS)
    slots[9] = bad
    with pytest.raises(IndexError, match=error):
        attend(*attention_case(slots))
    assert not attend(*attention_case(torch.tensor(GOOD_SLOTS))).isnan().any()


@needs_attention
def test_the_pool_bound_is_the_pool_handed_in():
    # A 16-bit pool's kernel rows index the step's distinct slots (attention/cpu.py): the bound
    # is the fp32 copy's rows, not the pool's.
    q, k_pool, v_pool, out, rows = attention_case(torch.tensor(GOOD_SLOTS))
    with pytest.raises(IndexError, match="slot 14, past the pool's 14 slots"):
        attend(q, k_pool[:14], v_pool[:14], out, rows)
    assert not attend(q, k_pool[:15], v_pool[:15], out, rows).isnan().any()


@needs_attention
def test_rows_past_the_queries_are_refused():
    q, k_pool, v_pool, out, rows = attention_case(torch.tensor(GOOD_SLOTS))
    with pytest.raises(ValueError, match="queries reach token 4, past q's 3"):
        attend(q[:3], k_pool, v_pool, out[:3], rows)


@needs_attention
@pytest.mark.parametrize("q_lens, kv_lens, field", [
    ((3, 1), (5, 8), "kv_start \\+ kv_len reach 13, past kv_indices' 12 entries"),
    ((3, -1), (5, 7), "q_len must be >= 0, got -1"),
    ((3, 1), (5, 0), "kv_len - q_len must be >= 0, got -1"),
    ((6, 1), (5, 7), "kv_len - q_len must be >= 0, got -1")])
def test_rows_past_their_context_are_refused(q_lens, kv_lens, field):
    with pytest.raises(ValueError, match=f"^NativeRows: {field}"):
        attention_case(torch.tensor(GOOD_SLOTS), q_lens, kv_lens)


def test_negative_starts_are_refused():
    with pytest.raises(ValueError, match="^NativeRows: q_start must be >= 0, got -2"):
        paged_attention.NativeRows.of([0], [-2], [1], [0], [1], torch.tensor([0]))
    with pytest.raises(ValueError, match="^NativeRows: kv_start must be >= 0, got -1"):
        paged_attention.NativeRows.of([0], [0], [1], [-1], [1], torch.tensor([0]))
    empty = paged_attention.NativeRows.of([], [0], [], [0], [], torch.empty(0, dtype=torch.long))
    assert empty.q_start.numel() == 0


@needs_panels
def test_packed_panels_must_be_contiguous():
    w, x = torch.randn(20, 8), torch.randn(3, 8)
    packed = linear.pack_panels(w)
    wide = torch.zeros(2 * packed.numel())
    wide[::2] = packed
    with pytest.raises(ValueError, match="^linear: .*packed .*contiguous"):
        linear.linear(x, wide[::2], 20)
    with pytest.raises(ValueError, match="^linear_add: .*packed .*contiguous"):
        linear.linear_add(x, wide[::2], torch.zeros(3, 20), 1.0)
    torch.testing.assert_close(linear.linear(x, packed, 20), x @ w.T)


@needs_panels
def test_panels_are_packed_into_a_contiguous_out_only():
    w = torch.randn(20, 8)
    wide = torch.zeros(2 * linear.panels_numel(w.shape))
    with pytest.raises(ValueError, match="^pack_panels: out .*contiguous"):
        linear.pack_panels(w, wide[::2])
    assert not wide.any()  # nothing written, in the view or between its elements
    with pytest.raises(ValueError, match="^pack_panels: weight torch.bfloat16"):
        linear.pack_panels(w.bfloat16())
    assert torch.equal(linear.pack_panels(w, wide[:wide.numel() // 2]), linear.pack_panels(w))


@needs_amx
def test_amx_packed_panels_must_be_contiguous():
    w, x = torch.randn(20, 8).bfloat16(), torch.randn(3, 8).bfloat16()
    packed = linear_amx.pack_panels(w)
    wide = torch.zeros(2 * packed.numel(), dtype=torch.bfloat16)
    wide[::2] = packed
    with pytest.raises(ValueError, match="^linear_amx: .*packed .*contiguous"):
        linear_amx.linear(x, wide[::2], 20, 8)
    assert torch.equal(linear_amx.linear(x, wide[::2].contiguous(), 20, 8),
                       linear_amx.linear(x, packed, 20, 8))


def test_an_odd_rotary_width_is_refused():
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cos, sin = torch.rand(2, 1, 5), torch.rand(2, 1, 5)
    before = q.clone(), k.clone()
    with pytest.raises(ValueError, match="^rotary_: .*even"):
        norm_rope.rotary_(q, k, cos, sin)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.skipif(not gumbel.supported(CPU, torch.float32),
                    reason=native.missing_reason("gumbel_argmax_f32"))
def test_an_empty_vocabulary_is_refused():
    keys = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="^gumbel_argmax: .*V >= 1"):
        gumbel.gumbel_argmax(torch.empty(2, 0), keys)
    assert gumbel.gumbel_argmax(torch.empty(0, 5), keys[:0]).shape == (0,)


@pytest.mark.skipif(not radix_sort.supported(), reason=native.missing_reason("radix_sort_u32"))
@pytest.mark.parametrize("keys", [torch.zeros(3, 5, dtype=torch.int64),
                                  torch.zeros(15, dtype=torch.int32),
                                  torch.zeros(5, 3, dtype=torch.int32).T])
def test_sort_rows_refuses_with_value_errors(keys):
    with pytest.raises(ValueError, match="^radix_sort_u32: keys"):
        radix_sort.sort_rows(keys)


@pytest.mark.skipif(not top_p_prefix.supported(),
                    reason=native.missing_reason("top_p_prefix_f32"))
@pytest.mark.parametrize("rows, length, error", [
    (4, 6, "length 6 must be within 1 and the vocabulary's 5"),
    (4, 0, "length 0 must be within 1 and the vocabulary's 5"),
    (3, 5, "k .* must have the probs' 4 rows"),
    (5, 5, "top_p .* must have the probs' 4 rows")])
def test_prefix_lengths_refuses_what_it_would_read_past(rows, length, error):
    probs = torch.full((4, 5), 0.2)
    k = torch.full((3 if rows == 3 else 4,), 5)
    top_p = torch.full((5 if rows == 5 else 4,), 0.5)
    with pytest.raises(ValueError, match=f"^top_p_prefix: {error}"):
        top_p_prefix.prefix_lengths(probs, k, top_p, length)
    with pytest.raises(ValueError, match="^top_p_prefix: probs torch.float64"):
        top_p_prefix.prefix_lengths(probs.double(), k[:4], top_p[:4], 5)
    assert np.array_equal(top_p_prefix.prefix_lengths(probs, torch.full((4,), 5),
                                                      torch.full((4,), 0.5), 5).numpy(),
                          [3, 3, 3, 3])
