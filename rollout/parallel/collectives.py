"""The collectives of a tensor-parallel forward: one all-reduce after each row-parallel
projection (attention's o_proj, the MLP's down_proj, the vocabulary-parallel embedding) and one
all-gather of the logits rows. Every rank gets bitwise the same result (ring all-reduce and
all-gather hand every rank the same bytes), so replicated activations stay identical across
ranks and so do the sampled tokens."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .group import TensorParallel


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum of `x` over the group, in place."""
    if tp.size > 1:
        dist.all_reduce(x, group=tp.group)
    return x


def gather_vocab(local: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor:
    """Logits [N, shard] of each rank's vocabulary shard -> [N, vocab_size] on every rank (the
    last shard's padding columns cut)."""
    if tp.size == 1:
        return local
    rows, shard = local.shape
    out = local.new_empty((tp.size * rows, shard))  # rank r's rows at [r * rows, (r+1) * rows)
    # all_gather_into_tensor is deprecated for all_gather_single where that exists (torch
    # >= 2.13); looked up per call so that a counting wrapper (bench/tp_comm.py) sees it.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local.contiguous(), group=tp.group)
    return out.view(tp.size, rows, shard).permute(1, 0, 2).reshape(rows, -1)[:, :vocab_size]


_MODULUS = (1 << 61) - 1  # keeps the polynomial hash in int64


def digest(value) -> int:
    """32 bits of `value`'s repr, alike in every process (configs and sampling params: no
    per-process hash or address in their reprs)."""
    return zlib.crc32(repr(value).encode())


def check_same(rows, tp: TensorParallel, device: torch.device, what: str,
               flag: bool = False) -> bool:
    """Every rank holds the same `rows` (lists of ints) or RuntimeError on every rank, saying
    `what` differs; returns whether any rank raised `flag` (the ranks' rows alike). One
    all-reduce of two int64s: the max of a hash and of its negation agree only when every
    rank's hash is the same. The flag is the hash's lowest bit, so that every check made here
    (a step's batch, a call's arguments) stays one collective of one size: a rank at another
    of them meets a mismatch, not a collective of another size, which gloo answers by
    aborting the process."""
    h = 0  # (not digest(): a polynomial over the ints, no repr built)
    for row in rows:
        for t in (len(row), *row):
            h = (h * 1_000_003 + t + 1) % _MODULUS
    h = 2 * h + flag
    both = torch.tensor([h, -h], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=tp.group)
    high, low = int(both[0]), -int(both[1])
    if high // 2 != low // 2:
        raise RuntimeError(f"tensor parallel: {what} (rank {tp.rank} hash {h}, max "
                           f"{high}, min {low})")
    return bool(high % 2)


def check_same_tokens(tokens: list[list[int]], tp: TensorParallel,
                      device: torch.device) -> None:
    """Debug check (EngineConfig.check_tensor_parallel): every rank sampled the same tokens this
    step."""
    check_same(tokens, tp, device, "ranks sampled different tokens this step; their logits "
                                   "differ")


def check_same_batch(batch, tp: TensorParallel, device: torch.device,
                     interrupted: bool = False) -> bool:
    """Every step of an engine of several ranks, before its forward: the ranks run the same
    batch (each item's request id, sample, position, and the tokens it feeds; while it
    computes its prompt, the sample's noise seed and params too). Ranks handed different
    requests (each its own prompts) would otherwise run a forward mixing them and all return
    the same wrong text; requests queued by add_request (agreed by no call) with a seed,
    temperature or length of each rank's own would sample apart or stop apart (the others
    then waiting forever for a step). Returns whether any rank was `interrupted` (it holds a
    Ctrl-C: every rank then stops at this step, rollout/engine/step.py)."""
    rows = []
    for it in batch.items:
        seq = it.seq
        row = [*seq.group.encode(), seq.sample_index, it.start, it.num_new,
               *seq.token_ids[it.start:it.start + it.num_new]]
        # Checked before the sample's first token is drawn (its last prompt token is always
        # computed), and only then: hashing params every decode step would cost each step.
        if it.start < len(seq.prompt_ids):
            row += [seq.seed, digest(seq.params)]
        rows.append(row)
    return check_same(rows, tp, device, "ranks of one engine run different requests this "
                                        "step (each rank must add the same requests, in the "
                                        "same order)", interrupted)
