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


def check_same(rows, tp: TensorParallel, device: torch.device, what: str) -> None:
    """Every rank holds the same `rows` (lists of ints) or RuntimeError on every rank, saying
    `what` differs. One all-reduce of two int64s: the max of a hash and of its negation agree
    only when every rank's hash is the same."""
    digest = 0
    for row in rows:
        for t in (len(row), *row):
            digest = (digest * 1_000_003 + t + 1) % _MODULUS
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=tp.group)
    if int(both[0]) != -int(both[1]):
        raise RuntimeError(f"tensor parallel: {what} (rank {tp.rank} hash {digest}, max "
                           f"{int(both[0])}, min {-int(both[1])})")


def check_same_tokens(tokens: list[list[int]], tp: TensorParallel,
                      device: torch.device) -> None:
    """Debug check (EngineConfig.check_tensor_parallel): every rank sampled the same tokens this
    step."""
    check_same(tokens, tp, device, "ranks sampled different tokens this step; their logits "
                                   "differ")


def check_same_batch(batch, tp: TensorParallel, device: torch.device) -> None:
    """Every step of an engine of several ranks, before its forward: the ranks run the same
    batch (each item's request id, sample, position, and the tokens it feeds; while it
    computes its prompt, the sample's noise seed and params too). Ranks handed different
    requests (each its own prompts) would otherwise run a forward mixing them and all return
    the same wrong text; requests queued by add_request (agreed by no call) with a seed,
    temperature or length of each rank's own would sample apart or stop apart (the others
    then waiting forever for a step)."""
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
    check_same(rows, tp, device, "ranks of one engine run different requests this step (each "
                                 "rank must add the same requests, in the same order)")
