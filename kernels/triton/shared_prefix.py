"""Decode attention for groups of samples that share a prompt's KV (n samples per prompt).

Plain paged decode reads the prompt's K/V once per sample. Here a group's queries are stacked
into the rows of one tile and the shared prefix is read once for the whole group: that is the
varlen kernel run with the group as one non-causal "request" (q rows = the group's samples,
context = the prefix). Each sample's private suffix is a second, ordinary decode launch. Both
write normalised partial outputs with their log-sum-exp, merged exactly by `merge_states`.

Layout: request b is query row b (one decode token each); the samples of group g are the
contiguous rows group_indptr[g]:group_indptr[g+1]. A request's context is its group's prefix
followed by its own suffix, so the query (last position) sees all of it: no causal mask.
"""

from __future__ import annotations

import torch

from .merge_states import merge_states
from .paged_attention import _num_sms, choose_num_kv_splits, launch_paged_attention


def shared_prefix_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                            out: torch.Tensor, group_indptr: torch.Tensor,
                            prefix_indptr: torch.Tensor, prefix_indices: torch.Tensor,
                            suffix_indptr: torch.Tensor, suffix_indices: torch.Tensor, *,
                            sm_scale: float, max_group_size: int, max_prefix_len: int,
                            max_suffix_len: int, num_prefix_splits: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """q, out: [B, Hq, D] (one decode query per request); group_indptr, prefix_indptr: int32
    [G+1]; prefix_indices: slots of each group's shared prefix; suffix_indptr: int32 [B+1];
    suffix_indices: slots of each request's private tokens (the new one included). softcap:
    score soft-capping as in paged_attention. There is no sliding window here: the query sees
    its whole context, so a caller with a window uses this path only when it cuts nothing.
    Both launches check their arguments as paged_attention does, under its contract on the
    metadata (group_indptr running from 0 to B; each group within max_group_size, each prefix
    within max_prefix_len, each suffix within max_suffix_len; slots in the pool)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_groups = group_indptr.shape[0] - 1
    if suffix_indptr.shape != (num_tokens + 1,):
        raise ValueError(f"shared_prefix_attention: suffix_indptr {tuple(suffix_indptr.shape)} "
                         f"must have one entry per query row + 1: {num_tokens + 1}")
    if num_prefix_splits is None:
        num_prefix_splits = choose_num_kv_splits(num_groups * k_pool.shape[1], 1, max_prefix_len,
                                                 _num_sms(q.device))
    num_prefix_splits = max(1, num_prefix_splits)
    splits = num_prefix_splits + 1  # the last one holds the suffix
    part_out = torch.empty(num_tokens, num_q_heads, splits, head_dim, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(num_tokens, num_q_heads, splits, dtype=torch.float32,
                           device=q.device)
    # Rows of a group whose prefix is empty are still written (lse = -inf), so nothing in the
    # partial buffers is left uninitialised.
    launch_paged_attention(q, k_pool, v_pool, out, group_indptr, prefix_indptr, prefix_indices,
                           sm_scale=sm_scale, max_q_len=max_group_size,
                           max_kv_len=max_prefix_len, causal=False,
                           num_kv_splits=num_prefix_splits, part_out=part_out,
                           part_lse=part_lse, split_base=0, softcap=softcap)
    rows = torch.arange(num_tokens + 1, dtype=torch.int32, device=q.device)
    launch_paged_attention(q, k_pool, v_pool, out, rows, suffix_indptr, suffix_indices,
                           sm_scale=sm_scale, max_q_len=1, max_kv_len=max_suffix_len,
                           causal=False, num_kv_splits=1, part_out=part_out,
                           part_lse=part_lse, split_base=num_prefix_splits, softcap=softcap)
    return merge_states(part_out, part_lse, out)


def shared_prefix_kv_bytes(group_sizes: list[int], prefix_lens: list[int],
                           suffix_lens: list[int], kv_row_bytes: int) -> tuple[int, int]:
    """(bytes plain paged decode reads, bytes this path reads) of K and V for one layer;
    kv_row_bytes = Hkv * D * element size."""
    plain = sum(n * p for n, p in zip(group_sizes, prefix_lens)) + sum(suffix_lens)
    shared = sum(prefix_lens) + sum(suffix_lens)
    return 2 * plain * kv_row_bytes, 2 * shared * kv_row_bytes
