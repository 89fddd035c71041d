"""Top-k alternatives of sampled tokens (SamplingParams.top_logprobs): the k most likely
tokens under the untruncated policy log_softmax(logits / T) (T = 1 on greedy rows), the
distribution `Sample.logprobs` reports, as vLLM's `logprobs=k` returns them; equal values by
ascending token id (ranked.py)."""

from __future__ import annotations

import torch

from .log_softmax import log_softmax
from .ranked import top_ranked


def top_alternatives(logits: torch.Tensor, rows: list[int], temperature: list[float],
                     k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [R, k], logprobs float32 [R, k]) of `logits`' `rows`, on the host."""
    index = torch.tensor(rows, device=logits.device)
    t = torch.tensor([1.0 if x == 0 else x for x in temperature], device=logits.device)
    ids, values = top_ranked(log_softmax(logits[index].float() / t[:, None]), k)
    return ids.cpu(), values.cpu()


def attach_tops(logits: torch.Tensor, positions: list, emitted: list, counts: list[int]) -> None:
    """Each emitted token's alternatives, for the items whose sequences ask: item i has
    `counts[i]` rows of `logits` (its draft + 1), its j-th emitted token drawn from row j."""
    starts, at = [], 0
    for c in counts:
        starts.append(at)
        at += c
    wanted = [i for i, s in enumerate(starts) if positions[s][0].params.top_logprobs]
    if not wanted:
        return
    rows = [starts[i] + j for i in wanted for j in range(len(emitted[i].tokens))]
    params = [positions[r][0].params for r in rows]
    k = max(p.top_logprobs for p in params)
    ids, lps = top_alternatives(logits, rows, [p.temperature for p in params], k)
    at = 0
    for i in wanted:
        n, want = len(emitted[i].tokens), positions[starts[i]][0].params.top_logprobs
        emitted[i].tops = [(ids[at + j, :want], lps[at + j, :want]) for j in range(n)]
        at += n
