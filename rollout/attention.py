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

from .kv_pool import KVPool


@dataclass
class AttentionMetadata:
    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int64 [sum kv_len]
    out_slots: torch.Tensor  # int64 [T]: where the new tokens' K/V go
    q_lens: list[int]
    kv_lens: list[int]
    # Per request, on the host: its sample group, and how many leading context slots it holds
    # in common with every other request of that group (the cached prompt; 0 = none known).
    # Backends that read a group's shared K/V once use these; empty lists mean no grouping.
    groups: list[str] = field(default_factory=list)
    shared_lens: list[int] = field(default_factory=list)
    plan: Any = field(default=None)  # the backend's per-step precomputation, shared by layers

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens)


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


def indptr(lens: list[int], device) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as int32 on `device`."""
    return torch.tensor([0, *accumulate(lens)], dtype=torch.int32, device=device)


def ranges(starts: list[int], lens: list[int], device) -> torch.Tensor:
    """arange(s, s + n) for each (s, n), concatenated; built on `device` from O(B) host data
    (output_size keeps repeat_interleave from reading the total back)."""
    total = sum(lens)
    lens_t = torch.tensor(lens, device=device)
    offsets = lens_t.cumsum(0) - lens_t  # where each range begins in the output
    shift = torch.tensor(starts, device=device) - offsets
    return torch.arange(total, device=device) + torch.repeat_interleave(shift, lens_t,
                                                                        output_size=total)


@dataclass
class _Segment:
    """Requests padded together: q_index [b, mq] into the flat axis, kv_slots [b, mk]."""

    q_index: torch.Tensor
    q_valid: torch.Tensor
    q_flat: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor  # bool [b, 1, mq, mk]


# Rows that take the shared-prefix path: decode (1 query) and verify (k + 1 <= 17 queries).
# A longer extend chunk keeps the plain path: its queries would pad every group's prefix tile.
MAX_SHARED_Q_LEN = 17
# Slots that begin every sharing group's prefix (a system prompt the radix tree holds once for
# all prompts) get one tile of their own, for all the groups' queries, when at least this many.
MIN_COMMON_LEN = 16


@dataclass
class _Part:
    """Tiles of the shared-prefix split, in GQA-packed layout: tile i holds the queries at flat
    indices q_index[i] (each repeated over the Hq / Hkv query heads of a KV head, query-major)
    against the keys at kv_slots[i]. `bias` [b, 1, mq * rep | 1, mk] is 0 where a query sees a
    key and -inf elsewhere (None: every query sees every key)."""

    q_index: torch.Tensor  # [b, mq] flat token indices (padding repeats a valid one)
    kv_slots: torch.Tensor  # [b, mk] pool slots (padding repeats a valid one)
    kv_start: int | None  # one tile of consecutive slots: keys are a view of the pool, no copy
    bias: torch.Tensor | None
    k_buf: torch.Tensor | None  # [b * mk, Hkv, D]: gather buffers reused by every layer
    v_buf: torch.Tensor | None


@dataclass
class _Suffix:
    """Requests' private context after their group's prefix; their valid queries (q_valid
    order, = q_flat) and, per prefix part, which of them it covers (None: all) and the rows of
    its [b * mq] query rows that hold them."""

    part: _Part
    q_valid: torch.Tensor | None  # bool [b, mq]; None: all valid (decode)
    q_flat: torch.Tensor
    prefix_rows: list[tuple[torch.Tensor | None, torch.Tensor]]


@dataclass
class _SharedPrefix:
    """Groups of >= 2 requests holding the same first shared_len slots: their queries attend
    to the prefix in tiles of all a group's queries (and of all groups' queries for the run of
    slots every group's prefix begins with), each request to its own suffix, and the partial
    results merge by log-sum-exp."""

    prefixes: list[_Part]  # the common run (if any), then each group's own prefix
    suffixes: list[_Suffix]


@dataclass
class _Plan:
    segments: list[_Segment]  # the plain path: requests outside any sharing group
    shared: _SharedPrefix | None
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
    has no soft-capping."""

    def plan(self, meta: AttentionMetadata) -> _Plan:
        windows = self.distinct_windows()
        # The plan without a window serves global layers and windows that cut nothing; a model
        # whose every layer has a window that cuts (Mistral past its window) needs none.
        unwindowed = None in self.windows or any(meta.max_kv_len <= w for w in windows)
        full = self._plan(meta, None) if unwindowed else _Plan(segments=[], shared=None)
        for window in windows:
            cut = meta.max_kv_len > window
            full.by_window[window] = self._plan(meta, window) if cut else full
        return full

    def _plan(self, meta: AttentionMetadata, window: int | None) -> _Plan:
        device = meta.kv_indices.device
        members = _sharing_groups(meta, window)
        shared = {b for m in members for b in m}
        q_lens = torch.tensor(meta.q_lens)
        kv_lens = torch.tensor(meta.kv_lens)
        q_start = torch.tensor([0, *accumulate(meta.q_lens)][:-1])
        kv_start = torch.tensor([0, *accumulate(meta.kv_lens)][:-1])
        segments = []
        plain = torch.tensor([b not in shared for b in range(len(meta.q_lens))], dtype=torch.bool)
        decode = q_lens == 1
        for rows in ((decode & plain).nonzero().flatten(), (~decode & plain).nonzero().flatten()):
            if rows.numel():
                segments.append(self._segment(rows, q_lens, kv_lens, q_start, kv_start,
                                              meta.kv_indices, device, window))
        return _Plan(segments, self._shared_plan(meta, members) if members else None)

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

    def _shared_plan(self, meta: AttentionMetadata, members: list[list[int]]) -> _SharedPrefix:
        device = meta.kv_indices.device
        q_starts = [0, *accumulate(meta.q_lens)]
        kv_starts = [0, *accumulate(meta.kv_lens)]
        group_q = [[t for b in m for t in range(q_starts[b], q_starts[b + 1])] for m in members]
        prefix_lens = [meta.shared_lens[m[0]] for m in members]
        firsts = [kv_starts[m[0]] for m in members]
        common = _common_len(meta.kv_indices, firsts, prefix_lens)
        common = common if common >= MIN_COMMON_LEN else 0
        prefixes, rows = [], []  # rows[i]: flat token -> its row among prefixes[i]'s queries
        if common:
            tokens = [t for qs in group_q for t in qs]
            kv_pos = torch.arange(firsts[0], firsts[0] + common)[None]
            prefixes.append(self._part(torch.tensor([tokens]), kv_pos, None, meta, device))
            rows.append({t: i for i, t in enumerate(tokens)})
        own = [g for g, p in enumerate(prefix_lens) if p > common]
        if own:
            # One tile per group, holding its requests' queries in batch order.
            own_q = [group_q[g] for g in own]
            mq = max(map(len, own_q))
            q_index = torch.tensor([qs + [qs[-1]] * (mq - len(qs)) for qs in own_q])
            lens = torch.tensor([prefix_lens[g] - common for g in own])
            mk = int(lens.max())
            kv_pos = _padded_ranges(torch.tensor([firsts[g] + common for g in own]), lens, mk)
            bias = None
            if int(lens.min()) < mk:
                bias = self._bias((torch.arange(mk)[None, :] < lens[:, None])[:, None, None],
                                  device)
            prefixes.append(self._part(q_index, kv_pos, bias, meta, device))
            rows.append({t: i * mq + j for i, qs in enumerate(own_q) for j, t in enumerate(qs)})
        shared_rows = [b for m in members for b in m]
        suffixes = []
        for part_rows in ([b for b in shared_rows if meta.q_lens[b] == 1],
                          [b for b in shared_rows if meta.q_lens[b] > 1]):
            if part_rows:
                suffixes.append(self._suffix(part_rows, meta, q_starts, kv_starts, rows,
                                             device))
        return _SharedPrefix(prefixes=prefixes, suffixes=suffixes)

    def _suffix(self, rows, meta, q_starts, kv_starts, prefix_rows, device) -> _Suffix:
        """Each request's context after its prefix, its new tokens last (so >= q_len long)."""
        ql = torch.tensor([meta.q_lens[b] for b in rows])
        skip = torch.tensor([meta.shared_lens[b] for b in rows])
        kl = torch.tensor([meta.kv_lens[b] for b in rows]) - skip
        mq, mk = int(ql.max()), int(kl.max())
        q_index = _padded_ranges(torch.tensor([q_starts[b] for b in rows]), ql, mq)
        kv_pos = _padded_ranges(torch.tensor([kv_starts[b] for b in rows]) + skip, kl, mk)
        q_flat = [q_starts[b] + i for b in rows for i in range(meta.q_lens[b])]
        bias, q_valid = None, None
        if mq > 1 or int(kl.min()) < mk:
            qi, kj = torch.arange(mq), torch.arange(mk)
            valid = (kj[None, None, :] < kl[:, None, None]) & (
                kj[None, None, :] <= qi[None, :, None] + (kl - ql)[:, None, None])
            if mq > 1:
                q_valid = qi[None, :] < ql[:, None]
                valid[:, :, 0] |= ~q_valid  # padded query rows attend somewhere, so no NaN
            bias = self._bias(valid[:, None], device)
        covered = []
        for row_of in prefix_rows:
            sel = [j for j, t in enumerate(q_flat) if t in row_of]
            covered.append((None if len(sel) == len(q_flat) else torch.tensor(sel, device=device),
                            torch.tensor([row_of[q_flat[j]] for j in sel], device=device)))
        return _Suffix(part=self._part(q_index, kv_pos, bias, meta, device),
                       q_valid=None if q_valid is None else q_valid.to(device),
                       q_flat=torch.tensor(q_flat, device=device), prefix_rows=covered)

    def _bias(self, valid: torch.Tensor, device) -> torch.Tensor:
        """Additive mask (0 / -inf) in the pool's dtype, as the fused CPU kernel wants it."""
        bias = torch.zeros(valid.shape, dtype=self.pool.dtype)
        return bias.masked_fill_(~valid, float("-inf")).to(device)

    def _part(self, q_index, kv_pos, bias, meta, device) -> _Part:
        kv_slots = meta.kv_indices[kv_pos.to(device)]
        kv_start = None
        if kv_slots.shape[0] == 1:
            first = int(kv_slots[0, 0])
            if torch.equal(kv_slots[0], torch.arange(first, first + kv_slots.shape[1],
                                                     device=device)):
                kv_start = first
        k_buf = v_buf = None
        if kv_start is None:
            # Gather buffers allocated once a step: a fresh multi-MB tensor per layer costs its
            # page faults every time on the CPU.
            shape = (kv_slots.numel(), self.pool.kv_heads, self.pool.head_dim)
            k_buf = torch.empty(shape, dtype=self.pool.dtype, device=device)
            v_buf = torch.empty(shape, dtype=self.pool.dtype, device=device)
        return _Part(q_index=q_index.to(device), kv_slots=kv_slots, kv_start=kv_start,
                     bias=bias, k_buf=k_buf, v_buf=v_buf)

    def forward(self, q, k, v, layer, meta, scale, softcap=None):
        k_pool, v_pool = self.pool.k(layer), self.pool.v(layer)
        k_pool.index_copy_(0, meta.out_slots, k)
        v_pool.index_copy_(0, meta.out_slots, v)
        out = torch.empty_like(q)
        plan = meta.plan
        window = self.windows[layer]
        if window is not None:
            plan = plan.by_window[window]
        for seg in plan.segments:
            qs = _gather(q, seg.q_index)
            ks, vs = _gather(k_pool, seg.kv_slots), _gather(v_pool, seg.kv_slots)
            o = _masked_attention(qs, ks, vs, seg.mask, scale, softcap)
            out[seg.q_flat] = o.transpose(1, 2)[seg.q_valid]
        if plan.shared is not None:
            if softcap is None:  # the call tests count (and replace) with six arguments
                self._shared_forward(q, k_pool, v_pool, plan.shared, out, scale)
            else:
                self._shared_forward(q, k_pool, v_pool, plan.shared, out, scale, softcap)
        return out

    @staticmethod
    def _shared_forward(q, k_pool, v_pool, plan: _SharedPrefix, out, scale,
                        softcap=None) -> None:
        prefixes = []
        for part in plan.prefixes:
            o, lse = _attend_part(q, k_pool, v_pool, part, scale, softcap)
            prefixes.append((o.flatten(0, 1), lse.flatten(0, 1)))  # [b * mq, Hq(, D)]
        for suf in plan.suffixes:
            o, lse = _attend_part(q, k_pool, v_pool, suf.part, scale, softcap)
            if suf.q_valid is None:
                o, lse = o.flatten(0, 1), lse.flatten(0, 1)
            else:
                o, lse = o[suf.q_valid], lse[suf.q_valid]
            o = o.float()
            for (o_pre, lse_pre), (sel, row) in zip(prefixes, suf.prefix_rows):
                o_p, lse_p = o_pre.index_select(0, row).float(), lse_pre.index_select(0, row)
                if sel is None:
                    o, lse = _merge(o, lse, o_p, lse_p)
                else:
                    o_m, lse_m = _merge(o[sel], lse[sel], o_p, lse_p)
                    o, lse = o.index_copy(0, sel, o_m), lse.index_copy(0, sel, lse_m)
            out.index_copy_(0, suf.q_flat, o.to(out.dtype))


