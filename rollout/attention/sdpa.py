"""The torch reference attention backend: gather by kv_indices, pad, SDPA with a mask; samples
that share a prompt take the shared-prefix split (shared_prefix.py). The CPU backend
(cpu.py) is this one with decode, verify and later-turn rows handed to a C kernel."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F

from ..ops.host_lists import host_tensor
from . import shared_prefix
from .base import AttentionBackend
from .metadata import AttentionMetadata
from .shared_prefix import SharedPrefix, plan_shared, sharing_groups


@dataclass
class _Segment:
    """Requests padded together: q_index [b, mq] into the flat axis, kv_slots [b, mk]."""

    q_index: torch.Tensor
    q_valid: torch.Tensor
    q_flat: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor  # bool [b, 1, mq, mk]


@dataclass
class _Plan:
    segments: list[_Segment]  # the plain path: requests outside any sharing group
    shared: SharedPrefix | None
    kernel: Any = None  # the rows a kernel serves in one call per layer (cpu.py), or None
    # The plan of the layers with each sliding window (this same plan where the window cuts no
    # request's context).
    by_window: dict[int, _Plan] = field(default_factory=dict)


class TorchAttention(AttentionBackend):
    """Gather by kv_indices, pad, one SDPA with a mask. Decode rows (one query) and longer
    rows are padded separately so a prefill does not pad every decode to its length.

    Samples of one prompt that decode (or verify) side by side share the prompt's slots
    (`meta.shared_lens`): gathering them once per sample per step would copy the prompt's K/V
    n times a step. Those requests take the shared-prefix split instead: per group, the prefix
    K/V is gathered once and all the group's queries attend to it in one batched call (the
    queries of a KV head's query heads stacked as rows, so GQA needs no repeated K/V); each
    request's private suffix is gathered and attended on its own; the normalised partial
    outputs merge exactly by their log-sum-exp (as kernels/triton/shared_prefix.py does on GPU).
    Slots that begin every group's prefix (a system prompt the radix tree holds once for all
    prompts) form one more tile, for all the groups' queries at once, read in place from the
    pool when they are consecutive slots.

    Sliding-window layers get a plan of their own when the window cuts into some request's
    context: those requests take the plain path with the window in their mask (the shared
    prefix would not be seen whole); requests whose context fits in the window keep the
    shared-prefix path. Soft-capped scores (Gemma 2) are computed with matmuls in fp32: SDPA
    has no soft-capping."""

    def plan(self, meta: AttentionMetadata) -> _Plan:
        windows = self.distinct_windows()
        # The plan without a window serves global layers and windows that cut nothing; a model
        # whose every layer has a window that cuts (Mistral past its window) needs none.
        unwindowed = None in self.windows or any(meta.max_kv_len <= w for w in windows)
        # A kernel applies each layer's window itself: one set of its rows serves every plan.
        kernel = self._kernel_rows(meta)
        full = self._plan(meta, None, kernel) if unwindowed else _Plan(segments=[], shared=None)
        for window in windows:
            cut = meta.max_kv_len > window
            full.by_window[window] = self._plan(meta, window, kernel) if cut else full
        return full

    def _kernel_rows(self, meta: AttentionMetadata) -> Any:
        """The requests a kernel attends for in one call per layer (none here: cpu.py)."""
        return None

    def _sharing(self, meta: AttentionMetadata, window: int | None, kernel: Any
                 ) -> tuple[list[list[int]], int, set[int]]:
        """(sharing groups, the slots all of them share, the requests taken off the plain
        path): the shared-prefix split's groups here."""
        members, common = sharing_groups(meta, window)
        return members, common, {b for m in members for b in m}

    def _plan(self, meta: AttentionMetadata, window: int | None, kernel: Any) -> _Plan:
        device = meta.kv_indices.device
        members, common, taken = self._sharing(meta, window, kernel)
        segments = []
        plain = [b for b in range(len(meta.q_lens)) if b not in taken]
        if plain:  # (a step the kernel or the sharing groups take whole builds nothing here)
            q_lens = host_tensor(meta.q_lens, torch.int64)
            kv_lens = host_tensor(meta.kv_lens, torch.int64)
            q_start = host_tensor([0, *accumulate(meta.q_lens)][:-1], torch.int64)
            kv_start = host_tensor([0, *accumulate(meta.kv_lens)][:-1], torch.int64)
            decode = [b for b in plain if meta.q_lens[b] == 1]
            longer = [b for b in plain if meta.q_lens[b] != 1]
            for rows in (decode, longer):
                if rows:
                    segments.append(self._segment(host_tensor(rows, torch.int64), q_lens,
                                                  kv_lens, q_start, kv_start, meta.kv_indices,
                                                  device, window))
        return _Plan(segments,
                     plan_shared(meta, members, common, self.pool) if members else None, kernel)

    @staticmethod
    def _segment(rows, q_lens, kv_lens, q_start, kv_start, kv_indices, device,
                 window: int | None = None) -> _Segment:
        ql, kl = q_lens[rows], kv_lens[rows]
        mq, mk = int(ql.max()), int(kl.max())
        qi, kj = torch.arange(mq), torch.arange(mk)
        # Padding points at the row's own last query / context token: a masked position
        # still multiplies its value by 0, and 0 * NaN from a stranger's slot would leak.
        q_valid = qi[None, :] < ql[:, None]
        q_index = q_start[rows][:, None] + torch.minimum(qi[None, :], ql[:, None] - 1)
        kv_valid = kj[None, :] < kl[:, None]
        kv_pos = kv_start[rows][:, None] + torch.minimum(kj[None, :], kl[:, None] - 1)
        q_pos = qi[None, :, None] + (kl - ql)[:, None, None]  # each query's position
        mask = kv_valid[:, None, :] & (kj[None, None, :] <= q_pos)
        if window is not None:
            mask &= kj[None, None, :] > q_pos - window
        mask[:, :, 0] |= ~q_valid  # padded query rows attend somewhere, so no NaN
        q_index = q_index.to(device)
        q_valid = q_valid.to(device)
        return _Segment(q_index=q_index, q_valid=q_valid, q_flat=q_index[q_valid],
                        kv_slots=kv_indices[kv_pos.to(device)],
                        mask=mask[:, None].to(device))

    def forward(self, q, k, v, layer, meta, scale, softcap=None):
        k_pool, v_pool = self.pool.k(layer), self.pool.v(layer)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        plan = meta.plan
        window = self.windows[layer]
        if window is not None:
            plan = plan.by_window[window]
        if plan.kernel is not None:  # it stores the step's K/V before it reads any
            self._attend_kernel_rows(q, k, v, k_pool, v_pool, out, plan.kernel, meta, scale,
                                     window, softcap)
        else:
            k_pool.index_copy_(0, meta.out_slots, k)
            v_pool.index_copy_(0, meta.out_slots, v)
        for seg in plan.segments:
            qs = _gather(q, seg.q_index)
            ks, vs = _gather(k_pool, seg.kv_slots), _gather(v_pool, seg.kv_slots)
            o = _masked_attention(qs, ks, vs, seg.mask, scale, softcap)
            out[seg.q_flat] = o.transpose(1, 2)[seg.q_valid]
        if plan.shared is not None:
            shared_prefix.attend_shared(q, k_pool, v_pool, plan.shared, out, scale, softcap)
        return out

    def _attend_kernel_rows(self, q, k, v, k_pool, v_pool, out, rows, meta, scale, window,
                            softcap) -> None:
        raise NotImplementedError  # only a backend whose _kernel_rows returns rows has some

def _masked_attention(q, k, v, mask, scale, softcap):
    """SDPA with a boolean mask; with soft-capping, the same in fp32 with matmuls. q [b, Hq, m,
    D], k/v [b, Hkv, n, D]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    s = torch.tanh(s / softcap).mul_(softcap).masked_fill_(~mask, float("-inf"))
    return torch.matmul(s.softmax(dim=-1), v.float()).to(q.dtype)


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [N, H, D] at index [b, m] -> [b, H, m, D] (index_select is ~2x faster on CPU than
    advanced indexing)."""
    b, m = index.shape
    return rows.index_select(0, index.flatten()).view(b, m, *rows.shape[1:]).transpose(1, 2)
