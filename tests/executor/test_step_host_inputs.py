"""The host side of a step, rebuilt for speed (docs/benchmarks.md, "Where the time goes"),
against the plain definitions it replaced: host lists as tensors, the step's K/V slots from
items whose decodes share one tensor, the sampling batch's flags from distinct values."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.ops.host_lists import host_tensor
from rollout.requests.batch import Batch, ScheduledSeq
from rollout.sample.sampler import SamplingBatch

INT_RANGES = {torch.int64: (-2**63, 2**63 - 1), torch.int32: (-2**31, 2**31 - 1)}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_host_ints_are_torch_tensor(dtype, data):
    lo, hi = INT_RANGES[dtype]
    values = data.draw(st.lists(st.integers(lo, hi) | st.sampled_from([lo, hi, 0, -1]),
                                max_size=300))
    got = host_tensor(values, dtype)
    assert got.dtype == dtype and got.shape == (len(values),)
    assert torch.equal(got, torch.tensor(values, dtype=dtype))


@given(st.lists(st.floats(allow_nan=False, width=64), max_size=200))
@settings(max_examples=60, deadline=None)
def test_host_floats_round_as_torch_does(values):
    """Rounded to float32 to nearest, as torch.tensor rounds (infinities and overflow alike)."""
    got = host_tensor(values, torch.float32)
    want = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(got, want)
    # and both are the IEEE float32 nearest each value (struct packs to nearest-even)
    for v, g in zip(values, got.tolist()):
        if abs(v) < 3.4e38:
            assert g == struct.unpack("f", struct.pack("f", v))[0]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_host_lists_reach_the_device(device):
    for dtype, values in ((torch.int64, [3, -1, 2**40]), (torch.int32, [7, -2**31]),
                          (torch.float32, [0.1, -2.5])):
        got = host_tensor(values, dtype, device)
        assert got.device.type == device and got.dtype == dtype
        assert torch.equal(got.cpu(), torch.tensor(values, dtype=dtype))


def test_host_empties_and_out_of_range():
    for dtype in (torch.int64, torch.int32, torch.float32):
        empty = host_tensor([], dtype)
        assert empty.dtype == dtype and empty.shape == (0,)
    with pytest.raises(OverflowError):
        host_tensor([2**31], torch.int32)
    with pytest.raises(TypeError):
        host_tensor([1.5], torch.int64)


@given(data=st.data())
@settings(max_examples=200, deadline=None)
def test_out_slots_are_every_item_s_slots_in_order(data):
    """Decodes grown together share one slots tensor; some then get drafts (own slots), other
    items (prefill chunks) have their own: out_slots is the concatenation item by item."""
    num_decodes = data.draw(st.integers(0, 12))
    shared = torch.arange(100, 100 + num_decodes)
    items = [ScheduledSeq(None, 0, 1, True, None, shared=shared, index=i)
             for i in range(num_decodes)]
    for it in items:
        if data.draw(st.booleans()) and data.draw(st.booleans()):
            n = data.draw(st.integers(1, 3))
            it.add_draft([7] * n, None, torch.arange(500 + 10 * it.index, 500 + 10 * it.index + n))
    for j in range(data.draw(st.integers(0 if num_decodes else 1, 4))):
        n = data.draw(st.integers(1, 5))
        items.insert(data.draw(st.integers(0, len(items))),
                     ScheduledSeq(None, 0, n, True, torch.arange(1000 + 10 * j, 1000 + 10 * j + n)))
    naive = torch.cat([it.slots for it in items])
    assert torch.equal(Batch(items).out_slots, naive)
    assert [it.slots.numel() for it in items] == [it.num_new for it in items]


def naive_flags(temperature, top_k, top_p, min_p):
    """Row by row, as SamplingBatch defines them."""
    greedy = tuple(t == 0 for t in temperature)
    truncated = tuple(t != 0 and (k > 0 or p < 1 or m > 0)
                      for t, k, p, m in zip(temperature, top_k, top_p, min_p))
    return dict(all_greedy=all(greedy), any_greedy=any(greedy),
                needs_filter=any(k > 0 or p < 1 or m > 0
                                 for k, p, m in zip(top_k, top_p, min_p)),
                unit_temperature=all(t in (0, 1) for t in temperature),
                greedy=greedy, truncated=truncated)


@given(st.lists(st.tuples(st.sampled_from([0, 0.0, 1, 1.0, 0.7, 2.0]),
                          st.sampled_from([0, -1, 1, 50]), st.sampled_from([1.0, 1, 0.9, 0.0]),
                          st.sampled_from([0.0, 0, 0.05])), max_size=8))
@settings(max_examples=300, deadline=None)
def test_sampling_flags_match_the_row_by_row_definition(rows):
    columns = list(map(list, zip(*rows))) or [[], [], [], []]
    batch = SamplingBatch.build(*columns, seed=[0] * len(rows), position=[0] * len(rows),
                                device="cpu")
    for name, want in naive_flags(*columns).items():
        assert getattr(batch, name) == want, name
