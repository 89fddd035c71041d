"""The fused Triton sampler (kernels/triton/sample.py) beside what the Sampler reports of its
rows: the support and sampling logprob come from the filters' definition (filter_by_sort's
candidates), so a row that reports them must have been drawn from those very candidates.

The kernel decides its own kept set from its own float32 sums (another order than the
definition's softmax and cumsum), so where a token's mass before it lies within rounding of
top_p the two keep different sets (its docstring says so). A token the kernel kept and the
definition dropped came back outside its own `support` with a sampling logprob of -inf.
The rows here put top_p exactly at the definition's float32 mass before a sorted position:
the definition drops that token, and the kernel keeps it in some of these rows.

The kernel runs in Triton's interpreter on the CPU (conftest.py sets it where there is no GPU):
where and how often the compiled kernel's sums round apart from the definition's is a GPU's to
show: on a GPU the same cases run compiled (bench/gpu_check.sh owed).
"""

import math
import os

import pytest
import torch

import rollout.sample.sampler as sampler_module
from rollout.ops.backend import resolve_backend
from rollout.ops.op import Op, always
from rollout.sample.log_softmax import log_softmax
from rollout.sample.sampler import Sampler, SamplingBatch, draw, draw_triton, target_logprobs
from rollout.sample.support import truncated_logprobs

# Compiled on a GPU; on the CPU, the kernel runs in Triton's interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.interpreter,
              pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the kernel on CPU tensors: Triton's interpreter")]
VOCAB, ROWS = 300, 64


@pytest.fixture
def fused(monkeypatch):
    """A Sampler whose draw is the fused kernel (the engine binds it on CUDA only)."""
    monkeypatch.setattr(sampler_module, "DRAW", Op("draw", torch=(draw, always),
                                                   triton=(draw_triton, always)))
    return Sampler(resolve_backend("triton", torch.device(DEVICE)))


def boundary_rows(seed: int, position: int, rows: int = ROWS) -> tuple[torch.Tensor, float]:
    """`rows` copies of one N(0, 4) row and a top_p equal to the definition's float32 mass
    before sorted position `position` (so that token is the first dropped)."""
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    sorted_logp = log_softmax(row[None])[0].sort(descending=True).values
    probs = sorted_logp.softmax(-1)
    top_p = (probs.cumsum(-1) - probs)[position].item()
    return row.expand(rows, VOCAB).contiguous().to(DEVICE), top_p


@pytest.mark.parametrize("seed,position", [(15, 5), (16, 6), (5, 5)])
@pytest.mark.parametrize("asked", ["logprobs", "support"])
def test_a_reported_row_is_drawn_from_the_distribution_it_reports(fused, seed, position,
                                                                  asked):
    logits, top_p = boundary_rows(seed, position)
    batch = SamplingBatch.build([1.0] * ROWS, [0] * ROWS, [top_p] * ROWS, [0.0] * ROWS,
                                list(range(ROWS)), [9] * ROWS, DEVICE)
    support = (True,) * ROWS if asked == "support" else None
    drawn = fused.draw(logits, batch, want_support=support, want_logprobs=(True,) * ROWS)
    logp, candidates = target_logprobs(logits, batch)
    kept = set((candidates[0] > float("-inf")).nonzero().flatten().tolist())
    assert len(kept) == position  # the boundary token is dropped by the definition
    tokens = torch.tensor([e.tokens[0] for e in drawn], device=DEVICE)
    want = truncated_logprobs(candidates, tokens).tolist()
    for e, w, lp in zip(drawn, want, logp.gather(-1, tokens[:, None])[:, 0].tolist()):
        (token,), (slp,) = e.tokens, e.sampling_logprobs
        assert token in kept, (token, sorted(kept))
        assert math.isfinite(slp) and slp == w
        assert e.logprobs[0] == lp  # log_softmax.py's, as Engine.score and the alternatives
        if asked == "support":
            assert e.supports[0].tolist() == sorted(kept)


def test_rows_that_report_nothing_keep_the_kernels_tokens(fused):
    """A row asking for neither logprobs nor support is the kernel's, in any batch: its token
    does not depend on whether its neighbours report theirs.

    32 rows, the odd ones reporting: in Triton's interpreter (AMD EPYC Zen 3) the kernel
    draws the token the definition drops in even rows 20, 22 and 26, where a row drawn from
    the definition's candidates would get another token."""
    rows = 32
    logits, top_p = boundary_rows(15, 5, rows)
    batch = SamplingBatch.build([1.0] * rows, [0] * rows, [top_p] * rows, [0.0] * rows,
                                list(range(rows)), [9] * rows, DEVICE)
    kernel_tokens = draw_triton(logits, batch)[0].tolist()
    half = tuple(r % 2 == 1 for r in range(rows))
    drawn = fused.draw(logits, batch, want_logprobs=half)
    assert [e.tokens[0] for r, e in enumerate(drawn) if not half[r]] == \
        [t for r, t in enumerate(kernel_tokens) if not half[r]]


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_reported_logprobs_are_those_of_log_softmax(fused, top_p):
    """The logprob of a row that reports it is log_softmax.py's at the token, the bits
    Engine.score and the top-k alternatives give for the same logits row: the kernel's own
    log-sum adds the row in another order (rows 14, 27, 30 of these 32 an ulp apart here,
    and 23 too at top_p 0.9: Triton's interpreter on AMD EPYC Zen 3)."""
    rows, vocab = 32, 2000
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * 3).to(DEVICE)
    batch = SamplingBatch.build([1.0] * rows, [0] * rows, [top_p] * rows, [0.0] * rows,
                                list(range(rows)), [3] * rows, DEVICE)
    drawn = fused.draw(logits, batch, want_logprobs=(True,) * rows)
    tokens = torch.tensor([e.tokens[0] for e in drawn], device=DEVICE)
    assert tokens.tolist() == draw_triton(logits, batch)[0].tolist()  # the kernel's tokens
    want = log_softmax(logits).gather(-1, tokens[:, None])[:, 0].tolist()
    assert [e.logprobs[0] for e in drawn] == want
