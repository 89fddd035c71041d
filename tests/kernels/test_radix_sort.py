"""kernels/cpu/radix_sort.c (the top-p filter's sort of log-probabilities) against numpy's sort
of the same keys as unsigned 32-bit integers: random keys, the float patterns a row of
log-probabilities holds (0, -0.0, -inf, NaN, denormals), keys sharing digits (passes skipped),
duplicates, short rows, rows in a wider buffer (a stride), several rows."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_kernels import cpu as native
from rollout_kernels.cpu import radix_sort

pytestmark = pytest.mark.skipif(not radix_sort.supported(),
                                reason=native.missing_reason("radix_sort_u32"))


def numpy_sorted(keys: torch.Tensor) -> np.ndarray:
    return np.sort(keys.numpy().view(np.uint32), axis=-1)


def check(keys: torch.Tensor) -> None:
    want = numpy_sorted(keys)
    radix_sort.sort_rows(keys)
    assert np.array_equal(keys.numpy().view(np.uint32), want)


SPECIAL = [0x00000000, 0x80000000, 0xFF800000, 0x7F800000, 0xFFC00000, 0x7FC00000,
           0x80000001, 0x00000001, 0xBF800000, 0xFFFFFFFF]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2**32 - 1), st.sampled_from(SPECIAL),
                          st.integers(0xC1000000, 0xC1000FFF)),  # one shared top digit
                min_size=0, max_size=300),
       st.integers(1, 3))
def test_rows_sort_as_numpy(values, rows):
    keys = torch.tensor(np.array(values * rows, dtype=np.uint32).view(np.int32)).reshape(rows, -1)
    check(keys)


@pytest.mark.parametrize("vocab", [2, 1000, 49152, 151936])
def test_log_probability_rows_sort_descending_as_floats(vocab):
    """Rows of log-probabilities (<= 0) with -inf where a filter cut: as uint32 keys ascending
    they are the floats descending, as `_sorted_values` takes them."""
    gen = torch.Generator().manual_seed(vocab)
    logp = (torch.randn(4, vocab, generator=gen) * 3).log_softmax(-1)
    logp[1, ::3] = float("-inf")
    logp[2] = logp[2].to(torch.bfloat16).float()  # ties
    logp[3, :2] = torch.tensor([-0.0, 0.0])
    keys = logp.clone().view(torch.int32)
    radix_sort.sort_rows(keys)
    got = keys.view(torch.float32)
    want = logp.sort(dim=-1, descending=True).values
    bits, want_bits = got.view(torch.int32), want.view(torch.int32)
    assert torch.equal(bits[:3], want_bits[:3])
    # +0.0 and -0.0 compare equal as floats (torch orders them by index); as keys +0.0 first
    assert bits[3, :2].tolist() == [0, -2**31] and torch.equal(bits[3, 2:], want_bits[3, 2:])


def test_equal_digits_and_a_strided_buffer():
    """Keys whose low or top digits all agree (those passes are skipped), and rows that are a
    slice of a wider buffer: the columns outside them untouched."""
    gen = torch.Generator().manual_seed(0)
    buffer = torch.randint(-2**31, 2**31 - 1, (5, 700), generator=gen, dtype=torch.int32)
    buffer[0, :600] = buffer[0, :600] & ~0x7FF  # low digit shared
    buffer[1, :600] = (buffer[1, :600] & 0x3FFFFF) | (0x155 << 22)  # top digit shared
    buffer[2, :600] = 12345  # every digit shared
    outside = buffer[:, 600:].clone()
    check(buffer[:, :600])
    assert torch.equal(buffer[:, 600:], outside)
