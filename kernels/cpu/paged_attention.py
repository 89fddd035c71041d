"""The CPU paged-attention kernel (paged_attention.c) for rollout/attention/cpu.py: decode,
verify and extend rows attend to their context read in place from the pool, fp32."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from . import fp32_cpu, has, library, missing_reason
from .ops import operator, returns_nothing

# A chunk's rows of one KV head (queries x its query heads) share each key block in L1: its
# scores (BLOCK floats a row), queries and accumulators stay within it up to about this many.
MAX_CHUNK_ROWS = 48
# Chunks (the work items) per thread at least, so that threads end together.
ITEMS_PER_THREAD = 4


@dataclass
class Chunks:
    first: torch.Tensor  # int32 [C]: each chunk's first request
    count: torch.Tensor  # int32 [C]: its number of requests
    prefix: torch.Tensor  # int32 [C]: the slots its requests share, read once for all


@dataclass
class NativeRows:
    """Requests the kernel serves in one step: int32 [R] each; kv_start indexes kv_indices."""

    q_start: torch.Tensor
    q_len: torch.Tensor
    kv_start: torch.Tensor
    kv_len: torch.Tensor
    kv_indices: torch.Tensor  # int32, the step's whole kv_indices
    # What the rows reach, for paged_attention to hold against each layer's q and pools: the
    # query rows (max q_start + q_len) and the pool slots (max kv_indices + 1).
    tokens: int
    slots: int
    rows: list[int] = field(default_factory=list)  # the batch's requests these are, in order
    _chunks: dict = field(default_factory=dict)  # (rep, threads) -> Chunks, built once a step

    def chunks(self, rep: int, threads: int) -> Chunks:
        key = (rep, threads)
        if key not in self._chunks:
            n = self.q_start.numel()
            first, count, prefix = (torch.empty(n, dtype=torch.int32) for _ in range(3))
            max_requests = max(1, -(-n // (ITEMS_PER_THREAD * threads)))
            c = library().plan_chunks(self.q_len.data_ptr(), self.kv_start.data_ptr(),
                                      self.kv_len.data_ptr(), self.kv_indices.data_ptr(), n,
                                      rep, MAX_CHUNK_ROWS, max_requests, first.data_ptr(),
                                      count.data_ptr(), prefix.data_ptr())
            self._chunks[key] = Chunks(first[:c], count[:c], prefix[:c])
        return self._chunks[key]

    @classmethod
    def of(cls, rows: list[int], q_starts: list[int], q_lens: list[int], kv_starts: list[int],
           kv_lens: list[int], kv_indices: torch.Tensor) -> NativeRows:
        """`rows`: ascending, distinct (all of the step's requests, most steps)."""
        every = len(rows) == len(q_lens)

        def ints(values):
            picked = values[:len(rows)] if every else [values[b] for b in rows]
            # Through an array of C ints: torch.tensor(list) checks each element's type, ~3x
            # slower for a step's hundred-odd requests.
            return torch.frombuffer(array("i", picked), dtype=torch.int32) if picked else \
                torch.empty(0, dtype=torch.int32)

        q_start, q_len, kv_start, kv_len = (ints(v) for v in (q_starts, q_lens, kv_starts,
                                                               kv_lens))
        tokens, slots = _reach(q_start, q_len, kv_start, kv_len, kv_indices)
        # The step's kv_indices are int64; the kernel's slot reads are half as wide.
        return cls(q_start, q_len, kv_start, kv_len, kv_indices.to(torch.int32).contiguous(),
                   tokens, slots, rows)


def _reach(q_start, q_len, kv_start, kv_len, kv_indices) -> tuple[int, int]:
    """(query rows, pool slots) the rows reach, after checking that their reads of kv_indices
    stay within it (the C checks none of them): once a step, in a few whole-tensor ops (~50 us
    for 128 requests over 400 slots each, against a decode step of ~150 ms), where a check in
    the C would repeat it for every layer."""
    slots = 0
    if kv_indices.numel():
        # on the int64 slots: one past int32 would wrap to a slot in the pool
        low, high = (int(x) for x in torch.aminmax(kv_indices))
        if low < 0:
            raise IndexError(f"NativeRows: kv_indices hold slot {low}, below 0")
        slots = high + 1
    if not q_start.numel():
        return 0, slots
    # int64: sums of two int32 fields must not wrap
    fields = torch.stack((q_start, q_len, kv_start, kv_len)).long()
    lowest = torch.cat((fields[:3], fields[3:] - fields[1:2])).amin(1).tolist()
    for name, low in zip(("q_start", "q_len", "kv_start", "kv_len - q_len"), lowest):
        if low < 0:
            raise ValueError(f"NativeRows: {name} must be >= 0, got {low}")
    tokens, kv_end = (fields[0::2] + fields[1::2]).amax(1).tolist()
    if kv_end > kv_indices.numel():
        raise ValueError(f"NativeRows: kv_start + kv_len reach {kv_end}, past kv_indices' "
                         f"{kv_indices.numel()} entries")
    return tokens, slots


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and _kernel() is not None


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with unit stride in D and D between heads (any token stride)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    out: torch.Tensor, rows: NativeRows, scale: float, window: int | None,
                    softcap: float | None,
                    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    invariant: bool = False) -> None:
    """Write into `out` [T, Hq, D] (contiguous) the rows' attention; q [T, Hq, D] with its
    heads contiguous, k_pool/v_pool [slots, Hkv, D] contiguous. `store` = (k, v, slots): the
    step's new K/V [N, Hkv, D] go into the pool at int64 `slots` [N] (negative: skipped) first,
    as `k_pool.index_copy_(0, slots, k)` would put them. `invariant`: every row's result
    independent of the other rows (key blocks at multiples of the kernel's block, one score
    tiling), for EngineConfig.batch_invariant."""
    hq, d = q.shape[1:]
    hkv = k_pool.shape[1]
    q = _heads_contiguous(q)
    if not (out.is_contiguous() and k_pool.is_contiguous() and v_pool.is_contiguous()
            and fp32_cpu(q, k_pool, v_pool, out) and out.shape == q.shape
            and k_pool.shape == v_pool.shape and k_pool.shape[2] == d and hq % hkv == 0):
        raise ValueError(f"paged_attention: q {q.dtype} {tuple(q.shape)}, out "
                         f"{tuple(out.shape)} and the pools {k_pool.dtype} {tuple(k_pool.shape)}"
                         f" / {v_pool.dtype} {tuple(v_pool.shape)} must be fp32 on the CPU "
                         f"(contiguous), of one head size, the query heads a multiple of the "
                         f"KV heads")
    if store is None:
        k_new = v_new = slots = torch.empty(0)
    else:
        k_new, v_new = (_heads_contiguous(x) for x in store[:2])
        slots = store[2].contiguous()
        if not (k_new.shape == v_new.shape == (slots.numel(), hkv, d)
                and slots.dtype == torch.int64 and fp32_cpu(k_new, v_new)):
            raise ValueError(f"paged_attention: store's k/v {k_new.dtype} "
                             f"{tuple(k_new.shape)} must be fp32 [slots, {hkv}, {d}], slots "
                             f"int64")
    if rows.tokens > q.shape[0]:
        raise ValueError(f"paged_attention: the rows' queries reach token {rows.tokens}, past "
                         f"q's {q.shape[0]}")
    if rows.slots > k_pool.shape[0]:
        raise IndexError(f"paged_attention: kv_indices reach slot {rows.slots - 1}, past the "
                         f"pool's {k_pool.shape[0]} slots")
    chunks = rows.chunks(hq // hkv, torch.get_num_threads())
    attend(q, k_pool, v_pool, out, rows.q_start, rows.q_len, rows.kv_start, rows.kv_len,
           rows.kv_indices, chunks.first, chunks.count, chunks.prefix, scale, window or 0,
           softcap or 0.0, k_new, v_new, slots, invariant)


@operator("paged_attention(Tensor q, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor(c!) out, "
          "Tensor q_start, Tensor q_len, Tensor kv_start, Tensor kv_len, Tensor kv_indices, "
          "Tensor chunk_first, Tensor chunk_count, Tensor chunk_prefix, float scale, "
          "int window, float softcap, Tensor k_new, Tensor v_new, Tensor slots, "
          "bool invariant) -> ()", returns_nothing)
def attend(q, k_pool, v_pool, out, q_start, q_len, kv_start, kv_len, kv_indices, chunk_first,
           chunk_count, chunk_prefix, scale, window, softcap, k_new, v_new, slots,
           invariant) -> None:
    """paged_attention's kernel call on its checked arguments (window 0: none, softcap 0.0:
    none, k_new/v_new/slots empty: nothing to store); the pools are written only by the
    store."""
    hq, d = q.shape[1:]
    bad = _kernel()(q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(),
                    out.data_ptr(), q_start.data_ptr(), q_len.data_ptr(), kv_start.data_ptr(),
                    kv_len.data_ptr(), kv_indices.data_ptr(), chunk_first.data_ptr(),
                    chunk_count.data_ptr(), chunk_prefix.data_ptr(), chunk_first.numel(), hq,
                    k_pool.shape[1], d, scale, window, softcap, k_new.data_ptr(),
                    k_new.stride(0), v_new.data_ptr(), v_new.stride(0), slots.data_ptr(),
                    slots.numel(), k_pool.shape[0], int(invariant), torch.get_num_threads())
    if bad == -2:  # (the new K/V are in the pool; some rows' output is not written)
        raise MemoryError("paged_attention: a thread could not allocate its workspace")
    if bad >= 0:
        raise IndexError(f"store: slot {int(slots[bad])} of token {bad} is past the pool's "
                         f"{k_pool.shape[0]} slots")


def built() -> bool:
    return _kernel() is not None


def why_not() -> str:
    return missing_reason("paged_attention_f32", "plan_chunks")


def _kernel():
    return library().paged_attention_f32 if has("paged_attention_f32", "plan_chunks") else None
