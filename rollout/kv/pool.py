"""The KV pool: one allocation for every layer's K and V, and the free-slot stack.

Page size is 1: a slot holds one token's K and V in every layer. Slots live as int64 tensors on
the pool's device so allocation, freeing and metadata building never leave the device. The free
list is a stack; its order is free to choose, and `arrange_runs` chooses it so that decoding
sequences take consecutive slots (see KVManager.alloc_decodes).

A slot may keep more than K/V: `extras` (the model's `slot_extras`, e.g. an MoE model's routed
experts) are per-slot arrays written by the forward that writes the slot's K/V, allocated and
dropped with the pool, so they live exactly as long as the K/V (prefix cache, preemption,
speculation's rejected drafts). Beside them the pool keeps the weights version of that forward
(SLOT_VERSION, stamped at the commit): K/V that outlives a weight update (carried_kv="park")
keeps the old weights' extras, and whoever reads them must be able to tell.
"""

from __future__ import annotations

import math
from collections.abc import Callable
import os

import torch

from . import huge_pages

# The per-slot Engine.weights_version of the forward that computed the slot, kept whenever the
# model keeps extras (they are that forward's outputs); int32: a version per optimizer step.
SLOT_VERSION = "weights_version"


def with_slot_version(extras: dict[str, tuple[tuple[int, ...], torch.dtype]] | None
                      ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The per-slot arrays a pool keeps for a model's `extras`: those and, when there are
    any, SLOT_VERSION (a dense model's pool keeps none)."""
    return {**extras, SLOT_VERSION: ((1,), torch.int32)} if extras else {}


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                       extras: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
                       ) -> int:
    """Bytes a slot costs: its K and V in every layer and its `extras` (KVPool's), so that a
    pool sized by memory counts an MoE model's routed experts (and their versions) too."""
    kv = 2 * num_layers * kv_heads * head_dim * dtype.itemsize
    return kv + sum(math.prod(shape) * extra_dtype.itemsize
                    for shape, extra_dtype in with_slot_version(extras).values())


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available_memory()


def host_available_memory() -> int:
    """What the host can give without swapping: Linux's MemAvailable (free pages and the page
    cache it can drop), else the free pages alone. Free pages alone understate it by far on a
    host that has read files (4.4 GiB of 16 GiB measured): an explicit pool would be refused
    that fits."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# The automatic pool's ceiling on the CPU. A CPU pool is host memory the trainer shares, zeroed
# page by page when it is built and again at every wake_up (sleep frees it), a cost paid at
# every GRPO step that grows with the pool: sized from a fraction of a host's free memory it
# took seconds (docs/benchmarks.md). 256 MiB holds 5,825 tokens of SmolLM2-135M in fp32 (30
# layers x 3 KV heads x 64); kv_cache_tokens asks for more.
CPU_POOL_BYTES = 256 << 20


def size_pool(kv_cache_tokens: int | None, memory_fraction: float, max_model_len: int,
              max_num_seqs: int, bytes_per_token: int, device: torch.device,
              agree: Callable[[int], int] | None = None) -> int:
    """Number of slots; refuses (ValueError) when one max_model_len request cannot fit, or an
    explicit `kv_cache_tokens` does not fit in the device's available memory. `agree`: the
    ranks of a tensor-parallel engine settle on the least spare room (an explicit size), then
    on one size (the smallest), before the checks, so they refuse together."""
    if kv_cache_tokens is not None:
        # Checked against the memory (a CPU pool too big for the host had been a bare OSError
        # from mmap; a GPU's, an out-of-memory error). Under tensor parallelism the ranks may
        # ask for different sizes (the pool takes the smallest, below): each offers its spare
        # room, and a rank short of it makes every rank refuse.
        available = available_memory(device)
        spare = available // bytes_per_token - kv_cache_tokens
        if agree is not None:
            spare = agree(spare)
        if spare < 0:
            asked = kv_cache_tokens * bytes_per_token
            where = (f"{device} has {available} bytes ({available / 2**20:.1f} MiB) available "
                     f"(room for {available // bytes_per_token} tokens)" if agree is None else
                     f"a rank's {device} lacks room for {-spare} of the tokens it asks for")
            raise ValueError(
                f"kv_cache_tokens={kv_cache_tokens} needs {asked} bytes ({asked / 2**20:.1f} "
                f"MiB) of KV pool, but {where}; lower kv_cache_tokens, or leave it None to "
                f"size the pool from free memory")
    else:
        budget = int(available_memory(device) * memory_fraction)
        # More than every sequence at full length could never be used.
        kv_cache_tokens = min(budget // bytes_per_token, max_num_seqs * max_model_len)
        if device.type == "cpu":
            # Never below one max_model_len request: a model the memory allows must not be
            # refused for the sake of build time.
            ceiling = max(CPU_POOL_BYTES // bytes_per_token, max_model_len)
            kv_cache_tokens = min(kv_cache_tokens, ceiling)
    if agree is not None:
        kv_cache_tokens = agree(kv_cache_tokens)
    if kv_cache_tokens < max_model_len:
        raise ValueError(
            f"kv_cache_tokens: the KV pool holds {kv_cache_tokens} tokens "
            f"({kv_cache_tokens * bytes_per_token / 2**20:.1f} MiB) but one request of "
            f"max_model_len={max_model_len} tokens needs {max_model_len} "
            f"({max_model_len * bytes_per_token / 2**20:.1f} MiB); raise kv_cache_tokens or "
            f"kv_memory_fraction, or lower max_model_len")
    return kv_cache_tokens


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device,
                 extras: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> None:
        self.num_layers, self.num_slots = num_layers, num_slots
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.buffer: torch.Tensor | None = None
        self.extra_layout = with_slot_version(extras)
        self.extras: dict[str, torch.Tensor] = {}
        self.allocate()

    # --- memory -----------------------------------------------------------------------------
    def allocate(self) -> None:
        shape = (2, self.num_layers, self.num_slots, self.kv_heads, self.head_dim)
        self.buffer = huge_pages.empty_zeros(shape, self.dtype, self.device)
        # One row more than slots: padded tokens of a CUDA-graph batch (slot -1) write there.
        self.extras = {name: torch.zeros((self.num_slots + 1, *extra_shape), dtype=dtype,
                                         device=self.device)
                       for name, (extra_shape, dtype) in self.extra_layout.items()}
        self._free = torch.arange(self.num_slots, dtype=torch.int64, device=self.device)
        self._num_free = self.num_slots

    def release(self) -> None:
        """Drop the whole pool (sleep); every slot is gone with it."""
        self.buffer = None
        self.extras = {}
        self._free = None
        self._num_free = 0

    @property
    def is_allocated(self) -> bool:
        return self.buffer is not None

    @property
    def nbytes(self) -> int:
        """K/V and extras (their padding row included); 0 when released."""
        tensors = [] if self.buffer is None else [self.buffer, *self.extras.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def k(self, layer: int) -> torch.Tensor:
        return self.buffer[0, layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[1, layer]

    def extra_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows of the per-slot arrays that `slots` write: padding (negative slots) goes to
        the spare last row."""
        return torch.where(slots >= 0, slots, self.num_slots)

    def store_extra(self, name: str, index: int, rows: torch.Tensor,
                    values: torch.Tensor) -> None:
        """extras[name][rows[t], index] = values[t], `rows` from `extra_rows`."""
        extra = self.extras[name]
        extra[rows, index] = values.to(extra.dtype)

    def read_versioned(self, name: str, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """On the host: the extra `name` of `slots` (an MoE model's routed experts: [n, MoE
        layers, k]) and the weights version of the forward that computed each ([n]). One
        device-to-host copy, each of which waits for the device: both are gathered into one
        byte row per slot there and split here, each part a tensor of its own."""
        routes = self.extras[name][slots]
        versions = self.extras[SLOT_VERSION][slots]
        route_bytes = math.prod(routes.shape[1:]) * routes.element_size()
        packed = torch.cat([routes.reshape(len(slots), -1).view(torch.uint8),
                            versions.view(torch.uint8)], 1).cpu()
        return (packed[:, :route_bytes].contiguous().view(routes.dtype).view(routes.shape),
                packed[:, route_bytes:].contiguous().view(versions.dtype)[:, 0])

    @property
    def keeps_versions(self) -> bool:
        return SLOT_VERSION in self.extra_layout

    def stamp_version(self, slots: torch.Tensor, version: int) -> None:
        """The forward under weights `version` computed `slots` (only when keeps_versions)."""
        self.extras[SLOT_VERSION][slots, 0] = version

    # --- slots ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor:
        if n > self._num_free:
            raise RuntimeError(f"KV pool: asked for {n} slots, {self._num_free} free")
        # Copied before the count drops: a copy failing (out of memory) takes nothing.
        slots = self._free[self._num_free - n:self._num_free].clone()
        self._num_free -= n
        return slots

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n:
            self._free[self._num_free:self._num_free + n] = slots
            self._num_free += n

    def unfree(self, slots: torch.Tensor) -> None:
        """Undo the latest `free(slots)` (rolling a failed step back, newest change first):
        they are still the top of the free stack, since every later change was undone."""
        self._num_free -= slots.numel()

    def free_slots(self) -> torch.Tensor:
        return self._free[:self._num_free]

    def arrange_runs(self, streams: int, run: int, after: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """Reorder the free list so that the next `run` allocations of `streams` slots each give
        stream i (the i-th slot of every allocation) a run of consecutive slot ids, as
        consecutive as the free slots are. With `after` (each stream's newest slot, in use),
        stream i first goes on with the free slots that directly follow after[i], as many of
        them as there are in a row (up to `run`), wherever they lie in the free list; what is
        still missing comes, sorted, from the top of the free list, stream i taking the i-th
        run of it (without `after`, all of it: the top `streams * run` slots, the only part
        of the list it then touches). Only the order of the free list changes. Returns the
        old order of what it touched for `restore_order`."""
        lo = 0 if after is not None else self._num_free - streams * run
        free = self._free[lo:self._num_free]
        old = free.clone()
        if after is None:
            own = torch.zeros(streams, run, dtype=torch.bool, device=free.device)
            runs = torch.empty(streams, run, dtype=free.dtype, device=free.device)
        else:  # the slots following each stream's newest, while free (num_slots: never free)
            is_free = torch.zeros(self.num_slots + 1, dtype=torch.bool, device=free.device)
            is_free[free] = True
            runs = (after[:, None] + 1 + torch.arange(run, device=free.device)).clamp(
                max=self.num_slots)
            own = is_free[runs].cumprod(1).bool()  # free, and every slot before it too
            # Streams whose newest slot is the same (samples with equal tokens on one cached
            # path) would go on into the same slots: only the first of them does.
            order = after.argsort(stable=True)
            own[order[1:][after[order][1:] == after[order][:-1]]] = False
            is_free[runs[own]] = False  # taken: not among what the rest comes from
            free = old[is_free[old]]
        rest = free[free.numel() - int((~own).sum()):]
        runs[~own] = rest.sort().values  # row-major: stream i's missing slots after stream i-1's
        # An allocation takes the top `streams` slots, lowest index first: the first one must
        # lie on top, stream order within it.
        self._free[lo:self._num_free] = torch.cat(
            [free[:free.numel() - rest.numel()], runs.t().flip(0).reshape(-1)])
        return old

    def restore_order(self, old: torch.Tensor) -> None:
        """Undo the latest `arrange_runs` (every later change undone first): `old` is the order
        it found in the top `old.numel()` free slots."""
        self._free[self._num_free - old.numel():self._num_free] = old