def _merge(o_a, lse_a, o_b, lse_b):
    """Attention over the union of two disjoint key sets from the normalised outputs and
    log-sum-exps over each: (exp(a) o_a + exp(b) o_b) / (exp(a) + exp(b)), written so that
    nothing overflows."""
    w = torch.sigmoid(lse_b - lse_a).unsqueeze(-1)
    return torch.addcmul(o_a, w, o_b - o_a), torch.logaddexp(lse_a, lse_b)


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


def _attend_part(q, k_pool, v_pool, part: _Part, scale, softcap=None):
    """Attention of one _Part: (out [b, mq, Hq, D] in q's dtype or fp32, lse [b, mq, Hq] fp32),
    the output normalised over the part's keys alone."""
    b, mq = part.q_index.shape
    mk = part.kv_slots.shape[1]
    hq, d = q.shape[1], q.shape[2]
    hkv = k_pool.shape[1]
    rep = hq // hkv
    # [b, mq, Hkv, rep, D] -> [b, Hkv, mq * rep, D]: a KV head's queries as the rows of a tile.
    qs = q.index_select(0, part.q_index.flatten()).view(b, mq, hkv, rep, d)
    qs = qs.transpose(1, 2).reshape(b, hkv, mq * rep, d)
    if part.kv_start is not None:
        ks = k_pool[part.kv_start:part.kv_start + mk]
        vs = v_pool[part.kv_start:part.kv_start + mk]
    else:
        slots = part.kv_slots.flatten()
        ks = torch.index_select(k_pool, 0, slots, out=part.k_buf)
        vs = torch.index_select(v_pool, 0, slots, out=part.v_buf)
    ks, vs = ks.view(b, mk, hkv, d).transpose(1, 2), vs.view(b, mk, hkv, d).transpose(1, 2)
    bias = part.bias
    if bias is not None and rep > 1 and bias.shape[2] > 1:
        bias = bias.repeat_interleave(rep, dim=2)  # query-major rows: each query rep times
    o, lse = _attention_with_lse(qs, ks, vs, bias, scale, softcap)
    # [b, Hkv, mq, rep, (D)] -> [b, mq, Hkv * rep, (D)]
    o = o.reshape(b, hkv, mq, rep, d).transpose(1, 2).reshape(b, mq, hq, d)
    lse = lse.reshape(b, hkv, mq, rep).transpose(1, 2).reshape(b, mq, hq)
    return o, lse


