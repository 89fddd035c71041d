"""The attention backend interface and the torch reference backend.

Every step runs the model once over a flat batch described by `AttentionMetadata` (the format
of DESIGN.md): request b computes queries `qo_indptr[b]:qo_indptr[b+1]` of the flat token axis
and attends to the pool slots `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`, its whole context in
position order with the new tokens last. Query i of a request sees context positions
j <= i + kv_len - q_len. The same format serves prefill, chunked prefill, decode and verify.

A layer with a sliding window W (the model's KV layout, given to the backend) sees only the W
latest of those: j > i + kv_len - q_len - W. Its K/V stay in the pool all the same (the radix
tree and the slot table keep every slot; the global layers of the same tokens need them), the
backend just masks what lies outside the window.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F

from . import shared_prefix_attention
from .attention_metadata import AttentionMetadata
from .kv_pool import KVPool
from .native import paged_attention as native_attention
from .shared_prefix_attention import SharedPrefix, plan_shared, sharing_groups


class AttentionBackend(ABC):
    def __init__(self, pool: KVPool, windows: Sequence[int | None] | None = None) -> None:
        """`windows`: each layer's sliding window (None: global), the model's
        KVLayout.windows; omitted, every layer is global."""
        self.pool = pool
        self.windows = tuple(windows) if windows is not None else (None,) * pool.num_layers
        if len(self.windows) != pool.num_layers:
            raise ValueError(f"windows: {len(self.windows)} for {pool.num_layers} layers")

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> Any:
        """Work done once per step for all layers (index maps, masks, split sizes)."""

    def graph_plan(self, batch_size: int, max_kv_len: int) -> Any:
        """The plan of a decode step captured in a CUDA graph: fixed for every replay, so it may
        depend on nothing but the bucket's batch size and the longest context allowed."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in CUDA graphs")

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: AttentionMetadata, scale: float,
                softcap: float | None = None) -> torch.Tensor:
        """Store k/v [T, Hkv, D] at meta.out_slots, attend q [T, Hq, D]; returns [T, Hq, D].
        `softcap`: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2)."""

    def distinct_windows(self) -> list[int]:
        return sorted({w for w in self.windows if w is not None})


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
    native: native_attention.NativeRows | None = None  # rows the C kernel serves
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
    outputs merge exactly by their log-sum-exp (as kernels/shared_prefix.py does on GPU).
    Slots that begin every group's prefix (a system prompt the radix tree holds once for all
    prompts) form one more tile, for all the groups' queries at once, read in place from the
    pool when they are consecutive slots.

    Sliding-window layers get a plan of their own when the window cuts into some request's
    context: those requests take the plain path with the window in their mask (the shared
    prefix would not be seen whole); requests whose context fits in the window keep the
    shared-prefix path. Soft-capped scores (Gemma 2) are computed with matmuls in fp32: SDPA
    has no soft-capping.

    `native` (fp32 on the CPU, where rollout/native could build its C kernel): decode and
    verify rows, and extend chunks over a context at least twice their length (later turns),
    skip all of the above and attend in one call per layer that reads the pool in place
    (consecutive requests with leading slots in common, siblings or a shared system prompt,
    read them once for all their rows; an extend chunk's queries its context once for all);
    prefills keep the padded SDPA path (`native_attention.serves`)."""

    def __init__(self, pool: KVPool, windows: Sequence[int | None] | None = None,
                 native: bool = False) -> None:
        super().__init__(pool, windows)
        self.native = native and native_attention.supported(pool.device, pool.dtype)

    def plan(self, meta: AttentionMetadata) -> _Plan:
        windows = self.distinct_windows()
        # The plan without a window serves global layers and windows that cut nothing; a model
        # whose every layer has a window that cuts (Mistral past its window) needs none.
        unwindowed = None in self.windows or any(meta.max_kv_len <= w for w in windows)
        # The kernel applies each layer's window itself: one set of its rows serves every plan.
        native = self._native_rows(meta) if self.native else None
        full = self._plan(meta, None, native) if unwindowed else _Plan(segments=[], shared=None)
        for window in windows:
            cut = meta.max_kv_len > window
            full.by_window[window] = self._plan(meta, window, native) if cut else full
        return full

    @staticmethod
    def _native_rows(meta: AttentionMetadata) -> native_attention.NativeRows | None:
        rows = [b for b, (q, kv) in enumerate(zip(meta.q_lens, meta.kv_lens))
                if native_attention.serves(q, kv)]
        if not rows:
            return None
        return native_attention.NativeRows.of(
            rows, [0, *accumulate(meta.q_lens)], meta.q_lens, [0, *accumulate(meta.kv_lens)],
            meta.kv_lens, meta.kv_indices)

    def _plan(self, meta: AttentionMetadata, window: int | None,
              native: native_attention.NativeRows | None) -> _Plan:
        device = meta.kv_indices.device
        if self.native:  # decode, verify and extend rows over a context are the kernel's
            members, common = [], 0
            taken = set(native.rows) if native is not None else set()
        else:
            members, common = sharing_groups(meta, window)
            taken = {b for m in members for b in m}
        q_lens = torch.tensor(meta.q_lens)
        kv_lens = torch.tensor(meta.kv_lens)
        q_start = torch.tensor([0, *accumulate(meta.q_lens)][:-1])
        kv_start = torch.tensor([0, *accumulate(meta.kv_lens)][:-1])
        segments = []
        plain = torch.tensor([b not in taken for b in range(len(meta.q_lens))], dtype=torch.bool)
        decode = q_lens == 1
        for rows in ((decode & plain).nonzero().flatten(), (~decode & plain).nonzero().flatten()):
            if rows.numel():
                segments.append(self._segment(rows, q_lens, kv_lens, q_start, kv_start,
                                              meta.kv_indices, device, window))
        return _Plan(segments,
                     plan_shared(meta, members, common, self.pool) if members else None, native)

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
        if plan.native is not None:  # it stores the step's K/V before it reads any
            native_attention.paged_attention(q, k_pool, v_pool, out, plan.native, scale, window,
                                             softcap, store=(k, v, meta.out_slots))
        else:
            k_pool.index_copy_(0, meta.out_slots, k)
            v_pool.index_copy_(0, meta.out_slots, v)
        for seg in plan.segments:
            qs = _gather(q, seg.q_index)
            ks, vs = _gather(k_pool, seg.kv_slots), _gather(v_pool, seg.kv_slots)
            o = _masked_attention(qs, ks, vs, seg.mask, scale, softcap)
            out[seg.q_flat] = o.transpose(1, 2)[seg.q_valid]
        if plan.shared is not None:
            shared_prefix_attention.attend_shared(q, k_pool, v_pool, plan.shared, out, scale,
                                                  softcap)
        return out

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
