"""The C Gumbel-max sampler of rollout_kernels.cpu (the cpu backend's for drawing tokens) against the
definition it must reproduce bit for bit: argmax(candidates + counter_noise.gumbel_noise), the
first index among equal scores, a NaN first."""

import pytest
import torch

from rollout.sample.noise import gumbel_noise, row_keys
from rollout.ops.backend import resolve_backend
from rollout.sample.sampler import Sampler, SamplingBatch, draw_cpu, sample
from rollout_kernels import cpu as native
from rollout_kernels.cpu import gumbel

pytestmark = pytest.mark.skipif(
    gumbel._kernel() is None,
    reason=native.missing_reason("gumbel_argmax_f32", "gumbel_all_uniforms")
    if not native.has("gumbel_argmax_f32", "gumbel_all_uniforms")
    else "torch's CPU log is not MKL's vmsLn here")


def argmax(candidates, seed, position, stream):
    return gumbel.gumbel_argmax(candidates, row_keys(seed, position, stream))


def keys(rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-2**31, 2**31 - 1, (rows,), generator=gen, dtype=torch.int32),
            torch.randint(0, 2**31 - 1, (rows,), generator=gen, dtype=torch.int32))


def definition(candidates, seed, position, stream):
    return (candidates + gumbel_noise(seed, position, candidates.shape[1], stream)).argmax(-1)


@pytest.mark.parametrize("rows,vocab,scale", [(1, 7, 1.0), (5, 1001, 2.0), (70, 49152, 3.0),
                                              (9, 49152, 0.02), (3, 151936, 8.0)])
def test_tokens_are_those_of_the_definition(rows, vocab, scale):
    gen = torch.Generator().manual_seed(rows)
    candidates = (torch.randn(rows, vocab, generator=gen) * scale).log_softmax(-1)
    candidates[:, 1::5] = float("-inf")  # filtered tokens
    seed, position = keys(rows, vocab)
    for stream in (0, 3):
        assert torch.equal(argmax(candidates, seed, position, stream),
                           definition(candidates, seed, position, stream))


def test_scores_equal_to_the_last_bit_and_one_ulp_apart():
    """Candidates minus the exact noise: every score is exactly 0 (every token within the
    kernel's approximation of the maximum), so the first token wins; raised by one ulp at one
    token (a score of ~1e-7 to 2e-6 above the others, inside the approximation's error), that
    token wins."""
    seed, position = keys(4, 1)
    noise = gumbel_noise(seed, position, 3000, 0)
    candidates = -noise
    assert argmax(candidates, seed, position, 0).tolist() == [0, 0, 0, 0]
    marked = torch.tensor([2999, 1, 1500, 77])
    at = (torch.arange(4), marked)
    candidates[at] = torch.nextafter(candidates[at], torch.tensor(float("inf")))
    assert torch.equal(argmax(candidates, seed, position, 0), marked)
    assert torch.equal(definition(candidates, seed, position, 0), marked)


def test_non_finite_candidates():
    seed, position = keys(4, 2)
    candidates = torch.randn(4, 2000)
    candidates[0] = float("-inf")  # nothing left: token 0, as torch.argmax
    candidates[1, 1234], candidates[1, 1500] = float("nan"), float("nan")  # the first NaN
    candidates[2, :] = float("-inf")
    candidates[2, 1999] = 0.0  # the only candidate
    candidates[3, 17] = float("inf")
    got = argmax(candidates, seed, position, 0)
    assert got.tolist() == [0, 1234, 1999, 17]
    assert torch.equal(got, definition(candidates, seed, position, 0))


def test_rows_with_a_stride():
    seed, position = keys(6, 3)
    wide = torch.randn(6, 3000)
    candidates = wide[:, :2500]
    assert torch.equal(argmax(candidates, seed, position, 0),
                       definition(candidates, seed, position, 0))


def test_the_bound_covers_the_approximation():
    """The bound is measured over every uniform (gumbel.c's own code against vmsLn): a few
    float32 ulps of noise of magnitude up to ~17."""
    _, _, bound = gumbel._kernel()
    assert 0 < bound < 1e-5


def test_sample_is_the_torch_path_with_filters_and_greedy_rows():
    rows, vocab = 40, 5000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(9)) * 4
    b = SamplingBatch.build(
        temperature=[0.0 if i % 7 == 3 else 0.5 + i / 40 for i in range(rows)],
        top_k=[20 if i % 3 == 0 else 0 for i in range(rows)],
        top_p=[0.9 if i % 4 == 1 else 1.0 for i in range(rows)],
        min_p=[0.05 if i % 5 == 2 else 0.0 for i in range(rows)],
        seed=list(range(rows)), position=[10 * i for i in range(rows)], device="cpu")
    native = draw_cpu(logits, b)[:2]
    torch_path = sample(logits, b)
    assert torch.equal(native[0], torch_path[0]) and torch.equal(native[1], torch_path[1])


def emitted(outs) -> list:
    return [(e.tokens, e.logprobs, e.sampling_logprobs,
             None if e.supports[0] is None else e.supports[0].tolist()) for e in outs]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,vocab,dtype", [(1, 49152, torch.float32), (2, 49152, torch.float32),
                                              (43, 49152, torch.float32),
                                              (1100, 1000, torch.float32),
                                              (53, 40000, torch.bfloat16)])
def test_a_batch_drawn_in_blocks_of_rows_is_drawn_as_a_whole(rows, vocab, dtype, threads):
    """The cpu backend's Sampler draws a batch without filters larger than a block a block of
    rows at a time: the tokens and logprobs of the whole batch drawn at once, bit for bit, and
    of the torch reference; at batch sizes within one block, of several blocks, of blocks and
    a lone row (43 and 53), with greedy rows, several temperatures or all at 1, bf16 logits
    (and batches with filters, drawn whole: the same)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(rows)
        logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
        in_blocks = Sampler(resolve_backend("cpu", torch.device("cpu")))
        whole = Sampler(resolve_backend("cpu", torch.device("cpu")))
        whole._block_rows = False
        want_support = tuple(i % 3 == 0 for i in range(rows))
        want_logprobs = tuple(i % 4 != 1 for i in range(rows))
        for temperature, filtered in (([0.0 if i % 5 == 1 else 0.6 + i / rows
                                        for i in range(rows)], True),
                                      ([1.0] * rows, False), ([0.0] * rows, False)):
            b = SamplingBatch.build(
                temperature, [20 if filtered and i % 3 == 0 else 0 for i in range(rows)],
                [0.9 if filtered and i % 3 == 1 else 1.0 for i in range(rows)],
                [0.05 if filtered and i % 7 == 2 else 0.0 for i in range(rows)],
                list(range(rows)), [7 * i for i in range(rows)], "cpu")
            got = emitted(in_blocks.draw(logits, b, want_support, want_logprobs))
            assert got == emitted(whole.draw(logits, b, want_support, want_logprobs))
            tokens, logprobs = sample(logits, b)
            assert [g[0][0] for g in got] == tokens.tolist()
            assert [g[1][0] for g in got] == logprobs.tolist()
    finally:
        torch.set_num_threads(before)
