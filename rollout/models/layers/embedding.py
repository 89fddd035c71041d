"""The vocabulary-parallel embedding and LM head: each rank holds ceil(V / k) rows of the
[V, H] table (rollout/parallel/shard.py split_vocab).

Lookup: a rank embeds the ids in its rows and zeros for the others; one all-reduce sums the
ranks' rows into the full embedding. Logits: each rank multiplies by its rows, one all-gather
assembles the full vocabulary row on every rank, so every rank samples from the same logits.
On one rank both are the plain embedding and matmul. The logits multiply through
`Projection.project` (packed_linear.py: a oneDNN-packed copy of the table on CPU).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ...parallel import Slice, all_reduce, current, gather_vocab, split_vocab
from .packed_linear import Projection


class VocabParallelEmbedding(Projection, nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp, self.vocab_size = current(), vocab_size
        rows, self.start, self.real = split_vocab(vocab_size, self.tp)
        # The last rank's padding rows are never loaded (build_model allocates uninitialised
        # memory, a level-2 sleep drops them) and never read: forward masks their lookups and
        # gather_vocab cuts their logit columns.
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.real)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        return all_reduce(out.masked_fill_(~mine[:, None], 0), self.tp)

    def logits(self, hidden: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
        """fp32 logits [N, V] of hidden [N, H] against this table; `softcap` (Gemma 2):
        cap * tanh(x / cap) in the weights' dtype, as the reference applies it."""
        logits = self.project(hidden, None)
        if softcap is not None:  # elementwise: the same before or after the gather
            logits = torch.tanh(logits / softcap) * softcap
        return gather_vocab(logits, self.tp, self.vocab_size).float()

    def tp_slice(self, attr: str, shard: int | None) -> Slice | None:
        return None if self.tp.size == 1 else Slice(0, self.start, self.real, self.vocab_size)


def lm_head(config) -> VocabParallelEmbedding | None:
    """The untied LM head (checkpoint name `lm_head.weight`, [V, H] like the embedding, so it
    shards the same way); None when tied to the embedding."""
    if getattr(config, "tie_word_embeddings", False):
        return None
    return VocabParallelEmbedding(config.vocab_size, config.hidden_size)
