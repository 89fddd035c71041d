"""The speculative acceptance kernel against its torch reference (the engine's CPU path)."""

import pytest
import torch
from kernels_env import DEVICE

from rollout.spec import accept as accept_ref
from rollout.spec.accept import accept_drafts_ref
from rollout_kernels.triton import accept_drafts, spec_accept

pytestmark = pytest.mark.interpreter


def random_rows(num_req: int, seed: int) -> dict:
    """Draft lengths 0..5; a 3-token vocabulary so drafts often match the target and scans run
    deep; greedy and sampled rows mixed; some q(d) = 0 (a token the draft cannot propose)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 6, (num_req,), generator=gen)
    row_indptr = torch.zeros(num_req + 1, dtype=torch.int32)
    row_indptr[1:] = (lens + 1).cumsum(0)
    num_rows = int(row_indptr[-1])
    draft = torch.randint(0, 3, (num_rows,), generator=gen)
    draft[row_indptr[1:].long() - 1] = -1  # the bonus row of each request has no draft
    q = torch.rand(num_rows, generator=gen)
    q[torch.rand(num_rows, generator=gen) < 0.1] = 0.0
    rows = dict(row_indptr=row_indptr, target=torch.randint(0, 3, (num_rows,), generator=gen),
                draft=draft, greedy=torch.rand(num_rows, generator=gen) < 0.3,
                p_draft=torch.rand(num_rows, generator=gen), q_draft=q,
                coin=torch.rand(num_rows, generator=gen),
                residual=torch.randint(100, 200, (num_rows,), generator=gen))
    return {k: v.to(DEVICE) for k, v in rows.items()}


def run_both(rows: dict) -> tuple[list, list]:
    got = [t.tolist() for t in accept_drafts(**rows)]
    want = [t.tolist() for t in accept_drafts_ref(**rows)]
    return got, want


@pytest.mark.parametrize("rule", ["coupled", "rejection"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_matches_reference(rule, seed):
    rows = random_rows(64, seed)
    if rule == "coupled":
        rows = {k: rows[k] for k in ("row_indptr", "target", "draft", "greedy")}
    got, want = run_both(rows)
    assert got == want
    num_accepted, last_token = want
    lens = (rows["row_indptr"][1:] - rows["row_indptr"][:-1] - 1).tolist()
    assert 0 < sum(num_accepted) < sum(lens), "the cases must mix acceptances and rejections"
    # Residual tokens (>= 100) are emitted exactly when the rule is rejection sampling.
    assert any(t >= 100 for t in last_token) == (rule == "rejection")


def test_rule_on_a_written_out_case():
    """Request 0: drafts 5 6 7 against targets 5 6 9 (bonus 8); request 1: no draft; request
    2: draft 4 (target 3) on a sampled row whose coin beats p/q = 0.5 / 0.25."""
    rows = dict(row_indptr=torch.tensor([0, 4, 5, 7], dtype=torch.int32),
                target=torch.tensor([5, 6, 9, 8, 1, 3, 2]),
                draft=torch.tensor([5, 6, 7, -1, -1, 4, -1]),
                greedy=torch.tensor([True] * 5 + [False] * 2),
                p_draft=torch.tensor([0.0] * 5 + [0.5, 0.0]),
                q_draft=torch.tensor([0.0] * 5 + [0.25, 0.0]),
                coin=torch.tensor([0.0] * 5 + [0.99, 0.0]),
                residual=torch.tensor([0, 0, 0, 0, 0, 42, 43]))
    rows = {k: v.to(DEVICE) for k, v in rows.items()}
    coupled = {k: rows[k] for k in ("row_indptr", "target", "draft", "greedy")}
    for args, want_rows in ((coupled, [[2, 0, 0], [9, 1, 3]]),  # 4 != 3: emit target 3
                            (rows, [[2, 0, 1], [9, 1, 2]])):  # coin 0.99 < 2: accept, bonus 2
        got, want = run_both(args)
        assert got == want == want_rows
    rows["p_draft"][5] = 0.1  # p/q = 0.4 < coin: rejected, the residual token 42 is emitted
    got, want = run_both(rows)
    assert got == want == [[2, 0, 0], [9, 1, 42]]


@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_verify_gives_the_kernel_what_the_reference_gets(rule):
    """verify() end to end with the kernel in the reference's place (as on CUDA): the per-row
    tensors it builds (dtypes included) must drive both to the same verdicts."""
    from rollout.sample.sampler import SamplingBatch
    from rollout.spec.verify import verify

    gen = torch.Generator().manual_seed(3)
    vocab, lens = 6, [3, 0, 5, 2, 4, 1, 5, 3]
    drafts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
    probs = [torch.rand(n, vocab, generator=gen).softmax(-1) if n else None for n in lens]
    rows = [(b, j) for b, n in enumerate(lens) for j in range(n + 1)]
    temps = [0.0 if b % 3 == 0 else 0.8 for b, _ in rows]
    batch = SamplingBatch.build(temps, [0] * len(rows), [1.0] * len(rows), [0.0] * len(rows),
                                [b for b, _ in rows], [10 + j for _, j in rows], DEVICE)
    logits = (torch.randn(len(rows), vocab, generator=gen) * 2).to(DEVICE)
    verdicts = {}
    for impl in (accept_drafts_ref, accept_drafts):
        verdicts[impl] = [(v.tokens, v.logprobs, v.accepted)
                          for v in verify(logits, batch, drafts, probs, rule, accept=impl)]
    want, got = verdicts.values()
    assert got == want
    assert 0 < sum(accepted for _, _, accepted in want) < sum(lens)


def test_kernel_and_reference_share_the_probability_floor():
    # kernels/ imports nothing from rollout/, so the floor is written in both places.
    assert spec_accept.Q_FLOOR == accept_ref.Q_FLOOR
