"""The Triton attention backend (CUDA default): store_kv, then one varlen paged-attention
kernel for prefill, extend, decode and verify (kernels/triton/paged_attention.py).

Decode steps in which samples of one prompt decode side by side (n samples per prompt, once
the prompt is cached) take the shared-prefix path instead (kernels/triton/shared_prefix.py): each
group's prompt K/V is read once for all its samples rather than once per sample. That kernel
wants a group's queries in contiguous rows, so the step's rows are permuted into group order
and the output permuted back; the permutation and index tensors are built once per step in
`plan`, not per layer.

Sliding-window layers pass their window to the paged kernel. The shared-prefix kernel sees each
query's whole context, so such a layer takes it only when the window cuts no request's context
(the step's longest context fits in it); otherwise that layer runs the plain kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from rollout_kernels.triton import paged_attention, shared_prefix_attention, store_kv

from .base import AttentionBackend
from .metadata import AttentionMetadata, indptr, ranges


@dataclass
class _SharedPrefixPlan:
    """Arguments of `shared_prefix_attention` for one decode step, in group order."""

    perm: torch.Tensor | None  # row i of the group order is request perm[i]; None: identity
    group_indptr: torch.Tensor
    prefix_indptr: torch.Tensor
    prefix_indices: torch.Tensor
    suffix_indptr: torch.Tensor
    suffix_indices: torch.Tensor
    max_group_size: int
    max_prefix_len: int
    max_suffix_len: int


@dataclass
class TritonPlan:
    """Launch sizes of the plain kernel (host-side upper bounds, so the kernels never
    synchronise) and, for a decode step whose samples share prompts, the shared-prefix
    arguments."""

    max_q_len: int
    max_kv_len: int
    shared: _SharedPrefixPlan | None = None


class TritonAttention(AttentionBackend):
    """`invariant` (EngineConfig.batch_invariant): the paged kernel's invariant mode for every
    step, never the shared-prefix path (its prefix/suffix split follows the batch)."""

    def __init__(self, pool, windows=None, invariant: bool = False) -> None:
        super().__init__(pool, windows)
        self.invariant = invariant

    def plan(self, meta: AttentionMetadata) -> TritonPlan:
        usable = not self.invariant and any(w is None or w >= meta.max_kv_len
                                            for w in self.windows)
        return TritonPlan(meta.max_q_len, meta.max_kv_len,
                          _shared_prefix_plan(meta) if usable else None)

    def graph_plan(self, batch_size: int, max_kv_len: int) -> TritonPlan:
        # Decode only, launch sizes fixed for every replay (split-KV sized for the longest
        # context), no shared-prefix path: its grouping changes every step.
        return TritonPlan(1, max_kv_len)

    def forward(self, q, k, v, layer, meta, scale, softcap=None):
        k_pool, v_pool = self.pool.k(layer), self.pool.v(layer)
        store_kv(k, v, k_pool, v_pool, meta.out_slots)
        out = torch.empty_like(q)
        plan: TritonPlan = meta.plan
        window = self.windows[layer]
        if window is not None and window >= plan.max_kv_len:
            window = None  # cuts nothing this step
        shared = plan.shared
        if shared is None or window is not None:
            paged_attention(q, k_pool, v_pool, out, meta.qo_indptr, meta.kv_indptr,
                            meta.kv_indices, sm_scale=scale, max_q_len=plan.max_q_len,
                            max_kv_len=plan.max_kv_len, window=window, softcap=softcap,
                            invariant=self.invariant)
            return out
        grouped_q = q if shared.perm is None else q.index_select(0, shared.perm)
        grouped_out = out if shared.perm is None else torch.empty_like(q)
        shared_prefix_attention(
            grouped_q, k_pool, v_pool, grouped_out, shared.group_indptr, shared.prefix_indptr,
            shared.prefix_indices, shared.suffix_indptr, shared.suffix_indices, sm_scale=scale,
            max_group_size=shared.max_group_size, max_prefix_len=shared.max_prefix_len,
            max_suffix_len=shared.max_suffix_len, softcap=softcap)
        if shared.perm is not None:
            out.index_copy_(0, shared.perm, grouped_out)
        return out


def _shared_prefix_plan(meta: AttentionMetadata) -> _SharedPrefixPlan | None:
    """The shared-prefix arguments of a decode-only step in which some group has >= 2 requests
    with a shared prefix; None otherwise (the plain kernel then serves the step)."""
    if not meta.shared_lens or meta.max_q_len != 1:
        return None
    sharing: dict[str, list[int]] = {}
    for b, (group, shared) in enumerate(zip(meta.groups, meta.shared_lens)):
        if shared:
            sharing.setdefault(group, []).append(b)
    shared_groups = [m for m in sharing.values() if len(m) > 1]
    if not shared_groups:
        return None
    grouped = {b for m in shared_groups for b in m}
    members = shared_groups + [[b] for b in range(len(meta.kv_lens)) if b not in grouped]
    kv_starts = [0, *accumulate(meta.kv_lens)]
    # A lone request reads all but its new token through the prefix launch, which splits long
    # contexts across programs (split-KV); the suffix launch never splits.
    prefix_lens = [meta.shared_lens[m[0]] if len(m) > 1 else meta.kv_lens[m[0]] - 1
                   for m in members]
    perm = [b for m in members for b in m]
    suffix_lens, suffix_starts = [], []
    for m, p in zip(members, prefix_lens):
        for b in m:
            suffix_starts.append(kv_starts[b] + p)
            suffix_lens.append(meta.kv_lens[b] - p)
    device = meta.kv_indices.device
    prefix_pos = ranges([kv_starts[m[0]] for m in members], prefix_lens, device)
    suffix_pos = ranges(suffix_starts, suffix_lens, device)
    return _SharedPrefixPlan(
        perm=None if perm == list(range(len(perm))) else torch.tensor(perm, device=device),
        group_indptr=indptr([len(m) for m in members], device),
        prefix_indptr=indptr(prefix_lens, device),
        prefix_indices=meta.kv_indices[prefix_pos],
        suffix_indptr=indptr(suffix_lens, device),
        suffix_indices=meta.kv_indices[suffix_pos],
        max_group_size=max(map(len, members)), max_prefix_len=max(prefix_lens),
        max_suffix_len=max(suffix_lens))
