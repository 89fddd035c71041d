"""rollout/sample/log_softmax.py against the float64 answer: the logprobs of a row's likely
tokens within a few float32 roundings of their size whatever the vocabulary, where a float32
sum along the row (torch's CPU log_softmax) loses accuracy as the vocabulary grows (measured at
the likely tokens of 64 rows: 3 / 88 / 232 eps at 1K / 49K / 152K tokens; this one 1.5 / 3.4 /
5.5 eps)."""

import pytest
import torch
from floors import assert_as_exact_as

from rollout.sample.log_softmax import log_softmax
from rollout.sample.support import truncated_logprobs

EPS = torch.finfo(torch.float32).eps
BOUND_EPS = 8  # the largest measured, 5.5 eps at 152K tokens, and headroom


def peaked_logits(vocab: int, likely: int = 8) -> torch.Tensor:
    """64 rows of noise with a few likely tokens in front, as a trained model's logits."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(64, vocab, generator=g) * 4
    x[:, :likely] += torch.rand(64, likely, generator=g) * 30
    return x


@pytest.mark.parametrize("vocab", [1000, 49152, 151936])
def test_likely_tokens_within_a_few_roundings_of_float64(vocab):
    x = peaked_logits(vocab)
    exact = x.double().log_softmax(-1)
    got = log_softmax(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    relative = (got.double() - exact).abs() / (EPS * exact.abs().clamp(min=1))
    assert relative[:, :8].max().item() <= BOUND_EPS
    assert_as_exact_as(got, exact, x.log_softmax(-1), "logprob")  # the tail tokens too


def test_masked_and_non_finite_rows_as_torch():
    x = peaked_logits(1000)[:4].clone()
    x[0, 10:] = float("-inf")  # a filtered row: the kept tokens renormalised
    x[1, 3], x[2, 5], x[3] = float("inf"), float("nan"), float("-inf")
    got, want = log_softmax(x), x.log_softmax(-1)
    assert torch.equal(got[0, 10:], want[0, 10:])  # -inf
    assert_as_exact_as(got[0, :10], x[0, :10].double().log_softmax(-1), want[0, :10], "logprob")
    assert torch.equal(got[1:].isnan(), want[1:].isnan())
    assert got[1:].isnan().all()


def test_gradient_is_log_softmax_s():
    x = peaked_logits(1000)[:4].clone().requires_grad_()
    weights = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1))
    (log_softmax(x) * weights).sum().backward()
    ours = x.grad.clone()
    x.grad = None
    (x.log_softmax(-1) * weights).sum().backward()
    exact = x.detach().double().requires_grad_()
    (exact.log_softmax(-1) * weights.double()).sum().backward()
    assert_as_exact_as(ours, exact.grad, x.grad, "gradient")


@pytest.fixture
def two_threads():
    """torch splits a lone long row's sum across threads only when it has more than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("vocab", [49152, 151936])
def test_a_lone_row_rounds_as_in_a_batch(vocab, two_threads):
    """A token's logprob and sampling logprob do not depend on whether it was sampled alone: a
    lone row, as [1, V] or [V], gives the bits of the same row in a batch (torch's own sum and
    logsumexp of a lone row over two threads do not, at these sizes)."""
    x = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    batched = log_softmax(x)
    assert torch.equal(log_softmax(x[2:3]), batched[2:3])
    assert torch.equal(log_softmax(x[2]), batched[2])
    cut = batched.masked_fill(batched < -9, float("-inf"))  # a truncated distribution
    tokens = cut.argmax(dim=-1)
    want = truncated_logprobs(cut, tokens)
    for row in range(5):  # torch's logsumexp of a lone row rounds some of these apart
        assert torch.equal(truncated_logprobs(cut[row:row + 1], tokens[row:row + 1]),
                           want[row:row + 1])
