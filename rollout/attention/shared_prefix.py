"""The torch backend's shared-prefix split (see TorchAttention): samples of one prompt that
decode or verify side by side attend to the prompt's slots once per group, and to a prefix
every group begins with once for all, then each to its private suffix; the partial outputs
merge exactly by their log-sum-exp (as kernels/triton/shared_prefix.py does on GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from ..kv.pool import KVPool
from .metadata import AttentionMetadata, ranges

# Rows that take the shared-prefix path: decode (1 query) and verify (k + 1 <= 17 queries).
# A longer extend chunk keeps the plain path: its queries would pad every group's prefix tile.
MAX_SHARED_Q_LEN = 17
# Slots that begin every sharing group's prefix (a system prompt the radix tree holds once for
# all prompts) get one tile of their own, for all the groups' queries, when at least this many.
MIN_COMMON_LEN = 16


@dataclass
class Part:
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
class Suffix:
    """Requests' private context after their group's prefix; their valid queries (q_valid
    order, = q_flat) and, per prefix part, which of them it covers (None: all) and the rows of
    its [b * mq] query rows that hold them."""

    part: Part
    q_valid: torch.Tensor | None  # bool [b, mq]; None: all valid (decode)
    q_flat: torch.Tensor
    prefix_rows: list[tuple[torch.Tensor | None, torch.Tensor] | None]  # None: covers none


@dataclass
class SharedPrefix:
    """Groups of >= 2 requests holding the same first shared_len slots: their queries attend
    to the prefix in tiles of all a group's queries (and of all groups' queries for the run of
    slots every group's prefix begins with), each request to its own suffix, and the partial
    results merge by log-sum-exp."""

    prefixes: list[Part]  # the common run (if any), then each group's own prefix
    suffixes: list[Suffix]


def plan_shared(meta: AttentionMetadata, members: list[list[int]], common: int,
                pool: KVPool) -> SharedPrefix:
    """The shared-prefix split of these requests and their common run (`sharing_groups`)."""
    device = meta.kv_indices.device
    q_starts = [0, *accumulate(meta.q_lens)]
    kv_starts = [0, *accumulate(meta.kv_lens)]
    group_q = [[t for b in m for t in range(q_starts[b], q_starts[b + 1])] for m in members]
    firsts = [kv_starts[m[0]] for m in members]
    # A request alone in its group shares only the common run: the rest of its prompt is as
    # private as its suffix, so it is read with the suffix (one tile fewer, one merge fewer).
    prefix_lens = [meta.shared_lens[m[0]] if len(m) > 1 else common for m in members]
    skip = {b: p for m, p in zip(members, prefix_lens) for b in m}
    prefixes, rows = [], []  # rows[i]: flat token -> its row among prefixes[i]'s queries
    if common:
        tokens = [t for qs in group_q for t in qs]
        kv_pos = torch.arange(firsts[0], firsts[0] + common)[None]
        prefixes.append(_part(pool, torch.tensor([tokens]), kv_pos, None, meta, device))
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
            bias = _bias(pool, (torch.arange(mk)[None, :] < lens[:, None])[:, None, None],
                              device)
        prefixes.append(_part(pool, q_index, kv_pos, bias, meta, device))
        rows.append({t: i * mq + j for i, qs in enumerate(own_q) for j, t in enumerate(qs)})
    shared_rows = [b for m in members for b in m]
    suffixes = []
    for part_rows in ([b for b in shared_rows if meta.q_lens[b] == 1],
                      [b for b in shared_rows if meta.q_lens[b] > 1]):
        if part_rows:
            suffixes.append(_suffix(pool, part_rows, meta, q_starts, kv_starts, skip, rows,
                                    device))
    return SharedPrefix(prefixes=prefixes, suffixes=suffixes)


def _suffix(pool: KVPool, rows, meta, q_starts, kv_starts, prefix_lens, prefix_rows,
            device) -> Suffix:
    """Each request's context after its prefix (prefix_lens[b] slots), its new tokens last
    (so >= q_len long)."""
    ql = torch.tensor([meta.q_lens[b] for b in rows])
    skip = torch.tensor([prefix_lens[b] for b in rows])
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
        bias = _bias(pool, valid[:, None], device)
    covered = []
    for row_of in prefix_rows:
        sel = [j for j, t in enumerate(q_flat) if t in row_of]
        if not sel:  # a part of other groups only (their own prefixes): nothing to merge
            covered.append(None)
            continue
        covered.append((None if len(sel) == len(q_flat) else torch.tensor(sel, device=device),
                        torch.tensor([row_of[q_flat[j]] for j in sel], device=device)))
    return Suffix(part=_part(pool, q_index, kv_pos, bias, meta, device),
                   q_valid=None if q_valid is None else q_valid.to(device),
                   q_flat=torch.tensor(q_flat, device=device), prefix_rows=covered)


def _bias(pool: KVPool, valid: torch.Tensor, device) -> torch.Tensor:
    """Additive mask (0 / -inf) in the pool's dtype, as the fused CPU kernel wants it."""
    bias = torch.zeros(valid.shape, dtype=pool.dtype)
    return bias.masked_fill_(~valid, float("-inf")).to(device)


