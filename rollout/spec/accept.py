"""The acceptance scan of speculative verification, in torch: per request, count the leading
accepted drafts and pick the final token. `kernels/triton/spec_accept.py` is the Triton version used
on CUDA, tested against this one; it lives here so speculation on CPU needs no Triton."""

from __future__ import annotations

import torch

Q_FLOOR = 1e-30  # q(d) of a token the draft cannot propose is 0; the ratio stays finite


def accept_drafts_ref(row_indptr: torch.Tensor, target: torch.Tensor, draft: torch.Tensor,
                      greedy: torch.Tensor, p_draft: torch.Tensor | None = None,
                      q_draft: torch.Tensor | None = None, coin: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `accept_drafts`, same arguments and results: the rule per row in
    torch, the scan as a Python loop over requests (the engine's path off CUDA)."""
    accept = draft == target
    if p_draft is not None:
        accept = torch.where(greedy, accept, coin < p_draft / q_draft.clamp(min=Q_FLOOR))
        residual = torch.where(greedy, target, residual)
    else:
        residual = target
    accept_l, target_l, residual_l = accept.tolist(), target.tolist(), residual.tolist()
    bounds = row_indptr.tolist()
    num_accepted, last_token = [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        num_drafts, a = end - start - 1, 0
        while a < num_drafts and accept_l[start + a]:
            a += 1
        num_accepted.append(a)
        last_token.append(target_l[start + a] if a == num_drafts else residual_l[start + a])
    return (torch.tensor(num_accepted, dtype=torch.int32, device=target.device),
            torch.tensor(last_token, dtype=torch.int64, device=target.device))
