"""Which part of each full (checkpoint) tensor a rank keeps.

Attention: the query heads split evenly; KV heads split evenly when there are at least as many
as ranks, otherwise each rank keeps the one KV head its query heads read (replicated on
size / num_kv_heads ranks), so attention needs no communication. MLP: the intermediate
dimension split evenly. Vocabulary: ceil(V / size) rows per rank, the last rank's tail padded
(its rows are never looked up and its logits columns are cut after the gather).

A layer says where its parameters come from with `tp_slice(attr, shard)` (layers/linear.py,
layers/embedding.py); models/base.py slices the checkpoint's tensors with it when loading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .group import TensorParallel


@dataclass(frozen=True)
class Slice:
    """`length` entries from `start` along `dim` of a full tensor that has `full` there."""

    dim: int
    start: int
    length: int
    full: int

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.length)  # a view: nothing copied

    def intervals(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """(dim, ((start, length), ...)): the full tensor's ranges along dim that make up the
        rank's part, in order (parallel/reshard.py fetches them from DTensor shards)."""
        return self.dim, ((self.start, self.length),)

    def full_shape(self, local: torch.Size) -> torch.Size:
        shape = list(local)
        shape[self.dim] = self.full
        return torch.Size(shape)


@dataclass(frozen=True)
class Concat:
    """A fused parameter loaded whole (Phi-3 stores qkv_proj and gate_up_proj fused, transformers
    5 the MoE experts' gate_up_proj): the full tensor is its parts' full tensors stacked along
    `dim`, the rank's their slices stacked (the parts' own dims are ignored)."""

    parts: tuple[Slice, ...]
    dim: int = 0

    @property
    def length(self) -> int:
        return sum(p.length for p in self.parts)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        dim, ranges = self.intervals()
        return torch.cat([tensor.narrow(dim, start, n) for start, n in ranges], dim=dim)

    def intervals(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        ranges, offset = [], 0
        for p in self.parts:
            ranges.append((offset + p.start, p.length))
            offset += p.full
        return self.dim, tuple(ranges)

    def full_shape(self, local: torch.Size) -> torch.Size:
        shape = list(local)
        shape[self.dim] = sum(p.full for p in self.parts)
        return torch.Size(shape)


def even_split(total: int, tp: TensorParallel, field: str) -> tuple[int, int]:
    """(start, length) of this rank's equal share of `total`."""
    if total % tp.size:
        raise ValueError(f"tensor_parallel_size={tp.size} must divide {field}={total}")
    share = total // tp.size
    return tp.rank * share, share


@dataclass(frozen=True)
class HeadSplit:
    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int


def split_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadSplit:
    q_start, q_heads = even_split(num_heads, tp, "num_attention_heads")
    if num_kv_heads >= tp.size:
        kv_start, kv_heads = even_split(num_kv_heads, tp, "num_key_value_heads")
        return HeadSplit(q_start, q_heads, kv_start, kv_heads)
    if tp.size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp.size}: with fewer KV heads than ranks, "
                         f"num_key_value_heads={num_kv_heads} must divide it (each rank keeps "
                         f"the one KV head its query heads read)")
    # Query head h reads KV head h // (num_heads / num_kv_heads): all of this rank's query
    # heads fall in the group of KV head rank * num_kv_heads // size.
    return HeadSplit(q_start, q_heads, tp.rank * num_kv_heads // tp.size, 1)


def split_vocab(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(rows per rank, this rank's first row, how many of its rows are real): every rank holds
    the same number of rows so that the logits gather is one all_gather_into_tensor."""
    rows = -(-vocab_size // tp.size)
    # the last ranks of a small vocabulary may hold no real row (5 rows on 4 ranks: 2, 2, 1, 0)
    start = min(tp.rank * rows, vocab_size)
    return rows, start, max(0, min(rows, vocab_size - start))