def _part(pool: KVPool, q_index, kv_pos, bias, meta, device) -> Part:
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
        shape = (kv_slots.numel(), pool.kv_heads, pool.head_dim)
        k_buf = torch.empty(shape, dtype=pool.dtype, device=device)
        v_buf = torch.empty(shape, dtype=pool.dtype, device=device)
    return Part(q_index=q_index.to(device), kv_slots=kv_slots, kv_start=kv_start,
                 bias=bias, k_buf=k_buf, v_buf=v_buf)


def attend_shared(q, k_pool, v_pool, plan: SharedPrefix, out, scale, softcap=None) -> None:
    """Write into `out` the attention of the plan's requests: prefix tiles, then each
    request's suffix, merged by log-sum-exp."""
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
        for (o_pre, lse_pre), covered in zip(prefixes, suf.prefix_rows):
            if covered is None:
                continue
            sel, row = covered
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


def _attend_part(q, k_pool, v_pool, part: Part, scale, softcap=None):
    """Attention of one Part: (out [b, mq, Hq, D] in q's dtype or fp32, lse [b, mq, Hq] fp32),
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


def _common_run(meta: AttentionMetadata, members: list[list[int]], kv_starts: list[int]) -> int:
    """Slots every group's prefix begins with, when at least MIN_COMMON_LEN; else 0."""
    common = _common_len(meta.kv_indices, [kv_starts[m[0]] for m in members],
                         [meta.shared_lens[m[0]] for m in members])
    return common if common >= MIN_COMMON_LEN else 0


def _common_len(kv_indices: torch.Tensor, firsts: list[int], prefix_lens: list[int]) -> int:
    """How many leading slots every group's prefix holds in common (0 for a single group):
    firsts[g] is where group g's context begins in kv_indices."""
    if len(firsts) < 2:
        return 0
    span = min(prefix_lens)
    slots = kv_indices[ranges(firsts, [span] * len(firsts), kv_indices.device)].view(-1, span)
    same = (slots == slots[:1]).all(0)
    return span if bool(same.all()) else int(same.int().argmin())


def sharing_groups(meta: AttentionMetadata,
                   window: int | None = None) -> tuple[list[list[int]], int]:
    """Requests of each group with the same shared prefix, in batch order, and the run of slots
    every one of those groups' prefixes begins with (0 when under MIN_COMMON_LEN): groups of >= 2
    members, and requests alone in theirs too when every group's prefix begins with the same
    run of >= MIN_COMMON_LEN slots (a system prompt the radix tree holds once: n = 1 requests,
    multi-turn conversations). Only decode and verify rows (q_len <= MAX_SHARED_Q_LEN) whose
    queries all come after the prefix and see every prefix position (a sliding window that
    cuts into the context rules a row out)."""
    if not meta.shared_lens:
        return [], 0
    sharing: dict[tuple[str, int], list[int]] = {}
    for b, (group, shared) in enumerate(zip(meta.groups, meta.shared_lens)):
        q_len, kv_len = meta.q_lens[b], meta.kv_lens[b]
        fits = window is None or kv_len <= window
        if shared and q_len <= MAX_SHARED_Q_LEN and shared <= kv_len - q_len and fits:
            sharing.setdefault((group, shared), []).append(b)
    groups = list(sharing.values())
    starts = [0, *accumulate(meta.kv_lens)]
    common = _common_run(meta, groups, starts)
    pairs = [m for m in groups if len(m) > 1]
    if common or len(pairs) == len(groups):
        return (groups if common else pairs), common
    # Nothing common to all: the lone requests keep the plain path; the pairs may share a run.
    return pairs, _common_run(meta, pairs, starts)