# The kernel SDPA itself runs on the CPU, reached directly because it also returns the lse.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attention_with_lse(q, k, v, bias, scale, softcap=None):
    """softmax(q k^T * scale + bias) v and the rows' natural log-sum-exp; q [b, h, m, D],
    k/v [b, h, n, D]. On CPU the fused flash kernel (which returns the lse); elsewhere, and
    with soft-capping, in fp32 with matmuls."""
    if q.device.type == "cpu" and _CPU_FLASH is not None and softcap is None:
        return _CPU_FLASH(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    return _attention_with_lse_matmul(q, k, v, bias, scale, softcap)


def _attention_with_lse_matmul(q, k, v, bias, scale, softcap=None):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if softcap is not None:
        s = torch.tanh(s / softcap).mul_(softcap)
    if bias is not None:
        s = s + bias.float()
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()), lse


def _padded_ranges(starts: torch.Tensor, lens: torch.Tensor, width: int) -> torch.Tensor:
    """[b, width]: starts[i] + j, with j past lens[i] - 1 repeating the range's last index
    (padding must read a slot of its own row: 0 * NaN from a stranger's would leak)."""
    return starts[:, None] + torch.minimum(torch.arange(width)[None, :], lens[:, None] - 1)


def _common_len(kv_indices: torch.Tensor, firsts: list[int], prefix_lens: list[int]) -> int:
    """How many leading slots every group's prefix holds in common (0 for a single group):
    firsts[g] is where group g's context begins in kv_indices."""
    if len(firsts) < 2:
        return 0
    span = min(prefix_lens)
    slots = kv_indices[ranges(firsts, [span] * len(firsts), kv_indices.device)].view(-1, span)
    same = (slots == slots[:1]).all(0)
    return span if bool(same.all()) else int(same.int().argmin())


def _sharing_groups(meta: AttentionMetadata, window: int | None = None) -> list[list[int]]:
    """Requests of each group that hold >= 2 members with the same shared prefix, in batch
    order; only decode and verify rows (q_len <= MAX_SHARED_Q_LEN) whose queries all come
    after the prefix and see every prefix position (a sliding window that cuts into the
    context rules a row out)."""
    if not meta.shared_lens:
        return []
    sharing: dict[tuple[str, int], list[int]] = {}
    for b, (group, shared) in enumerate(zip(meta.groups, meta.shared_lens)):
        q_len, kv_len = meta.q_lens[b], meta.kv_lens[b]
        fits = window is None or kv_len <= window
        if shared and q_len <= MAX_SHARED_Q_LEN and shared <= kv_len - q_len and fits:
            sharing.setdefault((group, shared), []).append(b)
    return [m for m in sharing.values() if len(m) > 1]


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [N, H, D] at index [b, m] -> [b, H, m, D] (index_select is ~2x faster on CPU than
    advanced indexing)."""
    b, m = index.shape
    return rows.index_select(0, index.flatten()).view(b, m, *rows.shape[1:]).transpose(1, 2)
