"""Speculative acceptance: how many drafts each request keeps, and the token it emits after them.

The caller (rollout/spec/verify.py) computes everything per verify row in vectorised torch; what
is left is a scan along each request's drafts that stops at the first rejection, which torch can
only do as a Python loop over requests. On CUDA that scan is this kernel (one program per request
looping over its drafts), so a verify step costs one launch and one host read, not a loop.

Rows: request b owns rows row_indptr[b]:row_indptr[b+1], one per draft plus the bonus row (its
draft token is -1). Per row: `target` (the target's own sample there), `draft`, `greedy`; for the
"rejection" rule also p(d), q(d), the acceptance `coin` and the `residual` token sampled from
max(0, p - q). Row j of request b accepts when
  - greedy row, or the "coupled" rule: draft == target;
  - otherwise ("rejection"): coin < p(d) / q(d).
With a accepted drafts, the emitted token is the target token of row a on full acceptance, under
"coupled" and on greedy rows, else (a rejection under "rejection") the residual token of row a.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# q(d) of a token the draft cannot propose is 0; the ratio stays finite. The torch reference
# (rollout/spec/accept.py, the engine's path off CUDA) uses the same floor: kernels import
# nothing from rollout, a test checks that the two agree.
Q_FLOOR = 1e-30


@triton.jit
def _accept_drafts_kernel(row_indptr, target, draft, greedy, p_draft, q_draft, coin, residual,
                          num_accepted, last_token, REJECTION: tl.constexpr,
                          Q_FLOOR: tl.constexpr):
    b = tl.program_id(0)
    start = tl.load(row_indptr + b)
    num_drafts = tl.load(row_indptr + b + 1) - start - 1
    a = tl.full([], 0, tl.int32)
    scanning = num_drafts > 0
    while scanning:
        row = start + a
        ok = tl.load(draft + row) == tl.load(target + row)
        if REJECTION:
            # IEEE division, as torch's: an approximate one could flip a coin at the boundary.
            ratio = tl.math.div_rn(tl.load(p_draft + row),
                                   tl.maximum(tl.load(q_draft + row), Q_FLOOR))
            ok = tl.where(tl.load(greedy + row) != 0, ok, tl.load(coin + row) < ratio)
        a += ok.to(tl.int32)
        scanning = ok & (a < num_drafts)
    row = start + a
    last = tl.load(target + row)
    if REJECTION:
        rejected = (a < num_drafts) & (tl.load(greedy + row) == 0)
        last = tl.where(rejected, tl.load(residual + row), last)
    tl.store(num_accepted + b, a)
    tl.store(last_token + b, last)


def accept_drafts(row_indptr: torch.Tensor, target: torch.Tensor, draft: torch.Tensor,
                  greedy: torch.Tensor, p_draft: torch.Tensor | None = None,
                  q_draft: torch.Tensor | None = None, coin: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted int32 [B], last_token int64 [B]). row_indptr: int32 [B+1]; target, draft,
    residual: int64 [R]; greedy: bool [R]; p_draft, q_draft, coin: float32 [R]. The "rejection"
    rule applies when p_draft is given (then q_draft, coin, residual too), else "coupled".
    Shapes are checked (ValueError); row_indptr's values are the caller's contract (from 0,
    each request at least its bonus row, ending within R): reading them would wait for the
    device."""
    if (row_indptr.dtype not in (torch.int32, torch.int64) or row_indptr.dim() != 1
            or not row_indptr.numel()):
        raise ValueError(f"accept_drafts: row_indptr must hold int32 or int64, B + 1 >= 1 "
                         f"entries, got {row_indptr.dtype} {tuple(row_indptr.shape)}")
    rows = {"target": target, "draft": draft, "greedy": greedy}
    rejection = p_draft is not None
    if rejection:
        extra = {"p_draft": p_draft, "q_draft": q_draft, "coin": coin, "residual": residual}
        missing = [name for name, t in extra.items() if t is None]
        if missing:
            raise ValueError(f"accept_drafts: p_draft given without {', '.join(missing)}: the "
                             f"rejection rule needs them")
        rows |= extra
    for name, t in rows.items():
        if t.dim() != 1 or t.shape != target.shape:
            raise ValueError(f"accept_drafts: {name} {tuple(t.shape)} must be target's "
                             f"{tuple(target.shape)}, one entry per row")
    # The kernel reads row r at offset r: strided views (a column of a wider tensor) are copied.
    rows = {name: t.contiguous() for name, t in rows.items()}
    num_req = row_indptr.shape[0] - 1
    num_accepted = torch.empty(num_req, dtype=torch.int32, device=target.device)
    last_token = torch.empty(num_req, dtype=torch.int64, device=target.device)
    if num_req == 0:
        return num_accepted, last_token
    if not rejection:  # placeholders, never read: REJECTION is a compile-time False
        rows |= dict.fromkeys(("p_draft", "q_draft", "coin", "residual"), rows["target"])
    _accept_drafts_kernel[(num_req,)](row_indptr.contiguous(), *rows.values(), num_accepted,
                                      last_token, REJECTION=rejection, Q_FLOOR=Q_FLOOR,
                                      num_warps=1)
    return num_accepted, last_token
